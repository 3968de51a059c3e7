package postgres_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// atomicCrashHarness shares a fresh schema with the killed child.
func atomicCrashHarness() *idemtest.AtomicCrashHarness[postgres.Tx] {
	return &idemtest.AtomicCrashHarness[postgres.Tx]{
		Create: func(t testing.TB) (*idemtest.Store[postgres.Tx], string) {
			pool := testenv.PostgresPool(t, 8)
			schema := testenv.FreshSchema(t, pool)
			return storeIn(t, pool, schema), schema
		},
		Attach: func(t testing.TB, schema string) *idemtest.Store[postgres.Tx] {
			drv, err := postgres.New(testenv.PostgresPool(t, 2), &postgres.Config{Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			balances := pgx.Identifier{schema, "balances"}.Sanitize()
			return &idemtest.Store[postgres.Tx]{Driver: drv, Credit: func(ctx context.Context, tx postgres.Tx, account string, amount int64) error {
				_, err := tx.Exec(ctx, `INSERT INTO `+balances+` AS b (account, amount) VALUES ($1, $2)
ON CONFLICT (account) DO UPDATE SET amount = b.amount + excluded.amount`, account, amount)
				return err
			}}
		},
		ChildTest: "TestAtomicCrashChild",
	}
}

// TestAtomicCrash kills a process inside an atomic-mode transaction, before
// and after its commit, and redelivers the message concurrently.
func TestAtomicCrash(t *testing.T) { idemtest.RunAtomicCrash(t, atomicCrashHarness()) }

// TestAtomicCrashChild is the killed process of TestAtomicCrash; run on its
// own it does nothing.
func TestAtomicCrashChild(t *testing.T) { idemtest.AtomicCrashChild(t, atomicCrashHarness()) }
