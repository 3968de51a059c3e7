package idem

import (
	"context"
	"time"
)

// Hook is any value implementing one or more of the Hook* interfaces in this
// package. The processor finds them by type assertion when it is built, so a
// metrics or tracing package implements only what it needs and the core
// imports neither.
type Hook any

// HookOutcome is called once per message after its outcome is final: the
// transaction committed (Applied), was not needed (Duplicate, Conflict), or
// failed (OutcomeNone with Err set). It runs on the processing goroutine:
// keep it fast and never block.
type HookOutcome interface {
	OnOutcome(ctx context.Context, ev *OutcomeEvent)
}

// OutcomeEvent describes one processed message.
type OutcomeEvent struct {
	// Handler is the handler name.
	Handler string
	// MessageID is the message ID (empty if the message was nil).
	MessageID string
	// Outcome is what happened; OutcomeNone when Err is set.
	Outcome Outcome
	// Err is the error returned to the caller, if any.
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
}
