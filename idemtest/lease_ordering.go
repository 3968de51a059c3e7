package idemtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// seqMsg is the message of event seq of aggregate agg.
func seqMsg(agg string, seq int64) *idem.Message {
	return &idem.Message{ID: fmt.Sprintf("%s-%d", agg, seq), AggregateID: agg, Seq: seq, Payload: []byte(fmt.Sprint(seq))}
}

// testLeaseOrderingFail checks the guard in lease mode under GapFail: a gap
// is a final *GapError and the handler is not called; once the missing
// event is applied the held one applies; older sequences are Stale.
func testLeaseOrderingFail(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, nil)
	var c callCounter
	h := c.handler("shipper", nil)
	h.Ordering = &idem.Ordering{Gap: idem.GapFail}

	step := func(what string, msg *idem.Message, want idem.Outcome) {
		t.Helper()
		out, err := p.Process(ctx, h, msg)
		if err != nil || out != want {
			t.Fatalf("%s: got (%v, %v), want %v", what, out, err, want)
		}
	}
	step("seq 1", seqMsg("order-1", 1), idem.Applied)
	out, err := p.Process(ctx, h, seqMsg("order-1", 3))
	var ge *idem.GapError
	if out != idem.OutcomeNone || !errors.As(err, &ge) || !ge.Final || ge.Last != 1 || !idem.IsPermanent(err) {
		t.Fatalf("seq 3 after 1: got (%v, %v), want a final *GapError after 1", out, err)
	}
	if n := c.count("order-1-3"); n != 0 {
		t.Fatalf("handler called %d times for the event after the gap", n)
	}
	step("seq 1 of another aggregate", seqMsg("order-2", 1), idem.Applied)
	step("seq 2", seqMsg("order-1", 2), idem.Applied)
	step("seq 3 redelivered after the gap closed", seqMsg("order-1", 3), idem.Applied)
	step("seq 2 redelivered", seqMsg("order-1", 2), idem.Duplicate)
	stale := seqMsg("order-1", 2)
	stale.ID = "order-1-2-resent-under-a-new-id"
	step("old sequence under a new ID", stale, idem.Stale)
	step("stale message redelivered", stale, idem.Duplicate)
	for id, want := range map[string]int{"order-1-1": 1, "order-1-2": 1, "order-1-3": 1, "order-2-1": 1, stale.ID: 0} {
		if n := c.count(id); n != want {
			t.Errorf("handler called %d times for %s, want %d", n, id, want)
		}
	}
	step("unsequenced message skips the guard", &idem.Message{ID: "note-1", AggregateID: "order-1"}, idem.Applied)

	vo := c.handler("shipper-vo", nil)
	vo.Ordering = &idem.Ordering{VersionOnly: true}
	if _, err := p.Process(ctx, vo, seqMsg("order-1", 1)); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("version-only lease handler: %v, want ErrInvalidConfig", err)
	}
}

// testLeaseOrderingWait checks GapWait in lease mode: a gap is retriable
// with a deadline from the durable first sighting, and waiting uses up no
// attempt (more waits than MaxAttempts, then the first call is attempt 1).
func testLeaseOrderingWait(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, &idem.LeaseConfig{MaxAttempts: 2})
	var c callCounter
	h := c.handler("shipper", nil)
	h.Ordering = &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Hour}
	var first time.Time
	for i := range 4 {
		out, err := p.Process(ctx, h, seqMsg("order-9", 2))
		var ge *idem.GapError
		if out != idem.OutcomeNone || !errors.As(err, &ge) || ge.Final || idem.IsPermanent(err) || ge.Deadline.IsZero() {
			t.Fatalf("attempt %d: got (%v, %v), want a retriable *GapError with a deadline", i+1, out, err)
		}
		if i == 0 {
			first = ge.FirstSeen
		} else if !ge.FirstSeen.Equal(first) {
			t.Fatalf("first sighting moved from %v to %v", first, ge.FirstSeen)
		}
	}
	for _, seq := range []int64{1, 2} {
		if out, err := p.Process(ctx, h, seqMsg("order-9", seq)); out != idem.Applied || err != nil {
			t.Fatalf("seq %d: got (%v, %v), want applied", seq, out, err)
		}
	}
	if l := c.last(); l.Attempt != 1 || l.Token != 5 {
		t.Fatalf("seq 2 ran with %+v, want attempt 1 (its four waits were no attempts) and token 5", l)
	}
}

// testLeaseOrderingAllowShuffled delivers 20 aggregates × 20 events
// shuffled, with duplicates, under GapAllow: each aggregate's applied
// events strictly increase, no event applies twice, and every aggregate
// ends at its last intended sequence.
func testLeaseOrderingAllowShuffled(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, nil)
	const aggs, perAgg = 20, 20
	applied := map[string][]int64{}
	h := &idem.LeaseHandler{Name: "latest", Ordering: &idem.Ordering{Gap: idem.GapAllow},
		Call: func(_ context.Context, _ *idem.Lease, m *idem.Message) error {
			applied[m.AggregateID] = append(applied[m.AggregateID], m.Seq)
			return nil
		}}
	var stream []*idem.Message
	for a := range aggs {
		for s := int64(1); s <= perAgg; s++ {
			m := seqMsg(fmt.Sprintf("acct-%02d", a), s)
			stream = append(stream, m)
			if rand.IntN(10) == 0 {
				stream = append(stream, m)
			}
		}
	}
	rand.Shuffle(len(stream), func(i, j int) { stream[i], stream[j] = stream[j], stream[i] })
	for _, m := range stream {
		if out, err := p.Process(ctx, h, m); err != nil || (out != idem.Applied && out != idem.Stale && out != idem.Duplicate) {
			t.Fatalf("%s: got (%v, %v)", m.ID, out, err)
		}
	}
	for a := range aggs {
		agg := fmt.Sprintf("acct-%02d", a)
		seqs := applied[agg]
		if len(seqs) == 0 || seqs[len(seqs)-1] != perAgg {
			t.Fatalf("%s applied %v, want it to end at %d", agg, seqs, perAgg)
		}
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Fatalf("%s applied %v: not strictly increasing", agg, seqs)
			}
		}
	}
}
