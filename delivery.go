package idem

import (
	"context"
	"time"
)

// Delivery is one broker delivery as a source adapter hands it to a
// DeliveryHandler. Adapters fill it from the broker; they never decide
// outcomes themselves.
type Delivery struct {
	// Msg is the decoded envelope, or nil when decoding failed.
	Msg *Message
	// DecodeErr is why the broker's record could not be mapped to a
	// Message (a missing ID header, a payload the decode hook refused).
	// A delivery with DecodeErr is dead-lettered with that reason, never
	// dropped.
	DecodeErr error
	// Raw is the broker's payload as received, kept verbatim for the
	// dead-letter store when Msg is nil.
	Raw []byte
	// Source names the broker location for dead letters and logs, for
	// example "kafka:orders/3@1042" or "jetstream:ORDERS/orders.created@17".
	// Name the one message (with its offset or sequence): a delivery
	// without a usable message ID is dead-lettered once per handler,
	// Source, Raw and error, so its redelivery after a crash updates that
	// dead letter instead of adding another.
	Source string
	// Attempt counts deliveries of this message by the broker, from 1
	// (JetStream's NumDelivered; adapters that retry in-process count
	// their own attempts). 0 when unknown.
	Attempt int
	// LastAttempt is set when the broker will not deliver the message
	// again (for example JetStream's MaxDeliver is reached): the handler
	// must then dead-letter a failure instead of asking for a retry.
	LastAttempt bool
	// Stopping, when set, is closed once the adapter stops consuming. An
	// adapter that decides with a context that outlives its own (so that
	// effects under way still commit) sets it: the Consumer then gives up
	// what may wait, such as writing again the dead letter of a last
	// delivery while its store is down. Nil: the context's end alone.
	Stopping <-chan struct{}

	// replay marks a delivery of a dead letter by Replay: a failure parks
	// it again with the replay's log entry.
	replay bool
}

// Verdict is what a source adapter must do with a delivery.
type Verdict struct {
	// Ack is true when the outcome is durable (applied, duplicate, stale,
	// or committed to the dead-letter store): acknowledge the broker or
	// commit the offset. When false, do not acknowledge: redeliver after
	// RetryAfter (JetStream: Nak with that delay; Kafka: keep the
	// partition's position and process the record again after the delay).
	Ack bool
	// RetryAfter is the backoff delay when Ack is false.
	RetryAfter time.Duration
	// Outcome is the processing outcome when known (for logs and metrics).
	Outcome Outcome
	// DeadLettered is true when the delivery was recorded in the
	// dead-letter store (Ack is then true).
	DeadLettered bool
	// DeadLetterClass is the dead letter's class (DeadLetterPermanent,
	// DeadLetterConflict, DeadLetterDecode, DeadLetterExhausted) when
	// DeadLettered.
	DeadLetterClass string
	// Err is the error behind a retry or a dead letter, for logs.
	Err error
}

// DeliveryHandler decides the fate of one delivery: process it, retry it
// later, or dead-letter it, and only then say whether to acknowledge. Source
// adapters (Kafka, JetStream) depend on this interface alone. It must be
// safe for concurrent use.
type DeliveryHandler interface {
	HandleDelivery(ctx context.Context, d *Delivery) Verdict
}

// DeliveryHandlerFunc adapts a function to DeliveryHandler.
type DeliveryHandlerFunc func(ctx context.Context, d *Delivery) Verdict

// HandleDelivery calls f.
func (f DeliveryHandlerFunc) HandleDelivery(ctx context.Context, d *Delivery) Verdict {
	return f(ctx, d)
}

// BatchDeliveryHandler decides several deliveries at once, so that their
// effects can commit in one transaction. Verdicts are parallel to the
// deliveries, with the same meaning as HandleDelivery's. Adapters configured
// for batches use it when their handler implements it (idem.Consumer does).
type BatchDeliveryHandler interface {
	DeliveryHandler
	HandleDeliveries(ctx context.Context, ds []*Delivery) []Verdict
}
