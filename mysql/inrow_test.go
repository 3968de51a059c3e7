package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
)

// rowAppend is the in-row conformance tests' guarded write on InnoDB: a
// locking read of the row's sequence (it waits for a concurrent writer and
// then sees its committed row), then a write conditioned on it. A missing
// row is created with INSERT IGNORE; should another transaction create it
// first, the read runs again on the row it committed.
func rowAppend(ctx context.Context, tx *sql.Tx, g *idem.RowGuard, value string) (idem.RowWrite, error) {
	for range 3 {
		var w idem.RowWrite
		err := tx.QueryRowContext(ctx, `SELECT last_seq FROM inrow WHERE aggregate = ? FOR UPDATE`, g.AggregateID).Scan(&w.Prev)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			if !g.Admits(0) {
				return w, nil
			}
			r, err := tx.ExecContext(ctx, `INSERT IGNORE INTO inrow (aggregate, value, last_seq) VALUES (?, ?, ?)`,
				g.AggregateID, value, g.To())
			if err != nil {
				return w, err
			}
			if n, err := r.RowsAffected(); err != nil || n == 1 {
				w.Advanced = n == 1
				return w, err
			}
			continue // created meanwhile: read it
		case err != nil:
			return w, err
		}
		if !g.Admits(w.Prev) {
			return w, nil
		}
		r, err := tx.ExecContext(ctx, `UPDATE inrow SET value = CONCAT(value, ?), last_seq = ? WHERE aggregate = ?`,
			value, g.To(), g.AggregateID)
		if err != nil {
			return w, err
		}
		n, err := r.RowsAffected()
		w.Advanced = n == 1
		return w, err
	}
	return idem.RowWrite{}, errors.New("inrow: the row kept appearing and vanishing")
}

func TestInRow(t *testing.T) {
	t.Parallel()
	idemtest.RunInRow(t, &idemtest.Harness[*sql.Tx]{Open: openStore})
}
