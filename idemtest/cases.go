package idemtest

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemhq/idem"
)

func newProc[TTx any](t *testing.T, s *Store[TTx]) *idem.Processor[TTx] {
	t.Helper()
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func wantOutcome(t *testing.T, what string, got idem.Outcome, err error, want idem.Outcome) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: unexpected error: %v", what, err)
	}
	if got != want {
		t.Fatalf("%s: outcome %v, want %v", what, got, want)
	}
}

func wantBalances[TTx any](t *testing.T, s *Store[TTx], want map[string]int64) {
	t.Helper()
	if err := checkBalances(context.Background(), s, want); err != nil {
		t.Fatal(err)
	}
}

func callsOf(calls *sync.Map, id string) int64 {
	v, ok := calls.Load(id)
	if !ok {
		return 0
	}
	return v.(*atomic.Int64).Load()
}

func testRedelivery[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	var calls sync.Map
	h := CreditHandler(s, "balances", &calls)
	ev := Events(3)
	for _, e := range ev {
		out, err := p.Process(ctx, h, e.Message())
		wantOutcome(t, "first delivery", out, err, idem.Applied)
	}
	for round := 0; round < 3; round++ {
		for _, e := range ev {
			out, err := p.Process(ctx, h, e.Message())
			wantOutcome(t, "redelivery", out, err, idem.Duplicate)
		}
	}
	for _, e := range ev {
		if n := callsOf(&calls, e.ID); n != 1 && !s.ApplyBeforeCheck {
			t.Fatalf("handler called %d times for %s, want 1", n, e.ID)
		}
	}
	wantBalances(t, s, Expected(ev))
}

func testHandlerError[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	boom := errors.New("downstream unavailable")
	e := Events(1)[0]
	failing := &idem.Handler[TTx]{Name: "balances", Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
		// The effect is written, then the handler fails: both must roll back.
		acct, amt, _ := DecodeCredit(m.Payload)
		if err := s.Credit(ctx, tx, acct, amt); err != nil {
			return err
		}
		return boom
	}}
	out, err := p.Process(ctx, failing, e.Message())
	if !errors.Is(err, boom) || out != idem.OutcomeNone {
		t.Fatalf("failing handler: got (%v, %v), want (none, wrapping %v)", out, err, boom)
	}
	wantBalances(t, s, map[string]int64{})
	out, err = p.Process(ctx, CreditHandler(s, "balances", nil), e.Message())
	wantOutcome(t, "next delivery after a failure", out, err, idem.Applied)
	wantBalances(t, s, Expected([]Event{e}))
}

func testHandlerPanic[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	e := Events(1)[0]
	panicky := &idem.Handler[TTx]{Name: "balances", Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
		acct, amt, _ := DecodeCredit(m.Payload)
		if err := s.Credit(ctx, tx, acct, amt); err != nil {
			return err
		}
		panic("handler bug")
	}}
	out, err := p.Process(ctx, panicky, e.Message())
	var pe *idem.PanicError
	if !errors.As(err, &pe) || out != idem.OutcomeNone || pe.Value != "handler bug" || len(pe.Stack) == 0 {
		t.Fatalf("panicking handler: got (%v, %v), want (none, *PanicError with value and stack)", out, err)
	}
	wantBalances(t, s, map[string]int64{})
	out, err = p.Process(ctx, CreditHandler(s, "balances", nil), e.Message())
	wantOutcome(t, "next delivery after a panic", out, err, idem.Applied)
	wantBalances(t, s, Expected([]Event{e}))
}

func testConflict[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	var calls sync.Map
	h := CreditHandler(s, "balances", &calls)
	e := Events(1)[0]
	out, err := p.Process(ctx, h, e.Message())
	wantOutcome(t, "first delivery", out, err, idem.Applied)

	changed := e
	changed.Amount = 1_000_000
	out, err = p.Process(ctx, h, changed.Message())
	var ce *idem.ConflictError
	if out != idem.Conflict || !errors.Is(err, idem.ErrConflict) || !errors.As(err, &ce) {
		t.Fatalf("same ID, other payload: got (%v, %v), want (conflict, *ConflictError)", out, err)
	}
	if ce.MessageID != e.ID || ce.Handler != "balances" || len(ce.StoredHash) == 0 || string(ce.StoredHash) == string(ce.ReceivedHash) {
		t.Fatalf("ConflictError fields: %+v", ce)
	}
	if !idem.IsPermanent(err) {
		t.Fatal("a conflict must be permanent (never retried)")
	}
	if n := callsOf(&calls, e.ID); n != 1 && !s.ApplyBeforeCheck {
		t.Fatalf("handler called %d times, want 1 (conflict must not apply)", n)
	}
	// The original payload is still a plain duplicate.
	out, err = p.Process(ctx, h, e.Message())
	wantOutcome(t, "original payload again", out, err, idem.Duplicate)
	wantBalances(t, s, Expected([]Event{e}))
}

func testConflictWarn[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	var logs bytes.Buffer
	p, err := idem.NewProcessor(s.Driver, &idem.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	h := CreditHandler(s, "balances", nil)
	h.OnConflict = idem.OnConflictWarn
	e := Events(1)[0]
	out, err := p.Process(ctx, h, e.Message())
	wantOutcome(t, "first delivery", out, err, idem.Applied)
	changed := e
	changed.Amount = 5
	out, err = p.Process(ctx, h, changed.Message())
	wantOutcome(t, "conflict under warn policy", out, err, idem.Duplicate)
	wantBalances(t, s, Expected([]Event{e}))
	line := logs.String()
	if !strings.Contains(line, "level=WARN") || !strings.Contains(line, "stored_hash=") ||
		!strings.Contains(line, "received_hash=") || !strings.Contains(line, e.ID) {
		t.Fatalf("warn policy must log the conflict with both hashes; got %q", line)
	}
}

func testHandlersIndependent[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	a := CreditHandler(s, "projection-a", nil)
	b := CreditHandler(s, "projection-b", nil)
	ev := Events(4)
	for _, h := range []*idem.Handler[TTx]{a, b} {
		for _, e := range ev {
			out, err := p.Process(ctx, h, e.Message())
			wantOutcome(t, h.Name+" first delivery", out, err, idem.Applied)
		}
	}
	for _, h := range []*idem.Handler[TTx]{a, b} {
		for _, e := range ev {
			out, err := p.Process(ctx, h, e.Message())
			wantOutcome(t, h.Name+" redelivery", out, err, idem.Duplicate)
		}
	}
	// Both handlers credit the same accounts: each event counts twice.
	want := Expected(append(slices.Clone(ev), ev...))
	wantBalances(t, s, want)
}

func testInvalidInput[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	var calls atomic.Int64
	h := &idem.Handler[TTx]{Name: "balances", Apply: func(context.Context, TTx, *idem.Message) error {
		calls.Add(1)
		return nil
	}}
	badIDs := map[string]string{
		"empty":         "",
		"too long":      strings.Repeat("x", idem.MaxIDLen+1),
		"invalid UTF-8": "evt-\xff\xfe",
		"NUL byte":      "evt\x00-1",
	}
	for name, id := range badIDs {
		out, err := p.Process(ctx, h, &idem.Message{ID: id, Payload: []byte("x")})
		var ve *idem.ValidationError
		if out != idem.OutcomeNone || !errors.Is(err, idem.ErrInvalidMessage) || !errors.As(err, &ve) || ve.Field != "ID" {
			t.Errorf("ID %s: got (%v, %v), want a *ValidationError on ID", name, out, err)
		}
		if idem.IsPermanent(err) != true {
			t.Errorf("ID %s: validation errors must be permanent", name)
		}
	}
	if _, err := p.Process(ctx, h, nil); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Errorf("nil message: got %v, want ErrInvalidMessage", err)
	}
	if _, err := p.ProcessBatch(ctx, h, []*idem.Message{{ID: "ok"}, {ID: ""}}); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Errorf("batch with an invalid message: got %v, want ErrInvalidMessage", err)
	}
	badNames := []string{"", "has space", "naïve", strings.Repeat("h", idem.MaxHandlerNameLen+1), "semi;colon", "quote'"}
	for _, name := range badNames {
		bad := &idem.Handler[TTx]{Name: name, Apply: h.Apply}
		out, err := p.Process(ctx, bad, &idem.Message{ID: "evt-1"})
		var ve *idem.ValidationError
		if out != idem.OutcomeNone || !errors.Is(err, idem.ErrInvalidHandlerName) || !errors.As(err, &ve) {
			t.Errorf("handler name %q: got (%v, %v), want ErrInvalidHandlerName", name, out, err)
		}
	}
	if calls.Load() != 0 {
		t.Fatalf("handler ran %d times on invalid input", calls.Load())
	}
	// A longest valid ID works and nothing invalid left a marker behind.
	longest := strings.Repeat("é", idem.MaxIDLen/2) // 254 bytes of valid UTF-8
	out, err := p.Process(ctx, h, &idem.Message{ID: longest})
	wantOutcome(t, "longest valid ID", out, err, idem.Applied)
	out, err = p.Process(ctx, h, &idem.Message{ID: "evt-1"})
	wantOutcome(t, "valid ID after invalid handler names", out, err, idem.Applied)
}

func testProcessTx[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := CreditHandler(s, "balances", nil)
	ev := Events(2)

	// Caller rolls back: neither effect nor marker survives.
	tx, err := s.Driver.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out, err := p.ProcessTx(ctx, tx, h, ev[0].Message())
	wantOutcome(t, "ProcessTx before caller rollback", out, err, idem.Applied)
	if err := s.Driver.Rollback(ctx, tx); err != nil {
		t.Fatal(err)
	}
	wantBalances(t, s, map[string]int64{})

	// Caller commits: both survive; a duplicate inside the next caller
	// transaction is reported and not applied.
	tx, err = s.Driver.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out, err = p.ProcessTx(ctx, tx, h, ev[0].Message())
	wantOutcome(t, "ProcessTx after rollback", out, err, idem.Applied)
	out, err = p.ProcessTx(ctx, tx, h, ev[1].Message())
	wantOutcome(t, "second message, same caller tx", out, err, idem.Applied)
	out, err = p.ProcessTx(ctx, tx, h, ev[0].Message())
	wantOutcome(t, "repeat inside the same caller tx", out, err, idem.Duplicate)
	if err := s.Driver.Commit(ctx, tx); err != nil {
		t.Fatal(err)
	}
	out, err = p.Process(ctx, h, ev[1].Message())
	wantOutcome(t, "redelivery after caller commit", out, err, idem.Duplicate)
	wantBalances(t, s, Expected(ev))
}

func testBatchDedupe[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	var calls sync.Map
	h := CreditHandler(s, "balances", &calls)
	ev := Events(10)
	var got [][]string
	inner := h.ApplyBatch
	h.ApplyBatch = func(ctx context.Context, tx TTx, msgs []*idem.Message) error {
		ids := make([]string, len(msgs))
		for i, m := range msgs {
			ids[i] = m.ID
		}
		got = append(got, ids)
		return inner(ctx, tx, msgs)
	}
	msg := func(i int) *idem.Message { return ev[i].Message() }

	// Batch 1: events 0..4 with event 2 repeated inside the batch.
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{msg(3), msg(0), msg(2), msg(1), msg(2), msg(4)})
	if err != nil {
		t.Fatal(err)
	}
	want := []idem.Outcome{idem.Applied, idem.Applied, idem.Applied, idem.Applied, idem.Duplicate, idem.Applied}
	if !slices.Equal(outs, want) {
		t.Fatalf("batch 1 outcomes %v, want %v", outs, want)
	}
	// Batch 2: events 3..7: 3 and 4 are old.
	outs, err = p.ProcessBatch(ctx, h, []*idem.Message{msg(5), msg(3), msg(6), msg(4), msg(7)})
	if err != nil {
		t.Fatal(err)
	}
	want = []idem.Outcome{idem.Applied, idem.Duplicate, idem.Applied, idem.Duplicate, idem.Applied}
	if !slices.Equal(outs, want) {
		t.Fatalf("batch 2 outcomes %v, want %v", outs, want)
	}
	// Batch 3: only old events: the handler is not called.
	outs, err = p.ProcessBatch(ctx, h, []*idem.Message{msg(0), msg(7)})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(outs, []idem.Outcome{idem.Duplicate, idem.Duplicate}) {
		t.Fatalf("batch 3 outcomes %v", outs)
	}
	// The handler saw only new messages, in delivery order.
	wantCalls := [][]string{{ev[3].ID, ev[0].ID, ev[2].ID, ev[1].ID, ev[4].ID}, {ev[5].ID, ev[6].ID, ev[7].ID}}
	if len(got) != len(wantCalls) || !slices.Equal(got[0], wantCalls[0]) || !slices.Equal(got[1], wantCalls[1]) {
		t.Fatalf("handler saw %v, want %v", got, wantCalls)
	}
	// Single-message and batch paths share markers.
	out, err := p.Process(ctx, h, msg(5))
	wantOutcome(t, "single redelivery of a batched message", out, err, idem.Duplicate)
	out, err = p.Process(ctx, h, msg(8))
	wantOutcome(t, "single new message", out, err, idem.Applied)
	outs, err = p.ProcessBatch(ctx, h, []*idem.Message{msg(8), msg(9)})
	if err != nil || !slices.Equal(outs, []idem.Outcome{idem.Duplicate, idem.Applied}) {
		t.Fatalf("batch after single: %v, %v", outs, err)
	}
	wantBalances(t, s, Expected(ev))
}

func testBatchConflict[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	var conflicts atomic.Int64
	p, err := idem.NewProcessor(s.Driver, &idem.Config{Hooks: []idem.Hook{outcomeCounter{idem.Conflict, &conflicts}}})
	if err != nil {
		t.Fatal(err)
	}
	h := CreditHandler(s, "balances", nil)
	ev := Events(4)
	if _, err := p.ProcessBatch(ctx, h, []*idem.Message{ev[0].Message()}); err != nil {
		t.Fatal(err)
	}
	stored := ev[0]
	stored.Amount += 1000 // conflicts with the committed marker
	inBatch := ev[2]
	inBatch.Amount += 1000 // conflicts with its first occurrence in this batch
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{stored.Message(), ev[1].Message(), ev[2].Message(), inBatch.Message(), ev[3].Message()})
	if err != nil {
		t.Fatal(err)
	}
	want := []idem.Outcome{idem.Conflict, idem.Applied, idem.Applied, idem.Conflict, idem.Applied}
	if !slices.Equal(outs, want) {
		t.Fatalf("outcomes %v, want %v", outs, want)
	}
	if conflicts.Load() != 2 {
		t.Fatalf("hooks saw %d conflicts, want 2", conflicts.Load())
	}
	wantBalances(t, s, Expected(ev))
}

// testLargeBatch: a batch far larger than any chunk a driver may split
// its marker inserts into, with old markers scattered through it (at chunk
// edges too) and one conflicting marker. A driver that bets on a new batch
// must tell every old marker from the new ones, whatever chunk it is in.
func testLargeBatch[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	var calls sync.Map
	h := CreditHandler(s, "balances", &calls)
	ev := Events(700)
	old := func(i int) bool { return i%37 == 5 || i == 31 || i == 32 || i == 63 || i == 64 || i == 699 }
	const conflicting = 100
	stored := ev[conflicting]
	stored.Amount += 1000 // the marker stored for 100 carries another payload
	applied := []Event{stored}
	var first []*idem.Message
	for i, e := range ev {
		if old(i) {
			first = append(first, e.Message())
			applied = append(applied, e)
		}
	}
	if _, err := p.ProcessBatch(ctx, h, append(first, stored.Message())); err != nil {
		t.Fatal(err)
	}
	batch := make([]*idem.Message, len(ev))
	want := make([]idem.Outcome, len(ev))
	for i, e := range ev {
		batch[i] = e.Message()
		switch {
		case i == conflicting:
			want[i] = idem.Conflict
		case old(i):
			want[i] = idem.Duplicate
		default:
			want[i] = idem.Applied
			applied = append(applied, e)
		}
	}
	outs, err := p.ProcessBatch(ctx, h, batch)
	if err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if outs[i] != want[i] {
			t.Fatalf("message %d (%s): outcome %v, want %v", i, ev[i].ID, outs[i], want[i])
		}
	}
	for i, e := range ev {
		if n := callsOf(&calls, e.ID); n != 1 && !(i == conflicting && n == 0) {
			t.Fatalf("%s applied %d times", e.ID, n)
		}
	}
	wantBalances(t, s, Expected(applied))
	// The same batch again: nothing new, the handler is not called.
	outs, err = p.ProcessBatch(ctx, h, batch)
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range outs {
		if w := map[bool]idem.Outcome{true: idem.Conflict, false: idem.Duplicate}[i == conflicting]; o != w {
			t.Fatalf("redelivered batch: message %d is %v, want %v", i, o, w)
		}
	}
	wantBalances(t, s, Expected(applied))
}

type outcomeCounter struct {
	want idem.Outcome
	n    *atomic.Int64
}

func (c outcomeCounter) OnOutcome(_ context.Context, ev *idem.OutcomeEvent) {
	if ev.Outcome == c.want {
		if ev.Outcome == idem.Conflict && !errors.Is(ev.Err, idem.ErrConflict) {
			return
		}
		c.n.Add(1)
	}
}

func testBatchRollback[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	ev := Events(5)
	msgs := make([]*idem.Message, len(ev))
	for i, e := range ev {
		msgs[i] = e.Message()
	}
	boom := errors.New("projection write failed")
	good := CreditHandler(s, "balances", nil)
	bad := &idem.Handler[TTx]{Name: "balances", ApplyBatch: func(ctx context.Context, tx TTx, ms []*idem.Message) error {
		if err := good.ApplyBatch(ctx, tx, ms); err != nil {
			return err
		}
		return boom
	}}
	outs, err := p.ProcessBatch(ctx, bad, msgs)
	if !errors.Is(err, boom) || outs != nil {
		t.Fatalf("failing batch: got (%v, %v), want (nil, %v)", outs, err, boom)
	}
	wantBalances(t, s, map[string]int64{})
	// Per-message Apply failing part-way also rolls back the whole batch.
	n := 0
	half := &idem.Handler[TTx]{Name: "balances", Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
		if n++; n == 3 {
			panic("third message")
		}
		return good.Apply(ctx, tx, m)
	}}
	var pe *idem.PanicError
	if _, err := p.ProcessBatch(ctx, half, msgs); !errors.As(err, &pe) {
		t.Fatalf("panicking per-message batch: got %v, want *PanicError", err)
	}
	wantBalances(t, s, map[string]int64{})
	outs, err = p.ProcessBatch(ctx, good, msgs)
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range outs {
		if o != idem.Applied {
			t.Fatalf("retry after rollback: message %d is %v, want applied", i, o)
		}
	}
	wantBalances(t, s, Expected(ev))
}

func testProcessBatchTx[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := CreditHandler(s, "balances", nil)
	ev := Events(6)
	msgs := func(es []Event) []*idem.Message {
		out := make([]*idem.Message, len(es))
		for i, e := range es {
			out[i] = e.Message()
		}
		return out
	}
	tx, err := s.Driver.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.ProcessBatchTx(ctx, tx, h, msgs(ev[:3])); err != nil {
		t.Fatal(err)
	}
	if err := s.Driver.Rollback(ctx, tx); err != nil {
		t.Fatal(err)
	}
	wantBalances(t, s, map[string]int64{})
	tx, err = s.Driver.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	outs, err := p.ProcessBatchTx(ctx, tx, h, msgs(ev))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Driver.Commit(ctx, tx); err != nil {
		t.Fatal(err)
	}
	for i, o := range outs {
		if o != idem.Applied {
			t.Fatalf("message %d: %v, want applied", i, o)
		}
	}
	outs, err = p.ProcessBatch(ctx, h, msgs(ev[2:4]))
	if err != nil || !slices.Equal(outs, []idem.Outcome{idem.Duplicate, idem.Duplicate}) {
		t.Fatalf("redelivery after caller commit: %v, %v", outs, err)
	}
	wantBalances(t, s, Expected(ev))
}
