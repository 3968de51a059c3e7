// Package lograte summarizes repeated log lines: the first line of a kind
// is written, the repeats within an interval are counted, and the next
// line of that kind after the interval carries the count.
//
// A consumer whose dependency fails fails every delivery alike. One line
// per delivery buries the cause under thousands of copies; one line per
// kind and interval keeps the cause and says how often it happened.
package lograte

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// maxKinds bounds the kinds remembered: past it the oldest memory is
// dropped, at worst writing a line early.
const maxKinds = 1024

// Limiter decides which lines to write. It is safe for concurrent use.
type Limiter struct {
	every time.Duration
	now   func() time.Time

	mu    sync.Mutex
	kinds map[string]*kind
}

type kind struct {
	last       time.Time // when a line of this kind was last written
	suppressed int       // lines not written since
}

// New returns a Limiter writing at most one line of a kind per every.
// every ≤ 0 writes every line.
func New(every time.Duration) *Limiter {
	return &Limiter{every: every, now: time.Now, kinds: map[string]*kind{}}
}

// Allow reports whether to write a line of kind key now, and how many
// lines of that kind were not written since the last one that was.
func (l *Limiter) Allow(key string) (ok bool, suppressed int) {
	if l == nil || l.every <= 0 {
		return true, 0
	}
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	k := l.kinds[key]
	if k == nil {
		if len(l.kinds) >= maxKinds {
			l.forgetOldest()
		}
		l.kinds[key] = &kind{last: now}
		return true, 0
	}
	if now.Sub(k.last) < l.every {
		k.suppressed++
		return false, 0
	}
	n := k.suppressed
	k.last, k.suppressed = now, 0
	return true, n
}

// Warn writes msg with attrs at WARN on logger, unless a line of the same
// msg and kind was written less than the interval ago; then it only counts
// it. The next line written carries the count as similar_not_logged.
func (l *Limiter) Warn(logger *slog.Logger, kind, msg string, attrs ...slog.Attr) {
	l.Log(logger, slog.LevelWarn, kind, msg, attrs...)
}

// Log is Warn at level.
func (l *Limiter) Log(logger *slog.Logger, level slog.Level, kind, msg string, attrs ...slog.Attr) {
	ok, n := l.Allow(msg + "\x00" + kind)
	if !ok {
		return
	}
	if n > 0 {
		attrs = append(attrs, slog.Int("similar_not_logged", n))
	}
	logger.LogAttrs(context.Background(), level, msg, attrs...)
}

// forgetOldest drops the kind written longest ago.
func (l *Limiter) forgetOldest() {
	var (
		oldest string
		at     time.Time
	)
	for key, k := range l.kinds {
		if oldest == "" || k.last.Before(at) {
			oldest, at = key, k.last
		}
	}
	delete(l.kinds, oldest)
}
