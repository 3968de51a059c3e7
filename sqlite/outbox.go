package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlfilter"
)

var (
	_ driver.OutboxWriter[*sql.Tx] = (*Driver)(nil)
	_ driver.OutboxRelayStore      = (*Driver)(nil)
)

// OutboxAdd implements driver.OutboxWriter: one prepared INSERT per row in
// tx (faster than a multi-row INSERT on SQLite).
func (d *Driver) OutboxAdd(ctx context.Context, tx *sql.Tx, rows []driver.OutboxRow) error {
	if len(rows) == 0 {
		return nil
	}
	q := `INSERT INTO ` + d.tables.outbox + ` (destination, message_id, ordering_key, aggregate_id, seq, type, headers, payload, payload_hash, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`
	now := time.Now().UnixMicro()
	exec := func(r *driver.OutboxRow, run func(args ...any) error) error {
		payload := r.Payload
		if payload == nil {
			payload = []byte{}
		}
		return run(r.Destination, r.MessageID, r.OrderingKey, r.AggregateID, r.Seq, r.Type, r.Headers, payload, r.PayloadHash, now)
	}
	if len(rows) == 1 {
		return wrapOutboxAdd(exec(&rows[0], func(args ...any) error { _, err := tx.ExecContext(ctx, q, args...); return err }))
	}
	st, err := tx.PrepareContext(ctx, q)
	if err != nil {
		return wrapOutboxAdd(err)
	}
	defer st.Close()
	for i := range rows {
		if err := exec(&rows[i], func(args ...any) error { _, err := st.ExecContext(ctx, args...); return err }); err != nil {
			return wrapOutboxAdd(err)
		}
	}
	return nil
}

func wrapOutboxAdd(err error) error {
	if err != nil {
		return fmt.Errorf("sqlite: add outbox rows: %w", err)
	}
	return nil
}

// OutboxClaim implements driver.OutboxRelayStore, in one write
// transaction (SQLite has one writer, so the steps cannot interleave with
// another relay's).
func (d *Driver) OutboxClaim(ctx context.Context, owner string, limit, maxBytes int, ttl time.Duration) (out []driver.OutboxRow, cut bool, err error) {
	tx, err := d.Begin(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("sqlite: claim outbox rows: %w", err)
	}
	defer func() {
		if err != nil {
			tx.Rollback()
			err = fmt.Errorf("sqlite: claim outbox rows: %w", err)
		}
	}()
	now := time.Now()
	// Take the write lock first, so no other relay reads the same
	// candidates between our read and our claim.
	if _, err = tx.ExecContext(ctx, `DELETE FROM `+d.tables.outboxClaims+` WHERE claimed_until <= ?`, now.UnixMicro()); err != nil {
		return nil, false, err
	}
	rows, err := tx.QueryContext(ctx, `SELECT DISTINCT ordering_key FROM (SELECT o.ordering_key FROM `+d.tables.outbox+` o
WHERE o.published_at IS NULL AND NOT EXISTS (SELECT 1 FROM `+d.tables.outboxClaims+` c WHERE c.ordering_key = o.ordering_key AND c.owner <> ?)
AND `+d.notParked("o")+`
ORDER BY o.id LIMIT ?)`, owner, limit)
	if err != nil {
		return nil, false, err
	}
	var keys []string
	for rows.Next() {
		var k string
		if err = rows.Scan(&k); err != nil {
			rows.Close()
			return nil, false, err
		}
		keys = append(keys, k)
	}
	rows.Close()
	if err = rows.Err(); err != nil {
		return nil, false, err
	}
	if len(keys) == 0 {
		return nil, false, tx.Commit()
	}
	until := now.Add(ttl).UnixMicro()
	st, err := tx.PrepareContext(ctx, `INSERT INTO `+d.tables.outboxClaims+` (ordering_key, owner, claimed_until) VALUES (?, ?, ?)
ON CONFLICT (ordering_key) DO UPDATE SET claimed_until = excluded.claimed_until`)
	if err != nil {
		return nil, false, err
	}
	for _, k := range keys {
		if _, err = st.ExecContext(ctx, k, owner, until); err != nil {
			st.Close()
			return nil, false, err
		}
	}
	st.Close()
	// The claims just written, found by their owner and expiry (not by a
	// list of keys: one ? per key would stop at SQLite's 32,766 bound
	// variables, and a relay's batch is the user's to size).
	rows, err = tx.QueryContext(ctx, `SELECT id, destination, message_id, ordering_key, aggregate_id, seq, type, headers, payload, payload_hash, created_at, attempts
FROM `+d.tables.outbox+` o WHERE published_at IS NULL AND ordering_key IN (SELECT ordering_key FROM `+d.tables.outboxClaims+` WHERE owner = ? AND claimed_until = ?)
AND `+d.notParked("o")+`
ORDER BY id LIMIT ?`, owner, until, limit)
	if err != nil {
		return nil, false, err
	}
	used := 0 // payload bytes in out
	for rows.Next() {
		var (
			o       driver.OutboxRow
			created int64
		)
		if err = rows.Scan(&o.ID, &o.Destination, &o.MessageID, &o.OrderingKey, &o.AggregateID, &o.Seq, &o.Type, &o.Headers, &o.Payload, &o.PayloadHash, &created, &o.Attempts); err != nil {
			rows.Close()
			return nil, false, err
		}
		if cut = !driver.OutboxClaimFits(len(out), used, len(o.Payload), maxBytes); cut {
			break
		}
		used += len(o.Payload)
		o.CreatedAt = time.UnixMicro(created)
		out = append(out, o)
	}
	rows.Close()
	if err = rows.Err(); err != nil {
		return nil, false, err
	}
	if cut { // every candidate key was claimed: the write lock was held
		if idle := driver.OutboxIdleKeys(keys, out); len(idle) > 0 {
			if st, err = tx.PrepareContext(ctx, `DELETE FROM `+d.tables.outboxClaims+` WHERE ordering_key = ? AND owner = ?`); err != nil {
				return nil, false, err
			}
			defer st.Close()
			for _, k := range idle {
				if _, err = st.ExecContext(ctx, k, owner); err != nil {
					return nil, false, err
				}
			}
		}
	}
	return out, cut, tx.Commit()
}

// notParked is the condition that the outbox row aliased o is not parked
// and no parked row of its key precedes it, read from the partial index
// of parked rows.
func (d *Driver) notParked(o string) string {
	return `NOT EXISTS (SELECT 1 FROM ` + d.tables.outbox + ` p WHERE p.ordering_key = ` + o + `.ordering_key
  AND p.parked_at IS NOT NULL AND p.published_at IS NULL AND p.id <= ` + o + `.id)`
}

// OutboxMarkPublished implements driver.OutboxRelayStore.
func (d *Driver) OutboxMarkPublished(ctx context.Context, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	if _, err := d.db.ExecContext(ctx, `UPDATE `+d.tables.outbox+` SET published_at = ? WHERE published_at IS NULL AND `+idsIn,
		time.Now().UnixMicro(), sqlfilter.JSONIDs(ids)); err != nil {
		return fmt.Errorf("sqlite: mark outbox rows published: %w", err)
	}
	return nil
}

// OutboxFailed implements driver.OutboxRelayStore: the attempt and the
// key's hold in one transaction.
func (d *Driver) OutboxFailed(ctx context.Context, owner string, id int64, errText string, holdFor time.Duration) (err error) {
	tx, err := d.Begin(ctx)
	if err != nil {
		return fmt.Errorf("sqlite: record outbox failure: %w", err)
	}
	defer func() {
		if err != nil {
			tx.Rollback()
			err = fmt.Errorf("sqlite: record outbox failure: %w", err)
		}
	}()
	if _, err = tx.ExecContext(ctx, `UPDATE `+d.tables.outbox+` SET attempts = attempts + 1, last_error = ? WHERE id = ?`, errText, id); err != nil {
		return err
	}
	now := time.Now()
	if _, err = tx.ExecContext(ctx, `INSERT INTO `+d.tables.outboxClaims+` (ordering_key, owner, claimed_until)
SELECT ordering_key, '', ? FROM `+d.tables.outbox+` WHERE id = ?
ON CONFLICT (ordering_key) DO UPDATE SET owner = '', claimed_until = excluded.claimed_until
WHERE owner = ? OR owner = '' OR claimed_until <= ?`, now.Add(holdFor).UnixMicro(), id, owner, now.UnixMicro()); err != nil {
		return err
	}
	return tx.Commit()
}

// OutboxRelease implements driver.OutboxRelayStore.
func (d *Driver) OutboxRelease(ctx context.Context, owner string) error {
	if _, err := d.db.ExecContext(ctx, `DELETE FROM `+d.tables.outboxClaims+` WHERE owner = ?`, owner); err != nil {
		return fmt.Errorf("sqlite: release outbox claims: %w", err)
	}
	return nil
}

// OutboxStats implements driver.OutboxRelayStore.
func (d *Driver) OutboxStats(ctx context.Context) (driver.OutboxStats, error) {
	var (
		s      driver.OutboxStats
		oldest sql.NullInt64
		last   sql.NullString
	)
	err := d.db.QueryRowContext(ctx, `SELECT count(*) FILTER (WHERE published_at IS NULL), count(*) FILTER (WHERE published_at IS NOT NULL),
min(created_at) FILTER (WHERE published_at IS NULL AND parked_at IS NULL),
count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL AND attempts > 0),
count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NOT NULL),
(SELECT last_error FROM `+d.tables.outbox+` WHERE published_at IS NULL AND parked_at IS NULL AND attempts > 0 ORDER BY id DESC LIMIT 1)
FROM `+d.tables.outbox).Scan(&s.Pending, &s.Published, &oldest, &s.Failing, &s.Parked, &last)
	if err != nil {
		return s, fmt.Errorf("sqlite: outbox stats: %w", err)
	}
	if oldest.Valid {
		s.OldestPending = time.UnixMicro(oldest.Int64)
	}
	s.LastError = last.String
	return s, nil
}

// OutboxPrune implements driver.OutboxRelayStore.
func (d *Driver) OutboxPrune(ctx context.Context, before time.Time, after int64, limit int) (int, int64, error) {
	if after == 0 {
		// The operators' log of retries, parks and discards ages with
		// the rows it is about: a few rows a day, deleted in one go.
		if _, err := d.db.ExecContext(ctx, `DELETE FROM `+d.tables.outboxLog+` WHERE at < ?`, before.UnixMicro()); err != nil {
			return 0, after, fmt.Errorf("sqlite: prune outbox log: %w", err)
		}
	}
	rows, err := d.db.QueryContext(ctx, `DELETE FROM `+d.tables.outbox+` WHERE id IN (SELECT id FROM `+d.tables.outbox+`
WHERE id > ? AND published_at < ? ORDER BY id LIMIT ?) RETURNING id`, after, before.UnixMicro(), limit)
	if err != nil {
		return 0, after, fmt.Errorf("sqlite: prune outbox: %w", err)
	}
	defer rows.Close()
	n, last := 0, after
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return n, last, fmt.Errorf("sqlite: prune outbox: %w", err)
		}
		n++
		last = max(last, id)
	}
	if err := rows.Err(); err != nil {
		return n, last, fmt.Errorf("sqlite: prune outbox: %w", err)
	}
	return n, last, nil
}

var _ driver.OutboxPrunableCounter = (*Driver)(nil)

// OutboxCountPrunable implements driver.OutboxPrunableCounter.
func (d *Driver) OutboxCountPrunable(ctx context.Context, before time.Time) (int64, error) {
	var n int64
	if err := d.db.QueryRowContext(ctx, `SELECT count(*) FROM `+d.tables.outbox+` WHERE published_at < ?`, before.UnixMicro()).Scan(&n); err != nil {
		return 0, fmt.Errorf("sqlite: count prunable outbox rows: %w", err)
	}
	return n, nil
}
