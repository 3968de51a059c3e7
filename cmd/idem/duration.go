package main

import (
	"flag"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// maxDays is the longest duration a flag takes, in days (time.Duration's
// bound, about 292 years).
const maxDays = math.MaxInt64 / int64(24*time.Hour)

// durationFlag is a flag.Value for durations that also takes days ("30d",
// the unit retention is thought in) and says what a bad value should look
// like: the flag package's own Duration answers only "parse error", also
// for a value past the bound.
type durationFlag struct{ d *time.Duration }

// durationVar defines a duration flag with the given default, as
// flag.FlagSet.DurationVar does.
func durationVar(fs *flag.FlagSet, p *time.Duration, name string, value time.Duration, usage string) {
	*p = value
	fs.Var(durationFlag{p}, name, usage)
}

func (f durationFlag) String() string {
	if f.d == nil {
		return "0s"
	}
	return f.d.String()
}

func (f durationFlag) Set(s string) error {
	d, err := parseDuration(s)
	if err != nil {
		return err
	}
	*f.d = d
	return nil
}

// parseDuration parses a Go duration ("90s", "36h", "1h30m") or a number
// of days ("30d", "1.5d").
func parseDuration(s string) (time.Duration, error) {
	if n, ok := strings.CutSuffix(s, "d"); ok {
		days, err := strconv.ParseFloat(n, 64)
		if err == nil && math.Abs(days) <= float64(maxDays) { // false for NaN
			return time.Duration(days * float64(24*time.Hour)), nil
		}
	} else if d, err := time.ParseDuration(s); err == nil {
		return d, nil
	}
	return 0, fmt.Errorf("want a number and a unit (ms, s, m, h or d), such as 90s, 36h or 30d, of at most %dd", maxDays)
}
