package idem

import (
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// TestBackoffFullJitter samples the backoff of every attempt: always within
// [0, min(max, base·2^(attempt−1))], spread over that whole range, and safe
// from overflow with huge settings.
func TestBackoffFullJitter(t *testing.T) {
	t.Parallel()
	p := &LeaseProcessor{cfg: LeaseConfig{BackoffBase: time.Second, BackoffMax: 5 * time.Minute}}
	for attempt := 1; attempt <= 40; attempt++ {
		ceiling := 5 * time.Minute
		if attempt <= 9 { // 2^8 s = 256 s < 300 s < 2^9 s
			ceiling = time.Second << (attempt - 1)
		}
		var lo, hi time.Duration = math.MaxInt64, 0
		var sum float64
		const n = 2000
		for range n {
			d := p.backoff(attempt)
			if d < 0 || d > ceiling {
				t.Fatalf("attempt %d: delay %s outside [0, %s]", attempt, d, ceiling)
			}
			lo, hi = min(lo, d), max(hi, d)
			sum += float64(d)
		}
		// Full jitter: uniform over the range, so both ends are reached
		// and the mean is about half the ceiling.
		if lo > ceiling/20 || hi < ceiling*19/20 {
			t.Fatalf("attempt %d: delays span [%s, %s], want most of [0, %s]", attempt, lo, hi, ceiling)
		}
		if mean := time.Duration(sum / n); mean < ceiling*4/10 || mean > ceiling*6/10 {
			t.Fatalf("attempt %d: mean delay %s, want about %s", attempt, mean, ceiling/2)
		}
	}

	huge := &LeaseProcessor{cfg: LeaseConfig{BackoffBase: time.Hour, BackoffMax: math.MaxInt64}}
	for _, attempt := range []int{1, 30, 62, 63, 64, 1000, math.MaxInt32} {
		if d := huge.backoff(attempt); d < 0 {
			t.Fatalf("attempt %d: negative delay %s", attempt, d)
		}
	}
}

func TestLastErrorText(t *testing.T) {
	t.Parallel()
	got := lastErrorText(errorString("bad \x00 byte \xff and more"))
	if got != "bad \uFFFD byte \uFFFD and more" {
		t.Fatalf("sanitised %q", got)
	}
	long := lastErrorText(errorString(strings.Repeat("é", 3000)))
	if len(long) > maxLastErrorLen+len("…") || !strings.HasSuffix(long, "…") || !utf8.ValidString(long) {
		t.Fatalf("long error kept %d bytes (valid UTF-8: %v)", len(long), utf8.ValidString(long))
	}
}

type errorString string

func (e errorString) Error() string { return string(e) }

// TestBackoffDelayExtremeSettings: Backoff.Delay stays within [0, Max] and
// never panics, whatever the settings: a Max at the largest duration, a
// multiplier that is not a number or infinite, a huge retry count.
func TestBackoffDelayExtremeSettings(t *testing.T) {
	t.Parallel()
	for _, b := range []Backoff{
		{Base: time.Second, Max: math.MaxInt64},
		{Base: math.MaxInt64, Max: math.MaxInt64},
		{Base: time.Second, Max: time.Minute, Multiplier: math.NaN()},
		{Base: time.Second, Max: math.MaxInt64, Multiplier: math.Inf(1)},
		{Base: time.Second, Max: time.Minute, Multiplier: math.Inf(-1)},
		{Base: time.Second, Max: time.Minute, Multiplier: 1},
	} {
		for _, n := range []int{0, 1, 62, 63, 64, 1000, math.MaxInt} {
			func() {
				defer func() {
					if r := recover(); r != nil {
						t.Fatalf("%+v Delay(%d) panicked: %v", b, n, r)
					}
				}()
				if d := b.Delay(n); d < 0 || d > b.Max {
					t.Fatalf("%+v Delay(%d) = %s, outside [0, %s]", b, n, d, b.Max)
				}
			}()
		}
	}
	// An infinite multiplier jumps to Max at the first retry.
	b := Backoff{Base: time.Second, Max: time.Minute, Multiplier: math.Inf(1)}
	var hi time.Duration
	for range 2000 {
		hi = max(hi, b.Delay(1))
	}
	if hi < 50*time.Second {
		t.Fatalf("Multiplier +Inf: Delay(1) reached at most %s, want up to %s", hi, b.Max)
	}
}
