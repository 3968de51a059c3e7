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
	_ driver.SequenceGuard[*sql.Tx]         = (*Driver)(nil)
	_ driver.SequenceBatchAdvancer[*sql.Tx] = (*Driver)(nil)
	_ driver.VersionStore[*sql.Tx]          = (*Driver)(nil)
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
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.tables.sequences+` (handler, aggregate_id, last_seq) VALUES (?1, ?2, ?3)
ON CONFLICT (handler, aggregate_id) DO UPDATE SET last_seq = ?3`, p.Handler, p.AggregateID, p.Seq); err != nil {
			return driver.SequenceAdvanceResult{}, err
		}
		return driver.SequenceAdvanceResult{Advanced: true}, nil
	}
	return driver.SequenceAdvanceResult{Last: last}, nil
}

// SequenceAdvanceMany implements driver.SequenceBatchAdvancer in two
// statements whatever the batch size: one reads every aggregate's last
// sequence, then, the entries decided here exactly as SequenceAdvance
// would decide them one after the other, one upsert writes the new last
// sequences. The arrays travel as JSON, so both statements keep one shape.
// The transaction holds SQLite's write lock from its first write (or, if
// the read comes first, fails to commit rather than lose an update), so no
// other writer can move a sequence between the read and the write.
func (d *Driver) SequenceAdvanceMany(ctx context.Context, tx *sql.Tx, p *driver.SequenceAdvanceManyParams) ([]driver.SequenceAdvanceResult, error) {
	if len(p.AggregateIDs) != len(p.Seqs) {
		return nil, fmt.Errorf("sqlite: %d aggregate IDs for %d sequences", len(p.AggregateIDs), len(p.Seqs))
	}
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
	out := make([]driver.SequenceAdvanceResult, len(p.Seqs))
	changed := map[string]int64{}
	for i, agg := range p.AggregateIDs {
		l, seq := last[agg], p.Seqs[i]
		if seq != l+1 && !(p.AllowGap && seq > l) {
			out[i].Last = l
			continue
		}
		out[i].Advanced = true
		last[agg], changed[agg] = seq, seq
	}
	if len(changed) == 0 {
		return out, nil
	}
	writes := make([][2]any, 0, len(changed))
	for agg, seq := range changed {
		writes = append(writes, [2]any{agg, seq})
	}
	enc, err := json.Marshal(writes)
	if err != nil {
		return nil, err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.tables.sequences+` (handler, aggregate_id, last_seq)
SELECT ?, value ->> 0, value ->> 1 FROM json_each(?) WHERE true
ON CONFLICT (handler, aggregate_id) DO UPDATE SET last_seq = excluded.last_seq`, p.Handler, string(enc)); err != nil {
		return nil, err
	}
	return out, nil
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
