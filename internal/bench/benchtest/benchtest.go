// Package benchtest runs package bench's workloads as Go benchmarks, so the
// store drivers' benchmark files share one set of cases.
//
// For each case it runs three sub-benchmarks: plain and idem apply b.N
// events and report events/s (ns/op is the time per event), and ratio runs
// bench.Compare, alternating both variants in rounds, and reports the
// median rates and the median of the rounds' idem/plain ratios as the
// ratio metric.
package benchtest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/bench"
)

// workers is the number of concurrent workers of every case.
const workers = 4

// Options tunes Run. The zero value gives the defaults.
type Options struct {
	// Accounts is as in bench.Workload. Default: bench's default.
	Accounts int
	// Rounds is the number of plain/idem pairs of the ratio
	// sub-benchmark. Default 5.
	Rounds int
	// RoundDuration is the length of each variant's run in a ratio round.
	// Default 500ms.
	RoundDuration time.Duration
}

// Run runs every case against t as sub-benchmarks of b. A target with a
// Close(context.Context) error method (the database targets') is closed
// when b ends.
func Run(b *testing.B, t bench.Target, opts *Options) {
	if c, ok := t.(interface{ Close(context.Context) error }); ok {
		b.Cleanup(func() {
			if err := c.Close(context.Background()); err != nil {
				b.Error(err)
			}
		})
	}
	if opts == nil {
		opts = &Options{}
	}
	rounds := opts.Rounds
	if rounds <= 0 {
		rounds = 5
	}
	roundDur := opts.RoundDuration
	if roundDur <= 0 {
		roundDur = 500 * time.Millisecond
	}
	ctx := context.Background()
	for _, c := range bench.Cases() {
		if !c.RunsOn(t.Name()) {
			continue
		}
		w := bench.Workload{Workers: workers, BatchSize: c.BatchSize, Accounts: opts.Accounts}
		t, err := c.Target(t)
		if errors.Is(err, bench.ErrUnsupported) {
			b.Logf("%s: %v", c.Name, err)
			continue
		}
		if err != nil {
			b.Fatal(err)
		}
		b.Run(c.Name, func(b *testing.B) {
			for _, v := range []bench.Variant{bench.Plain, bench.Idem} {
				b.Run(v.String(), func(b *testing.B) {
					w := w
					w.Events = b.N
					res, err := bench.Run(ctx, t, v, w)
					if err != nil {
						b.Fatal(err)
					}
					b.ReportMetric(float64(res.Elapsed.Nanoseconds())/float64(b.N), "ns/op")
					b.ReportMetric(res.Rate(), "events/s")
				})
			}
			b.Run("ratio", func(b *testing.B) {
				w := w
				w.Duration = roundDur
				var cmp bench.Comparison
				for b.Loop() {
					var err error
					cmp, err = bench.Compare(ctx, t, bench.CompareOptions{Workload: w, Rounds: rounds, Warmup: roundDur / 2})
					if err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(0, "ns/op")
				b.ReportMetric(cmp.Plain, "plain-events/s")
				b.ReportMetric(cmp.Idem, "idem-events/s")
				b.ReportMetric(cmp.Ratio, "ratio")
				b.Log(summary(cmp))
			})
		})
	}
}

// summary lists every round's rates, to judge the noise behind a ratio.
func summary(c bench.Comparison) string {
	s := fmt.Sprintf("plain %.0f, idem %.0f events/s, ratio %.3f; rounds (plain/idem):", c.Plain, c.Idem, c.Ratio)
	for i := range c.PlainRounds {
		s += fmt.Sprintf(" %.0f/%.0f", c.PlainRounds[i].Rate(), c.IdemRounds[i].Rate())
	}
	return s
}
