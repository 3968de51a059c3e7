package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/idemhq/idem"
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
