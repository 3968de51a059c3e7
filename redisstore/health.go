package redisstore

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/redis/go-redis/v9"
)

// Unavailable implements driver.Prober: err is the pool timing out for a
// connection, the server closing a connection (go-redis returns io.EOF,
// bare or in its bad-connection error, for a server killed mid-command),
// or the server refusing to serve now: still loading its data (LOADING),
// a replica refusing writes (READONLY, as after a failover), its primary
// or cluster down (MASTERDOWN, CLUSTERDOWN). Other network errors are
// recognized by the core.
func (d *Driver) Unavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, io.EOF) {
		return true
	}
	for _, p := range []string{"LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "BUSY "} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// Probe implements driver.Prober: the server answers PING, and is a
// primary (a replica refuses writes).
func (d *Driver) Probe(ctx context.Context) error {
	role, err := d.client.Do(ctx, "ROLE").Slice()
	if err != nil {
		return fmt.Errorf("redisstore: probe: %w", err)
	}
	if len(role) > 0 && role[0] != "master" {
		return fmt.Errorf("redisstore: probe: the server is a %v, which refuses writes", role[0])
	}
	return nil
}
