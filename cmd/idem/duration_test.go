package main

import (
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestParseDuration(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{
		"90s": 90 * time.Second, "36h": 36 * time.Hour, "1h30m": 90 * time.Minute,
		"30d": 30 * 24 * time.Hour, "1.5d": 36 * time.Hour, "0d": 0, "106751d": 106751 * 24 * time.Hour,
	} {
		if got, err := parseDuration(in); err != nil || got != want {
			t.Errorf("parseDuration(%q) = %s, %v; want %s", in, got, err, want)
		}
	}
	for _, in := range []string{"", "d", "abc", "30", "1d12h", "9999999h", "106752d", "NaNd", "Infd", "1e300d"} {
		if got, err := parseDuration(in); err == nil || !strings.Contains(err.Error(), "such as 90s, 36h or 30d") {
			t.Errorf("parseDuration(%q) = %s, %v; want the error that shows good values", in, got, err)
		}
	}
}

// TestDurationFlagErrors: a bad duration names what a good one looks like,
// where the flag package says only "parse error".
func TestDurationFlagErrors(t *testing.T) {
	t.Parallel()
	code, _, errOut := runCLI(t, "cleanup", "--dsn", "unused.db", "--retention", "9999999h")
	if code != exitUsage || !strings.Contains(errOut, `invalid value "9999999h" for flag -retention: want a number and a unit`) ||
		!strings.Contains(errOut, "at most 106751d") {
		t.Fatalf("exit %d, stderr:\n%s", code, errOut)
	}
}

// FuzzParseDuration: any text is refused or read as what it says: a Go
// duration as time.ParseDuration reads it, a number of days within
// maxDays, with its sign (never wrapped around), whole days exactly.
func FuzzParseDuration(f *testing.F) {
	for _, s := range []string{"90s", "36h", "30d", "1.5d", "-2d", "106751d", "106752d", "1e300d", "NaNd", "-Infd", "0x10d", "d", "", "1h30m", "-0d"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, err := parseDuration(s)
		if err != nil {
			if d != 0 {
				t.Fatalf("%q: %v and %v; want 0 with an error", s, d, err)
			}
			return
		}
		n, days := strings.CutSuffix(s, "d")
		if !days {
			if want, werr := time.ParseDuration(s); werr != nil || d != want {
				t.Fatalf("%q read as %v; time.ParseDuration: %v, %v", s, d, want, werr)
			}
			return
		}
		v, perr := strconv.ParseFloat(n, 64)
		if perr != nil || math.Abs(v) > float64(maxDays) {
			t.Fatalf("%q read as %v; the number: %v, %v", s, d, v, perr)
		}
		if (v < 0 && d > 0) || (v > 0 && d < 0) {
			t.Fatalf("%q read as %v: the sign turned", s, d)
		}
		if v == math.Trunc(v) && d != time.Duration(v)*24*time.Hour {
			t.Fatalf("%q read as %v, want %v", s, d, time.Duration(v)*24*time.Hour)
		}
	})
}
