package idemtest

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// testDuplicateWaitsForOpenTx: delivery A has inserted its marker and written its
// effect, and is held open; delivery B of the same ID starts meanwhile. B
// must not return while A is open (a Duplicate reported for an
// uncommitted marker would be acked and lost if A then rolls back). Once A
// commits, B is a Duplicate without an error; once A rolls back, B applies.
//
// On a store whose handler runs before the marker is checked
// (Store.ApplyBeforeCheck), A holds nothing while in its handler: see
// testFirstCommitApplies.
func testDuplicateWaitsForOpenTx[TTx any](t *testing.T, s *Store[TTx], commit bool) {
	if s.ApplyBeforeCheck {
		testFirstCommitApplies(t, s, commit)
		return
	}
	ctx := context.Background()
	p := newProc(t, s)
	e := Events(1)[0]
	entered, release := make(chan struct{}), make(chan struct{})
	var firstCalls atomic.Int64
	first := &idem.Handler[TTx]{Name: "balances", Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
		if firstCalls.Add(1) > 1 {
			return errors.New("first handler called twice")
		}
		acct, amt, _ := DecodeCredit(m.Payload)
		if err := s.Credit(ctx, tx, acct, amt); err != nil {
			return err
		}
		close(entered)
		<-release
		if !commit {
			return errors.New("A fails after its write")
		}
		return nil
	}}
	var calls sync.Map
	second := CreditHandler(s, "balances", &calls)

	type res struct {
		out idem.Outcome
		err error
		at  time.Time
	}
	aDone, bDone := make(chan res, 1), make(chan res, 1)
	go func() {
		out, err := p.Process(ctx, first, e.Message())
		aDone <- res{out, err, time.Now()}
	}()
	select {
	case <-entered:
	case r := <-aDone:
		t.Fatalf("A ended before its handler ran: %v %v", r.out, r.err)
	case <-time.After(10 * time.Second):
		t.Fatal("A's handler never ran")
	}
	go func() {
		out, err := p.Process(ctx, second, e.Message())
		bDone <- res{out, err, time.Now()}
	}()
	select {
	case r := <-bDone:
		close(release)
		t.Fatalf("B returned (%v, %v) while A's transaction was still open", r.out, r.err)
	case <-time.After(300 * time.Millisecond):
	}
	released := time.Now()
	close(release)
	a, b := <-aDone, <-bDone
	if b.at.Before(released) {
		t.Fatalf("B returned before A ended")
	}
	if commit {
		wantOutcome(t, "A", a.out, a.err, idem.Applied)
		wantOutcome(t, "B after A committed", b.out, b.err, idem.Duplicate)
		if n := callsOf(&calls, e.ID); n != 0 {
			t.Fatalf("B's handler ran %d times after A committed", n)
		}
	} else {
		if a.err == nil || a.out != idem.OutcomeNone {
			t.Fatalf("A: (%v, %v), want its error", a.out, a.err)
		}
		wantOutcome(t, "B after A rolled back", b.out, b.err, idem.Applied)
		if n := callsOf(&calls, e.ID); n != 1 {
			t.Fatalf("B's handler ran %d times, want 1", n)
		}
	}
	wantBalances(t, s, Expected([]Event{e}))
	out, err := p.Process(ctx, second, e.Message())
	wantOutcome(t, "redelivery", out, err, idem.Duplicate)
}

// testFirstCommitApplies is testDuplicateWaitsForOpenTx for a store whose
// handler runs before the marker is checked: delivery A is in its handler
// and holds nothing, so B of the same ID applies and commits at once.
// Then A, committing, finds B's marker: a Duplicate, with nothing of its
// own applied; or, failing, its error. Either way the effect is there
// once.
func testFirstCommitApplies[TTx any](t *testing.T, s *Store[TTx], commit bool) {
	ctx := context.Background()
	p := newProc(t, s)
	e := Events(1)[0]
	entered, release := make(chan struct{}), make(chan struct{})
	first := &idem.Handler[TTx]{Name: "balances", Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
		acct, amt, _ := DecodeCredit(m.Payload)
		if err := s.Credit(ctx, tx, acct, amt); err != nil {
			return err
		}
		close(entered)
		<-release
		if !commit {
			return errors.New("A fails after its write")
		}
		return nil
	}}
	type res struct {
		out idem.Outcome
		err error
	}
	aDone := make(chan res, 1)
	go func() {
		out, err := p.Process(ctx, first, e.Message())
		aDone <- res{out, err}
	}()
	select {
	case <-entered:
	case r := <-aDone:
		t.Fatalf("A ended before its handler ran: %v %v", r.out, r.err)
	case <-time.After(10 * time.Second):
		t.Fatal("A's handler never ran")
	}
	second := CreditHandler(s, "balances", nil)
	out, err := p.Process(ctx, second, e.Message())
	close(release)
	wantOutcome(t, "B while A is in its handler", out, err, idem.Applied)
	a := <-aDone
	if commit {
		wantOutcome(t, "A after B committed", a.out, a.err, idem.Duplicate)
	} else if a.err == nil || a.out != idem.OutcomeNone {
		t.Fatalf("A: (%v, %v), want its error", a.out, a.err)
	}
	wantBalances(t, s, Expected([]Event{e}))
	out, err = p.Process(ctx, second, e.Message())
	wantOutcome(t, "redelivery", out, err, idem.Duplicate)
}

// testConflictDeadLettered: guarantee 4 end to end through a Consumer:
// a delivery whose ID is known with another payload is acknowledged,
// dead-lettered with class conflict and never applied, alone and inside a
// batch; under OnConflictWarn it is a Duplicate, with no dead letter.
func testConflictDeadLettered[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	var calls sync.Map
	h := CreditHandler(s, "balances", &calls)
	c := newConsumer(t, s, h, dl, nil)
	ev := Events(4)
	for _, e := range ev[:2] {
		if v := deliverTo(c, e.Message(), 1); !v.Ack || v.Outcome != idem.Applied {
			t.Fatalf("%s: %+v, want applied", e.ID, v)
		}
	}
	c0, c1 := ev[0], ev[1]
	c0.Amount, c1.Amount = 1_000_000, 2_000_000
	v := deliverTo(c, c0.Message(), 1)
	if !v.Ack || !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterConflict || v.Outcome != idem.Conflict {
		t.Fatalf("conflicting delivery: %+v, want acked, dead-lettered as conflict", v)
	}
	vs := c.HandleDeliveries(ctx, []*idem.Delivery{
		{Msg: ev[2].Message(), Attempt: 1, Source: "test"},
		{Msg: c1.Message(), Attempt: 1, Source: "test"},
		{Msg: ev[3].Message(), Attempt: 1, Source: "test"},
	})
	if !vs[0].Ack || vs[0].Outcome != idem.Applied || !vs[2].Ack || vs[2].Outcome != idem.Applied {
		t.Fatalf("batch neighbours of a conflict: %+v, %+v, want applied", vs[0], vs[2])
	}
	if !vs[1].Ack || !vs[1].DeadLettered || vs[1].DeadLetterClass != idem.DeadLetterConflict {
		t.Fatalf("conflict inside a batch: %+v, want acked, dead-lettered as conflict", vs[1])
	}
	got := deadLetters(t, dl, nil)
	byID := map[string]driver.DeadLetter{}
	for _, d := range got {
		byID[d.MessageID] = d
	}
	for _, want := range []Event{c0, c1} {
		d, ok := byID[want.ID]
		if !ok || d.Class != idem.DeadLetterConflict || d.State != driver.DeadLetterParked || string(d.Raw) != string(want.Message().Payload) {
			t.Fatalf("dead letter of %s: %+v (all: %d), want parked, class conflict, the conflicting payload", want.ID, d, len(got))
		}
	}
	if len(got) != 2 {
		t.Fatalf("%d dead letters, want 2", len(got))
	}
	for _, e := range ev {
		if n := callsOf(&calls, e.ID); n != 1 {
			t.Fatalf("%s reached the handler %d times, want 1", e.ID, n)
		}
	}
	wantBalances(t, s, Expected(ev))

	warn := CreditHandler(s, "balances", nil)
	warn.OnConflict = idem.OnConflictWarn
	cw := newConsumer(t, s, warn, dl, nil)
	if v := deliverTo(cw, c0.Message(), 1); !v.Ack || v.DeadLettered || v.Outcome != idem.Duplicate {
		t.Fatalf("conflict under warn: %+v, want an acked duplicate", v)
	}
	if n := len(deadLetters(t, dl, nil)); n != 2 {
		t.Fatalf("%d dead letters after a warn-policy conflict, want still 2", n)
	}
	wantBalances(t, s, Expected(ev))
}

// testAllowConcurrentAppend: GapAllow with an order-sensitive effect,
// shuffled with redeliveries, eight workers taking any message. Latest
// state wins, so per aggregate the applied sequences must be strictly
// increasing (a double apply or an older event applied after a newer one
// would show), end at the last sequence, and number exactly the Applied
// outcomes (AllowShuffledWithDuplicates writes with Put, whose final
// state cannot show a double apply).
func testAllowConcurrentAppend[TTx any](t *testing.T, s *Store[TTx]) {
	p := newProc(t, s)
	const aggs, per = 20, 50
	r := rand.New(rand.NewPCG(11, 12))
	events := seqEvents(aggs, per)
	stream := withDuplicates(r, events)
	r.Shuffle(len(stream), func(i, j int) { stream[i], stream[j] = stream[j], stream[i] })
	msgs := make([]*idem.Message, len(stream))
	for i, e := range stream {
		msgs[i] = e.msg()
	}
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapAllow})
	outs, errs := deliver(t, p, h, msgs, 8, nil)
	if len(errs) > 0 {
		t.Fatalf("%d errors under Allow, first: %v", len(errs), errs[0])
	}
	if n := outs[idem.Applied] + outs[idem.Stale] + outs[idem.Duplicate]; n != len(msgs) {
		t.Fatalf("outcomes %v do not add up to %d", outs, len(msgs))
	}
	states, err := s.States(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(states) != aggs {
		t.Fatalf("%d aggregates, want %d", len(states), aggs)
	}
	total := 0
	for agg, st := range states {
		var last int64
		for _, f := range strings.Split(strings.TrimPrefix(st, ","), ",") {
			q, err := strconv.ParseInt(f, 10, 64)
			if err != nil || q <= last {
				t.Fatalf("%s applied %q: not strictly increasing", agg, st)
			}
			last = q
			total++
		}
		if last != per {
			t.Fatalf("%s ends at %d, want %d", agg, last, per)
		}
	}
	if total != outs[idem.Applied] {
		t.Fatalf("%d applications in the state, %d Applied outcomes", total, outs[idem.Applied])
	}
}
