package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemhq/idem/driver"
)

var (
	_ driver.MarkerPruner = (*Driver)(nil)
	_ driver.Clock        = (*Driver)(nil)
)

// Now implements driver.Clock: the server's clock, which stamps markers,
// leases and outbox rows (now()).
func (d *Driver) Now(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := d.pool.QueryRow(ctx, `SELECT now()`).Scan(&t); err != nil {
		return time.Time{}, fmt.Errorf("postgres: read the server's clock: %w", err)
	}
	return t, nil
}

// prunableLease is the condition, besides its age, on a row that retention
// may delete: a done marker or lease. A running lease stays whatever its
// age (its holder may be a paused worker that would not be fenced off a
// row re-created at token 1), and so does a failed one: its dead letter
// may be replayed at any time, and the replay's claim must get a token
// above the failed attempts', which a downstream fence has seen.
const prunableLease = `status = 'done'`

// PruneMarkers implements driver.MarkerPruner. It walks the old table
// first (leases, and atomic markers written before migration 011), by
// key, then the markers table, by physical position (pruneMarkers); the
// batch that finishes the old table goes on into the markers table, so
// that batches stay full. Each statement runs in its own short
// transaction, so row locks last one batch.
func (d *Driver) PruneMarkers(ctx context.Context, p *driver.PruneParams) (driver.PruneResult, error) {
	if p.Limit < 1 {
		return driver.PruneResult{}, fmt.Errorf("postgres: prune limit %d must be at least 1", p.Limit)
	}
	if p.After.Position != 0 {
		return d.pruneMarkers(ctx, p)
	}
	res, picked, err := d.pruneOld(ctx, p)
	if err != nil || !res.Done {
		return res, err
	}
	if err := d.retireLegacy(ctx); err != nil {
		return driver.PruneResult{}, err
	}
	// Position 1 is the markers table's first tuple.
	next := &driver.PruneParams{Before: p.Before, After: driver.MarkerKey{Position: 1}, Limit: p.Limit - picked}
	if next.Limit < 1 {
		return driver.PruneResult{Deleted: res.Deleted, Last: next.After}, nil
	}
	more, err := d.pruneMarkers(ctx, next)
	more.Deleted += res.Deleted
	return more, err
}

// pruneOld deletes a batch from the old table. One statement picks the
// next batch in primary-key order after the cursor and deletes it; rows of
// running and failed leases are skipped (prunableLease).
// picked counts the rows it examined.
func (d *Driver) pruneOld(ctx context.Context, p *driver.PruneParams) (_ driver.PruneResult, picked int, _ error) {
	var (
		res          driver.PruneResult
		lastH, lastM *string
	)
	err := d.auto.QueryRow(ctx, `WITH victims AS (
  SELECT handler, message_id FROM `+d.t.processed+`
  WHERE (handler, message_id) > ($2, $3) AND processed_at < $1 AND `+prunableLease+`
  ORDER BY handler, message_id
  LIMIT $4
), gone AS (
  DELETE FROM `+d.t.processed+` AS m USING victims AS v
  WHERE m.handler = v.handler AND m.message_id = v.message_id AND processed_at < $1 AND `+prunableLease+`
  RETURNING 1
), last AS (
  SELECT handler, message_id FROM victims ORDER BY handler DESC, message_id DESC LIMIT 1
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM victims),
       (SELECT handler FROM last), (SELECT message_id FROM last)`,
		p.Before, p.After.Handler, p.After.MessageID, p.Limit).Scan(&res.Deleted, &picked, &lastH, &lastM)
	if err != nil {
		return driver.PruneResult{}, 0, fmt.Errorf("postgres: prune markers: %w", err)
	}
	if lastH != nil && lastM != nil {
		res.Last = driver.MarkerKey{Handler: *lastH, MessageID: *lastM}
	}
	res.Done = picked < p.Limit
	return res, picked, nil
}

// pruneMarkers deletes a batch from the markers table. The table is walked
// in physical order (ctid), a range of pages per batch: a TID range scan
// reads only those pages, and the DELETE goes by the same range rather
// than by a list of ctids, which took twice as long. The range is sized
// from the table's statistics to hold a quarter more rows than the limit,
// so that a run of old markers makes full batches (and to at most Limit/4
// pages, should the statistics say the table is nearly empty; and never
// past the last page number a table can have, 2^32 - 2, whatever the
// Limit); when it holds more old
// markers than the limit, the Limit-th one ends the batch and the next
// batch starts after it. Markers arrive in time order, so the old ones sit
// together at the start; rows written into space that vacuum freed are
// found wherever they are, since every page is visited. The cursor,
// PruneParams.After.Position, is 1 + the last tuple examined
// (block << 16 | offset).
func (d *Driver) pruneMarkers(ctx context.Context, p *driver.PruneParams) (driver.PruneResult, error) {
	pos := p.After.Position - 1
	blk, off := pos>>16, pos&0xffff
	var (
		deleted     int64
		last        pgtype.TID // the Limit-th old marker of the range, if any
		nblocks, hi int64
	)
	err := d.auto.QueryRow(ctx, `WITH range AS (
  SELECT least($5::bigint + least(ceil($3 * 1.25 / CASE WHEN relpages > 0 AND reltuples > 0 THEN reltuples / relpages ELSE 100 END),
                                  ceil($3 / 4.0))::bigint + 1, 4294967295) AS hi
  FROM pg_class WHERE oid = $4::text::regclass
), cut AS (
  SELECT ctid FROM `+d.t.markers+`
  WHERE ctid > $2::text::tid AND ctid < (SELECT ('(' || hi || ',0)')::tid FROM range) AND processed_at < $1
  OFFSET $3 - 1 LIMIT 1
), gone AS (
  DELETE FROM `+d.t.markers+`
  WHERE ctid > $2::text::tid AND ctid < (SELECT ('(' || hi || ',0)')::tid FROM range)
    AND ctid <= coalesce((SELECT ctid FROM cut), '(4294967295,65535)'::tid) AND processed_at < $1
  RETURNING 1
)
SELECT (SELECT count(*) FROM gone), (SELECT ctid FROM cut),
       pg_relation_size($4::text::regclass) / current_setting('block_size')::bigint, (SELECT hi FROM range)`,
		p.Before, fmt.Sprintf("(%d,%d)", blk, off), p.Limit, d.t.markers, blk).Scan(&deleted, &last, &nblocks, &hi)
	if err != nil {
		return driver.PruneResult{}, fmt.Errorf("postgres: prune markers: %w", err)
	}
	res := driver.PruneResult{Deleted: int(deleted)}
	if last.Valid {
		// Cut short by the limit: go on after the last tuple taken.
		res.Last.Position = (int64(last.BlockNumber)<<16 | int64(last.OffsetNumber)) + 1
		return res, nil
	}
	res.Last.Position = (hi << 16) + 1
	res.Done = hi >= nblocks
	return res, nil
}

// retireLegacy records that the old table holds no atomic marker any more
// (when that is so), so that drivers stop reading it on the atomic path.
// Nothing writes one there since migration 011.
func (d *Driver) retireLegacy(ctx context.Context) error {
	// The flag first: the check below scans the old table.
	if legacy, err := d.legacyAtomic(ctx, d.pool); err != nil || !legacy {
		return err
	}
	_, err := d.auto.Exec(ctx, `UPDATE `+d.t.markerLayout+` SET legacy_atomic = false
WHERE legacy_atomic AND NOT EXISTS (SELECT 1 FROM `+d.t.processed+` WHERE token = 0)`)
	if err != nil {
		return fmt.Errorf("postgres: update the marker layout: %w", err)
	}
	return nil
}

// CountPrunable implements driver.MarkerPruner, over both tables.
func (d *Driver) CountPrunable(ctx context.Context, before time.Time) (map[string]int64, time.Time, error) {
	rows, err := d.pool.Query(ctx, `SELECT handler, sum(n)::bigint FROM (
  SELECT handler, count(*) AS n FROM `+d.t.processed+` WHERE processed_at < $1 AND `+prunableLease+` GROUP BY handler
  UNION ALL
  SELECT h.name, c.n FROM (SELECT handler_id, count(*) AS n FROM `+d.t.markers+` WHERE processed_at < $1 GROUP BY handler_id) c
  JOIN `+d.t.handlers+` h ON h.id = c.handler_id
) AS u GROUP BY handler`, before)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("postgres: count prunable markers: %w", err)
	}
	counts := map[string]int64{}
	var (
		h string
		n int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&h, &n}, func() error { counts[h] = n; return nil }); err != nil {
		return nil, time.Time{}, fmt.Errorf("postgres: count prunable markers: %w", err)
	}
	var oldest *time.Time
	if err := d.pool.QueryRow(ctx, `SELECT least((SELECT min(processed_at) FROM `+d.t.processed+` WHERE `+prunableLease+`),
  (SELECT min(processed_at) FROM `+d.t.markers+`))`).Scan(&oldest); err != nil {
		return nil, time.Time{}, fmt.Errorf("postgres: oldest marker: %w", err)
	}
	if oldest == nil {
		return counts, time.Time{}, nil
	}
	return counts, *oldest, nil
}

// TryMaintenanceLock implements driver.MarkerPruner with a session-level
// advisory lock named after the schema and table prefix, held until unlock
// on a connection of its own, opened with the pool's settings but outside
// it: the run's batches take pooled connections, and a lock holding one
// of a small pool would starve them.
func (d *Driver) TryMaintenanceLock(ctx context.Context) (func(), bool, error) {
	c, err := pgx.ConnectConfig(ctx, d.pool.Config().ConnConfig.Copy())
	if err != nil {
		return nil, false, fmt.Errorf("postgres: maintenance lock: connect: %w", err)
	}
	// Named after the schema the markers table is in: with Config.Schema
	// unset that is the one the search_path finds, so that tenants in
	// schemas of their own do not wait on each other's runs.
	var (
		key string
		ok  bool
	)
	if err := c.QueryRow(ctx, `SELECT k, pg_try_advisory_lock(hashtext(k)) FROM (SELECT 'idem-maintenance:' || coalesce(
  (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)), $2) || '.' || $3 AS k) AS s`,
		d.t.markers, d.schema, d.prefix).Scan(&key, &ok); err != nil {
		_ = c.Close(context.WithoutCancel(ctx))
		return nil, false, fmt.Errorf("postgres: maintenance lock: %w", err)
	}
	if !ok {
		_ = c.Close(context.WithoutCancel(ctx))
		return nil, false, nil
	}
	// The lock is the session's: closing the connection frees it too, but
	// only once the server's backend has gone, after Close returns. It is
	// released first, so that the next TryMaintenanceLock finds it free.
	unlock := func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = c.Exec(uctx, `SELECT pg_advisory_unlock(hashtext($1))`, key)
		_ = c.Close(uctx)
	}
	return unlock, true, nil
}

var _ driver.GapPruner = (*Driver)(nil)

// PruneGaps implements driver.GapPruner: one bounded DELETE of sightings
// whose sequence the guard has reached, or first seen before before.
func (d *Driver) PruneGaps(ctx context.Context, before time.Time, limit int) (int, error) {
	tag, err := d.auto.Exec(ctx, `DELETE FROM `+d.t.gaps+` WHERE ctid = ANY(ARRAY(
  SELECT g.ctid FROM `+d.t.gaps+` g LEFT JOIN `+d.t.sequences+` s ON s.handler = g.handler AND s.aggregate_id = g.aggregate_id
  WHERE g.first_seen_at < $1 OR g.seq <= s.last_seq LIMIT $2))`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("postgres: prune gap sightings: %w", err)
	}
	return int(tag.RowsAffected()), nil
}
