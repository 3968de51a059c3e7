package idem

import (
	"math"
	"testing"
	"time"
)

// A slow marker batch halves the next one, down to minPruneBatch; a fast
// one doubles it, up to BatchSize; one in between keeps it.
func TestPruneBatchFollowsBatchTime(t *testing.T) {
	p := &Pruner{cfg: RetentionConfig{BatchSize: 5000, BatchTime: 40 * time.Millisecond}}
	steps := []struct {
		took time.Duration
		want int
	}{
		{112 * time.Millisecond, 2500},
		{50 * time.Millisecond, 1250},
		{30 * time.Millisecond, 1250},
		{41 * time.Millisecond, 625},
		{45 * time.Millisecond, 312},
		{45 * time.Millisecond, 156},
		{45 * time.Millisecond, 100},
		{45 * time.Millisecond, 100},
		{5 * time.Millisecond, 200},
		{5 * time.Millisecond, 400},
		{5 * time.Millisecond, 800},
		{5 * time.Millisecond, 1600},
		{5 * time.Millisecond, 3200},
		{5 * time.Millisecond, 5000},
		{5 * time.Millisecond, 5000},
	}
	limit := p.cfg.BatchSize
	for i, s := range steps {
		if limit = p.nextBatch(limit, s.took); limit != s.want {
			t.Fatalf("step %d (%v): next batch %d, want %d", i, s.took, limit, s.want)
		}
	}
	small := &Pruner{cfg: RetentionConfig{BatchSize: 10, BatchTime: time.Millisecond}}
	if got := small.nextBatch(10, time.Second); got != 10 {
		t.Fatalf("BatchSize below the floor: next batch %d, want 10", got)
	}
}

// A fast batch of a batch size past half of MaxInt doubles to BatchSize,
// not to a negative limit that the drivers refuse.
func TestPruneBatchNeverOverflows(t *testing.T) {
	p := &Pruner{cfg: RetentionConfig{BatchSize: math.MaxInt, BatchTime: 40 * time.Millisecond}}
	for _, limit := range []int{math.MaxInt, math.MaxInt/2 + 1, math.MaxInt - 100} {
		if got := p.nextBatch(limit, time.Millisecond); got != math.MaxInt {
			t.Fatalf("next batch after a fast one of %d: %d, want BatchSize %d", limit, got, math.MaxInt)
		}
	}
}
