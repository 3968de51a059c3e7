package sqlite

import (
	"context"
	"database/sql"
	"errors"
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

// PruneMarkers implements driver.MarkerPruner. A batch is a range of the
// table in primary-key order: the Limit rows after the cursor, whatever
// their age, found by walking the key; one DELETE then removes the
// prunable ones (old enough, and not a running or failed lease:
// prunableLease) between the cursor and the range's last key, in its own
// short write transaction. Deleting by range rather than by a list of
// keys, and not returning the keys, keeps the work a batch does bounded by
// Limit and takes a third of the time of the list.
func (d *Driver) PruneMarkers(ctx context.Context, p *driver.PruneParams) (driver.PruneResult, error) {
	if p.Limit < 1 {
		return driver.PruneResult{}, fmt.Errorf("sqlite: prune limit %d must be at least 1", p.Limit)
	}
	var res driver.PruneResult
	err := d.db.QueryRowContext(ctx, `SELECT handler, message_id FROM `+d.tables.processed+`
WHERE (handler, message_id) > (?, ?) ORDER BY handler, message_id LIMIT 1 OFFSET ?`,
		p.After.Handler, p.After.MessageID, p.Limit-1).Scan(&res.Last.Handler, &res.Last.MessageID)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		res.Done = true // fewer than Limit rows left: this batch takes the rest
	case err != nil:
		return driver.PruneResult{}, fmt.Errorf("sqlite: prune markers: %w", err)
	}
	q := `DELETE FROM ` + d.tables.processed + `
WHERE (handler, message_id) > (?1, ?2) AND processed_at < ?3 AND ` + prunableLease
	args := []any{p.After.Handler, p.After.MessageID, p.Before.UnixMicro()}
	if !res.Done {
		q += ` AND (handler, message_id) <= (?4, ?5)`
		args = append(args, res.Last.Handler, res.Last.MessageID)
	}
	r, err := d.db.ExecContext(ctx, q, args...)
	if err != nil {
		return driver.PruneResult{}, fmt.Errorf("sqlite: prune markers: %w", err)
	}
	n, err := r.RowsAffected()
	if err != nil {
		return driver.PruneResult{}, fmt.Errorf("sqlite: prune markers: %w", err)
	}
	res.Deleted = int(n)
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
