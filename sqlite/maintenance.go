package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/idemhq/idem/driver"
)

var _ driver.MarkerPruner = (*Driver)(nil)

// prunableLease is the condition, besides its age, on a row that retention
// may delete: a done marker or lease. A running lease stays whatever its
// age (its holder may be a paused worker that would not be fenced off a
// row re-created at token 1), and so does a failed one: its dead letter
// may be replayed at any time, and the replay's claim must get a token
// above the failed attempts', which a downstream fence has seen.
const prunableLease = `status = 'done'`

// PruneMarkers implements driver.MarkerPruner: the next batch after the
// cursor in primary-key order, deleted in one statement (its own short
// write transaction); rows of running and failed leases are skipped
// (prunableLease).
func (d *Driver) PruneMarkers(ctx context.Context, p *driver.PruneParams) (driver.PruneResult, error) {
	if p.Limit < 1 {
		return driver.PruneResult{}, fmt.Errorf("sqlite: prune limit %d must be at least 1", p.Limit)
	}
	rows, err := d.db.QueryContext(ctx, `DELETE FROM `+d.tables.processed+` WHERE (handler, message_id) IN (
  SELECT handler, message_id FROM `+d.tables.processed+`
  WHERE (handler, message_id) > (?, ?) AND processed_at < ? AND `+prunableLease+`
  ORDER BY handler, message_id
  LIMIT ?
) RETURNING handler, message_id`, p.After.Handler, p.After.MessageID, p.Before.UnixMicro(), p.Limit)
	if err != nil {
		return driver.PruneResult{}, fmt.Errorf("sqlite: prune markers: %w", err)
	}
	defer rows.Close()
	var res driver.PruneResult
	for rows.Next() {
		var k driver.MarkerKey
		if err := rows.Scan(&k.Handler, &k.MessageID); err != nil {
			return driver.PruneResult{}, fmt.Errorf("sqlite: prune markers: %w", err)
		}
		res.Deleted++
		if k.Handler > res.Last.Handler || (k.Handler == res.Last.Handler && k.MessageID > res.Last.MessageID) {
			res.Last = k
		}
	}
	if err := rows.Err(); err != nil {
		return driver.PruneResult{}, fmt.Errorf("sqlite: prune markers: %w", err)
	}
	res.Done = res.Deleted < p.Limit
	return res, nil
}

// CountPrunable implements driver.MarkerPruner.
func (d *Driver) CountPrunable(ctx context.Context, before time.Time) (map[string]int64, time.Time, error) {
	rows, err := d.db.QueryContext(ctx, `SELECT handler, count(*) FROM `+d.tables.processed+`
WHERE processed_at < ? AND `+prunableLease+` GROUP BY handler`, before.UnixMicro())
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("sqlite: count prunable markers: %w", err)
	}
	defer rows.Close()
	counts := map[string]int64{}
	for rows.Next() {
		var (
			h string
			n int64
		)
		if err := rows.Scan(&h, &n); err != nil {
			return nil, time.Time{}, fmt.Errorf("sqlite: count prunable markers: %w", err)
		}
		counts[h] = n
	}
	if err := rows.Err(); err != nil {
		return nil, time.Time{}, fmt.Errorf("sqlite: count prunable markers: %w", err)
	}
	rows.Close()
	var oldest sql.NullInt64
	if err := d.db.QueryRowContext(ctx, `SELECT min(processed_at) FROM `+d.tables.processed+` WHERE `+prunableLease).Scan(&oldest); err != nil {
		return nil, time.Time{}, fmt.Errorf("sqlite: oldest marker: %w", err)
	}
	if !oldest.Valid {
		return counts, time.Time{}, nil
	}
	return counts, time.UnixMicro(oldest.Int64), nil
}

// TryMaintenanceLock implements driver.MarkerPruner. SQLite has one writer
// at a time, so concurrent pruners in several processes only take turns
// batch by batch; within a process the driver lets one run at a time.
func (d *Driver) TryMaintenanceLock(context.Context) (func(), bool, error) {
	if !d.maintenance.TryLock() {
		return nil, false, nil
	}
	return d.maintenance.Unlock, true, nil
}

var _ driver.GapPruner = (*Driver)(nil)

// PruneGaps implements driver.GapPruner: one bounded DELETE of sightings
// whose sequence the guard has reached, or first seen before before.
func (d *Driver) PruneGaps(ctx context.Context, before time.Time, limit int) (int, error) {
	r, err := d.db.ExecContext(ctx, `DELETE FROM `+d.tables.gaps+` WHERE (handler, aggregate_id, seq) IN (
  SELECT g.handler, g.aggregate_id, g.seq FROM `+d.tables.gaps+` g LEFT JOIN `+d.tables.sequences+` s ON s.handler = g.handler AND s.aggregate_id = g.aggregate_id
  WHERE g.first_seen_at < ? OR g.seq <= s.last_seq LIMIT ?)`, before.UnixMicro(), limit)
	if err != nil {
		return 0, fmt.Errorf("sqlite: prune gap sightings: %w", err)
	}
	n, err := r.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("sqlite: prune gap sightings: %w", err)
	}
	return int(n), nil
}
