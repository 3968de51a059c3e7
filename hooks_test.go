package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/idemhq/idem"
)

type ctxKey struct{}

// callRecorder is a HookCall that tags the context it returns and records
// what it saw.
type callRecorder struct {
	name string
	log  *[]string
}

func (r callRecorder) OnCallStart(ctx context.Context, ev *idem.CallStart) context.Context {
	ids := make([]string, len(ev.Messages))
	for i, m := range ev.Messages {
		if m != nil {
			ids[i] = m.ID
		}
	}
	*r.log = append(*r.log, fmt.Sprintf("%s start %s %v", r.name, ev.Handler, ids))
	tags, _ := ctx.Value(ctxKey{}).([]string)
	return context.WithValue(ctx, ctxKey{}, append(slices.Clone(tags), r.name))
}

func (r callRecorder) OnCallEnd(ctx context.Context, ev *idem.CallEnd) {
	*r.log = append(*r.log, fmt.Sprintf("%s end %s %v %v ctx=%v", r.name, ev.Handler, ev.Outcomes, ev.Err != nil, ctx.Value(ctxKey{})))
}

// HookCall hooks wrap every call: they start in order, end in reverse, and
// the context they return reaches the handler and the end of the call.
func TestHookCallWrapsEveryCall(t *testing.T) {
	t.Parallel()
	var log []string
	p := memProcessor(t, &idem.Config{Hooks: []idem.Hook{callRecorder{"a", &log}, callRecorder{"b", &log}}})
	ctx := context.Background()
	var seen []any
	h := &idem.Handler[*sql.Tx]{
		Name: "h",
		Apply: func(ctx context.Context, _ *sql.Tx, m *idem.Message) error {
			seen = append(seen, ctx.Value(ctxKey{}))
			if string(m.Payload) == "fail" {
				return errors.New("boom")
			}
			return nil
		},
	}
	if _, err := p.Process(ctx, h, &idem.Message{ID: "m-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Process(ctx, h, &idem.Message{ID: "m-2", Payload: []byte("fail")}); err == nil {
		t.Fatal("want the handler's error")
	}
	if _, err := p.ProcessBatch(ctx, h, []*idem.Message{{ID: "m-1"}, {ID: "m-3"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Process(ctx, nil, &idem.Message{ID: "m-4"}); err == nil {
		t.Fatal("nil handler: want an error")
	}
	want := []string{
		"a start h [m-1]", "b start h [m-1]",
		"b end h [applied] false ctx=[a b]", "a end h [applied] false ctx=[a b]",
		"a start h [m-2]", "b start h [m-2]",
		"b end h [none] true ctx=[a b]", "a end h [none] true ctx=[a b]",
		"a start h [m-1 m-3]", "b start h [m-1 m-3]",
		"b end h [duplicate applied] false ctx=[a b]", "a end h [duplicate applied] false ctx=[a b]",
		"a start  [m-4]", "b start  [m-4]",
		"b end  [none] true ctx=[a b]", "a end  [none] true ctx=[a b]",
	}
	if !slices.Equal(log, want) {
		t.Errorf("hook calls:\n%s\nwant:\n%s", strings.Join(log, "\n"), strings.Join(want, "\n"))
	}
	// The handler ran for m-1, m-2 and m-3, each time with both tags.
	if len(seen) != 3 {
		t.Fatalf("handler ran %d times, want 3", len(seen))
	}
	for i, s := range seen {
		if tags, _ := s.([]string); !slices.Equal(tags, []string{"a", "b"}) {
			t.Errorf("handler call %d saw context tags %v, want [a b]", i, s)
		}
	}
}

// LeaseProcessor.Process runs the HookCall hooks too, and the handler
// sees the context they return.
func TestHookCallWrapsLeaseCalls(t *testing.T) {
	t.Parallel()
	var log []string
	p, err := idem.NewLeaseProcessor(leaseDriver(t), &idem.LeaseConfig{Hooks: []idem.Hook{callRecorder{"a", &log}}})
	if err != nil {
		t.Fatal(err)
	}
	var seen any
	h := &idem.LeaseHandler{Name: "mailer", Call: func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		seen = ctx.Value(ctxKey{})
		return nil
	}}
	ctx := context.Background()
	for range 2 {
		if _, err := p.Process(ctx, h, &idem.Message{ID: "m-1"}); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{
		"a start mailer [m-1]", "a end mailer [applied] false ctx=[a]",
		"a start mailer [m-1]", "a end mailer [duplicate] false ctx=[a]",
	}
	if !slices.Equal(log, want) {
		t.Errorf("hook calls:\n%s\nwant:\n%s", strings.Join(log, "\n"), strings.Join(want, "\n"))
	}
	if tags, _ := seen.([]string); !slices.Equal(tags, []string{"a"}) {
		t.Errorf("lease handler saw context tags %v, want [a]", seen)
	}
}

// panicAt is a HookCall (and HookOutcome) that panics where told.
type panicAt struct {
	callRecorder
	where string // "start", "end" or "outcome"
}

func (p panicAt) OnCallStart(ctx context.Context, ev *idem.CallStart) context.Context {
	if p.where == "start" {
		panic("hook bug")
	}
	return p.callRecorder.OnCallStart(ctx, ev)
}

func (p panicAt) OnCallEnd(ctx context.Context, ev *idem.CallEnd) {
	if p.where == "end" {
		panic("hook bug")
	}
	p.callRecorder.OnCallEnd(ctx, ev)
}

func (p panicAt) OnOutcome(context.Context, *idem.OutcomeEvent) {
	if p.where == "outcome" {
		panic("hook bug")
	}
}

// Whatever panics — a hook starting, ending, or reporting an outcome —
// every hook that started ends exactly once, and the panic goes on.
func TestHookCallEndsOnceThroughPanics(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		where string
		want  []string
	}{
		{"start", []string{"a start h [m]", "a end h [] true ctx=[a]"}},
		{"end", []string{"a start h [m]", "b start h [m]", "c start h [m]", "c end h [applied] false ctx=[a b c]", "a end h [applied] false ctx=[a b c]"}},
		{"outcome", []string{"a start h [m]", "b start h [m]", "c start h [m]", "c end h [] true ctx=[a b c]", "b end h [] true ctx=[a b c]", "a end h [] true ctx=[a b c]"}},
	} {
		for _, lease := range []bool{false, true} {
			var log []string
			hooks := []idem.Hook{callRecorder{"a", &log}, panicAt{callRecorder{"b", &log}, c.where}, callRecorder{"c", &log}}
			run := func() {
				if lease {
					p, err := idem.NewLeaseProcessor(leaseDriver(t), &idem.LeaseConfig{Hooks: hooks})
					if err != nil {
						t.Fatal(err)
					}
					_, _ = p.Process(context.Background(), &idem.LeaseHandler{Name: "h", Call: func(context.Context, *idem.Lease, *idem.Message) error { return nil }}, &idem.Message{ID: "m"})
					return
				}
				p := memProcessor(t, &idem.Config{Hooks: hooks})
				_, _ = p.Process(context.Background(), &idem.Handler[*sql.Tx]{Name: "h", Apply: idem.Ignore[*sql.Tx]}, &idem.Message{ID: "m"})
			}
			func() {
				defer func() {
					if r := recover(); r != "hook bug" {
						t.Errorf("%s (lease %v): recovered %v, want the hook's panic", c.where, lease, r)
					}
				}()
				run()
			}()
			want := c.want
			if lease && c.where == "outcome" {
				// Lease mode ends the call after its outcome hooks, with
				// the outcome, panic or not.
				want = []string{"a start h [m]", "b start h [m]", "c start h [m]", "c end h [applied] false ctx=[a b c]", "b end h [applied] false ctx=[a b c]", "a end h [applied] false ctx=[a b c]"}
			}
			if !slices.Equal(log, want) {
				t.Errorf("%s (lease %v):\n%s\nwant:\n%s", c.where, lease, strings.Join(log, "\n"), strings.Join(want, "\n"))
			}
		}
	}
}
