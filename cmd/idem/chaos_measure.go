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
		n          int
		rates      map[string][]float64
		loadBefore string
		loadAfter  string
	}
	var rows []row
	desc := ""
	for _, n := range counts {
		r := row{n: n, rates: map[string][]float64{}, loadBefore: loadAverage()}
		for run := range cfg.runs {
			rates, d, err := measureChaosRun(ctx, cfg, n, logger)
			if err != nil {
				return fmt.Errorf("chaos: measure %d consumers, run %d: %w", n, run+1, err)
			}
			desc = d
			var parts []string
			for _, name := range chaosHandlers {
				r.rates[name] = append(r.rates[name], rates[name])
				parts = append(parts, fmt.Sprintf("%s %.0f", strings.TrimPrefix(name, "chaos."), rates[name]))
			}
			fmt.Fprintf(e.stdout, "  %d consumer processes, run %d: events/s %s\n", n, run+1, strings.Join(parts, ", "))
		}
		r.loadAfter = loadAverage()
		rows = append(rows, r)
	}
	fmt.Fprintf(e.stdout, "\n  on %s\n", desc)
	fmt.Fprintf(e.stdout, "  median events/s of %d runs (min–max), each handler timed from its first applied event to its last:\n", cfg.runs)
	fmt.Fprintf(e.stdout, "  %-10s", "consumers")
	for _, name := range chaosHandlers {
		fmt.Fprintf(e.stdout, " %-22s", strings.TrimPrefix(name, "chaos."))
	}
	fmt.Fprintf(e.stdout, " %s\n", "load average before → after")
	for _, r := range rows {
		fmt.Fprintf(e.stdout, "  %-10d", r.n)
		for _, name := range chaosHandlers {
			xs := r.rates[name]
			fmt.Fprintf(e.stdout, " %-22s", fmt.Sprintf("%.0f (%.0f–%.0f)", median(xs), slices.Min(xs), slices.Max(xs)))
		}
		fmt.Fprintf(e.stdout, " %s → %s\n", r.loadBefore, r.loadAfter)
	}
	return nil
}

// measureChaosRun runs one measurement: a fresh store and broker, the
// events written and relayed, then n consumers timed until every handler
// has applied every event.
func measureChaosRun(ctx context.Context, cfg *chaosConfig, n int, logger *slog.Logger) (map[string]float64, string, error) {
	h, err := newChaosHarness(ctx, cfg, logger)
	if err != nil {
		return nil, "", err
	}
	defer h.close(ctx, true)
	h.started = time.Now()
	if err := h.produce(ctx, time.Time{}, cfg.events); err != nil {
		return nil, "", err
	}
	if err := h.startRelays(); err != nil {
		return nil, "", err
	}
	if err := h.waitOutboxEmpty(ctx); err != nil {
		return nil, "", err
	}
	for _, p := range h.relays {
		p.stop()
	}
	if err := h.startConsumers(n); err != nil {
		return nil, "", err
	}
	// Each handler is timed from its first applied event to its last, so
	// that the processes' start (a connection, a durable or a group join)
	// is left out: rate = events applied in that time / the time.
	first, last := map[string]time.Time{}, map[string]time.Time{}
	base := map[string]int64{}
	deadline := time.Now().Add(cfg.drainTimeout)
	for len(last) < len(chaosHandlers) {
		p, err := h.progress(ctx)
		if err != nil {
			return nil, "", err
		}
		now := time.Now()
		for _, name := range chaosHandlers {
			if _, ok := first[name]; !ok && p.applied[name] > 0 {
				first[name], base[name] = now, p.applied[name]
			}
			if _, ok := last[name]; !ok && p.applied[name] >= int64(cfg.events) {
				last[name] = now
			}
		}
		if now.After(deadline) {
			return nil, "", fmt.Errorf("not done within %s: %v of %d", cfg.drainTimeout, p.applied, cfg.events)
		}
		sleepCtx(ctx, 20*time.Millisecond)
		if err := ctx.Err(); err != nil {
			return nil, "", err
		}
	}
	rates := map[string]float64{}
	for _, name := range chaosHandlers {
		rates[name] = float64(int64(cfg.events)-base[name]) / max(last[name].Sub(first[name]).Seconds(), 1e-3)
	}
	return rates, h.broker.describe(), nil
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
