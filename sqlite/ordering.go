package sqlite

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/idemhq/idem/driver"
)

var (
	_ driver.SequenceGuard[*sql.Tx]      = (*Driver)(nil)
	_ driver.SequenceBatchStore[*sql.Tx] = (*Driver)(nil)
	_ driver.VersionStore[*sql.Tx]       = (*Driver)(nil)
)

// SequenceAdvance implements driver.SequenceGuard. SQLite has one writer
// and transactions begin IMMEDIATE, so the read-then-decide fallback cannot
// race.
func (d *Driver) SequenceAdvance(ctx context.Context, tx *sql.Tx, p *driver.SequenceAdvanceParams) (driver.SequenceAdvanceResult, error) {
	if d.advanceSeq == nil {
		return driver.SequenceAdvanceResult{}, errNotMigrated
	}
	var last int64
	err := tx.StmtContext(ctx, d.advanceSeq).QueryRowContext(ctx, p.Handler, p.AggregateID, p.Seq, p.AllowGap).Scan(&last)
	if err == nil {
		return driver.SequenceAdvanceResult{Advanced: true}, nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return driver.SequenceAdvanceResult{}, err
	}
	err = tx.StmtContext(ctx, d.selectSeq).QueryRowContext(ctx, p.Handler, p.AggregateID).Scan(&last)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return driver.SequenceAdvanceResult{}, err
	}
	if p.Seq == last+1 || (p.AllowGap && p.Seq > last) {
		if _, err := tx.StmtContext(ctx, d.setSeq).ExecContext(ctx, p.Handler, p.AggregateID, p.Seq); err != nil {
			return driver.SequenceAdvanceResult{}, err
		}
		return driver.SequenceAdvanceResult{Advanced: true}, nil
	}
	return driver.SequenceAdvanceResult{Last: last}, nil
}

// SequenceLockMany implements driver.SequenceBatchStore with one read, the
// aggregate IDs passed as JSON so that the statement keeps one shape. The
// transaction's SQLite write lock, held from its first write (or, if this
// read comes first, making the commit fail rather than lose an update),
// keeps other writers from moving the sequences until it ends.
func (d *Driver) SequenceLockMany(ctx context.Context, tx *sql.Tx, p *driver.SequenceLockManyParams) ([]int64, error) {
	aggs, err := json.Marshal(p.AggregateIDs)
	if err != nil {
		return nil, err
	}
	rows, err := tx.QueryContext(ctx, `SELECT aggregate_id, last_seq FROM `+d.tables.sequences+`
WHERE handler = ? AND aggregate_id IN (SELECT value FROM json_each(?))`, p.Handler, string(aggs))
	if err != nil {
		return nil, err
	}
	last := make(map[string]int64, len(p.AggregateIDs))
	for rows.Next() {
		var (
			agg string
			seq int64
		)
		if err := rows.Scan(&agg, &seq); err != nil {
			rows.Close()
			return nil, err
		}
		last[agg] = seq
	}
	if err := rows.Close(); err != nil {
		return nil, err
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	out := make([]int64, len(p.AggregateIDs))
	for i, a := range p.AggregateIDs {
		out[i] = last[a] // 0 when never seen
	}
	return out, nil
}

// SequenceSetMany implements driver.SequenceBatchStore with one prepared
// upsert per aggregate. A single statement over all of them (JSON rows, or
// a multi-row VALUES) writes the same rows but, as a multi-row write that
// may abort, first copies every page it changes to a statement journal,
// which spills to a temporary file past 64 KiB: a third slower for 100
// aggregates. As in MarkerInsertMany, the caller's context is checked
// between the statements rather than armed on each.
func (d *Driver) SequenceSetMany(ctx context.Context, tx *sql.Tx, p *driver.SequenceSetManyParams) error {
	if len(p.AggregateIDs) != len(p.Seqs) {
		return fmt.Errorf("sqlite: %d aggregate IDs for %d sequences", len(p.AggregateIDs), len(p.Seqs))
	}
	if d.setSeq == nil {
		return errNotMigrated
	}
	st := tx.StmtContext(ctx, d.setSeq)
	rowCtx := context.WithoutCancel(ctx)
	for i, a := range p.AggregateIDs {
		if err := ctx.Err(); err != nil {
			return err
		}
		if _, err := st.ExecContext(rowCtx, p.Handler, a, p.Seqs[i]); err != nil {
			return err
		}
	}
	return nil
}

// GapSighting implements driver.SequenceGuard on this host's clock.
func (d *Driver) GapSighting(ctx context.Context, p *driver.GapSightingParams) (driver.GapSightingResult, error) {
	now := time.Now()
	var first int64
	err := d.db.QueryRowContext(ctx, `INSERT INTO `+d.tables.gaps+` AS g (handler, aggregate_id, seq, first_seen_at) VALUES (?, ?, ?, ?)
ON CONFLICT (handler, aggregate_id, seq) DO UPDATE SET first_seen_at = g.first_seen_at
RETURNING first_seen_at`, p.Handler, p.AggregateID, p.Seq, now.UnixMicro()).Scan(&first)
	if err != nil {
		return driver.GapSightingResult{}, err
	}
	return driver.GapSightingResult{FirstSeen: time.UnixMicro(first), Now: now}, nil
}

// VersionNext implements driver.VersionStore with one upsert.
func (d *Driver) VersionNext(ctx context.Context, tx *sql.Tx, p *driver.VersionParams) (int64, error) {
	var v int64
	err := tx.QueryRowContext(ctx, `INSERT INTO `+d.tables.versions+` AS v (stream, aggregate_id, version) VALUES (?, ?, 1)
ON CONFLICT (stream, aggregate_id) DO UPDATE SET version = v.version + 1
RETURNING version`, p.Stream, p.AggregateID).Scan(&v)
	return v, err
}

// VersionAdvance implements driver.VersionStore with one conditional
// statement.
func (d *Driver) VersionAdvance(ctx context.Context, tx *sql.Tx, p *driver.VersionParams) (bool, int64, error) {
	var (
		v   int64
		err error
	)
	if p.Expected == 0 {
		err = tx.QueryRowContext(ctx, `INSERT INTO `+d.tables.versions+` (stream, aggregate_id, version) VALUES (?, ?, 1)
ON CONFLICT DO NOTHING RETURNING version`, p.Stream, p.AggregateID).Scan(&v)
	} else {
		err = tx.QueryRowContext(ctx, `UPDATE `+d.tables.versions+` SET version = version + 1
WHERE stream = ? AND aggregate_id = ? AND version = ? RETURNING version`, p.Stream, p.AggregateID, p.Expected).Scan(&v)
	}
	if err == nil {
		return true, v, nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return false, 0, err
	}
	err = tx.QueryRowContext(ctx, `SELECT version FROM `+d.tables.versions+` WHERE stream = ? AND aggregate_id = ?`, p.Stream, p.AggregateID).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, fmt.Errorf("sqlite: read version: %w", err)
	}
	return false, v, nil
}

// VersionCurrent implements driver.VersionStore.
func (d *Driver) VersionCurrent(ctx context.Context, tx *sql.Tx, p *driver.VersionParams) (int64, error) {
	var v int64
	err := tx.QueryRowContext(ctx, `SELECT version FROM `+d.tables.versions+` WHERE stream = ? AND aggregate_id = ?`, p.Stream, p.AggregateID).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return v, err
}
