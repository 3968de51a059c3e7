package postgres_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// A deferred BEGIN goes with the first statement, whichever call sends
// it: the statement runs inside the transaction (a rollback undoes it), a
// commit keeps it, and a transaction that ran nothing ends cleanly.
func TestBeginDeferred(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{schema, "t"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (k text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	insert := `INSERT INTO ` + table + ` (k) VALUES ($1) RETURNING k`
	firsts := map[string]func(tx postgres.Tx, k string) error{
		"Exec": func(tx postgres.Tx, k string) error {
			_, err := tx.Exec(ctx, insert, k)
			return err
		},
		"QueryRow": func(tx postgres.Tx, k string) error {
			var got string
			return tx.QueryRow(ctx, insert, k).Scan(&got)
		},
		"Query": func(tx postgres.Tx, k string) error {
			rows, err := tx.Query(ctx, insert, k)
			if err != nil {
				return err
			}
			_, err = pgx.CollectRows(rows, pgx.RowTo[string])
			return err
		},
		"SendBatch": func(tx postgres.Tx, k string) error {
			b := &pgx.Batch{}
			b.Queue(insert, k)
			b.Queue(`SELECT 1`)
			br := tx.SendBatch(ctx, b)
			var got string
			err := br.QueryRow().Scan(&got)
			if err == nil {
				_, err = br.Exec()
			}
			return errors.Join(err, br.Close())
		},
		"CopyFrom": func(tx postgres.Tx, k string) error {
			_, err := tx.CopyFrom(ctx, pgx.Identifier{schema, "t"}, []string{"k"}, pgx.CopyFromRows([][]any{{k}}))
			return err
		},
		"Conn": func(tx postgres.Tx, k string) error {
			_, err := tx.Conn().Exec(ctx, insert, k)
			return err
		},
	}
	exists := func(k string) bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE k = $1`, k).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	for name, first := range firsts {
		for _, commit := range []bool{true, false} {
			k := name + map[bool]string{true: "-commit", false: "-rollback"}[commit]
			tx, err := drv.BeginDeferred(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := first(tx, k); err != nil {
				t.Fatalf("%s: %v", k, err)
			}
			// A second statement sees the first: one transaction.
			var n int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE k = $1`, k).Scan(&n); err != nil || n != 1 {
				t.Fatalf("%s: the transaction sees %d rows (%v)", k, n, err)
			}
			if commit {
				err = drv.Commit(ctx, tx)
			} else {
				err = drv.Rollback(ctx, tx)
			}
			if err != nil {
				t.Fatalf("%s: end: %v", k, err)
			}
			if exists(k) != commit {
				t.Fatalf("%s: row exists %v after the transaction ended", k, !commit)
			}
		}
	}
	// Nothing ran: both ends succeed.
	for _, commit := range []bool{true, false} {
		tx, err := drv.BeginDeferred(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if commit {
			err = drv.Commit(ctx, tx)
		} else {
			err = drv.Rollback(ctx, tx)
		}
		if err != nil {
			t.Fatalf("empty transaction, commit %v: %v", commit, err)
		}
	}
	// A failing first statement aborts the transaction: its commit fails.
	tx, err := drv.BeginDeferred(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
		t.Fatal("division by zero did not fail")
	}
	if err := drv.Commit(ctx, tx); !errors.Is(err, postgres.ErrCommitRolledBack) {
		t.Fatalf("commit after a failed first statement: %v; want ErrCommitRolledBack", err)
	}
}
