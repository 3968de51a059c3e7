package sqlite_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"

	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
)

// atomicCrashHarness shares a database file with the killed child.
func atomicCrashHarness() *idemtest.AtomicCrashHarness[*sql.Tx] {
	return &idemtest.AtomicCrashHarness[*sql.Tx]{
		Create: func(t testing.TB) (*idemtest.Store[*sql.Tx], string) {
			path := filepath.Join(t.TempDir(), "crash.db")
			db, drv := testenv.SQLite(t, path, nil)
			return storeOn(t, db, drv), path
		},
		Attach: func(t testing.TB, path string) *idemtest.Store[*sql.Tx] {
			_, drv := testenv.SQLite(t, path, nil)
			return &idemtest.Store[*sql.Tx]{Driver: drv, Credit: func(ctx context.Context, tx *sql.Tx, account string, amount int64) error {
				_, err := tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES (?, ?)
ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, account, amount)
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
