package idem

import (
	"context"
	"fmt"
	"time"
)

// Hook is any value implementing one or more of the Hook* interfaces in this
// package. The processor finds them by type assertion when it is built, so a
// metrics or tracing package implements only what it needs and the core
// imports neither.
type Hook any

// HookOutcome is called once per message after its outcome is final: the
// transaction committed (Applied), was not needed (Duplicate, Conflict), or
// failed (OutcomeNone with Err set). Under ProcessTx and ProcessBatchTx
// the caller commits: the hook runs when the call returns, before that
// commit, so Applied there means applied in the caller's transaction,
// which may still roll back. It runs on the processing goroutine: keep it
// fast and never block.
type HookOutcome interface {
	OnOutcome(ctx context.Context, ev *OutcomeEvent)
}

// OutcomeEvent describes one processed message.
type OutcomeEvent struct {
	// Handler is the handler name.
	Handler string
	// MessageID is the message ID (empty if the message was nil).
	MessageID string
	// Outcome is what happened; OutcomeNone when Err is set, except for
	// Conflict, whose Err is the *ConflictError.
	Outcome Outcome
	// Err is the error returned to the caller, if any; in a batch that
	// committed, the message's own (a *ConflictError, a *GapError).
	Err error
	// Duration is the wall time of the whole call: for a batch, of the
	// whole batch.
	Duration time.Duration
	// BatchSize is 1 for Process and ProcessTx, len(msgs) for batches.
	BatchSize int
}

// HookVerdict is called by a Consumer once for every delivery it decides,
// with the verdict it returns to the adapter: acknowledged, to be retried,
// or dead-lettered. Install it in ConsumerConfig.Hooks. It runs on the
// delivery's goroutine: keep it fast and never block.
type HookVerdict interface {
	OnVerdict(ctx context.Context, ev *VerdictEvent)
}

// VerdictEvent describes one decided delivery.
type VerdictEvent struct {
	// Handler is the consumer's handler name.
	Handler string
	// MessageID is the message ID, empty when the delivery could not be
	// decoded into a message.
	MessageID string
	// Attempt is the broker's delivery count (1 on the first delivery; 0
	// if the broker does not say).
	Attempt int
	// Verdict is what the Consumer returned.
	Verdict Verdict
	// Message is the delivered message, nil when the delivery could not
	// be decoded. A hook must not modify it or keep it after OnVerdict
	// returns.
	Message *Message
}

// HookOutage is told when a Consumer or LeaseConsumer finds its store
// down and when the store answers again (see ErrStoreUnavailable).
// Install it in ConsumerConfig.Hooks; the metrics package's hook keeps a
// store-availability gauge and an outages counter with it. It runs on the
// goroutine that saw the change: keep it fast and never block.
type HookOutage interface {
	OnOutage(ctx context.Context, ev *OutageEvent)
}

// OutageEvent is the start or the end of an outage of a consumer's store.
type OutageEvent struct {
	// Handler is the consumer's handler name.
	Handler string
	// Down is true when the outage starts, false when it ends.
	Down bool
	// Cause is the error that revealed the outage.
	Cause error
	// Duration is how long the outage lasted, when it ends.
	Duration time.Duration
}

// HookCall is called around every call of Process, ProcessTx,
// ProcessBatch, ProcessBatchTx and LeaseProcessor.Process. OnCallStart runs
// first, before the store is touched; the context it returns is the one the
// call runs with, so the store, the handler and the call's other hooks see
// it. OnCallEnd runs last, after HookOutcome, with that context. A tracing
// hook starts a span in one and ends it in the other (package tracing).
// Several HookCall hooks start in the order installed and end in reverse.
// Both run on the processing goroutine: keep them fast and never block.
type HookCall interface {
	OnCallStart(ctx context.Context, ev *CallStart) context.Context
	OnCallEnd(ctx context.Context, ev *CallEnd)
}

// CallStart describes a call about to run.
type CallStart struct {
	// Handler is the handler name (empty if the handler was nil).
	Handler string
	// Messages are the call's messages: one for Process, the batch for
	// ProcessBatch. They are not validated yet and may hold nil. A hook
	// must not modify them or keep them after OnCallStart returns.
	Messages []*Message
	// Lease is true for LeaseProcessor.Process.
	Lease bool
	// Batch is true for ProcessBatch and ProcessBatchTx, whatever the
	// number of messages: a batch of one is still a batch.
	Batch bool
}

// CallEnd describes a finished call.
type CallEnd struct {
	// Handler is the handler name (empty if the handler was nil).
	Handler string
	// Outcomes are the messages' outcomes, parallel to CallStart.Messages;
	// nil when Err is set on a batch (nothing was committed).
	Outcomes []Outcome
	// Err is the error the call returned; for a batch that committed with
	// conflicts, nil (the conflicts are Conflict outcomes).
	Err error
	// Duration is the wall time of the whole call.
	Duration time.Duration
	// Batch is as in CallStart.
	Batch bool
}

// callHooks are a processor's HookCall hooks.
type callHooks []HookCall

// call is one call's run of the HookCall hooks: each hook whose
// OnCallStart ran gets exactly one OnCallEnd, also when the call, or a
// hook, panics.
type call struct {
	hs      callHooks
	handler string
	batch   bool
	t0      time.Time
	ctx     context.Context // the context the call runs with
	open    int             // hooks started and not yet ended: hs[:open]
	ev      *CallEnd        // set once ending has begun
}

// start runs OnCallStart of every hook for the messages of a call (msg
// alone unless batch) begun at t0, and returns the context the call runs
// with and the call to end; without hooks, ctx and a nil call, whose
// methods do nothing (no allocation on the path of every message). If a
// hook panics, the hooks started before it are ended, and the panic goes
// on.
func (hs callHooks) start(ctx context.Context, handler string, msg *Message, msgs []*Message, batch, lease bool, t0 time.Time) (context.Context, *call) {
	if len(hs) == 0 {
		return ctx, nil
	}
	c := &call{hs: hs, handler: handler, batch: batch, t0: t0, ctx: ctx}
	if !batch {
		msgs = []*Message{msg}
	}
	ev := &CallStart{Handler: handler, Messages: msgs, Lease: lease, Batch: batch}
	defer c.endOnPanic()
	for _, h := range hs {
		if cctx := h.OnCallStart(c.ctx, ev); cctx != nil {
			c.ctx = cctx
		}
		c.open++
	}
	return c.ctx, c
}

// end runs OnCallEnd of the hooks not ended yet, last installed first.
// A second call ends nothing more.
func (c *call) end(outs []Outcome, err error) {
	if c == nil {
		return
	}
	if c.ev == nil {
		c.ev = &CallEnd{Handler: c.handler, Outcomes: outs, Err: err, Duration: time.Since(c.t0), Batch: c.batch}
	}
	for c.open > 0 {
		c.open--
		c.hs[c.open].OnCallEnd(c.ctx, c.ev)
	}
}

// endOnPanic, deferred right after start, ends the hooks still open when
// the call panics (a bug in a hook or a driver: handler panics are
// recovered into a *PanicError before this), with the panic as the error
// unless ending had begun, so that no span is left open; then the panic
// goes on. A hook that panics in OnCallEnd is not ended again.
func (c *call) endOnPanic() {
	if c == nil || c.open == 0 {
		return
	}
	if r := recover(); r != nil {
		c.end(nil, fmt.Errorf("idem: the call panicked: %v", r))
		panic(r)
	}
}
