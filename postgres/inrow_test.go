package postgres_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// inRowStore adds to s a table of in-row aggregates, each row holding its
// state and its last applied sequence, and the guarded writes of the
// in-row conformance tests.
func inRowStore(t testing.TB, pool *pgxpool.Pool, schema string, s *idemtest.Store[postgres.Tx]) *idemtest.Store[postgres.Tx] {
	t.Helper()
	table := pgx.Identifier{schema, "inrow"}.Sanitize()
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+table+` (aggregate text PRIMARY KEY, value text NOT NULL, last_seq bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	// One round trip: the locked read of the row's sequence, then the
	// write carrying the guard. A row that exists stays locked from the
	// read to the commit, so Prev is exact; for a missing row a
	// concurrent creator makes the insert do nothing, which idem reports
	// as a retriable disagreement.
	s.RowAppend = func(ctx context.Context, tx postgres.Tx, g *idem.RowGuard, value string) (idem.RowWrite, error) {
		b := &pgx.Batch{}
		b.Queue(`SELECT last_seq FROM `+table+` WHERE aggregate = $1 FOR UPDATE`, g.AggregateID)
		switch {
		case g.AllowGap:
			b.Queue(`INSERT INTO `+table+` AS r (aggregate, value, last_seq) VALUES ($1, $2, $3)
ON CONFLICT (aggregate) DO UPDATE SET value = r.value || excluded.value, last_seq = excluded.last_seq
WHERE r.last_seq < $4`, g.AggregateID, value, g.To(), g.From())
		case g.From() == 1:
			b.Queue(`INSERT INTO `+table+` (aggregate, value, last_seq) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`, g.AggregateID, value, g.To())
		default:
			b.Queue(`UPDATE `+table+` SET value = value || $2, last_seq = $3 WHERE aggregate = $1 AND last_seq = $4`, g.AggregateID, value, g.To(), g.From()-1)
		}
		br := tx.SendBatch(ctx, b)
		var w idem.RowWrite
		err := br.QueryRow().Scan(&w.Prev)
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
		if err == nil {
			tag, eerr := br.Exec()
			err, w.Advanced = eerr, tag.RowsAffected() == 1
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		return w, err
	}
	// Two round trips for a whole batch: the locked read of every row
	// (one index lookup each, in the guards' order), then one set-based
	// write of the admitted ones whose RETURNING says which advanced:
	// rows that exist are locked and decided, rows that did not are only
	// inserted.
	s.RowAppendMany = func(ctx context.Context, tx postgres.Tx, gs []*idem.RowGuard, values []string) ([]idem.RowWrite, error) {
		aggs := make([]string, len(gs))
		for i, g := range gs {
			aggs[i] = g.AggregateID
		}
		rows, err := tx.Query(ctx, `SELECT u.a, s.last_seq FROM unnest($1::text[]) WITH ORDINALITY AS u(a, n),
LATERAL (SELECT last_seq FROM `+table+` WHERE aggregate = u.a FOR UPDATE) AS s ORDER BY u.n`, aggs)
		if err != nil {
			return nil, err
		}
		last := map[string]int64{}
		var (
			a string
			n int64
		)
		if _, err := pgx.ForEachRow(rows, []any{&a, &n}, func() error { last[a] = n; return nil }); err != nil {
			return nil, err
		}
		ws := make([]idem.RowWrite, len(gs))
		var upd, ins struct {
			aggs, values []string
			to           []int64
		}
		for i, g := range gs {
			prev, found := last[g.AggregateID]
			ws[i].Prev = prev
			if !g.Admits(prev) {
				continue
			}
			w := &ins
			if found {
				w = &upd
			}
			w.aggs, w.values, w.to = append(w.aggs, g.AggregateID), append(w.values, values[i]), append(w.to, g.To())
		}
		advanced := map[string]bool{}
		collect := func(rows pgx.Rows, err error) error {
			if err != nil {
				return err
			}
			_, err = pgx.ForEachRow(rows, []any{&a}, func() error { advanced[a] = true; return nil })
			return err
		}
		if len(upd.aggs) > 0 {
			if err := collect(tx.Query(ctx, `INSERT INTO `+table+` AS r (aggregate, value, last_seq)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])
ON CONFLICT (aggregate) DO UPDATE SET value = r.value || excluded.value, last_seq = excluded.last_seq
WHERE r.last_seq < excluded.last_seq
RETURNING aggregate`, upd.aggs, upd.values, upd.to)); err != nil {
				return nil, err
			}
		}
		if len(ins.aggs) > 0 {
			if err := collect(tx.Query(ctx, `INSERT INTO `+table+` (aggregate, value, last_seq)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])
ON CONFLICT DO NOTHING RETURNING aggregate`, ins.aggs, ins.values, ins.to)); err != nil {
				return nil, err
			}
		}
		for i, g := range gs {
			ws[i].Advanced = advanced[g.AggregateID]
		}
		return ws, nil
	}
	s.Rows = func(ctx context.Context) (map[string]idemtest.Row, error) {
		rows, err := pool.Query(ctx, `SELECT aggregate, value, last_seq FROM `+table)
		if err != nil {
			return nil, err
		}
		m := map[string]idemtest.Row{}
		var (
			a string
			r idemtest.Row
		)
		_, err = pgx.ForEachRow(rows, []any{&a, &r.Value, &r.Last}, func() error { m[a] = r; return nil })
		return m, err
	}
	return s
}

func TestInRow(t *testing.T) {
	t.Parallel()
	idemtest.RunInRow(t, &idemtest.Harness[postgres.Tx]{Open: func(t testing.TB) *idemtest.Store[postgres.Tx] {
		pool := testenv.PostgresPool(t, 40)
		schema := testenv.FreshSchema(t, pool)
		return inRowStore(t, pool, schema, storeIn(t, pool, schema))
	}})
}
