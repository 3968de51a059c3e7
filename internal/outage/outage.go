// Package outage tells an outage of a store from the failure of one
// message, and waits it out.
//
// A consumer that treats "connection refused" as the message's failure
// cycles its deliveries while the store is down: it pulls, fails, asks
// the broker to redeliver, counts an attempt and logs a line, thousands
// of times a second, and a broker delivery limit turns good messages into
// dead letters. A Watch instead confirms a suspect error with a probe of
// the store (does it answer, and take writes?) and, when the probe fails
// too, marks the store down: callers then wait, holding what they have,
// while one goroutine probes with a capped backoff. One WARN line marks
// the start of the outage and one INFO line its end.
package outage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// ErrStopped is returned by Wait when its stop channel closed first.
var ErrStopped = errors.New("stopped while the store was down")

// Prober is the store's side: the drivers implement it (driver.Prober).
type Prober interface {
	// Unavailable reports whether err looks like the store being out of
	// reach. It is only a hint: a Watch confirms it with Probe.
	Unavailable(err error) bool
	// Probe returns nil when the store answers and takes writes.
	Probe(ctx context.Context) error
}

// Change is an outage starting (Down) or ending.
type Change struct {
	// Down is true when the outage starts, false when it ends.
	Down bool
	// Cause is the error that revealed the outage (on its start and end).
	Cause error
	// Duration is the outage's length, on its end.
	Duration time.Duration
}

// Config configures a Watch.
type Config struct {
	// Component names who watches in the log lines, e.g. `consumer
	// "balances"` or `outbox relay "host-1"`.
	Component string
	// Logger receives the outage's two lines. Required.
	Logger *slog.Logger
	// Base and Max bound the delay between probes: it doubles from Base
	// up to Max, with jitter. Defaults 100 ms and 1 s.
	Base, Max time.Duration
	// ProbeTimeout bounds one probe. Default 2 s.
	ProbeTimeout time.Duration
	// OnChange, when set, is told of every start and end.
	OnChange func(Change)
	// OnEnd, when set, is told of an outage's end while the store still
	// counts as down, before any work resumes: bookkeeping that new work
	// must find done. It must not wait for the store (Wait would wait for
	// it); OnChange, told once work may resume, is for anything else.
	OnEnd func(Change)
}

// Watch tracks whether one store is down. It is safe for concurrent use.
// The zero Watch and a nil *Watch never report an outage.
type Watch struct {
	p   Prober
	cfg Config

	isDown atomic.Bool // down, read without the lock on every delivery

	mu      sync.Mutex
	down    bool
	since   time.Time
	cause   error
	up      chan struct{} // closed when the current outage ends
	waiters int
	probing bool
	outages int
}

// New returns a Watch of the store p; nil when p is nil, so that a store
// whose driver cannot probe keeps today's behaviour.
func New(p Prober, cfg Config) *Watch {
	if p == nil {
		return nil
	}
	if cfg.Base <= 0 {
		cfg.Base = 100 * time.Millisecond
	}
	if cfg.Max <= 0 {
		cfg.Max = time.Second
	}
	if cfg.Max < cfg.Base {
		cfg.Max = cfg.Base
	}
	if cfg.ProbeTimeout <= 0 {
		cfg.ProbeTimeout = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Watch{p: p, cfg: cfg}
}

// Down reports whether an outage is in progress.
func (w *Watch) Down() bool {
	return w != nil && w.isDown.Load()
}

// Outages counts the outages seen so far.
func (w *Watch) Outages() int {
	if w == nil {
		return 0
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.outages
}

// Check reports whether err came from the store being down: err looks
// like an outage (Suspect) and a probe of the store fails too. The first
// confirmation starts an outage. It never reports true for nil.
func (w *Watch) Check(ctx context.Context, err error) bool {
	return w.Suspect(err) && w.Confirm(ctx, err)
}

// Confirm reports whether the store is down, err being an error Suspect
// took for an outage: one is under way, or a probe fails now and starts
// one.
func (w *Watch) Confirm(ctx context.Context, err error) bool {
	if w == nil {
		return false
	}
	if w.Down() {
		return true
	}
	perr := w.probe(ctx)
	if perr == nil {
		return false
	}
	w.start(err, perr)
	return true
}

// Suspect reports whether err looks like the store being out of reach:
// the driver says so, or err is a network error (refused, reset, broken
// pipe, a timeout, an unexpected end of a connection).
func (w *Watch) Suspect(err error) bool {
	if w == nil || err == nil {
		return false
	}
	return w.p.Unavailable(err) || Network(err)
}

// Network reports whether err is a failure of the connection itself.
func Network(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.ETIMEDOUT) || errors.Is(err, syscall.EHOSTUNREACH) ||
		errors.Is(err, syscall.ENETUNREACH) || errors.Is(err, io.ErrUnexpectedEOF)
}

// probe runs one probe, bounded by ProbeTimeout whatever ctx's state: a
// caller stopping still learns whether the store answers.
func (w *Watch) probe(ctx context.Context) error {
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.ProbeTimeout)
	defer cancel()
	return w.p.Probe(pctx)
}

// start marks the store down, unless it already is.
func (w *Watch) start(cause, probeErr error) {
	w.mu.Lock()
	if w.down {
		w.mu.Unlock()
		return
	}
	w.down, w.since, w.cause, w.up = true, time.Now(), cause, make(chan struct{})
	w.isDown.Store(true)
	w.outages++
	w.mu.Unlock()
	w.cfg.Logger.Warn("idem: store unreachable; pausing until it answers (deliveries are held, not counted as attempts)",
		slog.String("component", w.cfg.Component), slog.Any("error", cause), slog.Any("probe", probeErr))
	if w.cfg.OnChange != nil {
		w.cfg.OnChange(Change{Down: true, Cause: cause})
	}
}

// Wait returns nil at once when the store is not down; else it waits
// until a probe succeeds (nil), ctx ends (ctx's error) or stop closes
// (ErrStopped). While anyone waits, one goroutine probes the store.
func (w *Watch) Wait(ctx context.Context, stop <-chan struct{}) error {
	if !w.Down() {
		return nil
	}
	w.mu.Lock()
	if !w.down {
		w.mu.Unlock()
		return nil
	}
	up := w.up
	w.waiters++
	if !w.probing {
		w.probing = true
		go w.probeLoop(up)
	}
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		w.waiters--
		w.mu.Unlock()
	}()
	select {
	case <-up:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-stop:
		return ErrStopped
	}
}

// probeLoop probes until the store answers, or until nobody waits.
func (w *Watch) probeLoop(up chan struct{}) {
	for n := 0; ; n++ {
		time.Sleep(w.delay(n))
		w.mu.Lock()
		if w.waiters == 0 || w.up != up {
			w.probing = false
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
		if err := w.probe(context.Background()); err != nil {
			continue
		}
		w.mu.Lock()
		cause, took := w.cause, time.Since(w.since)
		w.mu.Unlock()
		// OnEnd while the store still counts as down (new deliveries
		// meanwhile join the waiters): what it records comes before any
		// work it concerns.
		if w.cfg.OnEnd != nil {
			w.cfg.OnEnd(Change{Cause: cause, Duration: took})
		}
		w.mu.Lock()
		w.down, w.probing, w.cause = false, false, nil
		w.isDown.Store(false)
		w.mu.Unlock()
		// Said before the waiters go on: the line and the hooks (a
		// store-up gauge) come before the work they resume.
		w.cfg.Logger.Info("idem: store answers again; resuming", slog.String("component", w.cfg.Component),
			slog.Duration("outage", took.Round(time.Millisecond)), slog.Any("cause", cause))
		if w.cfg.OnChange != nil {
			w.cfg.OnChange(Change{Cause: cause, Duration: took})
		}
		close(up)
		return
	}
}

// delay is the wait before probe n (from 0): Base doubling up to Max,
// the upper half jittered, so probes neither hammer a recovering store
// nor leave it idle long once it is back.
func (w *Watch) delay(n int) time.Duration {
	d := w.cfg.Base
	for i := 0; i < n && d < w.cfg.Max; i++ {
		d *= 2
	}
	d = min(d, w.cfg.Max)
	return d/2 + time.Duration(rand.Int64N(int64(d/2)+1))
}

// Pause waits Base, or less if ctx ends or stop closes: the pause before
// trying again an error that looked like an outage while the store
// answered the probe.
func (w *Watch) Pause(ctx context.Context, stop <-chan struct{}) {
	if w == nil {
		return
	}
	t := time.NewTimer(w.cfg.Base)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	case <-stop:
	}
}

// Do runs fn until it succeeds, fails for another reason than the store
// being down (per Check), or the wait for the store ends (ctx or stop);
// it returns fn's last error, or the wait's joined with it.
func (w *Watch) Do(ctx context.Context, stop <-chan struct{}, fn func() error) error {
	var last error
	for {
		if err := w.Wait(ctx, stop); err != nil {
			if last != nil {
				return fmt.Errorf("%w (last failure: %w)", err, last)
			}
			return err
		}
		last = fn()
		if !w.Check(ctx, last) {
			return last
		}
	}
}
