package lograte

import (
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestLimiterSummarizesRepeats(t *testing.T) {
	t.Parallel()
	l := New(10 * time.Second)
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	if ok, n := l.Allow("a"); !ok || n != 0 {
		t.Fatalf("first line: ok %v, suppressed %d", ok, n)
	}
	for range 5 {
		if ok, _ := l.Allow("a"); ok {
			t.Fatal("a repeat within the interval was written")
		}
	}
	if ok, _ := l.Allow("b"); !ok {
		t.Fatal("another kind's first line was held back")
	}
	now = now.Add(10 * time.Second)
	if ok, n := l.Allow("a"); !ok || n != 5 {
		t.Fatalf("after the interval: ok %v, suppressed %d, want true 5", ok, n)
	}
	if ok, _ := l.Allow("a"); ok {
		t.Fatal("the count did not start again")
	}
}

func TestLimiterBoundsItsMemory(t *testing.T) {
	t.Parallel()
	l := New(time.Hour)
	for i := range 3 * maxKinds {
		if ok, _ := l.Allow(strconv.Itoa(i)); !ok {
			t.Fatalf("kind %d's first line was held back", i)
		}
	}
	if len(l.kinds) > maxKinds {
		t.Fatalf("%d kinds remembered, want at most %d", len(l.kinds), maxKinds)
	}
}

func TestZeroIntervalWritesEverything(t *testing.T) {
	t.Parallel()
	var l *Limiter
	if ok, _ := l.Allow("x"); !ok {
		t.Fatal("nil limiter held a line back")
	}
	l = New(0)
	for range 3 {
		if ok, _ := l.Allow("x"); !ok {
			t.Fatal("zero interval held a line back")
		}
	}
}

func TestWarnCarriesTheCount(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	logger := slog.New(slog.NewTextHandler(&out, nil))
	l := New(10 * time.Second)
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	for range 3 {
		l.Warn(logger, "kind", "failed")
	}
	now = now.Add(10 * time.Second)
	l.Warn(logger, "kind", "failed")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 || strings.Contains(lines[0], "similar_not_logged") || !strings.Contains(lines[1], "similar_not_logged=2") || !strings.Contains(lines[1], "level=WARN") {
		t.Fatalf("lines:\n%s", out.String())
	}
}
