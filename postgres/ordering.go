package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/driver"
)

var (
	_ driver.SequenceGuard[Tx]        = (*Driver)(nil)
	_ driver.SequenceBatchStore[Tx]   = (*Driver)(nil)
	_ driver.SequenceManyAdvancer[Tx] = (*Driver)(nil)
	_ driver.VersionStore[Tx]         = (*Driver)(nil)
)

// SequenceAdvance implements driver.SequenceGuard. The in-order case is one
// statement (see advanceSQL) that only changes the row when the stored
// sequence is the one before; it waits on a concurrent transaction's row
// lock and re-checks the committed value. Anything else ensures the row
// exists, locks it and reads it in one round trip, then decides.
func (d *Driver) SequenceAdvance(ctx context.Context, tx Tx, p *driver.SequenceAdvanceParams) (res driver.SequenceAdvanceResult, err error) {
	err = d.liftAround(ctx, tx, func() error {
		var last int64
		q, args := d.advanceSQL(p)
		err := tx.QueryRow(ctx, q, args...).Scan(&last)
		res, err = d.advanceSlow(ctx, tx, p, err, nil)
		return err
	})
	return res, err
}

// advanceSQL is the statement that advances the sequence when the event is
// the next one (or, with AllowGap, any later one) and returns a row then,
// with its arguments. An event that may create the row (sequence 1, or
// any under AllowGap) is an upsert; any other can only follow an existing
// row, and is an UPDATE of it: an upsert would need a row to propose,
// and could then create one past a gap.
func (d *Driver) advanceSQL(p *driver.SequenceAdvanceParams) (string, []any) {
	if p.Seq == 1 || p.AllowGap {
		return `INSERT INTO ` + d.t.sequences + ` AS s (handler, aggregate_id, last_seq) VALUES ($1, $2, $3)
ON CONFLICT (handler, aggregate_id) DO UPDATE SET last_seq = excluded.last_seq
WHERE s.last_seq = excluded.last_seq - 1 OR ($4::boolean AND s.last_seq < excluded.last_seq)
RETURNING last_seq`, []any{p.Handler, p.AggregateID, p.Seq, p.AllowGap}
	}
	return `UPDATE ` + d.t.sequences + ` SET last_seq = $3
WHERE handler = $1 AND aggregate_id = $2 AND last_seq = $3::bigint - 1
RETURNING last_seq`, []any{p.Handler, p.AggregateID, p.Seq}
}

// BeginSequenceAdvance implements driver.BeginSequenceAdvancer: BEGIN and
// the one-statement advance go in one round trip; an out-of-order event
// continues with SequenceAdvance's locked read in the same transaction.
func (d *Driver) BeginSequenceAdvance(ctx context.Context, p *driver.SequenceAdvanceParams) (Tx, driver.SequenceAdvanceResult, error) {
	// The advance waits on a concurrent delivery of the aggregate: no
	// session timeout cuts that wait (see liftTimeouts).
	lift := d.liftTimeouts(ctx)
	c, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, driver.SequenceAdvanceResult{}, err
	}
	tx := &connTx{c: c}
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	lift.off(b)
	q, args := d.advanceSQL(p)
	b.Queue(q, args...)
	lift.on(b)
	br := c.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil {
		err = lift.read(br)
	}
	var last int64
	if err == nil {
		err = br.QueryRow().Scan(&last)
	}
	first := err // nil: advanced; pgx.ErrNoRows: out of order
	if err == nil || errors.Is(err, pgx.ErrNoRows) {
		if lerr := lift.read(br); lerr != nil {
			err, first = lerr, lerr
		}
	}
	if cerr := br.Close(); err == nil || errors.Is(err, pgx.ErrNoRows) {
		err = cerr
	}
	if err != nil {
		_, _ = tx.end(context.WithoutCancel(ctx), "rollback")
		return nil, driver.SequenceAdvanceResult{}, err
	}
	res, err := d.advanceSlow(ctx, tx, p, first, lift)
	if err != nil {
		_, _ = tx.end(context.WithoutCancel(ctx), "rollback")
		return nil, driver.SequenceAdvanceResult{}, err
	}
	return tx, res, nil
}

// advanceSlow finishes SequenceAdvance after the one-statement attempt,
// whose error is err: no error means it advanced. lift is nil in a
// caller's transaction, whose settings are the caller's.
func (d *Driver) advanceSlow(ctx context.Context, tx Tx, p *driver.SequenceAdvanceParams, err error, lift *timeoutLift) (driver.SequenceAdvanceResult, error) {
	var last int64
	if err == nil {
		return driver.SequenceAdvanceResult{Advanced: true}, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return driver.SequenceAdvanceResult{}, err
	}
	// Out of order, or a new aggregate starting past 1. Creating the row
	// first makes a concurrent creator's insert wait for ours (and ours for
	// it), so the locked read below sees every committed predecessor.
	b := &pgx.Batch{}
	lift.off(b)
	b.Queue(`INSERT INTO `+d.t.sequences+` (handler, aggregate_id, last_seq) VALUES ($1, $2, 0) ON CONFLICT DO NOTHING`, p.Handler, p.AggregateID)
	b.Queue(`SELECT last_seq FROM `+d.t.sequences+` WHERE handler = $1 AND aggregate_id = $2 FOR UPDATE`, p.Handler, p.AggregateID)
	lift.on(b)
	br := tx.SendBatch(ctx, b)
	err = lift.read(br)
	if err == nil {
		_, err = br.Exec()
	}
	if err == nil {
		err = br.QueryRow().Scan(&last)
	}
	if err == nil {
		err = lift.read(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return driver.SequenceAdvanceResult{}, err
	}
	if p.Seq == last+1 || (p.AllowGap && p.Seq > last) {
		if _, err := tx.Exec(ctx, `UPDATE `+d.t.sequences+` SET last_seq = $3 WHERE handler = $1 AND aggregate_id = $2`,
			p.Handler, p.AggregateID, p.Seq); err != nil {
			return driver.SequenceAdvanceResult{}, err
		}
		return driver.SequenceAdvanceResult{Advanced: true}, nil
	}
	return driver.SequenceAdvanceResult{Last: last}, nil
}

// SequenceLockMany implements driver.SequenceBatchStore in one round trip
// of two statements, neither of which rewrites an existing row. The first
// inserts the rows that are missing (ON CONFLICT DO NOTHING: an existing
// row is only probed in the index; a row another transaction is creating
// is waited for). The second locks and reads every row with SELECT … FOR
// UPDATE. Both go in byte order of the aggregate IDs. A transaction that
// waits on another's new row is still inserting, so it holds no row lock
// of this call yet; one that waits on a row lock is past its inserts, so
// nobody waits on it for an insert. Concurrent batches queue instead of
// deadlocking.
func (d *Driver) SequenceLockMany(ctx context.Context, tx Tx, p *driver.SequenceLockManyParams) (out []int64, err error) {
	err = d.liftAround(ctx, tx, func() error {
		out, err = d.sequenceLockMany(ctx, tx, p)
		return err
	})
	return out, err
}

func (d *Driver) sequenceLockMany(ctx context.Context, tx Tx, p *driver.SequenceLockManyParams) ([]int64, error) {
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO `+d.t.sequences+` (handler, aggregate_id, last_seq)
SELECT $1, a, 0 FROM unnest($2::text[]) AS a ORDER BY a COLLATE "C"
ON CONFLICT (handler, aggregate_id) DO NOTHING`, p.Handler, p.AggregateIDs)
	// One index lookup per aggregate, in the sorted order, whatever the
	// statistics say: a plan that scans the whole table would read every
	// dead row version the updates leave behind.
	b.Queue(`SELECT u.a, s.last_seq FROM (SELECT a FROM unnest($2::text[]) AS a ORDER BY a COLLATE "C") AS u,
LATERAL (SELECT last_seq FROM `+d.t.sequences+` WHERE handler = $1 AND aggregate_id = u.a FOR UPDATE) AS s`, p.Handler, p.AggregateIDs)
	br := tx.SendBatch(ctx, b)
	last := make(map[string]int64, len(p.AggregateIDs))
	_, err := br.Exec()
	if err == nil {
		var rows pgx.Rows
		if rows, err = br.Query(); err == nil {
			var (
				agg string
				seq int64
			)
			_, err = pgx.ForEachRow(rows, []any{&agg, &seq}, func() error {
				last[agg] = seq
				return nil
			})
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	out := make([]int64, len(p.AggregateIDs))
	for i, a := range p.AggregateIDs {
		l, ok := last[a]
		if !ok {
			return nil, fmt.Errorf("postgres: sequence row of %q neither locked nor created", a)
		}
		out[i] = l
	}
	return out, nil
}

// SequenceAdvanceMany implements driver.SequenceManyAdvancer with one
// upsert, in byte order of the aggregate IDs, so that each row's lock
// comes with its one write: no locking read before it, no second write
// after. With AllowGap each aggregate's largest sequence travels in an
// array and a row moves to it if it is newer. Otherwise the runs of
// consecutive sequences travel as one jsonb object keyed by aggregate ID,
// [first, last] pairs, which the conflict branch looks its row up in; the
// row moves to the end of the run that holds last_seq + 1 (written first -
// 1 <= last_seq < last, which cannot overflow at the largest bigint). A row
// the batch does not move (a redelivery) is locked but not rewritten, and
// read after. The value replaced is kept in prev_seq and returned
// (RETURNING sees only the new row before PostgreSQL 18).
func (d *Driver) SequenceAdvanceMany(ctx context.Context, tx Tx, p *driver.SequenceAdvanceManyParams) (before, after []int64, err error) {
	err = d.liftAround(ctx, tx, func() error {
		before, after, err = d.sequenceAdvanceMany(ctx, tx, p)
		return err
	})
	return before, after, err
}

func (d *Driver) sequenceAdvanceMany(ctx context.Context, tx Tx, p *driver.SequenceAdvanceManyParams) ([]int64, []int64, error) {
	if len(p.AggregateIDs) != len(p.Seqs) {
		return nil, nil, fmt.Errorf("postgres: %d aggregates for %d sequence lists", len(p.AggregateIDs), len(p.Seqs))
	}
	for i, seqs := range p.Seqs {
		if len(seqs) == 0 {
			return nil, nil, fmt.Errorf("postgres: no sequences for aggregate %q", p.AggregateIDs[i])
		}
	}
	var (
		rows pgx.Rows
		err  error
	)
	if p.AllowGap {
		largest := make([]int64, len(p.Seqs))
		for i, seqs := range p.Seqs {
			largest[i] = seqs[len(seqs)-1]
		}
		rows, err = tx.Query(ctx, `INSERT INTO `+d.t.sequences+` AS s (handler, aggregate_id, last_seq, prev_seq)
SELECT $1, u.a, u.l, 0 FROM unnest($2::text[], $3::bigint[]) AS u(a, l) ORDER BY u.a COLLATE "C"
ON CONFLICT (handler, aggregate_id) DO UPDATE SET prev_seq = s.last_seq, last_seq = excluded.last_seq
WHERE excluded.last_seq > s.last_seq
RETURNING aggregate_id, prev_seq, last_seq`, p.Handler, p.AggregateIDs, largest)
	} else {
		batch := make(map[string][][2]int64, len(p.AggregateIDs))
		for i, a := range p.AggregateIDs {
			// encoding/json would turn invalid UTF-8 into U+FFFD,
			// another key; such an ID cannot be stored in a text
			// column anyway.
			if !utf8.ValidString(a) {
				return nil, nil, fmt.Errorf("postgres: aggregate ID %q is not valid UTF-8", a)
			}
			var runs [][2]int64
			for _, s := range p.Seqs[i] {
				if n := len(runs); n > 0 && runs[n-1][1]+1 == s {
					runs[n-1][1] = s
				} else {
					runs = append(runs, [2]int64{s, s})
				}
			}
			batch[a] = runs
		}
		js, jerr := json.Marshal(batch)
		if jerr != nil {
			return nil, nil, fmt.Errorf("postgres: encode the batch's sequences: %w", jerr)
		}
		next := `COALESCE((SELECT (r->>1)::bigint FROM jsonb_array_elements($2::jsonb -> excluded.aggregate_id) AS r
    WHERE (r->>0)::bigint - 1 <= s.last_seq AND s.last_seq < (r->>1)::bigint), s.last_seq)`
		rows, err = tx.Query(ctx, `INSERT INTO `+d.t.sequences+` AS s (handler, aggregate_id, last_seq, prev_seq)
SELECT $1, u.key, COALESCE((SELECT (r->>1)::bigint FROM jsonb_array_elements(u.value) AS r WHERE (r->>0)::bigint = 1), 0), 0
FROM jsonb_each($2::jsonb) AS u ORDER BY u.key COLLATE "C"
ON CONFLICT (handler, aggregate_id) DO UPDATE SET prev_seq = s.last_seq, last_seq = `+next+`
WHERE `+next+` <> s.last_seq
RETURNING aggregate_id, prev_seq, last_seq`, p.Handler, string(js))
	}
	if err != nil {
		return nil, nil, err
	}
	type pair struct{ before, after int64 }
	got := make(map[string]pair, len(p.AggregateIDs))
	var (
		agg string
		pr  pair
	)
	_, err = pgx.ForEachRow(rows, []any{&agg, &pr.before, &pr.after}, func() error {
		got[agg] = pr
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	// A row the batch does not move (a redelivered batch) is locked by
	// the conflict but not rewritten, nor returned: read it.
	var still []string
	for _, a := range p.AggregateIDs {
		if _, ok := got[a]; !ok {
			still = append(still, a)
		}
	}
	if len(still) > 0 {
		rows, err := tx.Query(ctx, `SELECT aggregate_id, last_seq FROM `+d.t.sequences+`
WHERE handler = $1 AND aggregate_id = ANY($2::text[])`, p.Handler, still)
		if err != nil {
			return nil, nil, err
		}
		var last int64
		_, err = pgx.ForEachRow(rows, []any{&agg, &last}, func() error {
			got[agg] = pair{last, last}
			return nil
		})
		if err != nil {
			return nil, nil, err
		}
	}
	before, after := make([]int64, len(p.AggregateIDs)), make([]int64, len(p.AggregateIDs))
	for i, a := range p.AggregateIDs {
		r, ok := got[a]
		if !ok {
			return nil, nil, fmt.Errorf("postgres: sequence row of %q neither advanced nor created", a)
		}
		before[i], after[i] = r.before, r.after
	}
	return before, after, nil
}

// SequenceSetMany implements driver.SequenceBatchStore with one upsert on
// the primary key, so that every row is found through the index (an
// UPDATE joined to the pairs may be planned as a scan of the whole
// table); SequenceLockMany created and locked the rows in this
// transaction already.
func (d *Driver) SequenceSetMany(ctx context.Context, tx Tx, p *driver.SequenceSetManyParams) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+d.t.sequences+` (handler, aggregate_id, last_seq)
SELECT $1, u.a, u.l FROM unnest($2::text[], $3::bigint[]) AS u(a, l)
ON CONFLICT (handler, aggregate_id) DO UPDATE SET last_seq = excluded.last_seq`, p.Handler, p.AggregateIDs, p.Seqs)
	return err
}

// GapSighting implements driver.SequenceGuard on the database clock.
func (d *Driver) GapSighting(ctx context.Context, p *driver.GapSightingParams) (driver.GapSightingResult, error) {
	var r driver.GapSightingResult
	err := d.auto.QueryRow(ctx, `INSERT INTO `+d.t.gaps+` AS g (handler, aggregate_id, seq) VALUES ($1, $2, $3)
ON CONFLICT (handler, aggregate_id, seq) DO UPDATE SET first_seen_at = g.first_seen_at
RETURNING first_seen_at, now()`, p.Handler, p.AggregateID, p.Seq).Scan(&r.FirstSeen, &r.Now)
	return r, err
}

// VersionNext implements driver.VersionStore with one upsert; the row lock
// it takes lasts until tx ends, so concurrent allocators queue and a
// rollback gives the number back.
func (d *Driver) VersionNext(ctx context.Context, tx Tx, p *driver.VersionParams) (int64, error) {
	var v int64
	err := tx.QueryRow(ctx, `INSERT INTO `+d.t.versions+` AS v (stream, aggregate_id, version) VALUES ($1, $2, 1)
ON CONFLICT (stream, aggregate_id) DO UPDATE SET version = v.version + 1
RETURNING version`, p.Stream, p.AggregateID).Scan(&v)
	return v, err
}

// VersionAdvance implements driver.VersionStore with one conditional
// statement; the current version is read only to report a mismatch.
func (d *Driver) VersionAdvance(ctx context.Context, tx Tx, p *driver.VersionParams) (bool, int64, error) {
	var (
		v   int64
		err error
	)
	if p.Expected == 0 {
		err = tx.QueryRow(ctx, `INSERT INTO `+d.t.versions+` (stream, aggregate_id, version) VALUES ($1, $2, 1)
ON CONFLICT DO NOTHING RETURNING version`, p.Stream, p.AggregateID).Scan(&v)
	} else {
		err = tx.QueryRow(ctx, `UPDATE `+d.t.versions+` SET version = version + 1
WHERE stream = $1 AND aggregate_id = $2 AND version = $3 RETURNING version`, p.Stream, p.AggregateID, p.Expected).Scan(&v)
	}
	if err == nil {
		return true, v, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return false, 0, err
	}
	err = tx.QueryRow(ctx, `SELECT version FROM `+d.t.versions+` WHERE stream = $1 AND aggregate_id = $2`, p.Stream, p.AggregateID).Scan(&v)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, fmt.Errorf("postgres: read version: %w", err)
	}
	return false, v, nil
}

// VersionCurrent implements driver.VersionStore.
func (d *Driver) VersionCurrent(ctx context.Context, tx Tx, p *driver.VersionParams) (int64, error) {
	var v int64
	err := tx.QueryRow(ctx, `SELECT version FROM `+d.t.versions+` WHERE stream = $1 AND aggregate_id = $2`, p.Stream, p.AggregateID).Scan(&v)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	return v, err
}
