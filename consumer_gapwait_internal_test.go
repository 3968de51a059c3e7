package idem

import (
	"errors"
	"testing"
	"time"
)

// TestCreditOutages: a gap waiting under GapWait gets back the time the
// store was down during its wait, and only that: outages before its first
// sighting, or of a handler that does not wait, give nothing; outages
// that no running wait can overlap any more are forgotten.
func TestCreditOutages(t *testing.T) {
	wait := time.Minute
	c := &deliveries{ordering: &Ordering{Gap: GapWait, WaitFor: wait}}
	now := time.Now()
	c.rememberOutage(now.Add(-10*time.Minute), time.Minute)
	c.rememberOutage(now.Add(-50*time.Second), 20*time.Second) // down from 70 s to 50 s ago
	c.rememberOutage(now.Add(-5*time.Second), 5*time.Second)   // down from 10 s to 5 s ago
	if len(c.downs) != 2 {
		t.Fatalf("%d outages kept, want 2: the one 10 minutes ago overlaps no running wait", len(c.downs))
	}
	if d := c.downSince(now.Add(-60*time.Second), now); d != 15*time.Second {
		t.Fatalf("down %s in the last minute, want 15s (10 s of the first outage, 5 s of the second)", d)
	}

	// First seen 90 s ago: 25 s of outages in its wait, 30 s past the
	// deadline by the store's clock: final.
	gap := func(waited time.Duration) *GapError {
		first := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC) // the store's clock, whatever the host's
		return &GapError{Policy: GapWait, FirstSeen: first, Deadline: first.Add(wait), Remaining: wait - waited, Final: waited >= wait}
	}
	ge := gap(90 * time.Second)
	if err := c.creditOutages(ge); err != ge || !ge.Final || ge.Remaining != -5*time.Second {
		t.Fatalf("90 s of wait, 25 s of them down: %+v; want still final, 5 s past", ge)
	}
	// First seen 80 s ago: 25 s of its wait down, so 55 s of it up:
	// retriable for 5 s more, its deadline 25 s later.
	ge = gap(80 * time.Second)
	if err := c.creditOutages(ge); !errors.Is(err, ErrGap) || IsPermanent(err) || ge.Remaining != 5*time.Second || !ge.Deadline.Equal(ge.FirstSeen.Add(wait+25*time.Second)) {
		t.Fatalf("80 s of wait, 25 s of them down: %+v; want retriable, 5 s left", ge)
	}
	// First seen 30 s ago, after the first outage: only the second one.
	ge = gap(30 * time.Second)
	if c.creditOutages(ge); ge.Final || ge.Remaining != 35*time.Second {
		t.Fatalf("30 s of wait, 5 s of them down: %+v; want 35 s left", ge)
	}
	// GapFail's gaps, and gaps without a sighting, are left alone.
	fail := &GapError{Policy: GapFail, Final: true}
	if c.creditOutages(fail); !fail.Final {
		t.Fatal("a GapFail gap was made retriable")
	}
	unsighted := &GapError{Policy: GapWait}
	if c.creditOutages(unsighted); unsighted.Final || unsighted.Remaining != 0 || !unsighted.Deadline.IsZero() {
		t.Fatalf("a gap without a sighting was changed: %+v", unsighted)
	}
	// A handler that does not wait for gaps remembers nothing.
	other := &deliveries{ordering: &Ordering{Gap: GapFail}}
	other.rememberOutage(now, time.Minute)
	if len(other.downs) != 0 {
		t.Fatal("a GapFail handler remembered an outage")
	}
}
