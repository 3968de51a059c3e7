package redisstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/redis/go-redis/v9"
)

// Unavailable implements driver.Prober: err is the pool timing out for a
// connection, the server closing a connection (go-redis returns io.EOF,
// bare or in its bad-connection error, for a server killed mid-command),
// or the server refusing to serve now: still loading its data (LOADING),
// a replica refusing writes (READONLY, as after a failover), its primary
// or cluster down (MASTERDOWN, CLUSTERDOWN), or out of memory under
// maxmemory-policy noeviction (OOM). Other network errors are recognized
// by the core.
func (d *Driver) Unavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, io.EOF) {
		return true
	}
	for _, p := range []string{"LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "BUSY ", "OOM "} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// Probe implements driver.Prober: the server takes a write, as a marker
// needs. A SET with a short expiry of a key under the prefix fails on a
// replica (READONLY, as after a failover) and on a server out of memory
// (OOM), and needs no command a user confined to idem's keys lacks (ROLE,
// which the probe once read, is an admin command: denied, it kept an
// outage from ever ending).
func (d *Driver) Probe(ctx context.Context) error {
	if err := d.client.Set(ctx, d.prefix+"probe", "1", time.Second).Err(); err != nil {
		return fmt.Errorf("redisstore: probe: %w", err)
	}
	return nil
}
