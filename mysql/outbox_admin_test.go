package mysql_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/outbox"
)

// openOutboxMigrated returns a migrated driver on a fresh database, and
// its outbox.
func openOutboxMigrated(t testing.TB, conns int) (*sql.DB, *mysql.Driver, *outbox.Outbox[*sql.Tx]) {
	t.Helper()
	db := testenv.MySQL(t, testenv.MySQLDatabase(t), conns)
	drv, err := mysql.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	return db, drv, ob
}

// addOutbox commits msgs to the outbox in one transaction.
func addOutbox(ctx context.Context, db *sql.DB, ob *outbox.Outbox[*sql.Tx], msgs ...*idem.Message) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := ob.Add(ctx, tx, msgs...); err != nil {
		return err
	}
	return tx.Commit()
}

// openOutboxStore returns an outbox on a fresh database.
func openOutboxStore(t testing.TB) *idemtest.OutboxStore {
	t.Helper()
	db, drv, ob := openOutboxMigrated(t, 10)
	return &idemtest.OutboxStore{Driver: drv, LogEntries: func(ctx context.Context) (n int, err error) {
		err = db.QueryRowContext(ctx, `SELECT count(*) FROM idem_outbox_log`).Scan(&n)
		return n, err
	}, Add: func(ctx context.Context, msgs ...*idem.Message) error {
		return addOutbox(ctx, db, ob, msgs...)
	}}
}

func TestOutboxAdmin(t *testing.T) {
	idemtest.RunOutboxAdmin(t, &idemtest.OutboxHarness{Open: openOutboxStore})
}

// Migrate run again after the outbox administration migration's ALTER
// went through (as after a crash before it was recorded) completes it:
// the columns and key it added already are taken as applied.
func TestMigrateAgainAfterOutboxAlter(t *testing.T) {
	ctx := context.Background()
	db, drv, _ := openOutboxMigrated(t, 2)
	if _, err := db.ExecContext(ctx, `DELETE FROM idem_migrations WHERE version = 2`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `DROP TABLE idem_outbox_log`); err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatalf("migrate again: %v", err)
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_outbox_log`).Scan(&n); err != nil {
		t.Fatalf("outbox log after migrating again: %v", err)
	}
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_migrations WHERE version = 2`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("migration 2 recorded %d times, %v", n, err)
	}
}
