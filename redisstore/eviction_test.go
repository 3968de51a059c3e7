package redisstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// TestMigrateRefusesEviction: on a server that may evict markers (a
// maxmemory with an allkeys-* policy, or volatile-* when markers expire)
// Migrate fails with ErrInvalidConfig, since an evicted marker is a
// message applied twice; settings that evict no marker, the opt-out and a
// client not allowed to read the configuration pass. The test runs its
// own server, whose configuration it changes.
func TestMigrateRefusesEviction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewRedisServer(t)
	admin := srv.Client(redis.Options{})
	for _, c := range []struct {
		maxmemory, policy string
		cfg               redisstore.Config
		refused           bool
	}{
		{"100mb", "allkeys-lru", redisstore.Config{}, true},
		{"100mb", "allkeys-random", redisstore.Config{}, true},
		{"100mb", "volatile-lru", redisstore.Config{MarkerTTL: time.Hour}, true},
		{"100mb", "volatile-ttl", redisstore.Config{}, false},
		{"100mb", "noeviction", redisstore.Config{MarkerTTL: time.Hour}, false},
		{"0", "allkeys-lru", redisstore.Config{}, false},
		{"100mb", "allkeys-lru", redisstore.Config{AllowEviction: true}, false},
	} {
		if err := admin.ConfigSet(ctx, "maxmemory", c.maxmemory).Err(); err != nil {
			t.Fatal(err)
		}
		if err := admin.ConfigSet(ctx, "maxmemory-policy", c.policy).Err(); err != nil {
			t.Fatal(err)
		}
		drv, err := redisstore.New(admin, &c.cfg)
		if err != nil {
			t.Fatal(err)
		}
		err = drv.Migrate(ctx)
		if refused := errors.Is(err, idem.ErrInvalidConfig); refused != c.refused || (err != nil && !refused) {
			t.Errorf("maxmemory %s, policy %s, %+v: Migrate %v; want refused %v", c.maxmemory, c.policy, c.cfg, err, c.refused)
		}
	}
	// A user who may not run CONFIG (as on managed services) is not
	// checked, and not refused either.
	if err := admin.Do(ctx, "ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-config").Err(); err != nil {
		t.Fatal(err)
	}
	app := srv.Client(redis.Options{Username: "app", Password: "pw"})
	if err := app.ConfigGet(ctx, "maxmemory").Err(); err == nil {
		t.Fatal("the restricted user may read the configuration: the test needs one that may not")
	}
	drv, err := redisstore.New(app, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatalf("Migrate as a user without CONFIG: %v", err)
	}
}
