// Package idemtest is idem's conformance suite: the tests every store driver
// must pass, public so that you can run them against your own database and
// driver configuration.
//
// A driver's test provides a Harness whose Open returns a Store on a fresh,
// migrated schema, together with a tiny account-balance effect (Credit and
// Balances) written in the driver's dialect. The suite checks every outcome
// against balances computed from the unique intended events, never by
// folding the delivered stream, so a double-apply cannot hide.
//
//	func TestConformance(t *testing.T) {
//		idemtest.Run(t, &idemtest.Harness[*sql.Tx]{Open: openStore})
//	}
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/atomic-mode.md#checking-your-own-setup
package idemtest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// Store is a driver under test plus the effect the suite's handlers write.
type Store[TTx any] struct {
	// Driver is migrated and empty. Required.
	Driver driver.Driver[TTx]
	// Credit adds amount to account's balance inside tx, creating the
	// account at zero if needed. Required.
	Credit func(ctx context.Context, tx TTx, account string, amount int64) error
	// CreditMany applies several credits with one set-based write. The
	// accounts are unique and sorted. Optional: Credit is used per
	// account when nil.
	CreditMany func(ctx context.Context, tx TTx, accounts []string, amounts []int64) error
	// Balances reads every account's committed balance. Required.
	Balances func(ctx context.Context) (map[string]int64, error)

	// Put sets an aggregate's state to value inside tx. Required by
	// RunOrdering.
	Put func(ctx context.Context, tx TTx, aggregate, value string) error
	// Append appends "," and value to an aggregate's state inside tx (an
	// order-sensitive effect). Required by RunOrdering.
	Append func(ctx context.Context, tx TTx, aggregate, value string) error
	// States reads every aggregate's committed state. Required by
	// RunOrdering.
	States func(ctx context.Context) (map[string]string, error)
	// Markers counts the marker rows stored for a handler. Required by
	// RunOrdering (version-only mode must write none) and RunInRow.
	Markers func(ctx context.Context, handler string) (int, error)

	// RowAppend is an in-row handler's guarded write (see
	// idem.Handler.ApplyInRow): it appends value to the aggregate's row,
	// which also holds the aggregate's last applied sequence, moves that
	// to g.To(), and does both only if g admits the row's last sequence
	// (a missing row counts as 0). It reports what it found. Required by
	// RunInRow.
	RowAppend func(ctx context.Context, tx TTx, g *idem.RowGuard, value string) (idem.RowWrite, error)
	// RowAppendMany is RowAppend for several aggregates (unique, in byte
	// order) with one set-based write, values parallel to gs. Optional.
	RowAppendMany func(ctx context.Context, tx TTx, gs []*idem.RowGuard, values []string) ([]idem.RowWrite, error)
	// Rows reads every in-row aggregate's committed row. Required by
	// RunInRow.
	Rows func(ctx context.Context) (map[string]Row, error)

	// ApplyBeforeCheck says that the driver's Process runs the handler
	// before it knows whether the message is new, and its commit applies
	// the handler's writes only if the marker was not there (redisstore
	// with Config.WriteOnly). A redelivery then reaches the handler too,
	// and of two concurrent deliveries the first to commit applies while
	// the other, whether it is still in its handler or not, ends as a
	// Duplicate. The suite then checks outcomes and balances, not how
	// often single-message handlers ran.
	ApplyBeforeCheck bool
}

// Harness tells the suite how to get a Store.
type Harness[TTx any] struct {
	// Open returns a Store on a fresh, migrated, empty schema. It is called
	// once per test; register clean-up with t.Cleanup. Required.
	Open func(t testing.TB) *Store[TTx]
	// Goroutines and IDs size the concurrent-duplicates tests. Defaults
	// 32 and 1,000.
	Goroutines, IDs int
	// Aggregates sizes RunOrdering's shuffled streams: that many
	// aggregates of 100 events each. Default 100.
	Aggregates int
}

// Run runs the whole conformance suite.
func Run[TTx any](t *testing.T, h *Harness[TTx]) {
	g, n := h.Goroutines, h.IDs
	if g == 0 {
		g = 32
	}
	if n == 0 {
		n = 1000
	}
	tests := []struct {
		name string
		fn   func(t *testing.T, s *Store[TTx])
	}{
		{"RedeliveryIsDuplicate", testRedelivery[TTx]},
		{"HandlerErrorRollsBack", testHandlerError[TTx]},
		{"HandlerPanicRollsBack", testHandlerPanic[TTx]},
		{"ConflictNeverApplied", testConflict[TTx]},
		{"ConflictWarnPolicy", testConflictWarn[TTx]},
		{"HandlersDedupeIndependently", testHandlersIndependent[TTx]},
		{"InvalidInputRejected", testInvalidInput[TTx]},
		{"ProcessTxCommitAndRollback", testProcessTx[TTx]},
		{"BatchDedupesWithinAndAcross", testBatchDedupe[TTx]},
		{"BatchConflict", testBatchConflict[TTx]},
		{"LargeBatchOverOldMarkers", testLargeBatch[TTx]},
		{"BatchHandlerErrorRollsBack", testBatchRollback[TTx]},
		{"ProcessBatchTx", testProcessBatchTx[TTx]},
		{"DuplicateWaitsForOpenTx/commit", func(t *testing.T, s *Store[TTx]) { testDuplicateWaitsForOpenTx(t, s, true) }},
		{"DuplicateWaitsForOpenTx/rollback", func(t *testing.T, s *Store[TTx]) { testDuplicateWaitsForOpenTx(t, s, false) }},
		{"ConcurrentDuplicates", func(t *testing.T, s *Store[TTx]) {
			if err := CheckConcurrentDuplicates(context.Background(), s, g, n, 0); err != nil {
				t.Fatal(err)
			}
		}},
		{"ConcurrentDuplicateBatches", func(t *testing.T, s *Store[TTx]) {
			if err := CheckConcurrentDuplicates(context.Background(), s, g, n, 100); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, h.Open(t))
		})
	}
}

// Event is one intended credit, encoded in a message payload as
// "account:amount".
type Event struct {
	// ID is the message ID.
	ID string
	// Account is credited with Amount; it is also the aggregate ID.
	Account string
	Amount  int64
}

// Message returns the event as an idem message.
func (e Event) Message() *idem.Message {
	return &idem.Message{ID: e.ID, Type: "Credited", AggregateID: e.Account, Payload: []byte(e.Account + ":" + strconv.FormatInt(e.Amount, 10))}
}

// Events returns n distinct intended events over 50 accounts.
func Events(n int) []Event {
	ev := make([]Event, n)
	for i := range ev {
		ev[i] = Event{ID: fmt.Sprintf("evt-%06d", i), Account: fmt.Sprintf("acct-%02d", i%50), Amount: int64(i%97 + 1)}
	}
	return ev
}

// Expected folds the unique intended events into balances.
func Expected(events []Event) map[string]int64 {
	m := map[string]int64{}
	for _, e := range events {
		m[e.Account] += e.Amount
	}
	return m
}

// DecodeCredit parses a payload written by Event.Message.
func DecodeCredit(p []byte) (account string, amount int64, err error) {
	acct, amt, ok := strings.Cut(string(p), ":")
	if !ok {
		return "", 0, fmt.Errorf("payload %q: want account:amount", p)
	}
	n, err := strconv.ParseInt(amt, 10, 64)
	if err != nil {
		return "", 0, fmt.Errorf("payload %q: %w", p, err)
	}
	return acct, n, nil
}

// CreditHandler returns a handler named name that credits the account in
// each payload, counting calls per message ID in calls (which may be nil).
func CreditHandler[TTx any](s *Store[TTx], name string, calls *sync.Map) *idem.Handler[TTx] {
	count := func(id string) {
		if calls == nil {
			return
		}
		v, _ := calls.LoadOrStore(id, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	return &idem.Handler[TTx]{
		Name: name,
		Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
			count(m.ID)
			acct, amt, err := DecodeCredit(m.Payload)
			if err != nil {
				return idem.Permanent(err)
			}
			return s.Credit(ctx, tx, acct, amt)
		},
		ApplyBatch: func(ctx context.Context, tx TTx, msgs []*idem.Message) error {
			sums := map[string]int64{}
			for _, m := range msgs {
				count(m.ID)
				acct, amt, err := DecodeCredit(m.Payload)
				if err != nil {
					return idem.Permanent(err)
				}
				sums[acct] += amt
			}
			// Sorted accounts: concurrent batches lock rows in one order.
			accts := make([]string, 0, len(sums))
			for a := range sums {
				accts = append(accts, a)
			}
			slices.Sort(accts)
			if s.CreditMany != nil {
				amts := make([]int64, len(accts))
				for i, a := range accts {
					amts[i] = sums[a]
				}
				return s.CreditMany(ctx, tx, accts, amts)
			}
			for _, a := range accts {
				if err := s.Credit(ctx, tx, a, sums[a]); err != nil {
					return err
				}
			}
			return nil
		},
	}
}

// CheckConcurrentDuplicates has goroutines deliver the same ids intended
// events at once, each in its own shuffled order, one message per
// transaction (batch 0) or in batches of the given size. It returns an error
// unless every event was applied exactly once, every other delivery reported
// Duplicate, no delivery reported an error, and the balances equal those of
// the unique intended events.
//
// It is exported so a driver can show that it fails without the unique
// constraint the guarantee rests on.
func CheckConcurrentDuplicates[TTx any](ctx context.Context, s *Store[TTx], goroutines, ids, batch int) error {
	proc, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		return err
	}
	events := Events(ids)
	var calls sync.Map
	h := CreditHandler(s, "concurrent", &calls)
	// Single-message mode exercises Apply; batch mode ApplyBatch.
	single := &idem.Handler[TTx]{Name: h.Name, Apply: h.Apply}

	var applied, duplicates, failed atomic.Int64
	var firstErr sync.Once
	var errSample error
	start := make(chan struct{})
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 7))
			order := r.Perm(len(events))
			msgs := make([]*idem.Message, len(order))
			for i, k := range order {
				msgs[i] = events[k].Message()
			}
			record := func(out idem.Outcome, err error) {
				switch {
				case err != nil:
					failed.Add(1)
					firstErr.Do(func() { errSample = err })
				case out == idem.Applied:
					applied.Add(1)
				case out == idem.Duplicate:
					duplicates.Add(1)
				default:
					failed.Add(1)
					firstErr.Do(func() { errSample = fmt.Errorf("unexpected outcome %v", out) })
				}
			}
			<-start
			if batch <= 0 {
				for _, m := range msgs {
					record(proc.Process(ctx, single, m))
				}
				return
			}
			for lo := 0; lo < len(msgs); lo += batch {
				chunk := msgs[lo:min(lo+batch, len(msgs))]
				outs, err := proc.ProcessBatch(ctx, h, chunk)
				if err != nil {
					for range chunk {
						record(idem.OutcomeNone, err)
					}
					continue
				}
				for _, o := range outs {
					record(o, nil)
				}
			}
		}()
	}
	close(start)
	wg.Wait()

	var problems []string
	if n := failed.Load(); n > 0 {
		problems = append(problems, fmt.Sprintf("%d deliveries failed, first: %v", n, errSample))
	}
	if got := applied.Load(); got != int64(ids) {
		problems = append(problems, fmt.Sprintf("applied %d, want %d", got, ids))
	}
	if got, want := duplicates.Load(), int64((goroutines-1)*ids); got != want {
		problems = append(problems, fmt.Sprintf("duplicates %d, want %d", got, want))
	}
	var over int
	calls.Range(func(_, v any) bool {
		if v.(*atomic.Int64).Load() != 1 {
			over++
		}
		return true
	})
	if over > 0 && !(batch == 0 && s.ApplyBeforeCheck) {
		problems = append(problems, fmt.Sprintf("%d message IDs reached the handler more than once", over))
	}
	if err := checkBalances(ctx, s, Expected(events)); err != nil {
		problems = append(problems, err.Error())
	}
	if len(problems) > 0 {
		return fmt.Errorf("concurrent duplicates (%d goroutines × %d IDs, batch %d): %s", goroutines, ids, batch, strings.Join(problems, "; "))
	}
	return nil
}

func checkBalances[TTx any](ctx context.Context, s *Store[TTx], want map[string]int64) error {
	got, err := s.Balances(ctx)
	if err != nil {
		return fmt.Errorf("read balances: %w", err)
	}
	var diffs []string
	for a, w := range want {
		if got[a] != w {
			diffs = append(diffs, fmt.Sprintf("%s=%d want %d", a, got[a], w))
		}
	}
	for a, g := range got {
		if _, ok := want[a]; !ok && g != 0 {
			diffs = append(diffs, fmt.Sprintf("%s=%d want 0", a, g))
		}
	}
	if len(diffs) > 0 {
		slices.Sort(diffs)
		if len(diffs) > 5 {
			diffs = append(diffs[:5], fmt.Sprintf("… %d more", len(diffs)-5))
		}
		return fmt.Errorf("balances differ from the unique intended events: %s", strings.Join(diffs, ", "))
	}
	return nil
}
