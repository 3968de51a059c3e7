package mysql_test

import (
	"context"
	"database/sql"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// openFolded opens a pool on dsn through mysql.Open: connections at READ
// COMMITTED, and the driver's transactions sending BEGIN with their first
// statement.
func openFolded(t testing.TB, dsn string, conns int) *sql.DB {
	t.Helper()
	cfg, err := gomysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	db, err := mysql.Open(context.Background(), cfg)
	if err != nil {
		testenv.Unavailable(t, "MySQL/MariaDB", cfg.Addr, err)
	}
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	t.Cleanup(func() { db.Close() })
	return db
}

// atomicCrashHarness shares a fresh database with the killed child, whose
// pool is a plain one or, with folded, one from mysql.Open.
func atomicCrashHarness(folded bool) *idemtest.AtomicCrashHarness[*sql.Tx] {
	child := "TestAtomicCrashChild"
	if folded {
		child = "TestAtomicCrashFoldedChild"
	}
	return &idemtest.AtomicCrashHarness[*sql.Tx]{
		Create: func(t testing.TB) (*idemtest.Store[*sql.Tx], string) {
			dsn := testenv.MySQLDatabase(t)
			return storeOn(t, testenv.MySQL(t, dsn, 8), nil), dsn
		},
		Attach: func(t testing.TB, dsn string) *idemtest.Store[*sql.Tx] {
			db, cfg := testenv.MySQL(t, dsn, 2), (*mysql.Config)(nil)
			if folded {
				db, cfg = openFolded(t, dsn, 2), &mysql.Config{SessionIsolation: true}
			}
			drv, err := mysql.New(db, cfg)
			if err != nil {
				t.Fatal(err)
			}
			return &idemtest.Store[*sql.Tx]{Driver: drv, Credit: func(ctx context.Context, tx *sql.Tx, account string, amount int64) error {
				_, err := tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES (?, ?)
ON DUPLICATE KEY UPDATE amount = amount + VALUES(amount)`, account, amount)
				return err
			}}
		},
		ChildTest: child,
	}
}

// TestAtomicCrash kills a process inside an atomic-mode transaction, before
// and after its commit, and redelivers the message concurrently.
func TestAtomicCrash(t *testing.T) { idemtest.RunAtomicCrash(t, atomicCrashHarness(false)) }

// TestAtomicCrashChild is the killed process of TestAtomicCrash; run on its
// own it does nothing.
func TestAtomicCrashChild(t *testing.T) { idemtest.AtomicCrashChild(t, atomicCrashHarness(false)) }

// TestAtomicCrashFolded is TestAtomicCrash with the killed process on a
// pool from mysql.Open, whose transactions send BEGIN with the marker.
func TestAtomicCrashFolded(t *testing.T) { idemtest.RunAtomicCrash(t, atomicCrashHarness(true)) }

// TestAtomicCrashFoldedChild is the killed process of
// TestAtomicCrashFolded; run on its own it does nothing.
func TestAtomicCrashFoldedChild(t *testing.T) {
	idemtest.AtomicCrashChild(t, atomicCrashHarness(true))
}
