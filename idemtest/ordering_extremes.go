package idemtest

import (
	"context"
	"errors"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/idemhq/idem"
)

// bigSeq is above math.MaxInt32: sequences are 64-bit everywhere.
const bigSeq = int64(3_000_000_000)

// bigMsg is the message of aggregate "big" at seq.
func bigMsg(seq int64) *idem.Message {
	return &idem.Message{ID: "big-" + seqText(seq), AggregateID: "big", Seq: seq, Payload: []byte(seqText(seq))}
}

// seqText is n in decimal.
func seqText(n int64) string { return strconv.FormatInt(n, 10) }

// testBigSeqInOrder: an aggregate whose sequence passed 2^31 − 1 goes on applying its next
// event in order, under every gap policy (the stores agree).
func testBigSeqInOrder[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	allow := putHandler(s, &idem.Ordering{Gap: idem.GapAllow})
	fail := putHandler(s, &idem.Ordering{Gap: idem.GapFail}) // same name: same guard rows
	out, err := p.Process(ctx, allow, bigMsg(bigSeq))
	wantOutcome(t, "GapAllow jump to 3e9", out, err, idem.Applied)
	out, err = p.Process(ctx, fail, bigMsg(bigSeq+1))
	wantOutcome(t, "GapFail, next in order after 3e9", out, err, idem.Applied)
}

// testBigSeqGap: a gap whose sequence is above 2^31 − 1 is a final *GapError under
// GapFail (dead-letter it), not a retriable store error.
func testBigSeqGap[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	fail := putHandler(s, &idem.Ordering{Gap: idem.GapFail})
	out, err := p.Process(ctx, fail, bigMsg(bigSeq))
	var ge *idem.GapError
	if out != idem.OutcomeNone || !errors.As(err, &ge) || !idem.IsPermanent(err) {
		t.Fatalf("GapFail, seq 3e9 on a new aggregate: got %v, %v; want a final *GapError", out, err)
	}
}

// testBigSeqVersionOnly: version-only, a redelivery above 2^31 − 1 is a Duplicate, the next one
// applies.
func testBigSeqVersionOnly[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	allow := putHandler(s, &idem.Ordering{Gap: idem.GapAllow, VersionOnly: true})
	vo := putHandler(s, &idem.Ordering{VersionOnly: true})
	out, err := p.Process(ctx, allow, bigMsg(bigSeq))
	wantOutcome(t, "version-only GapAllow jump to 3e9", out, err, idem.Applied)
	out, err = p.Process(ctx, vo, bigMsg(bigSeq))
	wantOutcome(t, "version-only redelivery of 3e9", out, err, idem.Duplicate)
	out, err = p.Process(ctx, vo, bigMsg(bigSeq+1))
	wantOutcome(t, "version-only next after 3e9", out, err, idem.Applied)
}

// testMaxSeq: the last possible sequence applies in order, and its redeliveries (under
// a new ID: Stale; version-only: Duplicate) never wrap around.
func testMaxSeq[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	allow := putHandler(s, &idem.Ordering{Gap: idem.GapAllow})
	fail := putHandler(s, &idem.Ordering{Gap: idem.GapFail})
	m := bigMsg(math.MaxInt64 - 1)
	out, err := p.Process(ctx, allow, m)
	wantOutcome(t, "GapAllow jump to MaxInt64-1", out, err, idem.Applied)
	last := bigMsg(math.MaxInt64)
	out, err = p.Process(ctx, fail, last)
	if err != nil && errors.Is(err, idem.ErrGap) {
		t.Fatalf("MaxInt64 after MaxInt64-1: %v", err)
	}
	wantOutcome(t, "MaxInt64 after MaxInt64-1", out, err, idem.Applied)
	again := bigMsg(math.MaxInt64)
	again.ID += "-again"
	out, err = p.Process(ctx, fail, again)
	wantOutcome(t, "MaxInt64 again, another ID", out, err, idem.Stale)
	vo := putHandler(s, &idem.Ordering{VersionOnly: true})
	out, err = p.Process(ctx, vo, again)
	wantOutcome(t, "version-only MaxInt64 again", out, err, idem.Duplicate)
	outs, err := p.ProcessBatch(ctx, vo, []*idem.Message{again, bigMsg(math.MaxInt64 - 1)})
	wantOutcomes(t, "version-only batch at MaxInt64", outs, err, []idem.Outcome{idem.Duplicate, idem.Stale})
}

// testGapWaitHugeSeq: GapWait's first sighting holds for sequences
// above 2^53 too: once
// WaitFor has passed since it, the gap is final.
func testGapWaitHugeSeq[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	const base = int64(1) << 54
	allow := putHandler(s, &idem.Ordering{Gap: idem.GapAllow})
	wait := putHandler(s, &idem.Ordering{Gap: idem.GapWait, WaitFor: 20 * time.Millisecond})
	out, err := p.Process(ctx, allow, bigMsg(base+3))
	wantOutcome(t, "GapAllow jump to 2^54+3", out, err, idem.Applied)
	m := bigMsg(base + 5) // 2^54+4 is missing
	_, err = p.Process(ctx, wait, m)
	var ge *idem.GapError
	if !errors.As(err, &ge) || ge.Final {
		t.Fatalf("first sighting: %v; want a retriable *GapError", err)
	}
	first := ge.FirstSeen
	time.Sleep(100 * time.Millisecond)
	_, err = p.Process(ctx, wait, m)
	if !errors.As(err, &ge) {
		t.Fatalf("second sighting: %v; want a *GapError", err)
	}
	if !ge.FirstSeen.Equal(first) || !ge.Final {
		t.Fatalf("100ms after the first sighting (WaitFor 20ms): first seen %s (was %s), final %v; want the first sighting kept and the gap final",
			ge.FirstSeen.Format(time.StampMicro), first.Format(time.StampMicro), ge.Final)
	}
}

// testBatchConflictsAndStaleCopies: conflicts, stale copies and
// same-sequence IDs inside one guarded batch.
func testBatchConflictsAndStaleCopies[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := appendHandler(s, &idem.Ordering{})
	mk := func(id string, seq int64, payload string) *idem.Message {
		return &idem.Message{ID: id, AggregateID: "a", Seq: seq, Payload: []byte(payload)}
	}
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{mk("X", 2, "P"), mk("X", 2, "Q"), mk("W", 1, "P"), mk("Z", 1, "P"), mk("X", 2, "P")})
	wantOutcomes(t, "batch 1", outs, err, []idem.Outcome{idem.Applied, idem.Conflict, idem.Applied, idem.Stale, idem.Duplicate})
	outs, err = p.ProcessBatch(ctx, h, []*idem.Message{mk("V", 4, "P"), mk("V", 4, "Q"), mk("Z", 1, "P"), mk("U", 3, "P")})
	wantOutcomes(t, "batch 2", outs, err, []idem.Outcome{idem.Applied, idem.Conflict, idem.Stale, idem.Applied})
	outs, err = p.ProcessBatch(ctx, h, []*idem.Message{mk("T", 6, "P"), mk("T", 6, "Q"), mk("S", 7, "P")})
	wantOutcomes(t, "batch 3 (gap)", outs, err, []idem.Outcome{idem.OutcomeNone, idem.OutcomeNone, idem.OutcomeNone})
	n, err := s.Markers(ctx, h.Name)
	if err != nil || n != 4 {
		t.Fatalf("%d markers (%v), want 4 (X W V U)", n, err)
	}
	wantStates(t, s, map[string]string{"a": chain(4)})
}

// testBatchSameSeqTie: two IDs claiming one (aggregate, seq) in one batch: the first delivered
// applies and the other is Stale, as when they are processed alone in
// delivery order.
func testBatchSameSeqTie[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := putHandler(s, &idem.Ordering{})
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{
		{ID: "z-first", AggregateID: "a", Seq: 1, Payload: []byte("z")},
		{ID: "a-second", AggregateID: "a", Seq: 1, Payload: []byte("a")},
	})
	wantOutcomes(t, "same (aggregate, seq), delivered z-first then a-second", outs, err, []idem.Outcome{idem.Applied, idem.Stale})
	wantStates(t, s, map[string]string{"a": "z"})
}
