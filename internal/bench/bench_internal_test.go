package bench

import (
	"testing"
	"time"
)

func TestWindowShare(t *testing.T) {
	d := time.Unix(100, 0) // the deadline
	at := func(ms int) time.Time { return d.Add(time.Duration(ms) * time.Millisecond) }
	for _, c := range []struct {
		name     string
		t0, t1   time.Time
		deadline time.Time
		want     float64
	}{
		{"ended before", at(-300), at(-100), d, 1000},
		{"ended on it", at(-300), d, d, 1000},
		{"a quarter inside", at(-100), at(300), d, 250},
		{"began on it", d, at(200), d, 0},
		{"began after", at(50), at(200), d, 0},
		{"no window", at(-300), at(-100), time.Time{}, 0},
	} {
		if got := windowShare(1000, c.t0, c.t1, c.deadline); got != c.want {
			t.Errorf("%s: windowShare = %v, want %v", c.name, got, c.want)
		}
	}
}

func TestRateUsesTheWindow(t *testing.T) {
	// The tail after the window (1.5s for 1,000 events) must not count.
	r := Result{Events: 1000, Elapsed: 2 * time.Second, Window: 500 * time.Millisecond, WindowEvents: 400}
	if got := r.Rate(); got != 800 {
		t.Errorf("windowed Rate = %v, want 800", got)
	}
	r = Result{Events: 1000, Elapsed: 2 * time.Second}
	if got := r.Rate(); got != 500 {
		t.Errorf("Rate without a window = %v, want 500", got)
	}
}
