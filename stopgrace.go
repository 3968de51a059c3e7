package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// errCut is the cause of a delivery context cancelled StopGrace after its
// adapter stopped.
var errCut = errors.New("idem: cancelled by the consumer's stop after its grace")

// cutOnStop returns the context a delivery is processed under: ctx,
// cancelled with cause errCut once stop has been closed for StopGrace,
// and the func that releases it. A LeaseProcessor runs its call under
// uncut's context instead, and gives the write recording a call's result
// a grace of its own (cutWriteContext).
//
// A ctx from cutOnStop is returned as it is: the deliveries of a batch
// decided one by one after it keep the batch's grace, not one each.
func (c *deliveries) cutOnStop(ctx context.Context, stop <-chan struct{}) (context.Context, func()) {
	if !c.cuts || c.cfg.StopGrace <= 0 || stop == nil || ctx.Value(cutKey{}) != nil {
		return ctx, func() {}
	}
	cctx, cancel := context.WithCancelCause(context.WithValue(ctx, cutKey{}, &cutScope{parent: ctx, grace: c.cfg.StopGrace}))
	done := make(chan struct{})
	go func() {
		select {
		case <-done:
			return
		case <-stop:
		}
		// From the stop, not from this delivery's start: the deliveries
		// an adapter decides one after another once stopped (JetStream's
		// put back) share one grace.
		t := time.NewTimer(c.cfg.StopGrace - time.Since(c.stops.firstSeen(stop, c.cfg.StopGrace)))
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
			cancel(errCut)
		}
	}()
	return cctx, func() { close(done); cancel(nil) }
}

// cutScope is the value of cutKey in a context from cutOnStop: the
// context it was made from, and the consumer's StopGrace.
type cutScope struct {
	parent context.Context
	grace  time.Duration
}

// uncut returns ctx without the stop's cut, for a lease handler's call,
// which the stop never cuts: ctx's values, cancelled as ctx is for any
// other reason (a hook's deadline, the caller's end) and when the context
// the cut was made from is. Outside a cut, ctx itself. Within the
// returned context, nothing counts as cut: a LeaseProcessor nested in the
// call keeps its caller's cancellations, and no second cut is made.
func uncut(ctx context.Context) (context.Context, context.CancelFunc) {
	cs, ok := ctx.Value(cutKey{}).(*cutScope)
	if !ok {
		return ctx, func() {}
	}
	uctx, cancel := context.WithCancelCause(context.WithValue(context.WithoutCancel(ctx), cutKey{}, uncutScope{}))
	stopCtx := context.AfterFunc(ctx, func() {
		if !wasCut(ctx) {
			cancel(context.Cause(ctx))
		}
	})
	stopParent := context.AfterFunc(cs.parent, func() { cancel(context.Cause(cs.parent)) })
	return uctx, func() { stopCtx(); stopParent(); cancel(nil) }
}

// uncutScope is the value of cutKey in a context from uncut.
type uncutScope struct{}

// cutGrace returns the StopGrace of the cut ctx is under, if any.
func cutGrace(ctx context.Context) (time.Duration, bool) {
	cs, ok := ctx.Value(cutKey{}).(*cutScope)
	if !ok {
		return 0, false
	}
	return cs.grace, true
}

// cutWriteContext is wctx, a write's context made to outlive ctx's end,
// for a write under ctx: once ctx is cut by the stop, the write runs at
// most StopGrace more (counted from the cut, or from the write's start
// if it began after it), then is cancelled with cause errCut. A write
// recording what a call did gets its chance even when the call ended
// after the grace; a store that hangs does not hold the stop for the
// lease's TTL. Outside a cut, wctx unchanged.
func cutWriteContext(ctx, wctx context.Context) (context.Context, context.CancelFunc) {
	grace, ok := cutGrace(ctx)
	if !ok {
		return wctx, func() {}
	}
	cctx, cancel := context.WithCancelCause(wctx)
	stop := context.AfterFunc(ctx, func() {
		if wasCut(ctx) {
			t := time.AfterFunc(grace, func() { cancel(errCut) })
			context.AfterFunc(cctx, func() { t.Stop() }) // at once if the write is over
		}
	})
	return cctx, func() { stop(); cancel(nil) }
}

// stopClock records when a consumer first saw each of its adapters'
// stop channels closed.
type stopClock struct {
	mu   sync.Mutex
	seen map[<-chan struct{}]time.Time
}

// firstSeen returns when stop, closed, was first seen so (now, if this is
// the first time). Stops seen long before are forgotten: the map holds
// those of the last minutes.
func (s *stopClock) firstSeen(stop <-chan struct{}, grace time.Duration) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	if at, ok := s.seen[stop]; ok {
		return at
	}
	if s.seen == nil {
		s.seen = map[<-chan struct{}]time.Time{}
	}
	for ch, at := range s.seen {
		if now.Sub(at) > 2*grace+time.Minute {
			delete(s.seen, ch)
		}
	}
	s.seen[stop] = now
	return now
}

// cutKey marks a context from cutOnStop.
type cutKey struct{}

// wasCut reports whether ctx, from cutOnStop, was cancelled by the stop.
func wasCut(ctx context.Context) bool { return errors.Is(context.Cause(ctx), errCut) }

// cutShort is the verdict of a delivery cancelled by its adapter's stop
// (StopGrace), whose failure err is that cancellation's: no attempt of
// the message, which the broker delivers again.
func (c *deliveries) cutShort(d *Delivery, err error) Verdict {
	err = fmt.Errorf("%w: still running %s after its consumer stopped, cancelled: %w", ErrStopped, c.cfg.StopGrace, err)
	attrs := []slog.Attr{slog.String("handler", c.name), slog.String("source", d.Source), slog.Any("error", err)}
	if d.Msg != nil {
		attrs = append(attrs, slog.String("message_id", d.Msg.ID))
	}
	msg := "idem: delivery cut short by the stop; the broker delivers it again"
	if d.LastAttempt && !d.replay {
		msg = "idem: delivery cut short by the stop, on the broker's last delivery: the adapter must requeue it, or the broker may not deliver it again"
	}
	c.logs.Warn(c.cfg.Logger, "cut\x00"+d.Source, msg, attrs...)
	return Verdict{RetryAfter: c.cfg.Backoff.Delay(max(d.Attempt-1, 0)), Err: err}
}

// storeAnswered reports whether err, a lease delivery's, is a verdict
// the store recorded (a failed call, a message failed for good): the
// message's own, which the stop's cut does not turn into no attempt.
func storeAnswered(err error) bool {
	var recorded *recordedFailure
	return errors.As(err, &recorded) || errors.Is(err, ErrFailedPermanently)
}

// rollbackContext is the context of a rollback after a call under ctx
// failed: one that outlives ctx's end, so that a cancelled delivery
// still ends its transaction cleanly, unless the stop cut it (the store
// may hang: the driver drops the connection instead of waiting).
func rollbackContext(ctx context.Context) context.Context {
	if wasCut(ctx) {
		return ctx
	}
	return context.WithoutCancel(ctx)
}

// warnWhenSlow logs a WARN should d (the first of n deliveries decided
// together) stay undecided for SlowWarning, and returns the func that
// ends the watch (safe to call twice).
func (c *deliveries) warnWhenSlow(d *Delivery, n int) func() {
	if c.cfg.SlowWarning <= 0 {
		return func() {}
	}
	start := time.Now()
	t := time.AfterFunc(c.cfg.SlowWarning, func() {
		attrs := []slog.Attr{slog.String("handler", c.name), slog.String("source", d.Source), slog.Duration("running", time.Since(start).Round(time.Millisecond))}
		if d.Msg != nil {
			attrs = append(attrs, slog.String("message_id", d.Msg.ID))
		}
		if n > 1 {
			attrs = append(attrs, slog.Int("batch", n))
		}
		c.logs.Warn(c.cfg.Logger, "slow", "idem: delivery still undecided; its store or handler may hang (no error comes from a store that stopped answering)", attrs...)
	})
	return func() { t.Stop() }
}
