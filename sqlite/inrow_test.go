package sqlite_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/sqlite"
)

// inRowStore adds to s a table of in-row aggregates, each row holding its
// state and its last applied sequence, and the guarded writes of the
// in-row conformance tests.
//
// SQLite transactions begin IMMEDIATE and so hold the write lock from the
// start: the read of the row's sequence stays true until the write.
func inRowStore(t testing.TB, db *sql.DB, s *idemtest.Store[*sql.Tx]) *idemtest.Store[*sql.Tx] {
	t.Helper()
	if _, err := db.Exec(`CREATE TABLE inrow (aggregate TEXT PRIMARY KEY, value TEXT NOT NULL, last_seq INTEGER NOT NULL) WITHOUT ROWID`); err != nil {
		t.Fatal(err)
	}
	s.RowAppend = func(ctx context.Context, tx *sql.Tx, g *idem.RowGuard, value string) (idem.RowWrite, error) {
		var w idem.RowWrite
		err := tx.QueryRowContext(ctx, `SELECT last_seq FROM inrow WHERE aggregate = ?`, g.AggregateID).Scan(&w.Prev)
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return w, err
		}
		// The write carries the guard itself.
		var res sql.Result
		switch {
		case g.AllowGap:
			res, err = tx.ExecContext(ctx, `INSERT INTO inrow (aggregate, value, last_seq) VALUES (?1, ?2, ?3)
ON CONFLICT (aggregate) DO UPDATE SET value = value || excluded.value, last_seq = excluded.last_seq WHERE last_seq < ?4`,
				g.AggregateID, value, g.To(), g.From())
		case g.From() == 1:
			res, err = tx.ExecContext(ctx, `INSERT INTO inrow (aggregate, value, last_seq) VALUES (?, ?, ?) ON CONFLICT DO NOTHING`,
				g.AggregateID, value, g.To())
		default:
			res, err = tx.ExecContext(ctx, `UPDATE inrow SET value = value || ?2, last_seq = ?3 WHERE aggregate = ?1 AND last_seq = ?4`,
				g.AggregateID, value, g.To(), g.From()-1)
		}
		if err != nil {
			return w, err
		}
		n, err := res.RowsAffected()
		w.Advanced = n == 1
		return w, err
	}
	s.RowAppendMany = func(ctx context.Context, tx *sql.Tx, gs []*idem.RowGuard, values []string) ([]idem.RowWrite, error) {
		aggs := make([]string, len(gs))
		for i, g := range gs {
			aggs[i] = g.AggregateID
		}
		enc, err := json.Marshal(aggs)
		if err != nil {
			return nil, err
		}
		rows, err := tx.QueryContext(ctx, `SELECT aggregate, last_seq FROM inrow WHERE aggregate IN (SELECT value FROM json_each(?))`, string(enc))
		if err != nil {
			return nil, err
		}
		last := map[string]int64{}
		for rows.Next() {
			var (
				a string
				n int64
			)
			if err := rows.Scan(&a, &n); err != nil {
				rows.Close()
				return nil, err
			}
			last[a] = n
		}
		if err := rows.Close(); err != nil {
			return nil, err
		}
		ws := make([]idem.RowWrite, len(gs))
		var write [][3]any
		for i, g := range gs {
			ws[i].Prev = last[g.AggregateID]
			if g.Admits(ws[i].Prev) {
				write = append(write, [3]any{g.AggregateID, values[i], g.To()})
			}
		}
		if len(write) == 0 {
			return ws, nil
		}
		if enc, err = json.Marshal(write); err != nil {
			return nil, err
		}
		// One statement for every admitted row; RETURNING says which
		// advanced. The rows read above cannot move meanwhile.
		rows, err = tx.QueryContext(ctx, `INSERT INTO inrow (aggregate, value, last_seq)
SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?) WHERE true
ON CONFLICT (aggregate) DO UPDATE SET value = inrow.value || excluded.value, last_seq = excluded.last_seq
WHERE inrow.last_seq < excluded.last_seq
RETURNING aggregate`, string(enc))
		if err != nil {
			return nil, err
		}
		advanced := map[string]bool{}
		for rows.Next() {
			var a string
			if err := rows.Scan(&a); err != nil {
				rows.Close()
				return nil, err
			}
			advanced[a] = true
		}
		if err := rows.Close(); err != nil {
			return nil, err
		}
		for i, g := range gs {
			ws[i].Advanced = advanced[g.AggregateID]
		}
		return ws, nil
	}
	s.Rows = func(ctx context.Context) (map[string]idemtest.Row, error) {
		rows, err := db.QueryContext(ctx, `SELECT aggregate, value, last_seq FROM inrow`)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		m := map[string]idemtest.Row{}
		for rows.Next() {
			var (
				a string
				r idemtest.Row
			)
			if err := rows.Scan(&a, &r.Value, &r.Last); err != nil {
				return nil, err
			}
			m[a] = r
		}
		return m, rows.Err()
	}
	return s
}

func TestInRow(t *testing.T) {
	t.Parallel()
	idemtest.RunInRow(t, &idemtest.Harness[*sql.Tx]{Open: func(t testing.TB) *idemtest.Store[*sql.Tx] {
		db, drv := openMigrated(t, &sqlite.OpenOptions{Synchronous: "OFF"})
		return inRowStore(t, db, storeOn(t, db, drv))
	}, Aggregates: 20})
}
