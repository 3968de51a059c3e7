package sqlite_test

import (
	"context"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/outbox"
)

// openOutboxStore returns an outbox in a fresh database file.
func openOutboxStore(t testing.TB) *idemtest.OutboxStore {
	t.Helper()
	db, drv := openMigrated(t, nil)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	return &idemtest.OutboxStore{Driver: drv, LogEntries: func(ctx context.Context) (n int, err error) {
		err = db.QueryRowContext(ctx, `SELECT count(*) FROM idem_outbox_log`).Scan(&n)
		return n, err
	}, Add: func(ctx context.Context, msgs ...*idem.Message) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if err := ob.Add(ctx, tx, msgs...); err != nil {
			return err
		}
		return tx.Commit()
	}}
}

func TestOutboxAdmin(t *testing.T) {
	idemtest.RunOutboxAdmin(t, &idemtest.OutboxHarness{Open: openOutboxStore})
}
