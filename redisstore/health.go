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
// or cluster down (MASTERDOWN, CLUSTERDOWN), out of memory under
// maxmemory-policy noeviction (OOM), failing its snapshots under
// stop-writes-on-bgsave-error (MISCONF) or short of the replicas
// min-replicas-to-write asks for (NOREPLICAS). Other network errors are
// recognized by the core.
func (d *Driver) Unavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, io.EOF) {
		return true
	}
	for _, p := range []string{"LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "BUSY ", "OOM ", "MISCONF ", "NOREPLICAS "} {
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
//
// A user whose ACL denies the probe's key (NOPERM) is answered: the server
// serves, and holding deliveries for an outage the probe cannot confirm
// would hold them for good.
func (d *Driver) Probe(ctx context.Context) error {
	err := d.client.Set(ctx, d.prefix+"probe", "1", time.Second).Err()
	if err != nil && !redis.HasErrorPrefix(err, "NOPERM") {
		return fmt.Errorf("redisstore: probe: %w", err)
	}
	return nil
}
