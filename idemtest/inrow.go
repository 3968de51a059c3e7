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
	"time"

	"github.com/idemhq/idem"
)

// Row is an in-row aggregate's committed state: the value its writes
// appended and the last applied sequence its row holds.
type Row struct {
	Value string
	Last  int64
}

// RunInRow runs the conformance tests of the in-row guard
// (Handler.ApplyInRow): the projection's own row holds the last applied
// sequence, and idem writes no row of its own. The Store must provide
// RowAppend and Rows (RowAppendMany is used when set) and Markers; the
// driver must implement driver.SequenceGuard (GapWait records its
// sightings there).
func RunInRow[TTx any](t *testing.T, h *Harness[TTx]) {
	aggs := h.Aggregates
	if aggs == 0 {
		aggs = 100
	}
	tests := []struct {
		name string
		fn   func(t *testing.T, s *Store[TTx])
	}{
		{"StrictStaleDuplicateGap", testInRowStrict[TTx]},
		{"WaitRetriesUntilDeadline", testInRowWait[TTx]},
		{"AllowLatestWins", testInRowAllow[TTx]},
		{"WrongGuardNeverCommits", testInRowWrongGuard[TTx]},
		{"ProcessTx", testInRowProcessTx[TTx]},
		{"NormalizedIDsShareARow", testInRowNormalized[TTx]},
		{"ConsumerDeadLettersGapsAndReplaysThem", testInRowConsumer[TTx]},
		{"BatchRunsInSequenceOrder", testInRowBatch[TTx]},
		{"BatchPerGuardWithoutSetBasedWrite", testInRowBatchPerGuard[TTx]},
		{"ConcurrentShuffledStrictExactlyInOrder", func(t *testing.T, s *Store[TTx]) { testInRowConcurrent(t, s, min(aggs, 20), idem.GapFail) }},
		{"ConcurrentShuffledAllowNeverRepeats", func(t *testing.T, s *Store[TTx]) { testInRowConcurrent(t, s, min(aggs, 20), idem.GapAllow) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := h.Open(t)
			if s.RowAppend == nil || s.Rows == nil || s.Markers == nil {
				t.Fatal("RunInRow needs Store.RowAppend, Rows and Markers")
			}
			tc.fn(t, s)
		})
	}
}

// rowValue is what a guard's messages append: ",seq" each.
func rowValue(g *idem.RowGuard) string {
	var b strings.Builder
	for _, m := range g.Msgs {
		b.WriteString("," + strconv.FormatInt(m.Seq, 10))
	}
	return b.String()
}

// inRowHandler returns an in-row handler appending each message's
// sequence to its aggregate's row; with the store's RowAppendMany, batches
// write with one set-based statement.
func inRowHandler[TTx any](s *Store[TTx], o *idem.Ordering) *idem.Handler[TTx] {
	h := &idem.Handler[TTx]{Name: "inrow", Ordering: o}
	if s.RowAppendMany != nil {
		h.ApplyInRowBatch = func(ctx context.Context, tx TTx, gs []*idem.RowGuard) ([]idem.RowWrite, error) {
			values := make([]string, len(gs))
			for i, g := range gs {
				values[i] = rowValue(g)
			}
			return s.RowAppendMany(ctx, tx, gs, values)
		}
	}
	h.ApplyInRow = func(ctx context.Context, tx TTx, g *idem.RowGuard) (idem.RowWrite, error) {
		return s.RowAppend(ctx, tx, g, rowValue(g))
	}
	if h.ApplyInRowBatch != nil {
		// Process then goes through the set-based write too.
		h.ApplyInRow = nil
	}
	return h
}

func wantRows[TTx any](t *testing.T, s *Store[TTx], want map[string]Row) {
	t.Helper()
	got, err := s.Rows(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var diffs []string
	for k, w := range want {
		if got[k] != w {
			diffs = append(diffs, fmt.Sprintf("%s=%+v want %+v", k, got[k], w))
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok && (g.Value != "" || g.Last != 0) {
			diffs = append(diffs, fmt.Sprintf("%s=%+v want none", k, g))
		}
	}
	if len(diffs) > 0 {
		slices.Sort(diffs)
		if len(diffs) > 5 {
			diffs = append(diffs[:5], fmt.Sprintf("… %d more", len(diffs)-5))
		}
		t.Fatalf("rows differ from the unique intended events: %s", strings.Join(diffs, "; "))
	}
}

func wantNoMarkers[TTx any](t *testing.T, s *Store[TTx], handler string) {
	t.Helper()
	n, err := s.Markers(context.Background(), handler)
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d markers written for in-row handler %q: want none", n, handler)
	}
}

func testInRowStrict[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := inRowHandler(s, &idem.Ordering{})
	for q := int64(1); q <= 3; q++ {
		out, err := p.Process(ctx, h, seqEvent{"a", q}.msg())
		wantOutcome(t, fmt.Sprint("a/", q), out, err, idem.Applied)
	}
	out, err := p.Process(ctx, h, seqEvent{"a", 3}.msg())
	wantOutcome(t, "a/3 again", out, err, idem.Duplicate)
	out, err = p.Process(ctx, h, seqEvent{"a", 2}.msg())
	wantOutcome(t, "a/2 again", out, err, idem.Stale)
	out, err = p.Process(ctx, h, seqEvent{"a", 5}.msg())
	var ge *idem.GapError
	if out != idem.OutcomeNone || !errors.As(err, &ge) || !ge.Final || !idem.IsPermanent(err) || ge.Last != 3 || ge.Seq != 5 {
		t.Fatalf("a/5 after a/3 under GapFail: %v, %v; want a final *GapError with Last 3", out, err)
	}
	out, err = p.Process(ctx, h, seqEvent{"b", 2}.msg())
	if !errors.As(err, &ge) || ge.Last != 0 {
		t.Fatalf("b/2 on a new aggregate: %v, %v; want a gap after 0", out, err)
	}
	// A message without a sequence cannot be guarded by the row.
	_, err = p.Process(ctx, h, &idem.Message{ID: "plain", Payload: []byte("x")})
	if !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("message without Seq: %v; want a *ValidationError", err)
	}
	wantRows(t, s, map[string]Row{"a": {chain(3), 3}})
	wantNoMarkers(t, s, h.Name)
}

func testInRowWait[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := inRowHandler(s, &idem.Ordering{Gap: idem.GapWait, WaitFor: 300 * time.Millisecond})
	_, err := p.Process(ctx, h, seqEvent{"a", 2}.msg())
	var ge *idem.GapError
	if !errors.As(err, &ge) || ge.Final || idem.IsPermanent(err) || ge.Deadline.IsZero() {
		t.Fatalf("a/2 first under GapWait: %v; want a retriable *GapError with a deadline", err)
	}
	first := ge.FirstSeen
	time.Sleep(400 * time.Millisecond)
	_, err = p.Process(ctx, h, seqEvent{"a", 2}.msg())
	if !errors.As(err, &ge) || !ge.Final || !ge.FirstSeen.Equal(first) {
		t.Fatalf("a/2 after the wait: %v; want a final *GapError first seen at %v", err, first)
	}
	for q := int64(1); q <= 2; q++ {
		out, err := p.Process(ctx, h, seqEvent{"a", q}.msg())
		wantOutcome(t, fmt.Sprint("a/", q), out, err, idem.Applied)
	}
	wantRows(t, s, map[string]Row{"a": {chain(2), 2}})
}

func testInRowAllow[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := inRowHandler(s, &idem.Ordering{Gap: idem.GapAllow})
	for _, c := range []struct {
		seq  int64
		want idem.Outcome
	}{{5, idem.Applied}, {3, idem.Stale}, {5, idem.Duplicate}, {7, idem.Applied}, {6, idem.Stale}} {
		out, err := p.Process(ctx, h, seqEvent{"a", c.seq}.msg())
		wantOutcome(t, fmt.Sprint("a/", c.seq), out, err, c.want)
	}
	wantRows(t, s, map[string]Row{"a": {",5,7", 7}})
	wantNoMarkers(t, s, h.Name)
}

// testInRowWrongGuard runs a strict handler whose write carries the
// latest-wins guard: the write that skips a sequence must never commit.
func testInRowWrongGuard[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := &idem.Handler[TTx]{Name: "wrong", Ordering: &idem.Ordering{Gap: idem.GapFail},
		ApplyInRow: func(ctx context.Context, tx TTx, g *idem.RowGuard) (idem.RowWrite, error) {
			wrong := *g
			wrong.AllowGap = true
			return s.RowAppend(ctx, tx, &wrong, rowValue(g))
		}}
	out, err := p.Process(ctx, h, seqEvent{"a", 1}.msg())
	wantOutcome(t, "a/1", out, err, idem.Applied)
	out, err = p.Process(ctx, h, seqEvent{"a", 3}.msg())
	var re *idem.RowGuardError
	if out != idem.OutcomeNone || !errors.As(err, &re) || !re.Final || !idem.IsPermanent(err) || !errors.Is(err, idem.ErrRowGuard) {
		t.Fatalf("a/3 written past a gap: %v, %v; want a final *RowGuardError", out, err)
	}
	outs, err := p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"b", 1}, seqEvent{"a", 4}))
	if !errors.As(err, &re) || !re.Final || outs != nil {
		t.Fatalf("batch with a/4 written past a gap: %v, %v; want the batch to fail with a final *RowGuardError", outs, err)
	}
	wantRows(t, s, map[string]Row{"a": {chain(1), 1}})
}

func testInRowProcessTx[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := inRowHandler(s, &idem.Ordering{Gap: idem.GapWait})
	run := func(m *idem.Message, commit bool) (idem.Outcome, error) {
		tx, err := s.Driver.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out, err := p.ProcessTx(ctx, tx, h, m)
		if commit && err == nil {
			if err := s.Driver.Commit(ctx, tx); err != nil {
				t.Fatal(err)
			}
		} else {
			_ = s.Driver.Rollback(ctx, tx)
		}
		return out, err
	}
	out, err := run(seqEvent{"a", 1}.msg(), false)
	wantOutcome(t, "a/1 rolled back", out, err, idem.Applied)
	out, err = run(seqEvent{"a", 1}.msg(), true)
	wantOutcome(t, "a/1", out, err, idem.Applied)
	out, err = run(seqEvent{"a", 1}.msg(), true)
	wantOutcome(t, "a/1 again", out, err, idem.Duplicate)
	_, err = run(seqEvent{"a", 3}.msg(), false)
	var ge *idem.GapError
	if !errors.As(err, &ge) || ge.Final || !ge.Deadline.IsZero() {
		t.Fatalf("a/3 under ProcessTx: %v; want a retriable *GapError without its sighting", err)
	}
	if err := p.SightGap(ctx, h, err); !errors.As(err, &ge) || ge.Deadline.IsZero() {
		t.Fatalf("SightGap: %v; want the deadline set", err)
	}
	outs, err := func() ([]idem.Outcome, error) {
		tx, err := s.Driver.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		outs, err := p.ProcessBatchTx(ctx, tx, h, seqMsgs(seqEvent{"a", 3}, seqEvent{"a", 2}, seqEvent{"a", 1}))
		if err == nil {
			err = s.Driver.Commit(ctx, tx)
		} else {
			_ = s.Driver.Rollback(ctx, tx)
		}
		return outs, err
	}()
	wantOutcomes(t, "batch under ProcessBatchTx", outs, err, []idem.Outcome{idem.Applied, idem.Applied, idem.Duplicate})
	wantRows(t, s, map[string]Row{"a": {chain(3), 3}})
}

func testInRowBatch[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := inRowHandler(s, &idem.Ordering{})
	outs, err := p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 3}, seqEvent{"b", 2}, seqEvent{"a", 1}, seqEvent{"b", 1}, seqEvent{"a", 2}, seqEvent{"a", 1}))
	wantOutcomes(t, "first batch", outs, err, []idem.Outcome{idem.Applied, idem.Applied, idem.Applied, idem.Applied, idem.Applied, idem.Duplicate})
	wantRows(t, s, map[string]Row{"a": {chain(3), 3}, "b": {chain(2), 2}})
	// Stale, duplicate, the next one, a gap and what follows it; a run
	// refused as stale whose later message applies in a second round.
	outs, err = p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 2}, seqEvent{"a", 3}, seqEvent{"a", 4}, seqEvent{"b", 4}, seqEvent{"b", 5}, seqEvent{"c", 1}))
	wantOutcomes(t, "second batch", outs, err, []idem.Outcome{idem.Stale, idem.Duplicate, idem.Applied, idem.OutcomeNone, idem.OutcomeNone, idem.Applied})
	wantRows(t, s, map[string]Row{"a": {chain(4), 4}, "b": {chain(2), 2}, "c": {chain(1), 1}})
	// Only refusals: nothing is committed, nothing fails.
	outs, err = p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 1}, seqEvent{"c", 1}))
	wantOutcomes(t, "stale batch", outs, err, []idem.Outcome{idem.Stale, idem.Duplicate})

	ha := inRowHandler(s, &idem.Ordering{Gap: idem.GapAllow})
	ha.Name = "inrow-allow"
	outs, err = p.ProcessBatch(ctx, ha, seqMsgs(seqEvent{"x", 5}, seqEvent{"x", 2}, seqEvent{"x", 9}))
	wantOutcomes(t, "allow batch", outs, err, []idem.Outcome{idem.Applied, idem.Applied, idem.Applied})
	outs, err = p.ProcessBatch(ctx, ha, seqMsgs(seqEvent{"x", 8}, seqEvent{"x", 12}, seqEvent{"x", 9}, seqEvent{"x", 10}))
	wantOutcomes(t, "allow batch over a stale one", outs, err, []idem.Outcome{idem.Stale, idem.Applied, idem.Duplicate, idem.Applied})
	wantRows(t, s, map[string]Row{"a": {chain(4), 4}, "b": {chain(2), 2}, "c": {chain(1), 1}, "x": {",2,5,9,10,12", 12}})
	wantNoMarkers(t, s, h.Name)
}

// testInRowBatchPerGuard runs batches through ApplyInRow, one write per
// guard, as a handler without a set-based write does.
func testInRowBatchPerGuard[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := &idem.Handler[TTx]{Name: "inrow-one", Ordering: &idem.Ordering{},
		ApplyInRow: func(ctx context.Context, tx TTx, g *idem.RowGuard) (idem.RowWrite, error) {
			return s.RowAppend(ctx, tx, g, rowValue(g))
		}}
	outs, err := p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"a", 2}, seqEvent{"b", 1}, seqEvent{"a", 1}, seqEvent{"a", 4}))
	wantOutcomes(t, "batch", outs, err, []idem.Outcome{idem.Applied, idem.Applied, idem.Applied, idem.OutcomeNone})
	wantRows(t, s, map[string]Row{"a": {chain(2), 2}, "b": {chain(1), 1}})
}

// testInRowConcurrent has 16 goroutines deliver every event of aggs
// aggregates, each 40 long, with a tenth of them twice, shuffled, half the
// goroutines one message at a time and half in batches. A delivery that
// is not decided (a gap, a retriable error) goes back to the queue, as a
// broker redelivers it. Under strict order every aggregate must end with
// each of its events applied exactly once, in order; under GapAllow each
// must end at its last event, no event applied twice and none out of
// order.
func testInRowConcurrent[TTx any](t *testing.T, s *Store[TTx], aggs int, gap idem.GapPolicy) {
	ctx := context.Background()
	p := newProc(t, s)
	h := inRowHandler(s, &idem.Ordering{Gap: gap})
	const per, workers = 40, 16
	events := seqEvents(aggs, per)
	r := rand.New(rand.NewPCG(11, uint64(gap)))
	queue := withDuplicates(r, events)
	r.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })
	var (
		mu       sync.Mutex
		busy     int
		requeued int
		failures []error
		applied  atomic.Int64
	)
	maxRequeues := 200 * len(events)
	take := func(n int) ([]seqEvent, bool) {
		mu.Lock()
		defer mu.Unlock()
		if requeued > maxRequeues {
			return nil, false
		}
		if len(queue) == 0 {
			return nil, busy > 0
		}
		n = min(len(queue), n)
		b := slices.Clone(queue[:n])
		queue = queue[n:]
		busy++
		return b, true
	}
	requeue := func(e seqEvent, err error) {
		var re *idem.RowGuardError
		if errors.As(err, &re) && re.Final {
			failures = append(failures, err)
			return
		}
		queue = append(queue, e)
		requeued++
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				size := 1
				if w%2 == 1 {
					size = 1 + rand.IntN(30)
				}
				b, more := take(size)
				if !more {
					return
				}
				if b == nil {
					time.Sleep(time.Millisecond)
					continue
				}
				if size == 1 {
					out, err := p.Process(ctx, h, b[0].msg())
					mu.Lock()
					busy--
					if err != nil {
						requeue(b[0], err)
					} else if out == idem.Applied {
						applied.Add(1)
					}
					mu.Unlock()
					continue
				}
				outs, err := p.ProcessBatch(ctx, h, seqMsgs(b...))
				mu.Lock()
				busy--
				for i, e := range b {
					switch {
					case err != nil:
						requeue(e, err)
					case outs[i] == idem.Applied:
						applied.Add(1)
					case outs[i] == idem.OutcomeNone:
						requeue(e, nil)
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("%d writes advanced out of order; first: %v", len(failures), failures[0])
	}
	if requeued > maxRequeues {
		t.Fatalf("deliveries were put back %d times and %d never decided", requeued, len(queue))
	}
	got, err := s.Rows(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if gap != idem.GapAllow {
		want := map[string]Row{}
		for a := range aggs {
			want[fmt.Sprintf("agg-%03d", a)] = Row{chain(per), per}
		}
		wantRows(t, s, want)
		if n := applied.Load(); n != int64(len(events)) {
			t.Fatalf("%d applied outcomes for %d unique events", n, len(events))
		}
		return
	}
	// Latest wins: each aggregate's applied sequences rise, end at its last
	// event, and each counts once among the applied outcomes.
	total := 0
	for a := range aggs {
		agg := fmt.Sprintf("agg-%03d", a)
		row := got[agg]
		seqs := strings.Split(strings.TrimPrefix(row.Value, ","), ",")
		prev := int64(0)
		for _, f := range seqs {
			q, err := strconv.ParseInt(f, 10, 64)
			if err != nil || q <= prev {
				t.Fatalf("%s holds %q: not rising sequences", agg, row.Value)
			}
			prev = q
		}
		if prev != per || row.Last != per {
			t.Fatalf("%s = %+v; want it to end at %d", agg, row, per)
		}
		total += len(seqs)
	}
	if n := applied.Load(); n != int64(total) {
		t.Fatalf("%d applied outcomes for %d sequences in the rows", n, total)
	}
}

// testInRowNormalized checks that the guard names the row by the
// normalized aggregate ID, alone and in a batch.
func testInRowNormalized[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	h := inRowHandler(s, &idem.Ordering{Normalize: idem.FoldAggregateID})
	out, err := p.Process(ctx, h, seqEvent{"ACCT-1", 1}.msg())
	wantOutcome(t, "ACCT-1/1", out, err, idem.Applied)
	out, err = p.Process(ctx, h, seqEvent{" acct-1", 1}.msg())
	wantOutcome(t, "' acct-1'/1", out, err, idem.Duplicate)
	outs, err := p.ProcessBatch(ctx, h, seqMsgs(seqEvent{"Acct-1", 3}, seqEvent{"acct-1", 2}))
	wantOutcomes(t, "batch", outs, err, []idem.Outcome{idem.Applied, idem.Applied})
	wantRows(t, s, map[string]Row{"acct-1": {chain(3), 3}})
}

// testInRowConsumer runs an in-row handler under a Consumer: gaps under
// GapFail are dead-lettered, a batch of deliveries applies in sequence
// order, and a replay of the dead letters completes the aggregate.
func testInRowConsumer[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	dl := deadLetterStore(t, s)
	c := newConsumer(t, s, inRowHandler(s, &idem.Ordering{Gap: idem.GapFail}), dl, nil)
	for _, q := range []int64{3, 2} { // before 1: final gaps, dead-lettered
		if v := deliverTo(c, seqEvent{"a", q}.msg(), 1); !v.DeadLettered {
			t.Fatalf("a/%d: %+v, want a dead letter", q, v)
		}
	}
	if v := deliverTo(c, seqEvent{"a", 1}.msg(), 1); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("a/1: %+v, want applied", v)
	}
	vs := c.HandleDeliveries(ctx, []*idem.Delivery{{Msg: seqEvent{"b", 2}.msg(), Attempt: 1}, {Msg: seqEvent{"b", 1}.msg(), Attempt: 1}})
	for i, v := range vs {
		if !v.Ack || v.Outcome != idem.Applied {
			t.Fatalf("batch delivery %d: %+v, want applied", i, v)
		}
	}
	if n, err := idem.RequestReplay(ctx, dl, nil, "ops"); err != nil || n != 2 {
		t.Fatalf("RequestReplay: %d, %v; want 2", n, err)
	}
	res, err := c.Replay(ctx)
	if err != nil || res.Replayed != 2 || res.Parked != 0 {
		t.Fatalf("replay: %+v, %v; want both replayed", res, err)
	}
	wantRows(t, s, map[string]Row{"a": {chain(3), 3}, "b": {chain(2), 2}})
	wantNoMarkers(t, s, "inrow")
}
