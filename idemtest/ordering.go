package idemtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/quick"
	"time"

	"github.com/idemhq/idem"
)

// RunOrdering runs the conformance tests of the ordering guard, version-only
// mode and write-side sequencing. The Store must provide Put, Append, States
// and Markers, and the driver must implement driver.SequenceGuard and
// driver.VersionStore.
func RunOrdering[TTx any](t *testing.T, h *Harness[TTx]) {
	aggs := h.Aggregates
	if aggs == 0 {
		aggs = 100
	}
	tests := []struct {
		name string
		fn   func(t *testing.T, s *Store[TTx])
	}{
		{"AllowShuffledWithDuplicates", func(t *testing.T, s *Store[TTx]) { testAllowShuffled(t, s, aggs) }},
		{"AllowConcurrentAppendNeverRepeats", testAllowConcurrentAppend[TTx]},
		{"SeqAboveInt32InOrder", testBigSeqInOrder[TTx]},
		{"SeqAboveInt32GapIsFinal", testBigSeqGap[TTx]},
		{"SeqAboveInt32VersionOnly", testBigSeqVersionOnly[TTx]},
		{"SeqAtMaxInt64", testMaxSeq[TTx]},
		{"GapWaitDeadlineAtHugeSeq", testGapWaitHugeSeq[TTx]},
		{"BatchConflictsAndStaleCopies", testBatchConflictsAndStaleCopies[TTx]},
		{"BatchSameSeqTieFollowsDeliveryOrder", testBatchSameSeqTie[TTx]},
		{"FailHoldsOnlyTheGappedAggregate", func(t *testing.T, s *Store[TTx]) { testFailHolds(t, s, aggs) }},
		{"WaitRetriesUntilDeadline", testWaitDeadline[TTx]},
		{"WaitReordersLocalShuffleExactly", func(t *testing.T, s *Store[TTx]) { testWaitLocalShuffle(t, s, min(aggs, 20)) }},
		{"StaleAndUnsequenced", testStaleAndUnsequenced[TTx]},
		{"AggregateIDsByteForByteUnlessNormalized", testNormalizer[TTx]},
		{"VersionOnly", testVersionOnly[TTx]},
		{"BatchAppliesInSequenceOrder", testBatchOrder[TTx]},
		{"BatchGapHoldsOnlyItsAggregate", testBatchGap[TTx]},
		{"BatchVersionOnly", testBatchVersionOnly[TTx]},
		{"BatchCopyWithAnotherPayloadIsDecidedAlone", testBatchStaleCopy[TTx]},
		{"ConsumerRetriesABatchInSequenceOrder", testConsumerFallbackOrder[TTx]},
		{"ReplayInSequenceOrder", testReplayOrder[TTx]},
		{"BatchesConcurrentShuffledExactlyInOrder", func(t *testing.T, s *Store[TTx]) { testBatchesConcurrent(t, s, min(aggs, 40)) }},
		{"AllocatorConcurrentNoDuplicatesNoGaps", testAllocator[TTx]},
		{"OptimisticConcurrencyNoLostUpdate", testOCC[TTx]},
		{"OptimisticConcurrencyProperty", testOCCProperty[TTx]},
		{"VersionsRejectBadNames", testVersionsBadNames[TTx]},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := h.Open(t)
			if s.Put == nil || s.Append == nil || s.States == nil || s.Markers == nil {
				t.Fatal("RunOrdering needs Store.Put, Append, States and Markers")
			}
			tc.fn(t, s)
		})
	}
}

// seqEvent is one intended event of an aggregate.
type seqEvent struct {
	agg string
	seq int64
}

func (e seqEvent) msg() *idem.Message {
	return &idem.Message{
		ID:          fmt.Sprintf("%s-%d", e.agg, e.seq),
		AggregateID: e.agg,
		Seq:         e.seq,
		Payload:     []byte(e.agg + ":" + strconv.FormatInt(e.seq, 10)),
	}
}

func seqEvents(aggs, perAgg int) []seqEvent {
	out := make([]seqEvent, 0, aggs*perAgg)
	for a := range aggs {
		for q := 1; q <= perAgg; q++ {
			out = append(out, seqEvent{agg: fmt.Sprintf("agg-%03d", a), seq: int64(q)})
		}
	}
	return out
}

// withDuplicates appends a copy of every tenth event, at random places.
func withDuplicates(r *rand.Rand, ev []seqEvent) []seqEvent {
	out := append([]seqEvent(nil), ev...)
	for i := 0; i < len(ev); i += 10 {
		j := r.IntN(len(out) + 1)
		out = append(out[:j], append([]seqEvent{ev[i]}, out[j:]...)...)
	}
	return out
}

func putHandler[TTx any](s *Store[TTx], o *idem.Ordering) *idem.Handler[TTx] {
	return &idem.Handler[TTx]{Name: "latest", Ordering: o, Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
		return s.Put(ctx, tx, m.AggregateID, string(m.Payload))
	}}
}

func appendHandler[TTx any](s *Store[TTx], o *idem.Ordering) *idem.Handler[TTx] {
	return &idem.Handler[TTx]{Name: "chain", Ordering: o, Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
		return s.Append(ctx, tx, m.AggregateID, strconv.FormatInt(m.Seq, 10))
	}}
}

// chain is the state Append produces for sequences 1..n in order.
func chain(n int64) string {
	var b strings.Builder
	for q := int64(1); q <= n; q++ {
		b.WriteString("," + strconv.FormatInt(q, 10))
	}
	return b.String()
}

func wantStates[TTx any](t *testing.T, s *Store[TTx], want map[string]string) {
	t.Helper()
	got, err := s.States(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var diffs []string
	for k, w := range want {
		if got[k] != w {
			g := got[k]
			if len(g) > 60 {
				g = "…" + g[len(g)-60:]
			}
			diffs = append(diffs, fmt.Sprintf("%s=%q", k, g))
		}
	}
	if len(got) != len(want) {
		diffs = append(diffs, fmt.Sprintf("%d aggregates, want %d", len(got), len(want)))
	}
	if len(diffs) > 0 {
		if len(diffs) > 5 {
			diffs = append(diffs[:5], fmt.Sprintf("… %d more", len(diffs)-5))
		}
		t.Fatalf("states differ from the in-order application of the unique events: %s", strings.Join(diffs, ", "))
	}
}

// deliver processes msgs with workers goroutines; route picks the worker of
// a message (a partition, keeping per-partition order), or -1 for any.
func deliver[TTx any](t *testing.T, p *idem.Processor[TTx], h *idem.Handler[TTx], msgs []*idem.Message, workers int, route func(*idem.Message) int) (outs map[idem.Outcome]int, errs []error) {
	t.Helper()
	chans := make([]chan *idem.Message, workers)
	for i := range chans {
		chans[i] = make(chan *idem.Message, 64)
	}
	var mu sync.Mutex
	outs = map[idem.Outcome]int{}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range chans[w] {
				out, err := p.Process(context.Background(), h, m)
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					outs[out]++
				}
				mu.Unlock()
			}
		}()
	}
	for i, m := range msgs {
		w := i % workers
		if route != nil {
			w = route(m)
		}
		chans[w] <- m
	}
	for _, c := range chans {
		close(c)
	}
	wg.Wait()
	return outs, errs
}

func testAllowShuffled[TTx any](t *testing.T, s *Store[TTx], aggs int) {
	p := newProc(t, s)
	r := rand.New(rand.NewPCG(1, 2))
	events := seqEvents(aggs, 100)
	stream := withDuplicates(r, events)
	r.Shuffle(len(stream), func(i, j int) { stream[i], stream[j] = stream[j], stream[i] })
	msgs := make([]*idem.Message, len(stream))
	for i, e := range stream {
		msgs[i] = e.msg()
	}
	outs, errs := deliver(t, p, putHandler(s, &idem.Ordering{Gap: idem.GapAllow}), msgs, 4, nil)
	if len(errs) > 0 {
		t.Fatalf("%d errors under Allow, first: %v", len(errs), errs[0])
	}
	if n := outs[idem.Applied] + outs[idem.Stale] + outs[idem.Duplicate]; n != len(msgs) {
		t.Fatalf("outcomes %v do not add up to %d deliveries", outs, len(msgs))
	}
	// Each unique event applies at most once (a redelivery is a Duplicate,
	// or Stale again if the original was stale), and at least the last
	// sequence of every aggregate applies.
	if outs[idem.Applied] > len(events) || outs[idem.Applied] < aggs || outs[idem.Duplicate] > len(stream)-len(events) {
		t.Fatalf("outcomes %v for %d unique events and %d redeliveries", outs, len(events), len(stream)-len(events))
	}
	// In-order application of the unique events leaves each aggregate at
	// its highest sequence.
	want := map[string]string{}
	for _, e := range events {
		want[e.agg] = e.agg + ":100"
	}
	wantStates(t, s, want)
}

func testFailHolds[TTx any](t *testing.T, s *Store[TTx], aggs int) {
	p := newProc(t, s)
	r := rand.New(rand.NewPCG(3, 4))
	const per, missing = 100, 50
	held := fmt.Sprintf("agg-%03d", aggs*42/100)
	events := seqEvents(aggs, per)
	// Interleave aggregates but keep each one's order (as a Kafka partition
	// or a JetStream subject would), with duplicates right after originals,
	// and lose sequence 50 of one aggregate.
	queues := map[string][]seqEvent{}
	var names []string
	for _, e := range events {
		if e.agg == held && e.seq == missing {
			continue
		}
		if _, ok := queues[e.agg]; !ok {
			names = append(names, e.agg)
		}
		queues[e.agg] = append(queues[e.agg], e)
		if r.IntN(10) == 0 {
			queues[e.agg] = append(queues[e.agg], e)
		}
	}
	var msgs []*idem.Message
	for len(names) > 0 {
		i := r.IntN(len(names))
		q := queues[names[i]]
		msgs = append(msgs, q[0].msg())
		if queues[names[i]] = q[1:]; len(q) == 1 {
			names = append(names[:i], names[i+1:]...)
		}
	}
	part := func(m *idem.Message) int { n, _ := strconv.Atoi(m.AggregateID[4:]); return n % 4 }
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapFail})
	_, errs := deliver(t, p, h, msgs, 4, part)

	// Every error is a final gap of the held aggregate, and the first is
	// exactly the missing sequence.
	var firstGap *idem.GapError
	for _, err := range errs {
		var ge *idem.GapError
		if !errors.As(err, &ge) || !ge.Final || !idem.IsPermanent(err) || ge.AggregateID != held {
			t.Fatalf("unexpected error: %v", err)
		}
		if firstGap == nil || ge.Seq < firstGap.Seq {
			firstGap = ge
		}
	}
	if firstGap == nil || firstGap.Seq != missing+1 || firstGap.Last != missing-1 {
		t.Fatalf("first gap %+v, want seq %d after %d", firstGap, missing+1, missing-1)
	}
	want := map[string]string{}
	for a := range aggs {
		want[fmt.Sprintf("agg-%03d", a)] = chain(per)
	}
	want[held] = chain(missing - 1)
	wantStates(t, s, want)

	// Resolving: the missing event arrives, the refused ones are replayed.
	ctx := context.Background()
	for q := int64(missing); q <= per; q++ {
		out, err := p.Process(ctx, h, seqEvent{held, q}.msg())
		wantOutcome(t, fmt.Sprintf("replay of %s/%d", held, q), out, err, idem.Applied)
	}
	want[held] = chain(per)
	wantStates(t, s, want)
}

func testWaitDeadline[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapWait, WaitFor: 300 * time.Millisecond})
	p := newProc(t, s)
	ev := func(q int64) *idem.Message { return seqEvent{"acct", q}.msg() }
	out, err := p.Process(ctx, h, ev(1))
	wantOutcome(t, "seq 1", out, err, idem.Applied)

	// 3 before 2: retriable, not applied.
	_, err = p.Process(ctx, h, ev(3))
	var ge *idem.GapError
	if !errors.As(err, &ge) || ge.Final || idem.IsPermanent(err) || ge.Deadline.Sub(ge.FirstSeen) != 300*time.Millisecond {
		t.Fatalf("3 before 2 under Wait: %v (%+v), want a retriable gap", err, ge)
	}
	out, err = p.Process(ctx, h, ev(2))
	wantOutcome(t, "seq 2", out, err, idem.Applied)
	out, err = p.Process(ctx, h, ev(3))
	wantOutcome(t, "seq 3 retried", out, err, idem.Applied)

	// 5 without 4: retriable until the deadline, measured from the first
	// sighting even by another processor instance, then final.
	_, err = p.Process(ctx, h, ev(5))
	if !errors.As(err, &ge) || ge.Final {
		t.Fatalf("first sighting of 5: %v", err)
	}
	first := ge.FirstSeen
	time.Sleep(350 * time.Millisecond)
	other := newProc(t, s)
	_, err = other.Process(ctx, h, ev(5))
	if !errors.As(err, &ge) || !ge.Final || !idem.IsPermanent(err) || !ge.FirstSeen.Equal(first) {
		t.Fatalf("5 after the deadline: %v (%+v), want final with the first sighting %v", err, ge, first)
	}
	wantStates(t, s, map[string]string{"acct": chain(3)})

	// ProcessTx: the gap comes back retriable without touching the store
	// while the caller's transaction is open; SightGap after the rollback
	// records the first sighting.
	tx, err := s.Driver.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.ProcessTx(ctx, tx, h, ev(7))
	if !errors.As(err, &ge) || ge.Final || !ge.FirstSeen.IsZero() {
		t.Fatalf("ProcessTx gap: %v", err)
	}
	if rerr := s.Driver.Rollback(ctx, tx); rerr != nil {
		t.Fatal(rerr)
	}
	err = p.SightGap(ctx, h, err)
	if !errors.As(err, &ge) || ge.Final || ge.FirstSeen.IsZero() || ge.Deadline.Sub(ge.FirstSeen) != 300*time.Millisecond {
		t.Fatalf("SightGap: %v (%+v)", err, ge)
	}
}

func testWaitLocalShuffle[TTx any](t *testing.T, s *Store[TTx], aggs int) {
	ctx := context.Background()
	p := newProc(t, s)
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Hour})
	r := rand.New(rand.NewPCG(5, 6))
	events := seqEvents(aggs, 50)
	stream := withDuplicates(r, events)
	// Temporary reordering: swap neighbours within windows of 4.
	for i := 0; i+4 <= len(stream); i += 4 {
		w := stream[i : i+4]
		r.Shuffle(len(w), func(a, b int) { w[a], w[b] = w[b], w[a] })
	}
	queue := make([]*idem.Message, len(stream))
	for i, e := range stream {
		queue[i] = e.msg()
	}
	// A consumer that parks a message refused with a retriable gap and
	// redelivers it once its aggregate has caught up to the sequence before
	// it, as a broker's redelivery delay would let the missing event arrive
	// first. It keeps no other order: the guard must refuse every early one.
	var parked []*idem.Message
	last := map[string]int64{}
	gaps := 0
	for len(queue) > 0 {
		m := queue[0]
		queue = queue[1:]
		out, err := p.Process(ctx, h, m)
		if err != nil {
			if idem.IsPermanent(err) || !errors.Is(err, idem.ErrGap) {
				t.Fatalf("%s: %v", m.ID, err)
			}
			gaps++
			parked = append(parked, m)
			continue
		}
		if out != idem.Applied {
			continue
		}
		if last[m.AggregateID]+1 != m.Seq {
			t.Fatalf("%s applied after sequence %d", m.ID, last[m.AggregateID])
		}
		last[m.AggregateID] = m.Seq
		// Redeliver, in front, what may now be next.
		ready := slices.DeleteFunc(slices.Clone(parked), func(pm *idem.Message) bool { return pm.AggregateID != m.AggregateID || pm.Seq != m.Seq+1 })
		parked = slices.DeleteFunc(parked, func(pm *idem.Message) bool { return pm.AggregateID == m.AggregateID && pm.Seq == m.Seq+1 })
		queue = append(ready, queue...)
	}
	if len(parked) > 0 {
		t.Fatalf("%d messages still refused at the end, first %s", len(parked), parked[0].ID)
	}
	if gaps == 0 {
		t.Fatal("no delivery was refused: the stream was not reordered")
	}
	want := map[string]string{}
	for _, e := range events {
		want[e.agg] = chain(50)
	}
	wantStates(t, s, want)
}

func testStaleAndUnsequenced[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := putHandler(s, &idem.Ordering{Gap: idem.GapAllow})
	out, err := p.Process(ctx, h, seqEvent{"a", 5}.msg())
	wantOutcome(t, "a/5", out, err, idem.Applied)
	stale := seqEvent{"a", 3}.msg()
	out, err = p.Process(ctx, h, stale)
	wantOutcome(t, "a/3 after a/5", out, err, idem.Stale)
	// Stale leaves no marker: the same message is stale again, not a
	// duplicate.
	out, err = p.Process(ctx, h, stale)
	wantOutcome(t, "a/3 again", out, err, idem.Stale)
	// Without Seq the guard is skipped.
	out, err = p.Process(ctx, h, &idem.Message{ID: "plain", AggregateID: "a", Payload: []byte("a:plain")})
	wantOutcome(t, "unsequenced", out, err, idem.Applied)
	wantStates(t, s, map[string]string{"a": "a:plain"})
	// In a batch too, a stale message leaves no marker while the rest of
	// the batch commits.
	for round := range 2 {
		outs, err := p.ProcessBatch(ctx, h, []*idem.Message{stale, seqEvent{"a", 6}.msg()})
		want := []idem.Outcome{idem.Stale, idem.Applied}
		if round == 1 {
			want[1] = idem.Duplicate
		}
		wantOutcomes(t, fmt.Sprintf("batch round %d", round), outs, err, want)
	}
	wantStates(t, s, map[string]string{"a": "a:6"})
	// And in a transaction the caller owns and commits.
	tx, err := s.Driver.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	out, err = p.ProcessTx(ctx, tx, h, stale)
	wantOutcome(t, "a/3 in the caller's transaction", out, err, idem.Stale)
	if err := s.Driver.Commit(ctx, tx); err != nil {
		t.Fatal(err)
	}
	out, err = p.Process(ctx, h, stale)
	wantOutcome(t, "a/3 after the caller committed", out, err, idem.Stale)
}

// wantOutcomes fails t unless a batch returned want without an error.
func wantOutcomes(t *testing.T, what string, got []idem.Outcome, err error, want []idem.Outcome) {
	t.Helper()
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("%s: (%v, %v), want (%v, nil)", what, got, err, want)
	}
}

func seqMsgs(evs ...seqEvent) []*idem.Message {
	out := make([]*idem.Message, len(evs))
	for i, e := range evs {
		out[i] = e.msg()
	}
	return out
}

// testBatchOrder: a batch holding an aggregate's events out of order
// applies them in sequence order, once each, beside other aggregates.
func testBatchOrder[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapFail})
	outs, err := p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 3}, seqEvent{"b", 2}, seqEvent{"a", 1}, seqEvent{"b", 1}, seqEvent{"a", 2}, seqEvent{"a", 1}))
	wantOutcomes(t, "shuffled batch", outs, err, []idem.Outcome{idem.Applied, idem.Applied, idem.Applied, idem.Applied, idem.Applied, idem.Duplicate})
	wantStates(t, s, map[string]string{"a": chain(3), "b": chain(2)})
	// Redelivered with the next events: the old ones are duplicates.
	outs, err = p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 4}, seqEvent{"a", 2}, seqEvent{"b", 3}))
	wantOutcomes(t, "redelivery batch", outs, err, []idem.Outcome{idem.Applied, idem.Duplicate, idem.Applied})
	wantStates(t, s, map[string]string{"a": chain(4), "b": chain(3)})
}

// testBatchGap: events behind a gap are left undecided (OutcomeNone) with
// no marker, the rest of the batch commits, and once the missing event
// arrives the held ones apply.
func testBatchGap[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	gaps := &gapRecorder{}
	p, err := idem.NewProcessor(s.Driver, &idem.Config{Hooks: []idem.Hook{gaps}})
	if err != nil {
		t.Fatal(err)
	}
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapFail})
	outs, err := p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 1}, seqEvent{"a", 4}, seqEvent{"b", 1}, seqEvent{"a", 2}, seqEvent{"a", 5}, seqEvent{"a", 4}))
	wantOutcomes(t, "batch with a gap", outs, err, []idem.Outcome{idem.Applied, idem.OutcomeNone, idem.Applied, idem.Applied, idem.OutcomeNone, idem.OutcomeNone})
	if len(gaps.errs) != 3 {
		t.Fatalf("hooks saw %d gap errors, want 3 (a/4 twice, a/5): %v", len(gaps.errs), gaps.errs)
	}
	for _, err := range gaps.errs {
		var ge *idem.GapError
		if !errors.As(err, &ge) || ge.AggregateID != "a" || ge.Last != 2 || (ge.Seq != 4 && ge.Seq != 5) {
			t.Fatalf("gap error %v, want a/4 or a/5 after 2", err)
		}
	}
	wantStates(t, s, map[string]string{"a": chain(2), "b": chain(1)})
	if n, err := s.Markers(ctx, h.Name); err != nil || n != 3 {
		t.Fatalf("%d markers (%v), want 3: the held events must leave none", n, err)
	}
	outs, err = p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 5}, seqEvent{"a", 4}, seqEvent{"a", 3}))
	wantOutcomes(t, "the missing event with the held ones", outs, err, []idem.Outcome{idem.Applied, idem.Applied, idem.Applied})
	wantStates(t, s, map[string]string{"a": chain(5), "b": chain(1)})
}

// testBatchStaleCopy: a batch holds one ID twice, the first copy stale.
// The second copy with the same payload is the same message and stale too;
// one with another payload (and a newer sequence) is undecided, and
// processed alone it applies, as it would have without the batch.
func testBatchStaleCopy[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapFail})
	out, err := p.Process(ctx, h, seqEvent{"a", 1}.msg())
	wantOutcome(t, "a/1", out, err, idem.Applied)
	old := &idem.Message{ID: "x", AggregateID: "a", Seq: 1, Payload: []byte("old")}
	oldAgain := &idem.Message{ID: "x", AggregateID: "a", Seq: 1, Payload: []byte("old")}
	other := &idem.Message{ID: "x", AggregateID: "a", Seq: 2, Payload: []byte("new")}
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{old, oldAgain, other})
	if err != nil || !slices.Equal(outs, []idem.Outcome{idem.Stale, idem.Stale, idem.OutcomeNone}) {
		t.Fatalf("batch: %v, %v; want stale, stale, none (the other payload left undecided)", outs, err)
	}
	wantStates(t, s, map[string]string{"a": chain(1)})
	out, err = p.Process(ctx, h, other)
	wantOutcome(t, "the other payload alone", out, err, idem.Applied)
	wantStates(t, s, map[string]string{"a": chain(2)})
}

// testConsumerFallbackOrder: a batch of deliveries that fails (another
// aggregate's handler call) is decided one delivery at a time, each
// aggregate's in sequence order as the batch would have applied them, so
// a reordering the batch tolerates does not become a gap.
func testConsumerFallbackOrder[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	dl := deadLetterStore(t, s)
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapFail})
	var down atomic.Bool
	down.Store(true)
	apply := h.Apply
	h.Apply = func(ctx context.Context, tx TTx, m *idem.Message) error {
		if m.AggregateID == "b" && down.Load() {
			return errors.New("b's ledger unavailable")
		}
		return apply(ctx, tx, m)
	}
	c := newConsumer(t, s, h, dl, nil)
	vs := c.HandleDeliveries(ctx, []*idem.Delivery{{Msg: seqEvent{"a", 2}.msg(), Attempt: 1}, {Msg: seqEvent{"a", 1}.msg(), Attempt: 1}, {Msg: seqEvent{"b", 1}.msg(), Attempt: 1}})
	for i, want := range []bool{true, true, false} {
		if vs[i].Ack != want || vs[i].DeadLettered {
			t.Fatalf("delivery %d: %+v; want a/2 and a/1 applied, b/1 retried", i, vs[i])
		}
	}
	wantStates(t, s, map[string]string{"a": chain(2)})
}

// testReplayOrder: dead letters of one aggregate are replayed in sequence
// order, not in the order they were parked, so one replay request settles
// the aggregate.
func testReplayOrder[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	dl := deadLetterStore(t, s)
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapFail})
	c := newConsumer(t, s, h, dl, nil)
	for _, q := range []int64{3, 2} { // before 1: final gaps, dead-lettered
		if v := deliverTo(c, seqEvent{"a", q}.msg(), 1); !v.DeadLettered {
			t.Fatalf("a/%d: %+v, want a dead letter", q, v)
		}
	}
	if v := deliverTo(c, seqEvent{"a", 1}.msg(), 1); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("a/1: %+v, want applied", v)
	}
	if n, err := idem.RequestReplay(ctx, dl, nil, "ops"); err != nil || n != 2 {
		t.Fatalf("RequestReplay: %d, %v; want 2", n, err)
	}
	res, err := c.Replay(ctx)
	if err != nil || res.Replayed != 2 || res.Parked != 0 {
		t.Fatalf("replay: %+v, %v; want both replayed", res, err)
	}
	wantStates(t, s, map[string]string{"a": chain(3)})
}

// gapRecorder is a hook keeping the gap errors reported to it.
type gapRecorder struct{ errs []error }

func (g *gapRecorder) OnOutcome(_ context.Context, ev *idem.OutcomeEvent) {
	if errors.Is(ev.Err, idem.ErrGap) {
		g.errs = append(g.errs, ev.Err)
	}
}

// testBatchVersionOnly: the guard alone decides a batch, with no marker.
func testBatchVersionOnly[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := appendHandler(s, &idem.Ordering{VersionOnly: true, Gap: idem.GapFail})
	h.Name = "version-only"
	if _, err := p.ProcessBatch(ctx, h, []*idem.Message{{ID: "no-seq", AggregateID: "a"}}); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("version-only batch without Seq: %v, want ErrInvalidMessage", err)
	}
	outs, err := p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 2}, seqEvent{"a", 1}, seqEvent{"a", 2}, seqEvent{"b", 1}, seqEvent{"a", 3}))
	wantOutcomes(t, "first batch", outs, err, []idem.Outcome{idem.Applied, idem.Applied, idem.Duplicate, idem.Applied, idem.Applied})
	outs, err = p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 3}, seqEvent{"a", 2}, seqEvent{"a", 4}, seqEvent{"a", 6}))
	wantOutcomes(t, "second batch", outs, err, []idem.Outcome{idem.Duplicate, idem.Stale, idem.Applied, idem.OutcomeNone})
	if n, err := s.Markers(ctx, h.Name); err != nil || n != 0 {
		t.Fatalf("version-only batches wrote %d marker rows (%v), want none", n, err)
	}
	wantStates(t, s, map[string]string{"a": chain(4), "b": chain(1)})
}

// testBatchesConcurrent delivers every event of aggs aggregates twice, in
// shuffled batches, from four goroutines at once; an event a batch leaves
// undecided (behind a gap) goes back to the queue. Every aggregate must end
// with each of its events applied exactly once, in sequence order.
func testBatchesConcurrent[TTx any](t *testing.T, s *Store[TTx], aggs int) {
	ctx := context.Background()
	p := newProc(t, s)
	h := appendHandler(s, &idem.Ordering{Gap: idem.GapFail})
	const per = 30
	events := seqEvents(aggs, per)
	r := rand.New(rand.NewPCG(7, 8))
	queue := append(slices.Clone(events), events...)
	r.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })
	var (
		mu       sync.Mutex
		busy     int
		applied  int
		requeued int
		failures []error
	)
	// An event that can never apply (a lost predecessor) would hold its
	// aggregate's later events forever: give up long before that.
	maxRequeues := 50 * len(events)
	take := func() ([]seqEvent, bool) {
		mu.Lock()
		defer mu.Unlock()
		if requeued > maxRequeues {
			return nil, false
		}
		if len(queue) == 0 {
			return nil, busy > 0
		}
		n := min(len(queue), 1+r.IntN(40))
		b := slices.Clone(queue[:n])
		queue = queue[n:]
		busy++
		return b, true
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				b, more := take()
				if !more {
					return
				}
				if b == nil {
					time.Sleep(time.Millisecond) // others may requeue
					continue
				}
				outs, err := p.ProcessBatch(ctx, h, seqMsgs(b...))
				mu.Lock()
				busy--
				switch {
				case err != nil:
					failures = append(failures, err)
					queue = append(queue, b...)
				default:
					for i, out := range outs {
						switch out {
						case idem.Applied:
							applied++
						case idem.OutcomeNone:
							queue = append(queue, b[i])
							requeued++
						}
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if requeued > maxRequeues {
		t.Fatalf("events were held back %d times and %d never applied: an event behind a gap never became applicable", requeued, len(queue))
	}
	// A batch may fail on a deadlock or serialization error and be
	// delivered again, as a broker would; anything else is a defect.
	if len(failures) > 0 {
		t.Logf("%d batches failed and were delivered again; first: %v", len(failures), failures[0])
	}
	for _, err := range failures {
		if errors.Is(err, idem.ErrInvalidConfig) || errors.Is(err, idem.ErrInvalidMessage) || errors.Is(err, idem.ErrSequenceMismatch) {
			t.Fatalf("batch failed: %v", err)
		}
	}
	if applied != len(events) {
		t.Fatalf("%d applied outcomes for %d unique events (%d batches failed and were redelivered)", applied, len(events), len(failures))
	}
	want := map[string]string{}
	for a := range aggs {
		want[fmt.Sprintf("agg-%03d", a)] = chain(per)
	}
	wantStates(t, s, want)
}

func testNormalizer[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	long := strings.Repeat("x", idem.MaxIDLen-1)
	ids := []string{
		"acct-1", "ACCT-1", "Acct-1", " acct-1", "acct-1 ", "\tacct-1",
		"\u0430cct-1",             // Cyrillic а
		"caf\u00e9", "cafe\u0301", // é composed and decomposed
		"a-b", "a_b", "a b", "a.b", "a:b", "a/b", "ab",
		"stra\u00dfe", "STRASSE", // ß folds to ss
		long + "a", long + "b", long + "A",
	}
	// Byte-for-byte by default: every ID is its own aggregate.
	raw := &idem.Handler[TTx]{Name: "raw", Ordering: &idem.Ordering{}, Apply: func(context.Context, TTx, *idem.Message) error { return nil }}
	for i, id := range ids {
		m := &idem.Message{ID: fmt.Sprintf("raw-%d", i), AggregateID: id, Seq: 1}
		out, err := p.Process(ctx, raw, m)
		wantOutcome(t, fmt.Sprintf("default, aggregate %q", id), out, err, idem.Applied)
	}
	// Under FoldAggregateID exactly the documented collisions happen.
	folded := &idem.Handler[TTx]{Name: "folded", Ordering: &idem.Ordering{Normalize: idem.FoldAggregateID}, Apply: raw.Apply}
	collides := map[string]bool{"ACCT-1": true, "Acct-1": true, " acct-1": true, "acct-1 ": true, "\tacct-1": true, "cafe\u0301": true, "STRASSE": true, long + "A": true}
	for i, id := range ids {
		m := &idem.Message{ID: fmt.Sprintf("fold-%d", i), AggregateID: id, Seq: 1}
		out, err := p.Process(ctx, folded, m)
		want := idem.Applied
		if collides[id] {
			want = idem.Stale
		}
		wantOutcome(t, fmt.Sprintf("folded, aggregate %q", id), out, err, want)
	}
	// A normalizer that empties an ID is refused, not silently merged.
	empty := &idem.Handler[TTx]{Name: "empty", Ordering: &idem.Ordering{Normalize: idem.FoldAggregateID}, Apply: raw.Apply}
	if _, err := p.Process(ctx, empty, &idem.Message{ID: "e", AggregateID: "   ", Seq: 1}); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("aggregate normalized to empty: %v", err)
	}
}

func testVersionOnly[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := appendHandler(s, &idem.Ordering{VersionOnly: true, Gap: idem.GapFail})
	h.Name = "version-only"
	if _, err := p.Process(ctx, h, &idem.Message{ID: "no-seq", AggregateID: "a"}); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("version-only without Seq: %v, want ErrInvalidMessage", err)
	}
	for q := int64(1); q <= 3; q++ {
		out, err := p.Process(ctx, h, seqEvent{"a", q}.msg())
		wantOutcome(t, fmt.Sprintf("a/%d", q), out, err, idem.Applied)
	}
	out, err := p.Process(ctx, h, seqEvent{"a", 3}.msg())
	wantOutcome(t, "redelivery of the last", out, err, idem.Duplicate)
	out, err = p.Process(ctx, h, seqEvent{"a", 2}.msg())
	wantOutcome(t, "redelivery of an older one", out, err, idem.Stale)
	// Documented limit: a changed payload for an old sequence is not seen.
	changed := seqEvent{"a", 3}.msg()
	changed.Payload = []byte("something else")
	out, err = p.Process(ctx, h, changed)
	wantOutcome(t, "changed payload, old sequence", out, err, idem.Duplicate)
	if _, err := p.Process(ctx, h, seqEvent{"a", 5}.msg()); !errors.Is(err, idem.ErrGap) {
		t.Fatalf("gap in version-only mode: %v", err)
	}
	n, err := s.Markers(ctx, h.Name)
	if err != nil || n != 0 {
		t.Fatalf("version-only wrote %d marker rows (%v), want none", n, err)
	}
	wantStates(t, s, map[string]string{"a": chain(3)})

	// Concurrent redeliveries of the same sequences: each applied once.
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for q := int64(4); q <= 40; q++ {
				out, err := p.Process(ctx, h, seqEvent{"b", q - 3}.msg())
				if err != nil || (out != idem.Applied && out != idem.Duplicate && out != idem.Stale) {
					t.Errorf("concurrent version-only: (%v, %v)", out, err)
				}
			}
		}()
	}
	wg.Wait()
	wantStates(t, s, map[string]string{"a": chain(3), "b": chain(37)})
}

func testAllocator[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	v, err := idem.NewVersions(s.Driver)
	if err != nil {
		t.Fatal(err)
	}
	const goroutines, each = 32, 20
	var mu sync.Mutex
	committed := map[int64]int{}
	var rolledBack atomic.Int64
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				tx, err := s.Driver.Begin(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				n, err := v.Next(ctx, tx, "orders", "order-1")
				if err != nil {
					_ = s.Driver.Rollback(ctx, tx)
					t.Error(err)
					return
				}
				if (g+i)%4 == 0 { // a business transaction that fails after allocating
					_ = s.Driver.Rollback(ctx, tx)
					rolledBack.Add(1)
					continue
				}
				if err := s.Driver.Commit(ctx, tx); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				committed[n]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	want := goroutines*each - int(rolledBack.Load())
	if len(committed) != want {
		t.Fatalf("%d distinct committed numbers, want %d", len(committed), want)
	}
	for n := int64(1); n <= int64(want); n++ {
		if committed[n] != 1 {
			t.Fatalf("number %d committed %d times, want once (no duplicates, no gaps)", n, committed[n])
		}
	}
}

func testOCC[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	v, err := idem.NewVersions(s.Driver)
	if err != nil {
		t.Fatal(err)
	}
	const goroutines, each = 32, 5
	var ok, gaveUp atomic.Int64
	var wg sync.WaitGroup
	for range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				err := idem.RetryVersionConflicts(ctx, &idem.Backoff{Retries: 5, Base: time.Millisecond, Max: 20 * time.Millisecond}, func(ctx context.Context) error {
					tx, err := s.Driver.Begin(ctx)
					if err != nil {
						return err
					}
					cur, err := v.Current(ctx, tx, "carts", "cart-1")
					if err == nil {
						// Let others interleave between the read and the write.
						time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
						_, err = v.Advance(ctx, tx, "carts", "cart-1", cur)
					}
					if err == nil {
						err = s.Credit(ctx, tx, "cart-1-increments", 1)
					}
					if err != nil {
						_ = s.Driver.Rollback(ctx, tx)
						return err
					}
					return s.Driver.Commit(ctx, tx)
				})
				switch {
				case err == nil:
					ok.Add(1)
				case errors.Is(err, idem.ErrExpectedVersion):
					gaveUp.Add(1)
				default:
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	tx, err := s.Driver.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	final, err := v.Current(ctx, tx, "carts", "cart-1")
	_ = s.Driver.Rollback(ctx, tx)
	if err != nil {
		t.Fatal(err)
	}
	if final != ok.Load() || final == 0 {
		t.Fatalf("final version %d, successful increments %d (gave up %d): a lost or phantom update", final, ok.Load(), gaveUp.Load())
	}
	wantBalances(t, s, map[string]int64{"cart-1-increments": final})
}

// testVersionsBadNames: a stream or aggregate ID that is not storable
// text (invalid UTF-8, a NUL, too long; an empty aggregate ID) is refused
// with a *idem.ValidationError before the store sees it; the empty stream
// is the default one.
func testVersionsBadNames[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	v, err := idem.NewVersions(s.Driver)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := s.Driver.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Driver.Rollback(ctx, tx) }()
	for _, c := range []struct{ stream, agg, field string }{
		{"bad\x00stream", "a", "stream"},
		{"bad\xffstream", "a", "stream"},
		{strings.Repeat("s", idem.MaxIDLen+1), "a", "stream"},
		{"orders", "", "AggregateID"},
		{"orders", "bad\xff", "AggregateID"},
	} {
		_, err := v.Next(ctx, tx, c.stream, c.agg)
		var ve *idem.ValidationError
		if !errors.As(err, &ve) || ve.Field != c.field || !errors.Is(err, idem.ErrInvalidMessage) {
			t.Errorf("Next(%q, %q): %v, want a ValidationError on %s", c.stream, c.agg, err, c.field)
		}
	}
	if n, err := v.Next(ctx, tx, "", "a"); err != nil || n != 1 {
		t.Fatalf("Next on the default stream: (%d, %v), want 1", n, err)
	}
}

// testOCCProperty checks Advance against a model over random sequences of
// expected-version guesses: it succeeds exactly when the guess is current.
func testOCCProperty[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	v, err := idem.NewVersions(s.Driver)
	if err != nil {
		t.Fatal(err)
	}
	run := 0
	prop := func(guesses []uint8) bool {
		run++
		agg := fmt.Sprintf("prop-%d", run)
		var model int64
		for _, g := range guesses {
			expected := int64(g % 6)
			tx, err := s.Driver.Begin(ctx)
			if err != nil {
				t.Log(err)
				return false
			}
			got, err := v.Advance(ctx, tx, "p", agg, expected)
			_ = s.Driver.Commit(ctx, tx)
			var ve *idem.ExpectedVersionError
			switch {
			case expected == model && (err != nil || got != model+1):
				t.Logf("guess %d at %d: (%d, %v), want success", expected, model, got, err)
				return false
			case expected == model:
				model++
			case !errors.As(err, &ve) || ve.Actual != model || ve.Expected != expected:
				t.Logf("guess %d at %d: %v, want ExpectedVersionError{actual %d}", expected, model, err, model)
				return false
			}
		}
		return true
	}
	if err := quick.Check(prop, &quick.Config{MaxCount: 40, Rand: nil}); err != nil {
		t.Fatal(err)
	}
}
