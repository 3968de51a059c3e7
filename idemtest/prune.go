package idemtest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
)

// CheckPruneWhileProcessing prunes the old markers the test seeded for
// handler "balances" (old of them, all past the default retention) in
// batches of up to batch, while a processor applies new credits to
// "balances" whose IDs come from newID. It checks that pruning ends
// without error having deleted exactly old markers, that messages were
// applied meanwhile, that exactly their markers are left, that the
// balances are exact, and that no message waited longer than the slowest
// batch plus a second of scheduling slack. It returns the pruning's
// statistics and logs them with the count of messages and the longest
// wait.
func CheckPruneWhileProcessing[TTx any](t *testing.T, s *Store[TTx], old, batch int, newID func(i int) string) idem.PruneStats {
	t.Helper()
	ctx := context.Background()
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	var calls sync.Map
	h := CreditHandler(s, "balances", &calls)
	pr, err := idem.NewPruner(s.Driver, &idem.RetentionConfig{BatchSize: batch})
	if err != nil {
		t.Fatal(err)
	}
	var (
		stop      atomic.Bool
		processed []Event
		maxWait   time.Duration
		procErr   error
		wg        sync.WaitGroup
	)
	wg.Go(func() {
		for i := 0; !stop.Load(); i++ {
			e := Event{ID: newID(i), Account: fmt.Sprintf("acct-%02d", i%10), Amount: int64(i%7 + 1)}
			t0 := time.Now()
			out, err := p.Process(ctx, h, e.Message())
			maxWait = max(maxWait, time.Since(t0))
			if err != nil || out != idem.Applied {
				procErr = fmt.Errorf("%s: %v, %v", e.ID, out, err)
				return
			}
			processed = append(processed, e)
		}
	})
	st, err := pr.Prune(ctx)
	stop.Store(true)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if procErr != nil {
		t.Fatal(procErr)
	}
	t.Logf("pruned %d markers in %d batches, %s (slowest batch %s); %d messages processed meanwhile, longest wait %s",
		st.Deleted, st.Batches, st.Duration, st.LongestBatch, len(processed), maxWait)
	if st.Deleted != old {
		t.Fatalf("deleted %d markers, want %d", st.Deleted, old)
	}
	if len(processed) == 0 {
		t.Fatal("the processor applied nothing while pruning ran")
	}
	if n, err := s.Markers(ctx, "balances"); err != nil || n != len(processed) {
		t.Fatalf("%d markers left (%v), want the %d new ones", n, err, len(processed))
	}
	balances, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for acct, v := range Expected(processed) {
		if balances[acct] != v {
			t.Fatalf("%s = %d, want %d", acct, balances[acct], v)
		}
	}
	if slack := time.Second; maxWait > st.LongestBatch+slack {
		t.Fatalf("a message waited %s, longer than the slowest batch (%s) plus %s", maxWait, st.LongestBatch, slack)
	}
	return st
}
