package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

func TestUnavailableAndProbe(t *testing.T) {
	t.Parallel()
	client, _ := testenv.Redis(t)
	drv, err := redisstore.New(client, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Probe(context.Background()); err != nil {
		t.Fatalf("Probe of a live primary: %v", err)
	}
	if !drv.Unavailable(fmt.Errorf("exec: %w", redis.ErrPoolTimeout)) {
		t.Error("a pool timeout does not look like an outage")
	}
	// A server killed mid-command: go-redis returns io.EOF, bare or
	// wrapped in its bad-connection error (TestOutageRedis meets both).
	if !drv.Unavailable(fmt.Errorf("redisstore: commit: %w", io.EOF)) {
		t.Error("a connection the server closed does not look like an outage")
	}
	if drv.Unavailable(errors.New("WRONGTYPE Operation against a key holding the wrong kind of value")) || drv.Unavailable(nil) {
		t.Error("a plain error looks like an outage")
	}
	down, err := redisstore.New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1}), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := down.Probe(context.Background()); err == nil {
		t.Fatal("Probe of nothing listening succeeded")
	}
}
