package watermill

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemhq/idem"
)

// ErrProduced is returned (permanent: the message is dead-lettered) by a
// handler adapted with Apply or Call that returned messages to publish.
// The router would publish them after the transaction committed, and lose
// them if it failed to: add them to idem's outbox in the transaction
// instead.
var ErrProduced = errors.New("watermill: a handler run through idem returned messages to publish; add them to the outbox in its transaction")

// Context keys of the values Apply and Call put in a message's context.
type (
	msgKey   struct{}
	txKey    struct{}
	leaseKey struct{}
)

// withMessage returns ctx carrying msg, for Apply and Call.
func withMessage(ctx context.Context, msg *message.Message) context.Context {
	return context.WithValue(ctx, msgKey{}, msg)
}

// watermillMessage returns the Watermill message a Handler is deciding
// (ctx being the one it handed to idem), or m as a new Watermill message
// when there is none (a dead letter's replay).
func watermillMessage(ctx context.Context, m *idem.Message) *message.Message {
	if msg, ok := ctx.Value(msgKey{}).(*message.Message); ok {
		return msg
	}
	return ToMessage(ctx, m)
}

// Apply adapts a Watermill handler to idem.Handler.Apply, so that an
// existing handler runs in idem's transaction: build the Handler with
// Apply(h), its Consumer, and a Handler (New) on that. h receives the
// Watermill message being decided (a new one built from the idem message
// when a dead letter is replayed), whose context carries the transaction:
// Tx[TTx](msg) returns it. Write through that transaction only: a write
// elsewhere is not undone when the transaction rolls back.
//
// h must not return messages to publish (ErrProduced, a permanent
// failure): add them to idem's outbox in the transaction.
func Apply[TTx any](h message.HandlerFunc) func(ctx context.Context, tx TTx, m *idem.Message) error {
	return func(ctx context.Context, tx TTx, m *idem.Message) error {
		msg := watermillMessage(ctx, m)
		prev := msg.Context()
		msg.SetContext(context.WithValue(ctx, txKey{}, tx))
		defer msg.SetContext(prev)
		out, err := h(msg)
		if err != nil {
			return err
		}
		if len(out) > 0 {
			return idem.Permanent(fmt.Errorf("%w (%d messages)", ErrProduced, len(out)))
		}
		return nil
	}
}

// Tx returns the transaction Apply put in msg's context, and whether
// there is one of type TTx.
func Tx[TTx any](msg *message.Message) (TTx, bool) {
	tx, ok := msg.Context().Value(txKey{}).(TTx)
	return tx, ok
}

// Call adapts a Watermill handler to idem.LeaseHandler.Call (lease mode),
// for effects outside the database: h receives the Watermill message
// being decided, whose context carries the lease (LeaseOf) and is
// cancelled if the lease is lost. Send the lease's IdempotencyKey to the
// downstream. h must not return messages to publish (ErrProduced).
func Call(h message.HandlerFunc) func(ctx context.Context, l *idem.Lease, m *idem.Message) error {
	return func(ctx context.Context, l *idem.Lease, m *idem.Message) error {
		msg := watermillMessage(ctx, m)
		prev := msg.Context()
		msg.SetContext(context.WithValue(ctx, leaseKey{}, l))
		defer msg.SetContext(prev)
		out, err := h(msg)
		if err != nil {
			return err
		}
		if len(out) > 0 {
			return idem.Permanent(fmt.Errorf("%w (%d messages)", ErrProduced, len(out)))
		}
		return nil
	}
}

// LeaseOf returns the lease Call put in msg's context, or nil.
func LeaseOf(msg *message.Message) *idem.Lease {
	l, _ := msg.Context().Value(leaseKey{}).(*idem.Lease)
	return l
}
