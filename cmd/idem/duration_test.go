package main

import (
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
