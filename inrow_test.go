package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// The in-row handler's setup is checked before anything runs.
func TestInRowConfig(t *testing.T) {
	t.Parallel()
	p := memProcessor(t, nil)
	write := func(context.Context, *sql.Tx, *idem.RowGuard) (idem.RowWrite, error) {
		return idem.RowWrite{Advanced: true}, nil
	}
	msg := &idem.Message{ID: "m", AggregateID: "a", Seq: 1}
	for name, h := range map[string]*idem.Handler[*sql.Tx]{
		"no Ordering":    {Name: "h", ApplyInRow: write},
		"also Apply":     {Name: "h", ApplyInRow: write, Ordering: &idem.Ordering{}, Apply: noop().Apply},
		"bad gap policy": {Name: "h", ApplyInRow: write, Ordering: &idem.Ordering{Gap: 9}},
	} {
		if _, err := p.Process(context.Background(), h, msg); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: Process: %v; want ErrInvalidConfig", name, err)
		}
		if _, err := p.ProcessBatch(context.Background(), h, []*idem.Message{msg}); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: ProcessBatch: %v; want ErrInvalidConfig", name, err)
		}
	}
	h := &idem.Handler[*sql.Tx]{Name: "h", ApplyInRow: write, Ordering: &idem.Ordering{}}
	if _, err := p.ProcessBatch(context.Background(), h, []*idem.Message{msg, {ID: "n", Payload: []byte("x")}}); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Errorf("batch with a message without Seq: %v; want ErrInvalidMessage", err)
	}
}

// idem decides from what the write reports, and refuses a report that
// contradicts the gap policy.
func TestInRowReports(t *testing.T) {
	t.Parallel()
	p := memProcessor(t, nil)
	ctx := context.Background()
	for _, c := range []struct {
		name      string
		w         idem.RowWrite
		gap       idem.GapPolicy
		want      idem.Outcome
		guardErr  bool
		permanent bool
	}{
		{"next", idem.RowWrite{Advanced: true, Prev: 4}, idem.GapFail, idem.Applied, false, false},
		{"duplicate", idem.RowWrite{Prev: 5}, idem.GapFail, idem.Duplicate, false, false},
		{"stale", idem.RowWrite{Prev: 9}, idem.GapFail, idem.Stale, false, false},
		{"allow past a gap", idem.RowWrite{Advanced: true, Prev: 1}, idem.GapAllow, idem.Applied, false, false},
		{"advanced past a gap", idem.RowWrite{Advanced: true, Prev: 1}, idem.GapFail, idem.OutcomeNone, true, true},
		{"advanced a stale one", idem.RowWrite{Advanced: true, Prev: 7}, idem.GapAllow, idem.OutcomeNone, true, true},
		{"refused the next one", idem.RowWrite{Prev: 4}, idem.GapFail, idem.OutcomeNone, true, false},
		{"negative", idem.RowWrite{Prev: -1}, idem.GapFail, idem.OutcomeNone, false, false},
	} {
		h := &idem.Handler[*sql.Tx]{Name: "h", Ordering: &idem.Ordering{Gap: c.gap},
			ApplyInRow: func(context.Context, *sql.Tx, *idem.RowGuard) (idem.RowWrite, error) { return c.w, nil }}
		out, err := p.Process(ctx, h, &idem.Message{ID: "m", AggregateID: "a", Seq: 5})
		if out != c.want || errors.Is(err, idem.ErrRowGuard) != c.guardErr || idem.IsPermanent(err) != c.permanent {
			t.Errorf("%s: %v, %v; want %v (guard error %v, permanent %v)", c.name, out, err, c.want, c.guardErr, c.permanent)
		}
		if c.want != idem.Applied && c.want != idem.Duplicate && c.want != idem.Stale && err == nil {
			t.Errorf("%s: no error", c.name)
		}
	}
}

// TestInRowBatchUnreadableAdvancedWriteRollsBack: in a batch, a guarded
// write that changed its row but reported a previous sequence idem cannot
// read (negative) fails the batch, as it fails Process: its messages are
// not applied, so the write must not commit with the rest of the batch.
// It was committed, its messages reported OutcomeNone, and their effect
// stayed in the projection.
func TestInRowBatchUnreadableAdvancedWriteRollsBack(t *testing.T) {
	t.Parallel()
	db, drv := testenv.SQLite(t, ":memory:", nil)
	if _, err := db.Exec(`CREATE TABLE rows (id TEXT PRIMARY KEY, last INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "rows", Ordering: &idem.Ordering{}, ApplyInRow: func(ctx context.Context, tx *sql.Tx, g *idem.RowGuard) (idem.RowWrite, error) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO rows VALUES (?, ?)`, g.AggregateID, g.To()); err != nil {
			return idem.RowWrite{}, err
		}
		if g.AggregateID == "broken" {
			return idem.RowWrite{Advanced: true, Prev: -1}, nil // a report idem cannot read
		}
		return idem.RowWrite{Advanced: true, Prev: g.From() - 1}, nil
	}}
	outs, err := p.ProcessBatch(context.Background(), h, []*idem.Message{{ID: "b-1", AggregateID: "broken", Seq: 1}, {ID: "o-1", AggregateID: "ok", Seq: 1}})
	var n int
	if qerr := db.QueryRow(`SELECT count(*) FROM rows`).Scan(&n); qerr != nil {
		t.Fatal(qerr)
	}
	if err == nil || outs != nil || n != 0 {
		t.Fatalf("batch with a write reported advanced from sequence -1: outcomes %v, error %v, %d rows committed; want an error and nothing committed", outs, err, n)
	}
}
