package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// DefaultRedisURL is used when IDEM_REDIS_URL is unset.
const DefaultRedisURL = "redis://127.0.0.1:6379/0"

// RedisURL returns IDEM_REDIS_URL or the default.
func RedisURL() string {
	if u := os.Getenv("IDEM_REDIS_URL"); u != "" {
		return u
	}
	return DefaultRedisURL
}

// Redis connects to the Redis server at RedisURL, skipping loudly when it is
// unreachable, and returns the client with a key prefix unique to the test
// ("idemtest:<random>:"). Every key under that prefix is deleted, and the
// client closed, when the test ends.
func Redis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	opts, err := redis.ParseURL(RedisURL())
	if err != nil {
		t.Fatalf("IDEM_REDIS_URL: %v", err)
	}
	// Redis before 8 lacks maintenance notifications, and go-redis's default
	// (auto) mode then rewrites the shared options as each connection
	// starts: a data race once transactions open connections at once.
	opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	// Probe once, without go-redis's retries, so that a server that is
	// down costs a refused dial and not seconds per test.
	po := *opts
	po.MaxRetries, po.DialerRetries = -1, 1
	probe := redis.NewClient(&po)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	err = probe.Ping(ctx).Err()
	probe.Close()
	if err != nil {
		Unavailable(t, "Redis", RedisURL(), err)
	}
	opts.PoolSize = 64
	c := redis.NewClient(opts)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	prefix := "idemtest:" + hex.EncodeToString(b) + ":"
	t.Cleanup(func() {
		defer c.Close()
		ctx := context.Background()
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		if err := iter.Err(); err != nil {
			t.Errorf("scan %s*: %v", prefix, err)
			return
		}
		for len(keys) > 0 {
			n := min(len(keys), 1000)
			if err := c.Del(ctx, keys[:n]...).Err(); err != nil {
				t.Errorf("delete %s*: %v", prefix, err)
				return
			}
			keys = keys[n:]
		}
	})
	return c, prefix
}

// RedisInts reads the hash at key as integers, the way tests keep balances
// in Redis.
func RedisInts(ctx context.Context, c *redis.Client, key string) (map[string]int64, error) {
	m, err := c.HGetAll(ctx, key).Result()
	if err != nil {
		return nil, err
	}
	out := make(map[string]int64, len(m))
	for k, v := range m {
		if out[k], err = strconv.ParseInt(v, 10, 64); err != nil {
			return nil, fmt.Errorf("%s field %s: %w", key, k, err)
		}
	}
	return out, nil
}
