package main

import (
	"context"
	"encoding/json"
	"net/http"
	"sort"
	"sync"
	"time"
)

// The live view: the server takes a reading of the store every interval
// (the same reading /metrics and the front page share, so it adds no load
// of its own) and keeps the last hour of them in memory. /api/live serves
// them as JSON; the console's script polls it and draws the charts. A
// reading that failed is kept as a gap, and the outage it belongs to is
// shown as such.

// liveWindow is how far back the live view goes.
const liveWindow = time.Hour

// liveMaxHandlers bounds the handlers the live view charts, the busiest
// first.
const liveMaxHandlers = 24

// liveSample is one reading of the store, as cumulative counts.
type liveSample struct {
	at       time.Time
	up       bool
	err      string
	handlers map[string]liveCounts
	parked   int64
	// outbox is false for a schema without one.
	outbox        bool
	pending, lagS int64
}

// liveCounts are one handler's cumulative counts in a sample.
type liveCounts struct {
	applied, duplicates, deadLetters int64
}

// liveRing holds the samples of the last liveWindow.
type liveRing struct {
	every time.Duration

	mu        sync.Mutex
	samples   []liveSample // oldest first
	downSince time.Time
}

// newLiveRing returns a ring for samples taken every interval.
func newLiveRing(every time.Duration) *liveRing {
	return &liveRing{every: every}
}

// add appends the reading r taken at at, unless it is the last one again
// (the cache hands out one reading until it is refresh old).
func (l *liveRing) add(r storeReading, at time.Time) {
	s := liveSample{at: at, up: r.err == nil, handlers: map[string]liveCounts{}}
	if r.err != nil {
		s.err = r.err.Error()
	}
	for _, h := range r.handlers {
		s.handlers[h.Handler] = liveCounts{applied: h.Applied, duplicates: h.Duplicates, deadLetters: h.DeadTotal}
		s.parked += h.DeadParked
	}
	if r.outbox != nil {
		s.outbox, s.pending, s.lagS = true, r.outbox.Pending, r.outbox.AgeSeconds
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if n := len(l.samples); n > 0 && !l.samples[n-1].at.Before(at) {
		return
	}
	l.samples = append(l.samples, s)
	cut := 0
	for cut < len(l.samples) && at.Sub(l.samples[cut].at) > liveWindow {
		cut++
	}
	l.samples = l.samples[cut:]
	l.downSince = r.downSince
}

// run samples cache every interval until ctx ends. Each sample is taken
// when the reading before it has expired: on a fixed tick of the interval
// the cache would still hold the last reading, taken a moment after the
// tick before, and hand it out again, so that only every other tick added
// a sample and each spanned two intervals.
func (l *liveRing) run(ctx context.Context, cache *readingCache) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r, at := cache.get(ctx)
		if ctx.Err() != nil {
			return
		}
		l.add(r, at)
		t.Reset(max(time.Until(at.Add(l.every)), 0))
	}
}

// liveJSON is what /api/live serves: per-interval series over the last
// hour, one value per sample; a null is a gap (the store did not answer,
// or it is the first sample and has no interval before it).
type liveJSON struct {
	IntervalS float64 `json:"interval_s"`
	WindowS   float64 `json:"window_s"`
	// T are the samples' times, Unix milliseconds; Up whether the store
	// answered.
	T  []int64 `json:"t"`
	Up []bool  `json:"up"`
	// Down is the outage in progress, if the last sample failed.
	Down *liveDown `json:"down,omitempty"`
	// Handlers are the per-handler series: applied, duplicates and new
	// dead letters in each interval.
	Handlers []liveHandler `json:"handlers"`
	// Parked is the dead-letter depth; OutboxPending and OutboxLagS the
	// outbox's pending rows and the oldest one's age.
	Parked        []*int64 `json:"parked"`
	OutboxPending []*int64 `json:"outbox_pending"`
	OutboxLagS    []*int64 `json:"outbox_lag_s"`
}

// liveDown is an outage in progress.
type liveDown struct {
	Since int64  `json:"since"`
	Error string `json:"error"`
}

// liveHandler is one handler's series.
type liveHandler struct {
	Name        string   `json:"name"`
	Applied     []*int64 `json:"applied"`
	Duplicates  []*int64 `json:"duplicates"`
	DeadLetters []*int64 `json:"dead_letters"`
}

// snapshot returns the ring as liveJSON.
func (l *liveRing) snapshot() liveJSON {
	l.mu.Lock()
	samples := append([]liveSample(nil), l.samples...)
	downSince := l.downSince
	l.mu.Unlock()
	j := liveJSON{IntervalS: l.every.Seconds(), WindowS: liveWindow.Seconds(), T: make([]int64, len(samples)), Up: make([]bool, len(samples)),
		Handlers: []liveHandler{}, Parked: make([]*int64, len(samples)), OutboxPending: make([]*int64, len(samples)), OutboxLagS: make([]*int64, len(samples))}
	// The busiest handlers over the window, by messages seen.
	busy := map[string]int64{}
	for i, s := range samples {
		j.T[i], j.Up[i] = s.at.UnixMilli(), s.up
		if !s.up {
			continue
		}
		j.Parked[i] = ptr(s.parked)
		if s.outbox {
			j.OutboxPending[i], j.OutboxLagS[i] = ptr(s.pending), ptr(s.lagS)
		}
		for h, c := range s.handlers {
			if _, ok := busy[h]; !ok {
				busy[h] = 0
			}
			if i > 0 && samples[i-1].up {
				p := samples[i-1].handlers[h]
				busy[h] += max(c.applied-p.applied, 0) + max(c.duplicates-p.duplicates, 0) + max(c.deadLetters-p.deadLetters, 0)
			}
		}
	}
	names := make([]string, 0, len(busy))
	for h := range busy {
		names = append(names, h)
	}
	sort.Slice(names, func(a, b int) bool {
		if busy[names[a]] != busy[names[b]] {
			return busy[names[a]] > busy[names[b]]
		}
		return names[a] < names[b]
	})
	if len(names) > liveMaxHandlers {
		names = names[:liveMaxHandlers]
	}
	sort.Strings(names)
	for _, h := range names {
		// The script writes the name with textContent: escaped here as
		// the pages escape it, a bidi override or an ESC shows as such.
		lh := liveHandler{Name: termText(h), Applied: make([]*int64, len(samples)), Duplicates: make([]*int64, len(samples)), DeadLetters: make([]*int64, len(samples))}
		for i := 1; i < len(samples); i++ {
			cur, prev := samples[i], samples[i-1]
			if !cur.up || !prev.up {
				continue
			}
			c, p := cur.handlers[h], prev.handlers[h]
			// A count that went down (cleanup deleted markers) is no
			// negative activity: the interval counts none.
			lh.Applied[i] = ptr(max(c.applied-p.applied, 0))
			lh.Duplicates[i] = ptr(max(c.duplicates-p.duplicates, 0))
			lh.DeadLetters[i] = ptr(max(c.deadLetters-p.deadLetters, 0))
		}
		j.Handlers = append(j.Handlers, lh)
	}
	if n := len(samples); n > 0 && !samples[n-1].up {
		since := downSince
		if since.IsZero() {
			since = samples[n-1].at
		}
		j.Down = &liveDown{Since: since.UnixMilli(), Error: termBlock(samples[n-1].err)}
	}
	return j
}

func ptr(v int64) *int64 { return &v }

func (c *console) liveJSON(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	if c.live == nil {
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"error":"the live view is off"}` + "\n"))
		return
	}
	_ = json.NewEncoder(w).Encode(c.live.snapshot())
}
