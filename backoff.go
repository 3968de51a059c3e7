package idem

import (
	"math"
	"math/rand/v2"
	"time"
)

// Backoff is an exponential backoff with full jitter: before retry n (from
// 0) it waits a random duration in [0, min(Max, Base·Multiplier^n)].
type Backoff struct {
	// Retries is how many times RetryVersionConflicts retries after the
	// first attempt. Default 3; negative means none. (A Consumer's
	// retries are bounded by ConsumerConfig.MaxAttempts instead.)
	Retries int
	// Base is the first delay bound. Default 50ms.
	Base time.Duration
	// Max caps the delay bound. Default 1s.
	Max time.Duration
	// Multiplier grows the bound per retry. Default 2.
	Multiplier float64
}

// Delay returns the jittered wait before retry n (counting from 0).
func (b *Backoff) Delay(n int) time.Duration {
	base, maxD, mult := b.Base, b.Max, b.Multiplier
	if base <= 0 {
		base = 50 * time.Millisecond
	}
	if maxD <= 0 {
		maxD = time.Second
	}
	if !(mult >= 1) { // NaN or < 1; +Inf reaches Max at the first retry
		mult = 2
	}
	// Grow in float64, and convert back only below Max: float64(Max)
	// may round above the largest int64 and not convert back.
	limit := maxD
	if base < maxD && n >= 0 {
		if bound := float64(base) * math.Pow(mult, float64(n)); bound < float64(maxD) {
			limit = time.Duration(bound)
		}
	}
	if limit == math.MaxInt64 {
		return time.Duration(rand.Int64N(int64(limit)))
	}
	return time.Duration(rand.Int64N(int64(limit) + 1))
}
