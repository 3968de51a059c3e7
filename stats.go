package idem

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem/driver"
)

// StatsRecorder counts the outcomes that leave no row in the store —
// duplicate and stale deliveries — and adds them to the store's per-handler
// counters, where `idem stats` reads them. Install it as a processor Hook
// (Config.Hooks, LeaseConfig.Hooks) and call Flush on an interval (Run)
// and at shutdown.
//
// Counting costs an atomic add per message; the store is written once per
// handler per flush. A process that dies between flushes loses at most one
// interval of counts: the counters are for operators, never for
// correctness. It is safe for concurrent use.
type StatsRecorder struct {
	store    driver.StatsStore
	logger   *slog.Logger
	handlers sync.Map // handler name → *outcomeCounts
	flushMu  sync.Mutex
}

type outcomeCounts struct{ duplicates, stale atomic.Int64 }

// NewStatsRecorder returns a recorder writing to store (the SQLite and
// Postgres drivers implement driver.StatsStore). A nil logger means
// slog.Default().
func NewStatsRecorder(store driver.StatsStore, logger *slog.Logger) (*StatsRecorder, error) {
	if store == nil {
		return nil, fmt.Errorf("%w: NewStatsRecorder needs a store", ErrInvalidConfig)
	}
	if logger == nil {
		logger = slog.Default()
	}
	return &StatsRecorder{store: store, logger: logger}, nil
}

// OnOutcome implements HookOutcome.
func (r *StatsRecorder) OnOutcome(_ context.Context, ev *OutcomeEvent) {
	if ev.Outcome != Duplicate && ev.Outcome != Stale {
		return
	}
	v, ok := r.handlers.Load(ev.Handler)
	if !ok {
		v, _ = r.handlers.LoadOrStore(ev.Handler, &outcomeCounts{})
	}
	c := v.(*outcomeCounts)
	if ev.Outcome == Duplicate {
		c.duplicates.Add(1)
	} else {
		c.stale.Add(1)
	}
}

// Flush adds the counts gathered since the last flush to the store. Counts
// a failed write could not store are kept for the next flush.
func (r *StatsRecorder) Flush(ctx context.Context) error {
	r.flushMu.Lock()
	defer r.flushMu.Unlock()
	var names []string
	r.handlers.Range(func(k, _ any) bool {
		names = append(names, k.(string))
		return true
	})
	sort.Strings(names) // a stable lock order across instances
	for _, name := range names {
		v, _ := r.handlers.Load(name)
		c := v.(*outcomeCounts)
		d := driver.StatsDelta{Duplicates: c.duplicates.Swap(0), Stale: c.stale.Swap(0)}
		if d == (driver.StatsDelta{}) {
			continue
		}
		if err := r.store.StatsAdd(ctx, name, d); err != nil {
			c.duplicates.Add(d.Duplicates)
			c.stale.Add(d.Stale)
			return fmt.Errorf("idem: flush stats of handler %q: %w", name, err)
		}
	}
	return nil
}

// Run flushes every interval until ctx is done, then flushes once more
// (bounded by five seconds) and returns ctx's error. Failed flushes are
// logged and retried at the next interval.
func (r *StatsRecorder) Run(ctx context.Context, interval time.Duration) error {
	if interval <= 0 {
		return fmt.Errorf("%w: stats flush interval %s must be positive", ErrInvalidConfig, interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := r.Flush(fctx); err != nil {
				r.logger.Warn("idem: final stats flush failed; counts since the last flush are lost", slog.Any("error", err))
			}
			return ctx.Err()
		case <-t.C:
			if err := r.Flush(ctx); err != nil && ctx.Err() == nil {
				r.logger.Warn("idem: stats flush failed; retrying at the next interval", slog.Any("error", err))
			}
		}
	}
}
