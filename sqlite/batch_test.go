package sqlite_test

import (
	"context"
	"database/sql"
	"log/slog"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
)

// TestBatchRolledBackBySQLiteLeavesNothing: an error that makes SQLite roll
// back the whole transaction in the middle of a batch's marker inserts (here
// a trigger's RAISE(ROLLBACK)) fails the batch; the driver does not go on
// inserting markers outside the transaction it lost.
func TestBatchRolledBackBySQLiteLeavesNothing(t *testing.T) {
	ctx := context.Background()
	db, drv := openMigrated(t, nil)
	if _, err := db.ExecContext(ctx, `CREATE TRIGGER refuse BEFORE INSERT ON idem_processed
WHEN NEW.message_id = 'evt-000040' BEGIN SELECT RAISE(ROLLBACK, 'refused by trigger'); END`); err != nil {
		t.Fatal(err)
	}
	var logs strings.Builder
	p, err := idem.NewProcessor(drv, &idem.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	msgs := make([]*idem.Message, 0, 100)
	for _, e := range idemtest.Events(100) {
		msgs = append(msgs, e.Message())
	}
	h := &idem.Handler[*sql.Tx]{Name: "balances", ApplyBatch: func(context.Context, *sql.Tx, []*idem.Message) error {
		t.Error("handler called for a batch whose markers failed")
		return nil
	}}
	_, err = p.ProcessBatch(ctx, h, msgs)
	if err == nil || !strings.Contains(err.Error(), "refused by trigger") {
		t.Fatalf("ProcessBatch: %v, want the trigger's error", err)
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_processed`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d markers stored after the transaction was rolled back, want 0", n)
	}
	// SQLite ended the transaction itself: nothing left to roll back, and
	// nothing to warn about.
	if strings.Contains(logs.String(), "rollback failed") {
		t.Fatalf("logged a failed rollback: %s", logs.String())
	}
}
