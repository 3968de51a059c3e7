package mysql_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// atomicCrashHarness shares a fresh database with the killed child.
func atomicCrashHarness() *idemtest.AtomicCrashHarness[*sql.Tx] {
	return &idemtest.AtomicCrashHarness[*sql.Tx]{
		Create: func(t testing.TB) (*idemtest.Store[*sql.Tx], string) {
			dsn := testenv.MySQLDatabase(t)
			return storeOn(t, testenv.MySQL(t, dsn, 8), nil), dsn
		},
		Attach: func(t testing.TB, dsn string) *idemtest.Store[*sql.Tx] {
			drv, err := mysql.New(testenv.MySQL(t, dsn, 2), nil)
			if err != nil {
				t.Fatal(err)
			}
			return &idemtest.Store[*sql.Tx]{Driver: drv, Credit: func(ctx context.Context, tx *sql.Tx, account string, amount int64) error {
				_, err := tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES (?, ?)
ON DUPLICATE KEY UPDATE amount = amount + VALUES(amount)`, account, amount)
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
