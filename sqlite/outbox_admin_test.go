package sqlite_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
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
	return &idemtest.OutboxStore{Driver: drv, Add: func(ctx context.Context, msgs ...*idem.Message) error {
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

// The outbox log of operators' actions ages out with the published rows:
// the first OutboxPrune call of a pass deletes its entries made before
// the cut-off, and keeps the later ones.
func TestOutboxPruneAgesTheLog(t *testing.T) {
	ctx := context.Background()
	db, drv := openMigrated(t, nil)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if err := ob.Add(ctx, tx, &idem.Message{ID: "m1", Type: "t", Stream: "orders.created", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	page, err := drv.OutboxList(ctx, driver.OutboxFilter{})
	if err != nil || len(page.Rows) != 1 {
		t.Fatalf("list: %d rows, %v", len(page.Rows), err)
	}
	if r, err := drv.OutboxPark(ctx, []int64{page.Rows[0].ID}, "alice", "no stream"); err != nil || len(r.Done) != 1 {
		t.Fatalf("park: %+v, %v", r, err)
	}
	count := func() (n int) {
		t.Helper()
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_outbox_log`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n != 1 {
		t.Fatalf("%d log entries after a park, want 1", n)
	}
	if _, _, err := drv.OutboxPrune(ctx, time.Now().Add(-time.Hour), 0, 100); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 1 {
		t.Fatalf("%d log entries after pruning what is older than an hour, want the new entry kept", n)
	}
	if _, _, err := drv.OutboxPrune(ctx, time.Now().Add(time.Hour), 0, 100); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 0 {
		t.Fatalf("%d log entries after pruning up to an hour ahead, want 0", n)
	}
}
