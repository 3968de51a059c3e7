package idemtest

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// testLeaseConsumer: idem.LeaseConsumer maps lease mode's outcomes to broker
// verdicts. Applied and Duplicate are acknowledged; a message whose lease
// another worker holds is asked again later, and dead-lettered on the
// broker's last delivery rather than dropped; a failure is retried, and
// asked again no earlier than its next attempt time; a permanent one is
// dead-lettered. Replaying the dead letter of a message still failed makes
// it claimable again and runs it once more.
func testLeaseConsumer(t *testing.T, drv driver.LeaseDriver) {
	dl, ok := drv.(driver.DeadLetterStore)
	if !ok {
		t.Skipf("driver %T has no dead-letter store: idem.LeaseConsumer needs one", drv)
	}
	ctx := context.Background()
	// A failed attempt waits up to an hour: only a replay brings it back
	// within the test.
	p := leaseProc(t, drv, &idem.LeaseConfig{BackoffBase: time.Hour, BackoffMax: time.Hour})
	var (
		calls callCounter
		down  atomic.Bool
	)
	down.Store(true)
	h := calls.handler("mailer", func(_ context.Context, _ *idem.Lease, m *idem.Message) error {
		switch {
		case m.ID == "flaky" && down.Load():
			return errors.New("smtp: connection refused")
		case m.ID == "bad":
			return idem.Permanent(errors.New("mailbox does not exist"))
		}
		return nil
	})
	c, err := idem.NewLeaseConsumer(p, h, dl, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	deliver := func(id string, attempt int, last bool) idem.Verdict {
		return c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: id, Payload: []byte("hello")}, Attempt: attempt, LastAttempt: last})
	}

	for i, want := range []idem.Outcome{idem.Applied, idem.Duplicate} {
		if v := deliver("ok", i+1, false); !v.Ack || v.Outcome != want || v.DeadLettered {
			t.Fatalf("ok, delivery %d: %+v, want acknowledged %v", i+1, v, want)
		}
	}

	// Another worker holds "busy".
	msg := &idem.Message{ID: "busy", Payload: []byte("hello")}
	if r, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "mailer", MessageID: msg.ID, PayloadHash: msg.PayloadHash(), Owner: "other", TTL: time.Minute}); err != nil || !r.Claimed {
		t.Fatalf("claim busy for another worker: %+v, %v", r, err)
	}
	if v := deliver("busy", 1, false); v.Ack || v.Outcome != idem.InFlight || v.RetryAfter <= 0 {
		t.Fatalf("busy: %+v, want InFlight, not acknowledged, asked again later", v)
	}
	if v := deliver("busy", 2, true); !v.Ack || !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterExhausted {
		t.Fatalf("busy on the broker's last delivery: %+v, want dead-lettered (exhausted)", v)
	}

	// "flaky" fails; asked again, it is in flight until its next attempt.
	if v := deliver("flaky", 1, false); v.Ack || v.Err == nil {
		t.Fatalf("flaky, first delivery: %+v, want a retry with the error", v)
	}
	v := deliver("flaky", 2, false)
	row, err := drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: "flaky"})
	if err != nil || row == nil {
		t.Fatalf("flaky's row: %+v, %v", row, err)
	}
	if due := row.NextAttemptAt.Sub(row.Now); v.Ack || v.Outcome != idem.InFlight || v.RetryAfter < due-time.Second {
		t.Fatalf("flaky before its retry is due (in %s): %+v, want InFlight asked again no earlier", due, v)
	}
	if v := deliver("flaky", 3, true); !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterExhausted {
		t.Fatalf("flaky on the broker's last delivery: %+v, want dead-lettered (exhausted)", v)
	}

	if v := deliver("bad", 1, false); !v.Ack || !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterPermanent {
		t.Fatalf("bad: %+v, want dead-lettered (permanent)", v)
	}

	// The dependency is back: replaying flaky's dead letter runs it once
	// more, although its next attempt was an hour away.
	down.Store(false)
	flaky := deadLetters(t, dl, &driver.DeadLetterFilter{Handler: "mailer", State: driver.DeadLetterParked})
	var ids []int64
	for _, d := range flaky {
		if d.MessageID == "flaky" {
			ids = append(ids, d.ID)
		}
	}
	if len(ids) != 1 {
		t.Fatalf("dead letters %+v, want one of flaky", flaky)
	}
	if _, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{IDs: ids}, "test"); err != nil {
		t.Fatal(err)
	}
	res, err := c.Replay(ctx)
	if err != nil || res.Replayed != 1 || res.Outcomes[idem.Applied] != 1 {
		t.Fatalf("replay: %+v, %v; want flaky applied", res, err)
	}
	for id, want := range map[string]int{"ok": 1, "busy": 0, "flaky": 2, "bad": 1} {
		if n := calls.count(id); n != want {
			t.Errorf("%s: handler called %d times, want %d", id, n, want)
		}
	}
}

// testLeaseReplayAfterMaxAttempts: a message that used up MaxAttempts is
// dead-lettered; once the cause is fixed, replaying the dead letter calls
// the handler again (attempt 1 of MaxAttempts more) and applies it.
func testLeaseReplayAfterMaxAttempts(t *testing.T, drv driver.LeaseDriver) {
	dl, ok := drv.(driver.DeadLetterStore)
	if !ok {
		t.Skipf("driver %T has no dead-letter store: idem.LeaseConsumer needs one", drv)
	}
	ctx := context.Background()
	p := leaseProc(t, drv, &idem.LeaseConfig{MaxAttempts: 2, BackoffBase: time.Millisecond, BackoffMax: time.Millisecond})
	var (
		calls callCounter
		down  atomic.Bool
	)
	down.Store(true)
	h := calls.handler("mailer", func(context.Context, *idem.Lease, *idem.Message) error {
		if down.Load() {
			return errors.New("smtp: connection refused")
		}
		return nil
	})
	c, err := idem.NewLeaseConsumer(p, h, dl, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: time.Millisecond, Max: time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var v idem.Verdict
	for i := 1; i <= 20 && !v.DeadLettered; i++ {
		time.Sleep(5 * time.Millisecond) // past the millisecond backoff
		v = c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: "m-1", Payload: []byte("hello")}, Attempt: i})
	}
	if !v.DeadLettered || calls.count("m-1") != 2 {
		t.Fatalf("after MaxAttempts 2: %+v and %d calls, want a dead letter after 2 calls", v, calls.count("m-1"))
	}
	down.Store(false)
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "mailer"}, "ops"); err != nil || n != 1 {
		t.Fatalf("RequestReplay: %d, %v; want 1", n, err)
	}
	res, err := c.Replay(ctx)
	if err != nil || res.Replayed != 1 || res.Outcomes[idem.Applied] != 1 {
		t.Fatalf("replay: %+v, %v; want m-1 applied (handler calls %d)", res, err, calls.count("m-1"))
	}
	if l := calls.last(); calls.count("m-1") != 3 || l.Attempt != 1 || l.Token != 3 {
		t.Fatalf("replay ran %d calls, the last with %+v; want a third call at attempt 1, token 3", calls.count("m-1"), l)
	}
}

// testLeasePermanentRedelivered: a lease-mode message that failed
// permanently, delivered again (the broker redelivers it, or its replay
// finds it failed for good), keeps its dead letter's error and group: the
// fingerprint "idem dlq replay --group" selects by stays the first
// error's, and each repeat is added to the dead letter's history instead
// of rewriting it.
func testLeasePermanentRedelivered(t *testing.T, drv driver.LeaseDriver) {
	dl, ok := drv.(driver.DeadLetterStore)
	if !ok {
		t.Skipf("driver %T has no dead-letter store: idem.LeaseConsumer needs one", drv)
	}
	ctx := context.Background()
	p := leaseProc(t, drv, &idem.LeaseConfig{BackoffBase: time.Hour, BackoffMax: time.Hour})
	var calls callCounter
	h := calls.handler("mailer", func(context.Context, *idem.Lease, *idem.Message) error {
		return idem.Permanent(errors.New("mailbox 4711 does not exist"))
	})
	c, err := idem.NewLeaseConsumer(p, h, dl, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: time.Millisecond, Max: time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	deliver := func(attempt int) idem.Verdict {
		return c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: "bad", Payload: []byte("hello")}, Attempt: attempt, Source: "test"})
	}
	if v := deliver(1); !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterPermanent {
		t.Fatalf("first delivery: %+v, want dead-lettered (permanent)", v)
	}
	first := deadLetters(t, dl, &driver.DeadLetterFilter{Handler: "mailer"})
	if len(first) != 1 {
		t.Fatalf("dead letters %+v, want one", first)
	}
	orig := first[0]
	histLen := func() int {
		t.Helper()
		hist, err := dl.DeadLetterHistory(ctx, orig.ID)
		if err != nil {
			t.Fatal(err)
		}
		return len(hist)
	}
	check := func(when string, attempts, wantHist int) {
		t.Helper()
		got := deadLetters(t, dl, &driver.DeadLetterFilter{Handler: "mailer"})
		if len(got) != 1 || got[0].ID != orig.ID {
			t.Fatalf("%s: dead letters %+v, want the first one alone", when, got)
		}
		d := got[0]
		if d.Fingerprint != orig.Fingerprint || d.Error != orig.Error || d.Class != orig.Class || d.State != driver.DeadLetterParked {
			t.Fatalf("%s: dead letter %q (%s, %s, %s); want the first error kept: %q (%s, %s), parked",
				when, d.Error, d.Fingerprint, d.Class, d.State, orig.Error, orig.Fingerprint, orig.Class)
		}
		if d.Attempts != attempts {
			t.Fatalf("%s: attempts %d, want %d", when, d.Attempts, attempts)
		}
		if n := histLen(); n != wantHist {
			t.Fatalf("%s: %d history entries, want %d", when, n, wantHist)
		}
	}
	// The broker delivers it again: the handler is not called, and the
	// dead letter says it failed again.
	if v := deliver(2); !v.DeadLettered || !errors.Is(v.Err, idem.ErrFailedPermanently) {
		t.Fatalf("redelivery: %+v, want dead-lettered as failed permanently earlier", v)
	}
	check("after a redelivery", 2, 1)
	hist, err := dl.DeadLetterHistory(ctx, orig.ID)
	if err != nil {
		t.Fatal(err)
	}
	if e := hist[0]; e.State != driver.DeadLetterParked || e.Actor != driver.RefailActor || !strings.Contains(e.Outcome, "failed permanently earlier") {
		t.Fatalf("history entry of the redelivery: %+v", e)
	}
	// Its group still selects it; replayed, it fails the same way (made
	// claimable again where the driver can, or found failed for good).
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Fingerprint: orig.Fingerprint}, "ops"); err != nil || n != 1 {
		t.Fatalf("RequestReplay by the group %q: %d, %v; want 1", orig.Fingerprint, n, err)
	}
	if res, err := c.Replay(ctx); err != nil || res.Parked != 1 {
		t.Fatalf("replay: %+v, %v; want it parked again", res, err)
	}
	d := deadLetters(t, dl, &driver.DeadLetterFilter{Handler: "mailer"})
	if len(d) != 1 || d[0].Fingerprint != orig.Fingerprint {
		t.Fatalf("after the replay: %+v, want the group %q kept", d, orig.Fingerprint)
	}
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Fingerprint: orig.Fingerprint}, "ops"); err != nil || n != 1 {
		t.Fatalf("RequestReplay by the group after a replay: %d, %v; want 1", n, err)
	}
}
