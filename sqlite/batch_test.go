package sqlite_test

import (
	"context"
	"database/sql"
	"log/slog"
	"slices"
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

// TestBatchRepeatedIDs pins what a batch does with an ID it holds twice, as
// docs/ordering.md and docs/atomic-mode.md state it: the later copy is
// decided against the first like a redelivery (Duplicate, or Conflict for
// another payload). Only when the guard refused the first copy, which then
// left no marker, does a copy with the same payload share its outcome, and
// a copy with another payload stay undecided (OutcomeNone).
func TestBatchRepeatedIDs(t *testing.T) {
	ctx := context.Background()
	_, drv := openMigrated(t, nil)
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var applied []string
	h := &idem.Handler[*sql.Tx]{Name: "orders", Ordering: &idem.Ordering{}, Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
		applied = append(applied, m.ID+"/"+string(m.Payload))
		return nil
	}}
	msg := func(id string, seq int64, payload string) *idem.Message {
		return &idem.Message{ID: id, AggregateID: "a", Seq: seq, Payload: []byte(payload)}
	}
	if _, err := p.ProcessBatch(ctx, h, []*idem.Message{msg("first", 1, "x")}); err != nil {
		t.Fatal(err)
	}
	applied = nil
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{
		msg("second", 2, "y"),
		msg("second", 2, "y"), // repeat of an applied message
		msg("second", 2, "z"), // same ID, another payload
		msg("old", 1, "w"),    // refused by the guard: seq 1 is applied
		msg("old", 1, "w"),    // repeat of a refused message
		msg("old", 1, "v"),    // same ID as a refused one, another payload
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []idem.Outcome{idem.Applied, idem.Duplicate, idem.Conflict, idem.Stale, idem.Stale, idem.OutcomeNone}
	if !slices.Equal(outs, want) {
		t.Fatalf("outcomes %v, want %v", outs, want)
	}
	if !slices.Equal(applied, []string{"second/y"}) {
		t.Fatalf("handler applied %v, want [second/y]", applied)
	}

	// A Consumer acknowledges the repeat as a Duplicate too.
	c, err := idem.NewConsumer(p, h, drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	applied = nil
	vs := c.HandleDeliveries(ctx, []*idem.Delivery{{Msg: msg("third", 3, "t")}, {Msg: msg("third", 3, "t")}})
	if !vs[0].Ack || vs[0].Outcome != idem.Applied || !vs[1].Ack || vs[1].Outcome != idem.Duplicate {
		t.Fatalf("verdicts %+v, want applied then duplicate, both acknowledged", vs)
	}
	if !slices.Equal(applied, []string{"third/t"}) {
		t.Fatalf("handler applied %v, want [third/t]", applied)
	}
}
