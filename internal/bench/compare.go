package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// CompareOptions configures Compare.
type CompareOptions struct {
	// Workload is run once per variant per round. Set Duration rather
	// than Events so that every round takes the same time whatever the
	// store's speed.
	Workload Workload
	// Rounds is the number of plain/idem pairs. Default 5.
	Rounds int
	// Warmup, when positive, runs each variant for this long before the
	// measured rounds (connections, prepared statements, caches).
	Warmup time.Duration
}

// Comparison is the result of Compare.
type Comparison struct {
	// Plain and Idem are the median throughputs, in events per second.
	Plain, Idem float64
	// Ratio is Idem / Plain: 1 means idem costs nothing.
	Ratio float64
	// PlainRounds and IdemRounds are the results of every round, in the
	// order they ran.
	PlainRounds, IdemRounds []Result
}

// Compare runs the plain and the idempotent variant alternately, several
// rounds each, and returns their median throughputs and ratio. Alternating
// in one process exposes both variants to the same machine noise (other
// processes, checkpoints, a growing table); the order within a pair flips
// every round so that a steady drift favours neither.
func Compare(ctx context.Context, t Target, opts CompareOptions) (Comparison, error) {
	rounds := opts.Rounds
	if rounds <= 0 {
		rounds = 5
	}
	if _, err := opts.Workload.withDefaults(); err != nil {
		return Comparison{}, err
	}
	if opts.Warmup > 0 {
		warm := opts.Workload
		warm.Events, warm.Duration = 0, opts.Warmup
		for _, v := range []Variant{Plain, Idem} {
			if _, err := Run(ctx, t, v, warm); err != nil {
				return Comparison{}, fmt.Errorf("bench: warm-up: %w", err)
			}
		}
	}
	var c Comparison
	for r := range rounds {
		order := []Variant{Plain, Idem}
		if r%2 == 1 {
			order = []Variant{Idem, Plain}
		}
		for _, v := range order {
			res, err := Run(ctx, t, v, opts.Workload)
			if err != nil {
				return Comparison{}, fmt.Errorf("bench: round %d: %w", r+1, err)
			}
			if v == Plain {
				c.PlainRounds = append(c.PlainRounds, res)
			} else {
				c.IdemRounds = append(c.IdemRounds, res)
			}
		}
	}
	c.Plain = medianRate(c.PlainRounds)
	c.Idem = medianRate(c.IdemRounds)
	if c.Plain == 0 {
		return c, errors.New("bench: the plain variant applied no events")
	}
	c.Ratio = c.Idem / c.Plain
	return c, nil
}

// medianRate returns the median of the results' rates.
func medianRate(rs []Result) float64 {
	if len(rs) == 0 {
		return 0
	}
	rates := make([]float64, len(rs))
	for i, r := range rs {
		rates[i] = r.Rate()
	}
	slices.Sort(rates)
	n := len(rates)
	if n%2 == 1 {
		return rates[n/2]
	}
	return (rates[n/2-1] + rates[n/2]) / 2
}
