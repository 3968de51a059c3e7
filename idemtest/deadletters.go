package idemtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// RunDeadLetters runs the conformance tests of idem.Consumer and the
// operator's view: retries, dead letters, replay and the stats counters.
// The store's Driver must implement driver.DeadLetterStore and
// driver.StatsStore.
func RunDeadLetters[TTx any](t *testing.T, h *Harness[TTx]) {
	tests := []struct {
		name string
		fn   func(t *testing.T, s *Store[TTx], dl driver.DeadLetterStore)
	}{
		{"PoisonDeadLetteredOthersFlow", testPoison[TTx]},
		{"NonASCIIErrorDeadLettered", testNonASCIIError[TTx]},
		{"TimeFiltersInMicroseconds", testTimeFilters[TTx]},
		{"EmptyIDsMatchNone", testEmptyIDs[TTx]},
		{"FailingAgainAfterDiscardIsLogged", testRefailLogged[TTx]},
		{"RetriedUntilApplied", testRetriedUntilApplied[TTx]},
		{"AttemptsExhausted", testExhausted[TTx]},
		{"DecodeFailureKeptVerbatim", testDecodeFailure[TTx]},
		{"ConflictDeadLettered", testConflictDeadLettered[TTx]},
		{"DeadLetterWriteFailureIsNotAcked", testDeadLetterWriteFails[TTx]},
		{"LastDeliveryKeepsWritingItsDeadLetter", testLastDeliveryDeadLetterRetried[TTx]},
		{"ReplayAppliesOnceAndDuplicates", testReplay[TTx]},
		{"ReplaySkipsWhatWasDiscardedMeanwhile", testReplayDiscardedMeanwhile[TTx]},
		{"StatsCountDuplicatesAndStale", testStats[TTx]},
		{"BatchOfDeliveries", testBatchDeliveries[TTx]},
		{"BatchRetryHoldsItsAggregate", testBatchRetryHoldsAggregate[TTx]},
		{"SameIDOtherPayloadKeptApart", testOtherPayloadKeptApart[TTx]},
		{"ConcurrentReplaysApplyOnce", testConcurrentReplays[TTx]},
		{"BodiesHeldOneAtATime", testBoundedBodies[TTx]},
		{"StaleReplayClaimRequestedAgain", testStaleReplayClaim[TTx]},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := h.Open(t)
			dl, ok := any(s.Driver).(driver.DeadLetterStore)
			if !ok {
				t.Fatalf("driver %T does not implement driver.DeadLetterStore", s.Driver)
			}
			tc.fn(t, s, dl)
		})
	}
}

// deadLetterStore is s's driver as a dead-letter store.
func deadLetterStore[TTx any](t *testing.T, s *Store[TTx]) driver.DeadLetterStore {
	t.Helper()
	dl, ok := any(s.Driver).(driver.DeadLetterStore)
	if !ok {
		t.Fatalf("driver %T does not implement driver.DeadLetterStore", s.Driver)
	}
	return dl
}

func newConsumer[TTx any](t *testing.T, s *Store[TTx], h *idem.Handler[TTx], dl driver.DeadLetterStore, cfg *idem.ConsumerConfig) *idem.Consumer[TTx] {
	t.Helper()
	c, err := idem.NewConsumer(newProc(t, s), h, dl, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func deliverTo[TTx any](c *idem.Consumer[TTx], m *idem.Message, attempt int) idem.Verdict {
	return c.HandleDelivery(context.Background(), &idem.Delivery{Msg: m, Source: "test", Attempt: attempt})
}

func deadLetters(t *testing.T, dl driver.DeadLetterStore, f *driver.DeadLetterFilter) []driver.DeadLetter {
	t.Helper()
	got, err := dl.DeadLetterList(context.Background(), f)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// testPoison: a message whose payload cannot be decoded is dead-lettered
// after one attempt with its reason, and the messages after it apply.
func testPoison[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	var calls sync.Map
	c := newConsumer(t, s, CreditHandler(s, "balances", &calls), dl, nil)
	ev := Events(10)
	poison := &idem.Message{ID: "poison-1", Payload: []byte("not a credit")}
	stream := []*idem.Message{ev[0].Message(), poison}
	for _, e := range ev[1:] {
		stream = append(stream, e.Message())
	}
	for _, m := range stream {
		v := deliverTo(c, m, 1)
		if !v.Ack {
			t.Fatalf("%s: not acknowledged: %+v", m.ID, v)
		}
		if (m == poison) != v.DeadLettered {
			t.Fatalf("%s: dead-lettered %v", m.ID, v.DeadLettered)
		}
	}
	if n := callsOf(&calls, poison.ID); n != 1 {
		t.Fatalf("poison handled %d times, want 1", n)
	}
	got := deadLetters(t, dl, nil)
	if len(got) != 1 || got[0].MessageID != poison.ID || got[0].Class != idem.DeadLetterPermanent || got[0].Attempts != 1 ||
		got[0].State != driver.DeadLetterParked || !strings.Contains(got[0].Error, "not a credit") || got[0].Fingerprint == "" || string(got[0].Raw) != "not a credit" {
		t.Fatalf("dead letters %+v, want the poison message, permanent, parked, with its reason", got)
	}
	wantBalances(t, s, Expected(ev))
}

// testNonASCIIError: a permanent error whose text is long and not ASCII
// (a localized message, quoted user data) is dead-lettered and
// acknowledged: its fingerprint, cut to length, stays valid UTF-8, which a
// store may require.
func testNonASCIIError[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	// The message's spaces shift where the length bound falls: inside a
	// two-byte é for one of them, a three-byte 日 for another.
	h := &idem.Handler[TTx]{Name: "balances", Apply: func(_ context.Context, _ TTx, m *idem.Message) error {
		return idem.Permanent(errors.New("compte introuvable :" + string(m.Payload) + strings.Repeat("é", 90) + strings.Repeat("日本", 50)))
	}}
	c := newConsumer(t, s, h, dl, nil)
	for i := range 6 {
		m := &idem.Message{ID: fmt.Sprintf("m-%d", i), Payload: []byte(strings.Repeat(" ", i))}
		if v := deliverTo(c, m, 1); !v.Ack || !v.DeadLettered {
			t.Fatalf("%s: verdict %+v, want dead-lettered and acknowledged", m.ID, v)
		}
	}
	got := deadLetters(t, dl, nil)
	if len(got) != 6 {
		t.Fatalf("%d dead letters, want 6", len(got))
	}
	for _, d := range got {
		if !utf8.ValidString(d.Fingerprint) || !utf8.ValidString(d.Error) || !strings.Contains(d.Fingerprint, "compte introuvable") {
			t.Fatalf("dead letter %s: fingerprint %q, error %q; want valid UTF-8", d.MessageID, d.Fingerprint, d.Error)
		}
	}
}

// testTimeFilters: Since and Until compare in whole microseconds, as the
// times are stored, on every store alike: a bound half a microsecond past
// a dead letter's time takes it in as Since and leaves it out as Until.
func testTimeFilters[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	c := newConsumer(t, s, CreditHandler(s, "balances", nil), dl, nil)
	if v := deliverTo(c, &idem.Message{ID: "poison-1", Payload: []byte("not a credit")}, 1); !v.DeadLettered {
		t.Fatalf("verdict %+v, want dead-lettered", v)
	}
	got := deadLetters(t, dl, nil)
	if len(got) != 1 {
		t.Fatalf("%d dead letters, want 1", len(got))
	}
	bound := got[0].LastFailed.Add(500 * time.Nanosecond)
	if n := len(deadLetters(t, dl, &driver.DeadLetterFilter{Since: bound})); n != 1 {
		t.Errorf("Since its time + 500 ns: %d dead letters, want 1", n)
	}
	if n := len(deadLetters(t, dl, &driver.DeadLetterFilter{Until: bound})); n != 0 {
		t.Errorf("Until its time + 500 ns: %d dead letters, want 0", n)
	}
}

// testEmptyIDs: an empty non-nil IDs selects no dead letter, so a
// selection built from empty input cannot discard or replay them all.
func testEmptyIDs[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	c := newConsumer(t, s, CreditHandler(s, "balances", nil), dl, nil)
	for _, id := range []string{"poison-1", "poison-2"} {
		if v := deliverTo(c, &idem.Message{ID: id, Payload: []byte("not a credit")}, 1); !v.DeadLettered {
			t.Fatalf("%s: verdict %+v, want dead-lettered", id, v)
		}
	}
	ctx := context.Background()
	if n := len(deadLetters(t, dl, &driver.DeadLetterFilter{IDs: []int64{}})); n != 0 {
		t.Errorf("list with empty IDs: %d dead letters, want 0", n)
	}
	if n, err := idem.Discard(ctx, dl, &driver.DeadLetterFilter{IDs: []int64{}}, "test"); err != nil || n != 0 {
		t.Errorf("discard with empty IDs: %d, %v; want 0, nil", n, err)
	}
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{IDs: []int64{}}, "test"); err != nil || n != 0 {
		t.Errorf("replay with empty IDs: %d, %v; want 0, nil", n, err)
	}
	parked := deadLetters(t, dl, &driver.DeadLetterFilter{State: driver.DeadLetterParked})
	if len(parked) != 2 {
		t.Fatalf("%d parked dead letters, want both still parked", len(parked))
	}
	// nil IDs do not restrict: both are listed.
	if n := len(deadLetters(t, dl, &driver.DeadLetterFilter{IDs: nil})); n != 2 {
		t.Errorf("list with nil IDs: %d dead letters, want 2", n)
	}
}

// testRefailLogged: a message whose dead letter an operator discarded (or
// that was replayed) and that fails again is parked again, and its
// history says so; a failure of a parked one adds no entry.
func testRefailLogged[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	c := newConsumer(t, s, CreditHandler(s, "balances", nil), dl, nil)
	for _, m := range []*idem.Message{
		{ID: "junk-1", Payload: []byte("not a credit")},
		{ID: "", Payload: []byte("no ID")}, // unkeyed: found again by source, payload and error
	} {
		deliver := func(attempt int) {
			t.Helper()
			d := &idem.Delivery{Msg: m, Source: "kafka:t/0@" + m.ID, Attempt: attempt}
			if m.ID == "" {
				d = &idem.Delivery{DecodeErr: errors.New("no ID header"), Raw: m.Payload, Source: "kafka:t/0@9", Attempt: attempt}
			}
			if v := c.HandleDelivery(ctx, d); !v.DeadLettered {
				t.Fatalf("%q attempt %d: %+v, want dead-lettered", m.ID, attempt, v)
			}
		}
		deliver(1)
		deliver(2) // parked already: no entry
		got := deadLetters(t, dl, &driver.DeadLetterFilter{State: driver.DeadLetterParked})
		if len(got) != 1 {
			t.Fatalf("%q: %d parked dead letters, want 1", m.ID, len(got))
		}
		id := got[0].ID
		if n, err := idem.Discard(ctx, dl, &driver.DeadLetterFilter{IDs: []int64{id}}, "ops"); err != nil || n != 1 {
			t.Fatalf("discard: %d, %v", n, err)
		}
		deliver(3)
		hist, err := dl.DeadLetterHistory(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if len(hist) != 2 || hist[0].State != driver.DeadLetterDiscarded || hist[1].State != driver.DeadLetterParked ||
			hist[1].Actor != driver.RefailActor || !strings.HasPrefix(hist[1].Outcome, "failed again: ") {
			t.Fatalf("%q: history %+v, want discarded, then parked by a delivery that failed again", m.ID, hist)
		}
		if got := deadLetters(t, dl, &driver.DeadLetterFilter{IDs: []int64{id}}); len(got) != 1 || got[0].State != driver.DeadLetterParked || got[0].Attempts != 3 {
			t.Fatalf("%q: dead letter %+v, want parked again after 3 attempts", m.ID, got)
		}
		if _, err := idem.Discard(ctx, dl, &driver.DeadLetterFilter{IDs: []int64{id}}, "ops"); err != nil {
			t.Fatal(err)
		}
	}

	// Replay requested: an ordinary delivery failing again parks it again
	// (logged as the delivery's); a replay failing logs one entry, the
	// replay's.
	last := func(id int64, n int) driver.DeadLetterEvent {
		t.Helper()
		hist, err := dl.DeadLetterHistory(ctx, id)
		if err != nil || len(hist) != n {
			t.Fatalf("history %+v, %v; want %d entries", hist, err, n)
		}
		return hist[n-1]
	}
	m := &idem.Message{ID: "junk-2", Payload: []byte("not a credit either")}
	if v := deliverTo(c, m, 1); !v.DeadLettered {
		t.Fatalf("junk-2: %+v, want dead-lettered", v)
	}
	got := deadLetters(t, dl, &driver.DeadLetterFilter{State: driver.DeadLetterParked})
	if len(got) != 1 || got[0].MessageID != "junk-2" {
		t.Fatalf("parked %+v, want junk-2 alone", got)
	}
	id := got[0].ID
	if _, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{IDs: []int64{id}}, "ops"); err != nil {
		t.Fatal(err)
	}
	if v := deliverTo(c, m, 2); !v.DeadLettered {
		t.Fatalf("junk-2 again: %+v, want dead-lettered", v)
	}
	if e := last(id, 2); e.State != driver.DeadLetterParked || e.Actor != driver.RefailActor {
		t.Fatalf("after a failing delivery while replay was requested: %+v, want parked by the delivery", e)
	}
	if _, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{IDs: []int64{id}}, "ops"); err != nil {
		t.Fatal(err)
	}
	if res, err := c.Replay(ctx); err != nil || res.Parked != 1 {
		t.Fatalf("replay: %+v, %v; want it parked again", res, err)
	}
	if e := last(id, 5); e.State != driver.DeadLetterParked || e.Actor != "consumer balances" || !strings.HasPrefix(e.Outcome, "replay failed: ") {
		t.Fatalf("after a failing replay: %+v, want two entries, the replay's claim and its failure", e)
	}
}

// testRetriedUntilApplied: a handler failing its first three calls is
// retried with a backoff and applied exactly once; without MaxAttempts
// a failure is retried however many deliveries it has had.
func testRetriedUntilApplied[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	h := CreditHandler(s, "balances", nil)
	var calls atomic.Int64
	apply := h.Apply
	h.Apply = func(ctx context.Context, tx TTx, m *idem.Message) error {
		if calls.Add(1) <= 3 {
			return errors.New("downstream timeout")
		}
		return apply(ctx, tx, m)
	}
	c := newConsumer(t, s, h, dl, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: time.Millisecond, Max: 10 * time.Millisecond}})
	ev := Events(1)
	for attempt := 1; ; attempt++ {
		v := deliverTo(c, ev[0].Message(), attempt)
		if v.Ack {
			if attempt != 4 || v.Outcome != idem.Applied || v.DeadLettered {
				t.Fatalf("attempt %d: %+v, want applied at attempt 4", attempt, v)
			}
			break
		}
		if v.Err == nil || v.RetryAfter < 0 || v.RetryAfter > 10*time.Millisecond || attempt > 3 {
			t.Fatalf("attempt %d: %+v, want a retry within the backoff's max", attempt, v)
		}
	}
	if v := deliverTo(c, ev[0].Message(), 5); !v.Ack || v.Outcome != idem.Duplicate {
		t.Fatalf("redelivery: %+v, want a duplicate", v)
	}
	wantBalances(t, s, Expected(ev))
	if got := deadLetters(t, dl, nil); len(got) != 0 {
		t.Fatalf("dead letters %+v, want none", got)
	}
	// MaxAttempts 0 (the default) retries without limit: a failure on
	// the millionth delivery is retried too, not dead-lettered.
	down := CreditHandler(s, "down", nil)
	down.Apply = func(context.Context, TTx, *idem.Message) error { return errors.New("service unavailable") }
	cd := newConsumer(t, s, down, dl, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: time.Millisecond, Max: 10 * time.Millisecond}})
	for _, attempt := range []int{1, 1000, 1_000_000, math.MaxInt32} {
		if v := deliverTo(cd, ev[0].Message(), attempt); v.Ack || v.DeadLettered || v.Err == nil {
			t.Fatalf("failure at attempt %d without MaxAttempts: %+v, want a retry", attempt, v)
		}
	}
	if got := deadLetters(t, dl, nil); len(got) != 0 {
		t.Fatalf("dead letters %+v after failures without MaxAttempts, want none", got)
	}
}

// testExhausted: with MaxAttempts, or on the broker's last attempt, a
// retriable failure becomes a dead letter instead of being dropped.
func testExhausted[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	h := CreditHandler(s, "balances", nil)
	h.Apply = func(context.Context, TTx, *idem.Message) error { return errors.New("service unavailable") }
	c := newConsumer(t, s, h, dl, &idem.ConsumerConfig{MaxAttempts: 2, Backoff: idem.Backoff{Base: time.Millisecond}})
	m := Events(1)[0].Message()
	if v := deliverTo(c, m, 1); v.Ack {
		t.Fatalf("attempt 1: %+v, want a retry", v)
	}
	if v := deliverTo(c, m, 2); !v.Ack || !v.DeadLettered {
		t.Fatalf("attempt 2 of 2: %+v, want a dead letter", v)
	}
	unlimited := newConsumer(t, s, h, dl, nil)
	m2 := Events(2)[1].Message()
	if v := deliverTo(unlimited, m2, 1000); v.Ack {
		t.Fatalf("attempt 1000 with no limit: %+v, want a retry", v)
	}
	if v := unlimited.HandleDelivery(context.Background(), &idem.Delivery{Msg: m2, Attempt: 5, LastAttempt: true}); !v.Ack || !v.DeadLettered {
		t.Fatalf("broker's last attempt: %+v, want a dead letter", v)
	}
	got := deadLetters(t, dl, &driver.DeadLetterFilter{Handler: "balances"})
	if len(got) != 2 || got[0].Class != idem.DeadLetterExhausted || got[0].Attempts != 2 || got[1].Attempts != 5 {
		t.Fatalf("dead letters %+v, want two exhausted", got)
	}
	if got[0].Fingerprint != got[1].Fingerprint {
		t.Fatalf("fingerprints %q and %q differ for the same failure", got[0].Fingerprint, got[1].Fingerprint)
	}
}

// testDecodeFailure: a record that did not map to a message is kept with
// its raw bytes and reason.
func testDecodeFailure[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	c := newConsumer(t, s, CreditHandler(s, "balances", nil), dl, nil)
	undecodable := func(source string, attempt int) {
		t.Helper()
		v := c.HandleDelivery(context.Background(), &idem.Delivery{DecodeErr: errors.New("no idem-id header"), Raw: []byte{0xff, 0x00, 'x'}, Source: source, Attempt: attempt})
		if !v.Ack || !v.DeadLettered {
			t.Fatalf("undecodable delivery at %s: %+v, want a dead letter", source, v)
		}
	}
	// The same delivery twice (redelivered after a crash before its
	// ack) keeps one dead letter; another offset with the same bytes is
	// another message.
	undecodable("kafka:t/0@7", 1)
	undecodable("kafka:t/0@7", 2)
	undecodable("kafka:t/0@8", 1)
	// Two messages with invalid IDs and the same payload from one source
	// (deliverTo's "test") are two dead letters: their errors name the IDs.
	for _, id := range []string{"bad\x00id", "bad\x00other"} {
		if v := deliverTo(c, &idem.Message{ID: id, Payload: []byte("p")}, 1); !v.Ack || !v.DeadLettered {
			t.Fatalf("invalid message %q: %+v, want a dead letter", id, v)
		}
	}
	got := deadLetters(t, dl, nil)
	if len(got) != 4 {
		t.Fatalf("%d dead letters %+v, want 4: one per undecodable message and per invalid one", len(got), got)
	}
	if got[0].Class != idem.DeadLetterDecode || got[0].MessageID != "" || string(got[0].Raw) != "\xff\x00x" ||
		got[0].Source != "kafka:t/0@7" || got[0].Attempts != 2 || !strings.Contains(got[0].Error, "no idem-id header") {
		t.Errorf("first dead letter %+v, want the undecodable delivery at @7 after 2 attempts", got[0])
	}
	if got[1].Source != "kafka:t/0@8" || got[1].Attempts != 1 || got[2].Class != idem.DeadLetterPermanent ||
		!strings.Contains(got[2].Error, `"bad\x00id"`) || !strings.Contains(got[3].Error, `"bad\x00other"`) {
		t.Errorf("dead letters %+v, want the one at @8, then the two invalid messages", got[1:])
	}

	// Two consumers writing the same delivery's dead letter at once (a
	// rebalance) still leave one row. Three rounds: the first also opens
	// the pool's connections, which staggers its writers.
	for round := range 3 {
		source := fmt.Sprintf("kafka:t/1@%d", round)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range 16 {
			wg.Go(func() {
				<-start
				if _, err := dl.DeadLetterPut(context.Background(), &driver.DeadLetter{Handler: "balances", Raw: []byte("junk"),
					Source: source, Error: "no idem-id header", Class: idem.DeadLetterDecode, Fingerprint: "f", Attempts: 1}); err != nil {
					t.Error(err)
				}
			})
		}
		close(start)
		wg.Wait()
		var rows int
		for _, d := range deadLetters(t, dl, nil) {
			if d.Source == source {
				rows++
			}
		}
		if rows != 1 {
			t.Errorf("round %d: %d dead letters for one delivery written 16 times at once, want 1", round, rows)
		}
	}
}

// failingDeadLetters injects a failure into the dead-letter write.
type failingDeadLetters struct{ driver.DeadLetterStore }

func (failingDeadLetters) DeadLetterPut(context.Context, *driver.DeadLetter) (int64, error) {
	return 0, errors.New("disk full")
}

// testDeadLetterWriteFails: when the dead letter cannot be stored, the
// delivery is not acknowledged, so the broker keeps it.
func testDeadLetterWriteFails[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	c := newConsumer(t, s, CreditHandler(s, "balances", nil), failingDeadLetters{dl}, nil)
	v := deliverTo(c, &idem.Message{ID: "poison", Payload: []byte("junk")}, 1)
	if v.Ack || v.DeadLettered || v.Err == nil || !strings.Contains(v.Err.Error(), "disk full") {
		t.Fatalf("%+v, want no acknowledgement and the write error", v)
	}
}

// flakyDeadLetters fails the first fails dead-letter writes.
type flakyDeadLetters struct {
	driver.DeadLetterStore
	fails, puts atomic.Int32
}

func (f *flakyDeadLetters) DeadLetterPut(ctx context.Context, dl *driver.DeadLetter) (int64, error) {
	if f.puts.Add(1) <= f.fails.Load() {
		return 0, errors.New("connection refused")
	}
	return f.DeadLetterStore.DeadLetterPut(ctx, dl)
}

// testLastDeliveryDeadLetterRetried: on the broker's last delivery, which
// a retry verdict would lose (JetStream does not deliver a message again
// after MaxDeliver), a dead letter that cannot be written is written
// again while the delivery lasts; only a delivery that ends first (the
// consumer stopping) gives up, unacknowledged.
func testLastDeliveryDeadLetterRetried[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	flaky := &flakyDeadLetters{DeadLetterStore: dl}
	flaky.fails.Store(5)
	c := newConsumer(t, s, CreditHandler(s, "balances", nil), flaky, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: time.Millisecond, Max: 5 * time.Millisecond}})
	poison := func(id string) *idem.Delivery {
		return &idem.Delivery{Msg: &idem.Message{ID: id, Payload: []byte("junk")}, Source: "test", Attempt: 3, LastAttempt: true}
	}
	v := c.HandleDelivery(context.Background(), poison("p1"))
	if !v.Ack || !v.DeadLettered || flaky.puts.Load() != 6 {
		t.Fatalf("%+v after %d writes, want dead-lettered on the 6th", v, flaky.puts.Load())
	}
	if got := deadLetters(t, dl, nil); len(got) != 1 || got[0].MessageID != "p1" {
		t.Fatalf("dead letters %+v, want p1's", got)
	}
	// The store stays down and the consumer stops: no acknowledgement.
	flaky.fails.Store(1 << 30)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	v = c.HandleDelivery(ctx, poison("p2"))
	if v.Ack || v.DeadLettered || v.Err == nil || !strings.Contains(v.Err.Error(), "connection refused") {
		t.Fatalf("%+v, want no acknowledgement and the write error once the delivery ended", v)
	}
	// The same when the adapter decides with a context that outlives it
	// and says it stops through Delivery.Stopping.
	stopping := make(chan struct{})
	time.AfterFunc(100*time.Millisecond, func() { close(stopping) })
	d := poison("p2")
	d.Stopping = stopping
	if v := c.HandleDelivery(context.Background(), d); v.Ack || v.Err == nil {
		t.Fatalf("%+v, want no acknowledgement once the adapter stopped", v)
	}
	// A delivery the broker will make again is retried, not waited on.
	before := flaky.puts.Load()
	v = deliverTo(c, &idem.Message{ID: "p3", Payload: []byte("junk")}, 1)
	if v.Ack || flaky.puts.Load() != before+1 {
		t.Fatalf("%+v after %d writes, want one write and a retry verdict", v, flaky.puts.Load()-before)
	}
}

// frozenCreditHandler is CreditHandler failing for good ("account
// frozen") until broken is set to false: the cause an operator fixes
// before replaying.
func frozenCreditHandler[TTx any](s *Store[TTx]) (*idem.Handler[TTx], *atomic.Bool) {
	h := CreditHandler(s, "balances", nil)
	broken := new(atomic.Bool)
	broken.Store(true)
	apply := h.Apply
	h.Apply = func(ctx context.Context, tx TTx, m *idem.Message) error {
		if broken.Load() {
			return idem.Permanent(errors.New("account frozen"))
		}
		return apply(ctx, tx, m)
	}
	return h, broken
}

// testReplay: a dead letter replayed after the cause is fixed applies once;
// replaying a message that was already applied is a Duplicate.
func testReplay[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	h, broken := frozenCreditHandler(s)
	c := newConsumer(t, s, h, dl, nil)
	ev := Events(3)
	for _, e := range ev {
		if v := deliverTo(c, e.Message(), 1); !v.DeadLettered {
			t.Fatalf("%s: %+v, want a dead letter", e.ID, v)
		}
	}
	broken.Store(false)
	// ev[0] also arrives again from the broker and applies.
	if v := deliverTo(c, ev[0].Message(), 2); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("redelivery after the fix: %+v", v)
	}
	n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "balances"}, "alice@ops")
	if err != nil || n != 3 {
		t.Fatalf("RequestReplay: %d, %v; want 3", n, err)
	}
	res, err := c.Replay(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Replayed != 3 || res.Outcomes[idem.Applied] != 2 || res.Outcomes[idem.Duplicate] != 1 {
		t.Fatalf("replay: %+v, want 2 applied and 1 duplicate", res)
	}
	wantBalances(t, s, Expected(ev))
	replayed := deadLetters(t, dl, &driver.DeadLetterFilter{State: driver.DeadLetterReplayed})
	if len(replayed) != 3 {
		t.Fatalf("%d replayed dead letters, want 3", len(replayed))
	}
	// Who asked, when, and what came of it are in the log.
	hist, err := dl.DeadLetterHistory(ctx, replayed[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(hist) != 3 || hist[0].State != driver.DeadLetterReplayRequested || hist[0].Actor != "alice@ops" || hist[0].At.IsZero() ||
		hist[1].State != driver.DeadLetterReplaying || hist[1].Actor != "consumer balances" ||
		hist[2].State != driver.DeadLetterReplayed || hist[2].Actor != "consumer balances" || hist[2].Outcome != idem.Duplicate.String() {
		t.Fatalf("history of %s: %+v, want the request by alice@ops, the consumer's claim, then replayed as a duplicate", replayed[0].MessageID, hist)
	}
	if n, err := idem.RequestReplay(ctx, dl, nil, "alice@ops"); err != nil || n != 0 {
		t.Fatalf("second RequestReplay: %d, %v; want nothing left to replay", n, err)
	}
	if res, err := c.Replay(ctx); err != nil || res.Replayed != 0 {
		t.Fatalf("second Replay: %+v, %v", res, err)
	}
	wantBalances(t, s, Expected(ev))

	// Discard parks nothing for replay.
	broken.Store(true)
	if v := deliverTo(c, Events(4)[3].Message(), 1); !v.DeadLettered {
		t.Fatalf("%+v, want a dead letter", v)
	}
	if n, err := idem.Discard(ctx, dl, &driver.DeadLetterFilter{Handler: "balances"}, "bob@ops"); err != nil || n != 1 {
		t.Fatalf("Discard: %d, %v", n, err)
	}
	if n, err := idem.RequestReplay(ctx, dl, nil, "alice@ops"); err != nil || n != 0 {
		t.Fatalf("RequestReplay after discard: %d, %v", n, err)
	}
}

// verdictFunc is a HookVerdict.
type verdictFunc func(ctx context.Context, ev *idem.VerdictEvent)

func (f verdictFunc) OnVerdict(ctx context.Context, ev *idem.VerdictEvent) { f(ctx, ev) }

// testReplayDiscardedMeanwhile: a dead letter that leaves replay_requested
// while a Replay run works through its list (another consumer replayed
// it and it failed again, then an operator discarded it) is not run: the
// operator's decision stands, and its effect is never applied. One parked
// by a failed delivery and discarded while its own replay runs applies
// all the same, and is then marked replayed, its history saying so.
func testReplayDiscardedMeanwhile[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	h, broken := frozenCreditHandler(s)
	ev := Events(2)
	ids := map[string]int64{}
	// discard moves a requested (or running) dead letter back to parked,
	// as another consumer's failed replay (or a failed delivery) does,
	// and discards it as an operator.
	discard := func(ctx context.Context, msgID string) error {
		if _, err := dl.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: []int64{ids[msgID]},
			From: []string{driver.DeadLetterReplayRequested, driver.DeadLetterReplaying}, To: driver.DeadLetterParked, Actor: "other consumer", Outcome: "failed again"}); err != nil {
			return err
		}
		if n, err := idem.Discard(ctx, dl, &driver.DeadLetterFilter{IDs: []int64{ids[msgID]}}, "bob@ops"); err != nil || n != 1 {
			return fmt.Errorf("discard %s: %d, %v", msgID, n, err)
		}
		return nil
	}
	var meddled atomic.Bool
	var meddleErr error
	cfg := &idem.ConsumerConfig{Hooks: []idem.Hook{verdictFunc(func(ctx context.Context, v *idem.VerdictEvent) {
		// Once the replay decided the first (committed, not yet marked
		// replayed), both are discarded.
		if broken.Load() || v.MessageID != ev[0].ID || meddled.Swap(true) {
			return
		}
		meddleErr = errors.Join(discard(ctx, ev[0].ID), discard(ctx, ev[1].ID))
	})}}
	c := newConsumer(t, s, h, dl, cfg)
	for _, e := range ev {
		if v := deliverTo(c, e.Message(), 1); !v.DeadLettered {
			t.Fatalf("%s: %+v, want a dead letter", e.ID, v)
		}
	}
	for _, d := range deadLetters(t, dl, nil) {
		ids[d.MessageID] = d.ID
	}
	broken.Store(false)
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "balances"}, "alice@ops"); err != nil || n != 2 {
		t.Fatalf("RequestReplay: %d, %v; want 2", n, err)
	}
	res, err := c.Replay(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !meddled.Load() || meddleErr != nil {
		t.Fatalf("the discards during the replay did not happen: %v", meddleErr)
	}
	if res.Replayed != 1 || res.Outcomes[idem.Applied] != 1 || res.Parked != 0 {
		t.Fatalf("replay: %+v, want the first applied and the discarded one left alone", res)
	}
	wantBalances(t, s, Expected(ev[:1]))
	if got := deadLetters(t, dl, &driver.DeadLetterFilter{State: driver.DeadLetterDiscarded}); len(got) != 1 || got[0].MessageID != ev[1].ID {
		t.Fatalf("discarded dead letters %+v, want %s's", got, ev[1].ID)
	}
	hist, err := dl.DeadLetterHistory(ctx, ids[ev[0].ID])
	if err != nil {
		t.Fatal(err)
	}
	var states []string
	for _, e := range hist {
		states = append(states, e.State)
	}
	if last := hist[len(hist)-1]; fmt.Sprint(states) != "[replay_requested replaying parked discarded replayed]" || !strings.HasPrefix(last.Outcome, idem.Applied.String()) {
		t.Fatalf("history of %s, discarded while it ran: %+v; want requested, parked, discarded, then replayed as applied", ev[0].ID, hist)
	}
}

// testStats: a StatsRecorder hook counts duplicates and stale deliveries
// per handler, and Flush adds them to the store's counters; a second flush
// adds only what came since.
func testStats[TTx any](t *testing.T, s *Store[TTx], _ driver.DeadLetterStore) {
	ctx := context.Background()
	st, ok := any(s.Driver).(driver.StatsStore)
	if !ok {
		t.Fatalf("driver %T does not implement driver.StatsStore", s.Driver)
	}
	rec, err := idem.NewStatsRecorder(st, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(s.Driver, &idem.Config{Hooks: []idem.Hook{rec}})
	if err != nil {
		t.Fatal(err)
	}
	credit := CreditHandler(s, "balances", nil)
	ordered := &idem.Handler[TTx]{Name: "ordered", Ordering: &idem.Ordering{Gap: idem.GapAllow},
		Apply: func(context.Context, TTx, *idem.Message) error { return nil }}
	deliver := func(h *idem.Handler[TTx], m *idem.Message, want idem.Outcome) {
		t.Helper()
		if out, err := p.Process(ctx, h, m); err != nil || out != want {
			t.Fatalf("%s %s: got %v, %v; want %v", h.Name, m.ID, out, err, want)
		}
	}
	ev := Events(10)
	for _, e := range ev {
		deliver(credit, e.Message(), idem.Applied)
	}
	for _, e := range ev[:4] {
		deliver(credit, e.Message(), idem.Duplicate)
	}
	// Sequence 3 first; 1 and 2 then arrive stale (Allow applied past them).
	seqMsg := func(q int64) *idem.Message {
		return &idem.Message{ID: "ord-" + strconv.FormatInt(q, 10), AggregateID: "agg", Seq: q, Payload: []byte("x")}
	}
	deliver(ordered, seqMsg(3), idem.Applied)
	deliver(ordered, seqMsg(1), idem.Stale)
	deliver(ordered, seqMsg(2), idem.Stale)
	deliver(ordered, seqMsg(3), idem.Duplicate)

	if err := rec.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	want := map[string]driver.StatsDelta{"balances": {Duplicates: 4}, "ordered": {Duplicates: 1, Stale: 2}}
	checkStats(t, st, want)

	deliver(credit, ev[9].Message(), idem.Duplicate)
	if err := rec.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := rec.Flush(ctx); err != nil { // nothing new: adds nothing
		t.Fatal(err)
	}
	want["balances"] = driver.StatsDelta{Duplicates: 5}
	checkStats(t, st, want)
}

func checkStats(t *testing.T, st driver.StatsStore, want map[string]driver.StatsDelta) {
	t.Helper()
	got, err := st.StatsRead(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("stats for %d handlers, want %d: %v", len(got), len(want), got)
	}
	for h, w := range want {
		if got[h] != w {
			t.Errorf("stats of %s = %+v, want %+v", h, got[h], w)
		}
	}
}

// testBatchDeliveries: Consumer.HandleDeliveries applies a batch's new
// messages in one transaction and decides the rest per delivery: a
// redelivery is a Duplicate, a conflicting payload and an undecodable
// record are dead-lettered, all acknowledged; a batch whose handler fails
// for one message falls back to one by one, so the others still apply.
func testBatchDeliveries[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	var calls sync.Map
	c := newConsumer(t, s, CreditHandler(s, "balances", &calls), dl, nil)
	ev := Events(6)
	if v := deliverTo(c, ev[0].Message(), 1); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("first delivery: %+v", v)
	}
	conflict := ev[0].Message()
	conflict.Payload = []byte(ev[0].Account + ":999")
	ds := []*idem.Delivery{
		{Msg: ev[1].Message(), Attempt: 1},
		{Msg: ev[0].Message(), Attempt: 1},                             // redelivered
		{Msg: conflict, Attempt: 1},                                    // same ID, other payload
		{DecodeErr: errors.New("no id"), Raw: []byte("?"), Attempt: 1}, // undecodable
		{Msg: ev[2].Message(), Attempt: 1},
		{Msg: ev[1].Message(), Attempt: 1}, // twice in one batch
	}
	want := []struct {
		out  idem.Outcome
		dead bool
	}{{idem.Applied, false}, {idem.Duplicate, false}, {idem.Conflict, true}, {idem.OutcomeNone, true}, {idem.Applied, false}, {idem.Duplicate, false}}
	vs := c.HandleDeliveries(ctx, ds)
	for i, v := range vs {
		if !v.Ack || v.Outcome != want[i].out || v.DeadLettered != want[i].dead {
			t.Errorf("delivery %d: %+v, want ack, %v, dead-lettered %v", i, v, want[i].out, want[i].dead)
		}
	}
	if n := len(deadLetters(t, dl, nil)); n != 2 {
		t.Fatalf("%d dead letters, want 2", n)
	}
	// A poison message in a batch: the batch cannot commit, each delivery
	// is decided alone.
	poison := &idem.Message{ID: "poison", Payload: []byte("not a credit")}
	vs = c.HandleDeliveries(ctx, []*idem.Delivery{{Msg: ev[3].Message(), Attempt: 1}, {Msg: poison, Attempt: 1}, {Msg: ev[4].Message(), Attempt: 1}})
	if !vs[0].Ack || vs[0].Outcome != idem.Applied || !vs[1].DeadLettered || !vs[2].Ack || vs[2].Outcome != idem.Applied {
		t.Fatalf("batch with a poison message: %+v", vs)
	}
	if err := checkBalances(ctx, s, Expected(ev[:5])); err != nil {
		t.Fatal(err)
	}
	// The first batch's messages reached the handler once each; the
	// poisoned batch's reached it twice (the rolled-back batch, then
	// alone), and the balances show the effect stayed single.
	for _, e := range ev[:3] {
		if n := callsOf(&calls, e.ID); n != 1 {
			t.Errorf("%s applied %d times", e.ID, n)
		}
	}
}

// testBatchRetryHoldsAggregate: when a batch cannot commit and one of its
// deliveries is to be retried, the later deliveries of the same aggregate
// are not processed but retried too, while other aggregates' apply; a
// delivery on its last attempt is decided regardless. Retried in order,
// the aggregate's messages apply in order.
func testBatchRetryHoldsAggregate[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	var (
		down  atomic.Bool
		mu    sync.Mutex
		order []string // IDs in the order their effects were written
	)
	down.Store(true)
	unavailable := errors.New("ledger unavailable")
	h := CreditHandler(s, "balances", nil)
	apply, applyBatch := h.Apply, h.ApplyBatch
	h.Apply = func(ctx context.Context, tx TTx, m *idem.Message) error {
		if m.ID == "a1" && down.Load() {
			return unavailable
		}
		if err := apply(ctx, tx, m); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		order = append(order, m.ID)
		return nil
	}
	h.ApplyBatch = func(ctx context.Context, tx TTx, msgs []*idem.Message) error {
		for _, m := range msgs {
			if m.ID == "a1" && down.Load() {
				return unavailable
			}
		}
		return applyBatch(ctx, tx, msgs)
	}
	c := newConsumer(t, s, h, dl, nil)
	credit := func(id, acct string, amt int) *idem.Message {
		return &idem.Message{ID: id, AggregateID: acct, Payload: []byte(acct + ":" + strconv.Itoa(amt))}
	}
	a1, a2, b1, a3 := credit("a1", "acct-a", 1), credit("a2", "acct-a", 2), credit("b1", "acct-b", 4), credit("a3", "acct-a", 8)
	vs := c.HandleDeliveries(ctx, []*idem.Delivery{{Msg: a1, Attempt: 1}, {Msg: a2, Attempt: 1}, {Msg: b1, Attempt: 1}, {Msg: a3, Attempt: 5, LastAttempt: true}})
	if vs[0].Ack || vs[0].DeadLettered || !errors.Is(vs[0].Err, unavailable) {
		t.Fatalf("a1 (handler unavailable): %+v, want a retry", vs[0])
	}
	if vs[1].Ack || vs[1].RetryAfter != vs[0].RetryAfter || vs[1].Err == nil {
		t.Fatalf("a2 (behind a1): %+v, want a retry after a1's delay, with the reason", vs[1])
	}
	if !vs[2].Ack || vs[2].Outcome != idem.Applied {
		t.Fatalf("b1 (another aggregate): %+v, want applied", vs[2])
	}
	if !vs[3].Ack || vs[3].Outcome != idem.Applied {
		t.Fatalf("a3 (last attempt): %+v, want applied, not held for the broker to drop", vs[3])
	}
	down.Store(false)
	for _, m := range []*idem.Message{a1, a2} { // as Kafka retries them: in order
		if v := deliverTo(c, m, 2); !v.Ack || v.Outcome != idem.Applied {
			t.Fatalf("%s retried: %+v, want applied", m.ID, v)
		}
	}
	mu.Lock()
	got := strings.Join(order, ",")
	mu.Unlock()
	if got != "b1,a3,a1,a2" {
		t.Errorf("effects written in the order %s, want b1,a3,a1,a2 (a2 after a1)", got)
	}
	if err := checkBalances(ctx, s, map[string]int64{"acct-a": 11, "acct-b": 4}); err != nil {
		t.Fatal(err)
	}
}

// testOtherPayloadKeptApart: a second failure of a message ID with
// another payload is a dead letter of its own, so that the first
// payload, the evidence, is not overwritten; the same ID with the same
// payload again updates its one dead letter.
func testOtherPayloadKeptApart[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	c := newConsumer(t, s, CreditHandler(s, "balances", nil), dl, nil)
	first := &idem.Message{ID: "junk-1", Payload: []byte("not a credit")}
	second := &idem.Message{ID: "junk-1", Payload: []byte("not a credit either")}
	for i, m := range []*idem.Message{first, first, second, second, first} {
		if v := deliverTo(c, m, i+1); !v.DeadLettered {
			t.Fatalf("delivery %d of %q: %+v, want dead-lettered", i+1, m.Payload, v)
		}
	}
	got := deadLetters(t, dl, &driver.DeadLetterFilter{Handler: "balances"})
	if len(got) != 2 {
		t.Fatalf("%d dead letters %+v, want two: one per payload", len(got), got)
	}
	for i, m := range []*idem.Message{first, second} {
		d := got[i]
		if d.MessageID != m.ID || string(d.Raw) != string(m.Payload) || string(d.PayloadHash) != string(m.PayloadHash()) || d.State != driver.DeadLetterParked {
			t.Fatalf("dead letter %d: %+v, want %s with payload %q and its hash, parked", i, d, m.ID, m.Payload)
		}
		var env idem.Message
		if err := json.Unmarshal(d.Envelope, &env); err != nil || string(env.Payload) != string(m.Payload) {
			t.Fatalf("dead letter %d's envelope %s (%v), want payload %q", i, d.Envelope, err, m.Payload)
		}
	}
	if got[0].Attempts != 5 || got[1].Attempts != 4 {
		t.Fatalf("attempts %d and %d, want 5 and 4: each updated by its own payload's deliveries", got[0].Attempts, got[1].Attempts)
	}
}

// testConcurrentReplays: consumers replaying the same dead letters at once
// run each once: exactly one replay of each applies, is counted, and is
// logged, and none is logged as a duplicate.
func testConcurrentReplays[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	h, broken := frozenCreditHandler(s)
	apply := h.Apply
	h.Apply = func(ctx context.Context, tx TTx, m *idem.Message) error {
		if !broken.Load() {
			time.Sleep(5 * time.Millisecond) // long enough for the replays to meet
		}
		return apply(ctx, tx, m)
	}
	// The consumer that applied a message is slow to record it: another
	// running the same dead letter meanwhile would find it a duplicate
	// and record that first.
	slow := &idem.ConsumerConfig{Hooks: []idem.Hook{verdictFunc(func(_ context.Context, v *idem.VerdictEvent) {
		if v.Verdict.Outcome == idem.Applied {
			time.Sleep(20 * time.Millisecond)
		}
	})}}
	const consumers = 3
	cs := make([]*idem.Consumer[TTx], consumers)
	for i := range cs {
		cs[i] = newConsumer(t, s, h, dl, slow)
	}
	ev := Events(12)
	for _, e := range ev {
		if v := deliverTo(cs[0], e.Message(), 1); !v.DeadLettered {
			t.Fatalf("%s: %+v, want a dead letter", e.ID, v)
		}
	}
	broken.Store(false)
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "balances"}, "ops"); err != nil || n != len(ev) {
		t.Fatalf("RequestReplay: %d, %v; want %d", n, err, len(ev))
	}
	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		results = make([]idem.ReplayResult, consumers)
		errs    = make([]error, consumers)
	)
	for i, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			results[i], errs[i] = c.Replay(ctx)
		}()
	}
	close(start)
	wg.Wait()
	replayed, applied := 0, 0
	for i := range cs {
		if errs[i] != nil {
			t.Fatalf("consumer %d: %v", i, errs[i])
		}
		replayed += results[i].Replayed
		applied += results[i].Outcomes[idem.Applied]
		if results[i].Parked != 0 || results[i].Outcomes[idem.Duplicate] != 0 {
			t.Fatalf("consumer %d: %+v, want nothing parked and no duplicate", i, results[i])
		}
	}
	if replayed != len(ev) || applied != len(ev) {
		t.Fatalf("replayed %d, applied %d across %d consumers; want %d each: every dead letter counted once", replayed, applied, consumers, len(ev))
	}
	wantBalances(t, s, Expected(ev))
	for _, d := range deadLetters(t, dl, &driver.DeadLetterFilter{Handler: "balances"}) {
		hist, err := dl.DeadLetterHistory(ctx, d.ID)
		if err != nil {
			t.Fatal(err)
		}
		var done []string
		for _, e := range hist {
			if e.State == driver.DeadLetterReplayed {
				done = append(done, e.Outcome)
			}
		}
		if d.State != driver.DeadLetterReplayed || len(done) != 1 || done[0] != idem.Applied.String() {
			t.Fatalf("%s: %s, replays logged %q; want replayed once, applied (history %+v)", d.MessageID, d.State, done, hist)
		}
	}
}

// countingDeadLetters passes calls to a real store and records the most
// body bytes (envelopes and payloads) one DeadLetterList call returned.
type countingDeadLetters struct {
	driver.DeadLetterStore
	mu       sync.Mutex
	maxBytes int
	calls    int
}

func (c *countingDeadLetters) DeadLetterList(ctx context.Context, f *driver.DeadLetterFilter) ([]driver.DeadLetter, error) {
	dls, err := c.DeadLetterStore.DeadLetterList(ctx, f)
	n := 0
	for _, d := range dls {
		n += len(d.Envelope) + len(d.Raw)
	}
	c.mu.Lock()
	c.maxBytes, c.calls = max(c.maxBytes, n), c.calls+1
	c.mu.Unlock()
	return dls, err
}

func (c *countingDeadLetters) reset() (maxBytes, calls int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	maxBytes, calls = c.maxBytes, c.calls
	c.maxBytes, c.calls = 0, 0
	return maxBytes, calls
}

// testBoundedBodies: a summary lists dead letters without their bodies,
// and requesting, discarding and replaying many large dead letters never
// holds more than one body at a time, however many there are.
func testBoundedBodies[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	const (
		n    = 8
		size = 256 << 10
	)
	cdl := &countingDeadLetters{DeadLetterStore: dl}
	h, broken := frozenCreditHandler(s)
	h.Ordering = &idem.Ordering{Gap: idem.GapFail}
	c := newConsumer(t, s, h, cdl, nil)
	ev := make([]Event, n)
	pad := strings.Repeat("x", size)
	for i := range ev {
		// Two aggregates, so that the replay orders by sequence.
		ev[i] = Event{ID: fmt.Sprintf("big-%d", i), Account: fmt.Sprintf("acct-%d", i%2), Amount: int64(i + 1)}
	}
	one := 0
	// Parked newest first within each aggregate: the replay must order them.
	for i := n - 1; i >= 0; i-- {
		m := ev[i].Message()
		m.Seq = int64(i/2 + 1)
		m.Headers = map[string]string{"pad": pad}
		d := &idem.Delivery{Msg: m, Raw: []byte(pad), Source: "test", Attempt: 1}
		if v := c.HandleDelivery(ctx, d); !v.DeadLettered {
			t.Fatalf("%s: %+v, want a dead letter", m.ID, v)
		}
	}
	all := deadLetters(t, dl, nil)
	for _, d := range all {
		one = max(one, len(d.Envelope)+len(d.Raw))
	}
	if len(all) != n || one < 2*size {
		t.Fatalf("%d dead letters of at most %d bytes, want %d of over %d", len(all), one, n, 2*size)
	}
	sum := deadLetters(t, dl, &driver.DeadLetterFilter{Summary: true})
	if len(sum) != n {
		t.Fatalf("summary of %d dead letters, want %d", len(sum), n)
	}
	for i, d := range sum {
		if d.Envelope != nil || d.Raw != nil || d.ID != all[i].ID || d.MessageID != all[i].MessageID || d.Fingerprint != all[i].Fingerprint ||
			d.State != all[i].State || d.Attempts != all[i].Attempts || !d.LastFailed.Equal(all[i].LastFailed) || string(d.PayloadHash) != string(all[i].PayloadHash) {
			t.Fatalf("summary %+v, want dead letter %d without its bodies", d, all[i].ID)
		}
	}
	page := deadLetters(t, dl, &driver.DeadLetterFilter{Summary: true, AfterID: all[2].ID, Limit: 3})
	if len(page) != 3 || page[0].ID != all[3].ID || page[2].ID != all[5].ID {
		t.Fatalf("the page after %d: %+v, want the 3 after it", all[2].ID, page)
	}
	cdl.reset()
	// The first parked is the last of its aggregate: discarding it
	// leaves no gap.
	if k, err := idem.Discard(ctx, cdl, &driver.DeadLetterFilter{IDs: []int64{all[0].ID}}, "ops"); err != nil || k != 1 {
		t.Fatalf("Discard: %d, %v", k, err)
	}
	if k, err := idem.RequestReplay(ctx, cdl, &driver.DeadLetterFilter{Handler: "balances"}, "ops"); err != nil || k != n-1 {
		t.Fatalf("RequestReplay: %d, %v; want %d", k, err, n-1)
	}
	if most, _ := cdl.reset(); most != 0 {
		t.Fatalf("Discard and RequestReplay read %d body bytes in one list, want none", most)
	}
	broken.Store(false)
	res, err := c.Replay(ctx)
	if err != nil || res.Replayed != n-1 || res.Outcomes[idem.Applied] != n-1 {
		t.Fatalf("replay: %+v, %v; want %d applied", res, err, n-1)
	}
	if most, calls := cdl.reset(); most > one || calls < n-1 {
		t.Fatalf("the replay read up to %d body bytes in one list (%d lists); want at most one dead letter's, %d", most, calls, one)
	}
	wantBalances(t, s, Expected(ev[:n-1]))
}

// testStaleReplayClaim: a dead letter left claimed by a replay (state
// replaying: its consumer crashed while running it) is not run by another
// consumer while the claim may still be live, and is requested again and
// replayed once ConsumerConfig.ReplayClaimTimeout has passed.
func testStaleReplayClaim[TTx any](t *testing.T, s *Store[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	h, broken := frozenCreditHandler(s)
	c := newConsumer(t, s, h, dl, nil)
	ev := Events(1)
	if v := deliverTo(c, ev[0].Message(), 1); !v.DeadLettered {
		t.Fatalf("%+v, want a dead letter", v)
	}
	broken.Store(false)
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "balances"}, "ops"); err != nil || n != 1 {
		t.Fatalf("RequestReplay: %d, %v", n, err)
	}
	id := deadLetters(t, dl, nil)[0].ID
	// A consumer claims it, then crashes.
	if n, err := dl.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: []int64{id}, From: []string{driver.DeadLetterReplayRequested},
		To: driver.DeadLetterReplaying, Actor: "consumer balances"}); err != nil || n != 1 {
		t.Fatalf("claim: %d, %v", n, err)
	}
	if res, err := c.Replay(ctx); err != nil || res.Replayed != 0 {
		t.Fatalf("replay while the claim is fresh: %+v, %v; want it left alone", res, err)
	}
	wantBalances(t, s, nil)
	time.Sleep(20 * time.Millisecond)
	late := newConsumer(t, s, h, dl, &idem.ConsumerConfig{ReplayClaimTimeout: 10 * time.Millisecond})
	if res, err := late.Replay(ctx); err != nil || res.Replayed != 1 || res.Outcomes[idem.Applied] != 1 {
		t.Fatalf("replay after the claim timed out: %+v, %v; want it applied", res, err)
	}
	wantBalances(t, s, Expected(ev))
	hist, err := dl.DeadLetterHistory(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	var states []string
	for _, e := range hist {
		states = append(states, e.State)
	}
	if fmt.Sprint(states) != "[replay_requested replaying replay_requested replaying replayed]" {
		t.Fatalf("history %+v, want requested, claimed, requested again, claimed, replayed", hist)
	}
}
