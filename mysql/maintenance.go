package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

var _ driver.MarkerPruner = (*Driver)(nil)

// prunableLease is the condition, besides its age, on a lease row that
// retention may delete: a done one. A running lease stays whatever its
// age (its holder may be a paused worker that would not be fenced off a
// row re-created at token 1), and so does a failed one: its dead letter
// may be replayed at any time, and the replay's claim must get a token
// above the failed attempts'.
const prunableLease = `status = 'done'`

// leasesPosition is MarkerKey.Position while retention walks the leases
// table; a position of 0 or more is a handler id of the markers table.
const leasesPosition = -1

// PruneMarkers implements driver.MarkerPruner. It walks the markers table
// in primary-key order, then the leases table. Each batch reads the next
// keys of up to p.Limit prunable rows, then deletes that key range in one
// short auto-committed statement; at READ COMMITTED InnoDB keeps the locks
// of the rows it deletes only, and only for that statement, so writers
// are never held up for long.
func (d *Driver) PruneMarkers(ctx context.Context, p *driver.PruneParams) (driver.PruneResult, error) {
	if err := d.ready(ctx); err != nil {
		return driver.PruneResult{}, err
	}
	if p.Limit < 1 {
		return driver.PruneResult{}, fmt.Errorf("mysql: prune limit %d must be at least 1", p.Limit)
	}
	before := micros(p.Before)
	after, limit, deleted := p.After, p.Limit, 0
	if after.Position != leasesPosition {
		res, seen, err := d.pruneMarkers(ctx, after, before, limit)
		if err != nil {
			return driver.PruneResult{}, fmt.Errorf("mysql: prune markers: %w", notMigrated(err))
		}
		if seen == limit {
			return res, nil
		}
		// The markers are done: the leases next, in the same batch.
		after, limit, deleted = driver.MarkerKey{Position: leasesPosition}, limit-seen, res.Deleted
	}
	res, err := d.pruneLeases(ctx, after, before, limit)
	if err != nil {
		return driver.PruneResult{}, fmt.Errorf("mysql: prune lease rows: %w", notMigrated(err))
	}
	res.Deleted += deleted
	return res, nil
}

// pruneMarkers deletes the markers table's next batch and returns how many
// prunable rows it found.
func (d *Driver) pruneMarkers(ctx context.Context, after driver.MarkerKey, before int64, limit int) (driver.PruneResult, int, error) {
	hid := after.Position
	rows, err := d.db.QueryContext(ctx, `SELECT handler_id, message_id FROM `+d.t.markers+`
WHERE (handler_id > ? OR (handler_id = ? AND message_id > ?)) AND processed_at < ?
ORDER BY handler_id, message_id LIMIT ?`, hid, hid, after.MessageID, before, limit)
	if err != nil {
		return driver.PruneResult{}, 0, err
	}
	var (
		n    int
		last driver.MarkerKey
	)
	for rows.Next() {
		if err := rows.Scan(&last.Position, &last.MessageID); err != nil {
			rows.Close()
			return driver.PruneResult{}, 0, err
		}
		n++
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return driver.PruneResult{}, 0, err
	}
	if n == 0 {
		return driver.PruneResult{}, 0, nil
	}
	r, err := d.db.ExecContext(ctx, `DELETE FROM `+d.t.markers+`
WHERE (handler_id > ? OR (handler_id = ? AND message_id > ?))
  AND (handler_id < ? OR (handler_id = ? AND message_id <= ?))
  AND processed_at < ?`, hid, hid, after.MessageID, last.Position, last.Position, last.MessageID, before)
	if err != nil {
		return driver.PruneResult{}, 0, err
	}
	deleted, err := r.RowsAffected()
	if err != nil {
		return driver.PruneResult{}, 0, err
	}
	return driver.PruneResult{Deleted: int(deleted), Last: last}, n, nil
}

func (d *Driver) pruneLeases(ctx context.Context, after driver.MarkerKey, before int64, limit int) (driver.PruneResult, error) {
	rows, err := d.db.QueryContext(ctx, `SELECT handler, message_id FROM `+d.t.leases+`
WHERE (handler > ? OR (handler = ? AND message_id > ?)) AND processed_at < ? AND `+prunableLease+`
ORDER BY handler, message_id LIMIT ?`, after.Handler, after.Handler, after.MessageID, before, limit)
	if err != nil {
		return driver.PruneResult{}, err
	}
	n := 0
	last := driver.MarkerKey{Position: leasesPosition}
	for rows.Next() {
		if err := rows.Scan(&last.Handler, &last.MessageID); err != nil {
			rows.Close()
			return driver.PruneResult{}, err
		}
		n++
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return driver.PruneResult{}, err
	}
	if n == 0 {
		return driver.PruneResult{Done: true}, nil
	}
	r, err := d.db.ExecContext(ctx, `DELETE FROM `+d.t.leases+`
WHERE (handler > ? OR (handler = ? AND message_id > ?))
  AND (handler < ? OR (handler = ? AND message_id <= ?))
  AND processed_at < ? AND `+prunableLease, after.Handler, after.Handler, after.MessageID,
		last.Handler, last.Handler, last.MessageID, before)
	if err != nil {
		return driver.PruneResult{}, err
	}
	deleted, err := r.RowsAffected()
	if err != nil {
		return driver.PruneResult{}, err
	}
	return driver.PruneResult{Deleted: int(deleted), Last: last, Done: n < limit}, nil
}

// CountPrunable implements driver.MarkerPruner.
func (d *Driver) CountPrunable(ctx context.Context, before time.Time) (map[string]int64, time.Time, error) {
	if err := d.ready(ctx); err != nil {
		return nil, time.Time{}, err
	}
	rows, err := d.db.QueryContext(ctx, `SELECT h.name, x.n FROM (
  SELECT handler_id, count(*) AS n FROM `+d.t.markers+` WHERE processed_at < ? GROUP BY handler_id) x
JOIN `+d.t.handlers+` h ON h.id = x.handler_id
UNION ALL
SELECT handler, count(*) FROM `+d.t.leases+` WHERE processed_at < ? AND `+prunableLease+` GROUP BY handler`,
		micros(before), micros(before))
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("mysql: count prunable markers: %w", notMigrated(err))
	}
	defer rows.Close()
	counts := map[string]int64{}
	for rows.Next() {
		var (
			h string
			n int64
		)
		if err := rows.Scan(&h, &n); err != nil {
			return nil, time.Time{}, fmt.Errorf("mysql: count prunable markers: %w", err)
		}
		counts[h] += n
	}
	if err := rows.Err(); err != nil {
		return nil, time.Time{}, fmt.Errorf("mysql: count prunable markers: %w", err)
	}
	rows.Close()
	var oldest sql.NullInt64
	if err := d.db.QueryRowContext(ctx, `SELECT LEAST(
  COALESCE((SELECT MIN(processed_at) FROM `+d.t.markers+`), 9223372036854775807),
  COALESCE((SELECT MIN(processed_at) FROM `+d.t.leases+` WHERE `+prunableLease+`), 9223372036854775807))`).Scan(&oldest); err != nil {
		return nil, time.Time{}, fmt.Errorf("mysql: oldest marker: %w", err)
	}
	if !oldest.Valid || oldest.Int64 == 1<<63-1 {
		return counts, time.Time{}, nil
	}
	return counts, time.UnixMicro(oldest.Int64), nil
}

// TryMaintenanceLock implements driver.MarkerPruner with GET_LOCK on a
// connection the lock holds for its life (the lock is the session's), so
// one instance at a time prunes a database's tables. The pruning's own
// statements run on the pool meanwhile, so a pool of one connection
// (SetMaxOpenConns(1)) cannot prune: the lock is then refused with an
// error wrapping idem.ErrInvalidConfig rather than waiting for ever.
func (d *Driver) TryMaintenanceLock(ctx context.Context) (func(), bool, error) {
	if err := d.ready(ctx); err != nil {
		return nil, false, err
	}
	if d.db.Stats().MaxOpenConnections == 1 {
		return nil, false, fmt.Errorf("mysql: maintenance lock: %w: pruning holds a connection for its lock and runs its statements on another, and the pool allows one (SetMaxOpenConns(1)); allow two or more", idem.ErrInvalidConfig)
	}
	c, err := d.db.Conn(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("mysql: maintenance lock: %w", err)
	}
	name, err := d.lockName(ctx, c, "maintenance")
	if err != nil {
		c.Close()
		return nil, false, fmt.Errorf("mysql: maintenance lock: %w", err)
	}
	var got sql.NullInt64
	if err := c.QueryRowContext(ctx, `SELECT GET_LOCK(?, 0)`, name).Scan(&got); err != nil {
		c.Close()
		return nil, false, fmt.Errorf("mysql: maintenance lock: %w", err)
	}
	if !got.Valid || got.Int64 != 1 {
		c.Close()
		return nil, false, nil
	}
	unlock := func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = c.ExecContext(uctx, `SELECT RELEASE_LOCK(?)`, name)
		c.Close()
	}
	return unlock, true, nil
}
