package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"
)

// runChaosMeasure measures, for each consumer count of --scale, how many
// events a second that many consumer processes apply in all three
// handlers, on a stream the relays filled beforehand. Nothing is killed.
func runChaosMeasure(ctx context.Context, e *env, cfg *chaosConfig) error {
	counts, err := cfg.scaleCounts()
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	fmt.Fprintf(e.stdout, "idem chaos --measure: %d events a run, %d runs per consumer count, broker %s\n", cfg.events, cfg.runs, cfg.broker)
	fmt.Fprintf(e.stdout, "  each event: an atomic balance, an ordered (GapWait) write and a lease-mode HTTP call; the relays fill the stream first\n")
	type row struct {
		n           int
		rates       []float64
		loadBefore  string
		loadAfter   string
		description string
	}
	var rows []row
	for _, n := range counts {
		r := row{n: n, loadBefore: loadAverage()}
		for run := range cfg.runs {
			rate, desc, err := measureChaosRun(ctx, cfg, n, logger)
			if err != nil {
				return fmt.Errorf("chaos: measure %d consumers, run %d: %w", n, run+1, err)
			}
			r.rates, r.description = append(r.rates, rate), desc
			fmt.Fprintf(e.stdout, "  %d consumer processes, run %d: %.0f events/s\n", n, run+1, rate)
		}
		r.loadAfter = loadAverage()
		rows = append(rows, r)
	}
	fmt.Fprintf(e.stdout, "\n  on %s\n", rows[0].description)
	fmt.Fprintf(e.stdout, "  %-10s %12s %22s  %s\n", "consumers", "events/s", "spread (min–max)", "load average before → after")
	base := 0.0
	for i, r := range rows {
		med := median(r.rates)
		if i == 0 {
			base = med
		}
		fmt.Fprintf(e.stdout, "  %-10d %12.0f %13.0f–%-8.0f  %s → %s   (%.2f× the first)\n", r.n, med, slices.Min(r.rates), slices.Max(r.rates), r.loadBefore, r.loadAfter, med/base)
	}
	return nil
}

// measureChaosRun runs one measurement: a fresh store and broker, the
// events written and relayed, then n consumers timed until every handler
// has applied every event.
func measureChaosRun(ctx context.Context, cfg *chaosConfig, n int, logger *slog.Logger) (float64, string, error) {
	h, err := newChaosHarness(ctx, cfg, logger)
	if err != nil {
		return 0, "", err
	}
	defer h.close(ctx, true)
	h.started = time.Now()
	if err := h.produce(ctx, time.Time{}, cfg.events); err != nil {
		return 0, "", err
	}
	if err := h.startRelays(); err != nil {
		return 0, "", err
	}
	if err := h.waitOutboxEmpty(ctx); err != nil {
		return 0, "", err
	}
	for _, p := range h.relays {
		p.stop()
	}
	start := time.Now()
	if err := h.startConsumers(n); err != nil {
		return 0, "", err
	}
	if err := h.waitDrained(ctx, cfg.drainTimeout); err != nil {
		return 0, "", err
	}
	elapsed := time.Since(start)
	return float64(cfg.events) / elapsed.Seconds(), h.broker.describe(), nil
}

// waitOutboxEmpty waits until the relays have published every row.
func (h *chaosHarness) waitOutboxEmpty(ctx context.Context) error {
	deadline := time.Now().Add(h.cfg.drainTimeout)
	for {
		st, err := h.drv.OutboxStats(ctx)
		if err != nil {
			return err
		}
		if st.Pending == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("chaos: %d outbox rows still pending after %s", st.Pending, h.cfg.drainTimeout)
		}
		sleepCtx(ctx, 100*time.Millisecond)
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// loadAverage is the 1-minute load average, or "?" where /proc has none.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}

// median returns the median of xs (the mean of the middle two for an even
// count).
func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
