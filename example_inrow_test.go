package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/sqlite"
)

// With ApplyInRow the projection's own row is the guard: it holds the
// account's last applied sequence, and the handler's write moves it only
// if the event is the next one. idem writes no row of its own; it decides
// from what the write reports. Here a redelivery is a Duplicate, an older
// event Stale, and an event past a missing one a gap (GapFail: a final
// error, to dead-letter).
func ExampleHandler_ApplyInRow() {
	ctx := context.Background()
	db, _ := sqlite.Open(":memory:", nil)
	defer db.Close()
	drv, _ := sqlite.New(db, nil)
	_ = drv.Migrate(ctx)
	_, _ = db.Exec(`CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL, last_seq INTEGER NOT NULL)`)
	proc, _ := idem.NewProcessor(drv, nil)

	h := &idem.Handler[*sql.Tx]{
		Name:     "account-view",
		Ordering: &idem.Ordering{Gap: idem.GapFail},
		ApplyInRow: func(ctx context.Context, tx *sql.Tx, g *idem.RowGuard) (idem.RowWrite, error) {
			var w idem.RowWrite
			// The row's sequence as the write finds it (0: no row). On
			// SQLite the transaction holds the write lock from its start.
			err := tx.QueryRowContext(ctx, `SELECT last_seq FROM accounts WHERE id = ?`, g.AggregateID).Scan(&w.Prev)
			if err != nil && !errors.Is(err, sql.ErrNoRows) {
				return w, err
			}
			var credit int64
			for _, m := range g.Msgs {
				credit += int64(len(m.Payload)) // the event's amount, say
			}
			// The guarded write, strict order: the first event creates
			// the row, every later one needs last_seq = From−1.
			var res sql.Result
			if g.From() == 1 {
				res, err = tx.ExecContext(ctx, `INSERT INTO accounts VALUES (?, ?, ?) ON CONFLICT DO NOTHING`,
					g.AggregateID, credit, g.To())
			} else {
				res, err = tx.ExecContext(ctx, `UPDATE accounts SET balance = balance + ?, last_seq = ? WHERE id = ? AND last_seq = ?`,
					credit, g.To(), g.AggregateID, g.From()-1)
			}
			if err != nil {
				return w, err
			}
			n, err := res.RowsAffected()
			w.Advanced = n == 1
			return w, err
		},
	}
	deliver := func(seq int64) {
		msg := &idem.Message{ID: fmt.Sprint("acct-7/", seq), AggregateID: "acct-7", Seq: seq, Payload: []byte("xx")}
		out, err := proc.Process(ctx, h, msg)
		fmt.Println(seq, out, err != nil && idem.IsPermanent(err))
	}
	for _, seq := range []int64{1, 2, 2, 1, 4, 3} {
		deliver(seq)
	}
	var balance, last int64
	_ = db.QueryRow(`SELECT balance, last_seq FROM accounts WHERE id = 'acct-7'`).Scan(&balance, &last)
	fmt.Println("balance", balance, "last", last)
	// Output:
	// 1 applied false
	// 2 applied false
	// 2 duplicate false
	// 1 stale false
	// 4 none true
	// 3 applied false
	// balance 6 last 3
}
