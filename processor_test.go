package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

func memProcessor(t testing.TB, cfg *idem.Config) *idem.Processor[*sql.Tx] {
	t.Helper()
	_, drv := testenv.SQLite(t, ":memory:", nil)
	p, err := idem.NewProcessor(drv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func noop() *idem.Handler[*sql.Tx] {
	return &idem.Handler[*sql.Tx]{Name: "noop", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
}

func TestNewProcessorRejectsBadConfig(t *testing.T) {
	t.Parallel()
	if _, err := idem.NewProcessor[*sql.Tx](nil, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("nil driver: %v", err)
	}
	db, _ := sqlite.Open(":memory:", nil)
	defer db.Close()
	drv, _ := sqlite.New(db, nil)
	if _, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{42}}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("hook implementing nothing: %v", err)
	}
}

func TestHandlerWithoutFunctionRejected(t *testing.T) {
	t.Parallel()
	p := memProcessor(t, nil)
	ctx := context.Background()
	h := &idem.Handler[*sql.Tx]{Name: "empty"}
	if _, err := p.Process(ctx, h, &idem.Message{ID: "1"}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("Process: %v", err)
	}
	if _, err := p.ProcessBatch(ctx, h, []*idem.Message{{ID: "1"}}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("ProcessBatch: %v", err)
	}
	if _, err := p.Process(ctx, nil, &idem.Message{ID: "1"}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("nil handler: %v", err)
	}
}

type recorder struct {
	mu  sync.Mutex
	evs []idem.OutcomeEvent
}

func (r *recorder) OnOutcome(_ context.Context, ev *idem.OutcomeEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.evs = append(r.evs, *ev)
}

func TestHooksSeeEveryOutcome(t *testing.T) {
	t.Parallel()
	rec := &recorder{}
	p := memProcessor(t, &idem.Config{Hooks: []idem.Hook{rec}})
	ctx := context.Background()
	boom := errors.New("boom")
	fail := &idem.Handler[*sql.Tx]{Name: "noop", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return boom }}

	_, _ = p.Process(ctx, noop(), &idem.Message{ID: "a", Payload: []byte("1")})
	_, _ = p.Process(ctx, noop(), &idem.Message{ID: "a", Payload: []byte("1")})
	_, _ = p.Process(ctx, noop(), &idem.Message{ID: "a", Payload: []byte("2")})
	_, _ = p.Process(ctx, fail, &idem.Message{ID: "b"})
	_, _ = p.ProcessBatch(ctx, noop(), []*idem.Message{{ID: "c"}, {ID: "a", Payload: []byte("1")}})

	want := []struct {
		id  string
		out idem.Outcome
		err error
		n   int
	}{
		{"a", idem.Applied, nil, 1},
		{"a", idem.Duplicate, nil, 1},
		{"a", idem.Conflict, idem.ErrConflict, 1},
		{"b", idem.OutcomeNone, boom, 1},
		{"c", idem.Applied, nil, 2},
		{"a", idem.Duplicate, nil, 2},
	}
	if len(rec.evs) != len(want) {
		t.Fatalf("%d events, want %d: %+v", len(rec.evs), len(want), rec.evs)
	}
	for i, w := range want {
		ev := rec.evs[i]
		if ev.Handler != "noop" || ev.MessageID != w.id || ev.Outcome != w.out || ev.BatchSize != w.n || ev.Duration <= 0 {
			t.Errorf("event %d: %+v, want id %s outcome %v batch %d", i, ev, w.id, w.out, w.n)
		}
		if (w.err == nil) != (ev.Err == nil) || (w.err != nil && !errors.Is(ev.Err, w.err)) {
			t.Errorf("event %d: err %v, want %v", i, ev.Err, w.err)
		}
	}
}

func TestHandlerErrorIsWrapped(t *testing.T) {
	t.Parallel()
	p := memProcessor(t, nil)
	boom := errors.New("boom")
	h := &idem.Handler[*sql.Tx]{Name: "wrap", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return idem.Permanent(boom) }}
	_, err := p.Process(context.Background(), h, &idem.Message{ID: "x"})
	if !errors.Is(err, boom) || !idem.IsPermanent(err) || !strings.Contains(err.Error(), `handler "wrap"`) {
		t.Fatalf("got %v", err)
	}
	if idem.IsPermanent(errors.New("timeout")) || idem.Permanent(nil) != nil {
		t.Fatal("plain errors must be retriable; Permanent(nil) must be nil")
	}
}

func TestCancelledContextRecordsNothing(t *testing.T) {
	t.Parallel()
	p := memProcessor(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var called atomic.Bool
	h := &idem.Handler[*sql.Tx]{Name: "h", Apply: func(context.Context, *sql.Tx, *idem.Message) error { called.Store(true); return nil }}
	out, err := p.Process(ctx, h, &idem.Message{ID: "x"})
	if err == nil || out != idem.OutcomeNone || called.Load() {
		t.Fatalf("cancelled: (%v, %v, called=%v)", out, err, called.Load())
	}
	out, err = p.Process(context.Background(), h, &idem.Message{ID: "x"})
	if out != idem.Applied || err != nil {
		t.Fatalf("after cancellation: (%v, %v), want applied", out, err)
	}
}

func TestValidateBoundaries(t *testing.T) {
	t.Parallel()
	cases := []struct {
		msg   idem.Message
		field string // "" = valid
	}{
		{idem.Message{ID: "x"}, ""},
		{idem.Message{ID: strings.Repeat("a", 255)}, ""},
		{idem.Message{ID: strings.Repeat("a", 256)}, "ID"},
		{idem.Message{ID: "ünïcödé ✓"}, ""},
		{idem.Message{ID: string([]byte{0xc3})}, "ID"},
		{idem.Message{ID: "a", AggregateID: "acct", Seq: 1}, ""},
		{idem.Message{ID: "a", Seq: 1}, "AggregateID"},
		{idem.Message{ID: "a", AggregateID: "x", Seq: -1}, "Seq"},
		{idem.Message{ID: "a", AggregateID: "x\x00"}, "AggregateID"},
	}
	for _, c := range cases {
		err := c.msg.Validate()
		var ve *idem.ValidationError
		switch {
		case c.field == "" && err != nil:
			t.Errorf("%q: unexpected %v", c.msg.ID, err)
		case c.field != "" && (!errors.As(err, &ve) || ve.Field != c.field || !errors.Is(err, idem.ErrInvalidMessage)):
			t.Errorf("%q: got %v, want a ValidationError on %s", c.msg.ID, err, c.field)
		}
	}
	long := (&idem.Message{ID: strings.Repeat("z", 300)}).Validate().Error()
	if len(long) > 200 {
		t.Errorf("error text should bound the quoted value: %d bytes", len(long))
	}
}

// TestValidatePublishBoundaries: what a publisher or the outbox sends must
// name where it goes, and carry Stream, Type and headers as text a store
// or a broker keeps as given.
func TestValidatePublishBoundaries(t *testing.T) {
	t.Parallel()
	cases := []struct {
		msg   idem.Message
		field string // "" = valid
	}{
		{idem.Message{ID: "x", Stream: "credits"}, ""},
		{idem.Message{ID: "x", Stream: "credits", Type: "FundsCredited", Headers: map[string]string{"trace": "ünï", "empty": ""}}, ""},
		{idem.Message{ID: "x"}, "Stream"},
		{idem.Message{ID: "", Stream: "credits"}, "ID"},
		{idem.Message{ID: "x", Stream: strings.Repeat("s", 256)}, "Stream"},
		{idem.Message{ID: "x", Stream: "credits\x00ledger"}, "Stream"},
		{idem.Message{ID: "x", Stream: "credits.\xff"}, "Stream"},
		{idem.Message{ID: "x", Stream: "s", Type: "Cred\x00ited"}, "Type"},
		{idem.Message{ID: "x", Stream: "s", Type: "\xc3"}, "Type"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"": "v"}}, "Headers"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"k": "ab\xffcd"}}, "Headers"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"k\x00": "v"}}, "Headers"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"idem-seq": "7"}}, "Headers"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"Nats-Msg-Id": "y"}}, "Headers"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"traceparent": "00-ab", "Idem": "free"}}, ""},
		{idem.Message{ID: "evt-1 ", Stream: "s"}, "ID"},
		{idem.Message{ID: " ", Stream: "s"}, "ID"},
		{idem.Message{ID: "a\nb", Stream: "s"}, "ID"},
		{idem.Message{ID: "a b", Stream: "s", AggregateID: "acct 1"}, ""},
		{idem.Message{ID: "x", Stream: "s", AggregateID: "acct\r"}, "AggregateID"},
		{idem.Message{ID: "x", Stream: "s", Type: " Credited"}, "Type"},
		{idem.Message{ID: "x", Stream: "s\t"}, "Stream"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"my key": "v"}}, "Headers"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"a:b": "v"}}, "Headers"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"clé": "v"}}, "Headers"},
		{idem.Message{ID: "x", Stream: "s", Headers: map[string]string{"k": " spaced value\n"}}, ""},
		{idem.Message{ID: "x", Stream: "s", Time: time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)}, ""},
		{idem.Message{ID: "x", Stream: "s", Time: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}, "Time"},
		{idem.Message{ID: "x", Stream: "s", Time: time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC)}, ""},
		{idem.Message{ID: "x", Stream: "s", Time: time.Date(-1, 12, 31, 0, 0, 0, 0, time.UTC)}, "Time"},
	}
	for _, c := range cases {
		err := c.msg.ValidatePublish()
		var ve *idem.ValidationError
		switch {
		case c.field == "" && err != nil:
			t.Errorf("%+v: unexpected %v", c.msg, err)
		case c.field != "" && (!errors.As(err, &ve) || ve.Field != c.field || !errors.Is(err, idem.ErrInvalidMessage)):
			t.Errorf("%+v: got %v, want a ValidationError on %s", c.msg, err, c.field)
		}
	}
	if err := (*idem.Message)(nil).ValidatePublish(); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Errorf("nil message: %v", err)
	}
}

func TestOutcomeString(t *testing.T) {
	t.Parallel()
	for o, s := range map[idem.Outcome]string{idem.OutcomeNone: "none", idem.Applied: "applied", idem.Duplicate: "duplicate", idem.Conflict: "conflict", 200: "outcome(200)"} {
		if o.String() != s {
			t.Errorf("%d: %q, want %q", o, o.String(), s)
		}
	}
}

// validID is the reference definition the fuzzer checks Validate against.
func validID(id string) bool {
	return len(id) >= 1 && len(id) <= idem.MaxIDLen && utf8.ValidString(id) && !strings.ContainsRune(id, 0)
}

func FuzzValidate(f *testing.F) {
	for _, s := range []string{"", "a", "evt-1", "\x00", "\xff", strings.Repeat("x", 255), strings.Repeat("é", 128), "a\u200bb"} {
		f.Add(s, "acct", int64(1))
	}
	f.Fuzz(func(t *testing.T, id, agg string, seq int64) {
		m := &idem.Message{ID: id, AggregateID: agg, Seq: seq}
		err := m.Validate()
		want := validID(id) && seq >= 0 && (seq == 0 || agg != "") && (agg == "" || validID(agg))
		if (err == nil) != want {
			t.Fatalf("Validate(%q, %q, %d) = %v, want valid=%v", id, agg, seq, err, want)
		}
		if err != nil {
			var ve *idem.ValidationError
			if !errors.As(err, &ve) || !errors.Is(err, idem.ErrInvalidMessage) {
				t.Fatalf("untyped error %T %v", err, err)
			}
			if !utf8.ValidString(err.Error()) || len(err.Error()) > 300 {
				t.Fatalf("error text must be bounded, printable UTF-8: %q", err.Error())
			}
		}
		if herr := idem.ValidateHandlerName(id); herr != nil && !errors.Is(herr, idem.ErrInvalidHandlerName) {
			t.Fatalf("handler name error untyped: %v", herr)
		}
	})
}

// FuzzProcess feeds arbitrary envelopes through a real SQLite processor:
// never a panic; invalid input gets the typed error; valid input is applied
// once, then a Duplicate, and a changed payload is a Conflict.
func FuzzProcess(f *testing.F) {
	f.Add("evt-1", []byte("payload"))
	f.Add("", []byte{})
	f.Add("\xffbad", []byte{0})
	f.Add(strings.Repeat("x", 256), []byte(nil))
	p := memProcessor(f, nil)
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, id string, payload []byte) {
		ctx := context.Background()
		h := noop()
		h.Name = fmt.Sprintf("fuzz-%d", n.Add(1)) // fresh handler: no state from earlier inputs
		msg := &idem.Message{ID: id, Payload: payload}
		out, err := p.Process(ctx, h, msg)
		if !validID(id) {
			if !errors.Is(err, idem.ErrInvalidMessage) || out != idem.OutcomeNone {
				t.Fatalf("invalid ID %q: (%v, %v)", id, out, err)
			}
			return
		}
		if out != idem.Applied || err != nil {
			t.Fatalf("first delivery of %q: (%v, %v)", id, out, err)
		}
		if out, err = p.Process(ctx, h, msg); out != idem.Duplicate || err != nil {
			t.Fatalf("redelivery of %q: (%v, %v)", id, out, err)
		}
		changed := &idem.Message{ID: id, Payload: append([]byte{1}, payload...)}
		if out, err = p.Process(ctx, h, changed); out != idem.Conflict || !errors.Is(err, idem.ErrConflict) {
			t.Fatalf("changed payload of %q: (%v, %v)", id, out, err)
		}
	})
}

// FuzzProcessBatch feeds arbitrary batches (IDs split on NUL, payload bits
// from flags, part of the batch delivered first) through a real SQLite
// processor and checks every outcome against a model of the markers: new
// IDs are applied once, repeats are Duplicates, a changed payload is a
// Conflict, and the handler sees exactly the applied messages.
func FuzzProcessBatch(f *testing.F) {
	f.Add([]byte("a\x00b\x00c"), []byte{0}, uint8(1))
	f.Add([]byte("a\x00a\x00b\x00a"), []byte{0, 1, 0, 1}, uint8(2))
	many := make([]string, 80)
	for i := range many {
		many[i] = fmt.Sprintf("evt-%d", i%70)
	}
	f.Add([]byte(strings.Join(many, "\x00")), []byte{0, 0, 0, 1, 0}, uint8(40))
	f.Add([]byte("\xff\x00ok"), []byte{}, uint8(0))
	f.Add([]byte(""), []byte{}, uint8(0))
	p := memProcessor(f, nil)
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, ids []byte, flags []byte, first uint8) {
		ctx := context.Background()
		var applied []string
		h := &idem.Handler[*sql.Tx]{
			Name: fmt.Sprintf("fuzz-batch-%d", n.Add(1)), // fresh handler: no state from earlier inputs
			ApplyBatch: func(_ context.Context, _ *sql.Tx, ms []*idem.Message) error {
				for _, m := range ms {
					applied = append(applied, m.ID)
				}
				return nil
			},
		}
		var msgs []*idem.Message
		for i, id := range strings.Split(string(ids), "\x00") {
			bit := byte(0)
			if len(flags) > 0 {
				bit = flags[i%len(flags)] & 1
			}
			msgs = append(msgs, &idem.Message{ID: id, Payload: []byte{bit}})
		}
		stored := map[string]byte{} // the model: ID → payload bit of its marker
		deliver := func(batch []*idem.Message) {
			applied = applied[:0]
			outs, err := p.ProcessBatch(ctx, h, batch)
			if slices.ContainsFunc(batch, func(m *idem.Message) bool { return !validID(m.ID) }) {
				if !errors.Is(err, idem.ErrInvalidMessage) || outs != nil {
					t.Fatalf("batch with an invalid ID: (%v, %v), want ErrInvalidMessage", outs, err)
				}
				return
			}
			if err != nil || len(outs) != len(batch) {
				t.Fatalf("batch of %d: %d outcomes, error %v", len(batch), len(outs), err)
			}
			var want []string
			for i, m := range batch {
				exp := idem.Applied
				if bit, ok := stored[m.ID]; !ok {
					stored[m.ID] = m.Payload[0]
					want = append(want, m.ID)
				} else if bit == m.Payload[0] {
					exp = idem.Duplicate
				} else {
					exp = idem.Conflict
				}
				if outs[i] != exp {
					t.Fatalf("message %d (%q): %v, want %v", i, m.ID, outs[i], exp)
				}
			}
			slices.Sort(want)
			got := slices.Sorted(slices.Values(applied))
			if !slices.Equal(got, want) {
				t.Fatalf("handler applied %q, want %q", got, want)
			}
		}
		deliver(msgs[:int(first)%(len(msgs)+1)])
		deliver(msgs)
	})
}

// An ordered batch needs driver.MarkerDeleter outside version-only mode,
// and a driver without it gets a clear error instead of a marker left
// behind for a refused message.
func TestOrderedBatchNeedsMarkerDeleter(t *testing.T) {
	t.Parallel()
	_, drv := testenv.SQLite(t, ":memory:", nil)
	limited := struct {
		driver.Driver[*sql.Tx]
		driver.SequenceGuard[*sql.Tx]
	}{drv, drv}
	p, err := idem.NewProcessor(limited, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	msg := &idem.Message{ID: "a-1", AggregateID: "a", Seq: 1}
	h := noop()
	h.Ordering = &idem.Ordering{}
	if _, err := p.ProcessBatch(ctx, h, []*idem.Message{msg}); !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "MarkerDeleter") {
		t.Fatalf("ordered batch without MarkerDeleter: %v, want ErrInvalidConfig naming it", err)
	}
	h.Ordering.VersionOnly = true
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{msg})
	if err != nil || !slices.Equal(outs, []idem.Outcome{idem.Applied}) {
		t.Fatalf("version-only batch: (%v, %v), want applied", outs, err)
	}
}
