package idem

import (
	"context"
	"errors"
	"fmt"
)

// ErrUnknownType matches (with errors.Is) the error of a message whose Type
// has no route; see ByType.
var ErrUnknownType = errors.New("idem: no route for the message type")

// UnknownTypeError is returned for a message whose Type has no route in
// ByType. It matches ErrUnknownType, and IsPermanent reports true for it.
type UnknownTypeError struct {
	// Type is the message's type; empty when the message had none.
	Type string
}

// Error implements error.
func (e *UnknownTypeError) Error() string {
	if e.Type == "" {
		return "idem: message has no type, and no route takes untyped messages"
	}
	return "idem: no route for message type " + typeText(e.Type)
}

// typeText returns t as it is when it is a short run of printable ASCII
// without spaces or quotes (as event type names are), so that dead letters
// of different unknown types get different fingerprints; otherwise quoted
// and bounded.
func typeText(t string) string {
	if len(t) > 64 {
		return quoteBounded(t, 64)
	}
	for i := 0; i < len(t); i++ {
		if c := t[i]; c <= ' ' || c >= 0x7f || c == '"' || c == '\\' {
			return quoteBounded(t, 64)
		}
	}
	return t
}

// Is reports whether target is ErrUnknownType.
func (e *UnknownTypeError) Is(target error) bool { return target == ErrUnknownType }

// Routes maps a message type (Message.Type) to the function that applies
// messages of that type. The key "" routes messages without a type.
//
// TTx is the handler's transaction type for a Handler (Routes[*sql.Tx],
// Routes[postgres.Tx]), and *Lease for a LeaseHandler (Routes[*Lease]):
// the function's second argument is what the handler kind passes.
type Routes[TTx any] map[string]func(ctx context.Context, tx TTx, msg *Message) error

// ByType returns a function that runs routes[msg.Type]. It serves both
// handler kinds. For a Handler that consumes several event types, use it
// as Apply: each route gets the handler's transaction. For a LeaseHandler,
// use ByType(Routes[*Lease]{...}) as Call: each route gets the lease, and
// a type without a route never reaches the routes that call external
// APIs.
//
// A type without a route is bad input, not a passing failure: the message
// fails with a permanent *UnknownTypeError (matching ErrUnknownType), so
// Process rolls back and returns it (in lease mode, marks the message
// failed for good), and a Consumer or LeaseConsumer dead-letters the
// message at once with class "permanent" and the type in the reason, where
// an operator can see it and replay it after deploying the route. Nothing
// is dropped silently. To consume a type deliberately without an effect,
// route it to Ignore: it is then marked, and its redeliveries are
// Duplicates, like any applied message.
//
// The routes are copied: changing the map afterwards has no effect. A nil
// function in routes fails its messages permanently with ErrInvalidConfig.
// All types share the handler's name, so a message ID is applied at most
// once whatever its type.
func ByType[TTx any](routes Routes[TTx]) func(ctx context.Context, tx TTx, msg *Message) error {
	rs := make(Routes[TTx], len(routes))
	for t, fn := range routes {
		rs[t] = fn
	}
	return func(ctx context.Context, tx TTx, msg *Message) error {
		fn, ok := rs[msg.Type]
		if !ok {
			return &UnknownTypeError{Type: msg.Type}
		}
		if fn == nil {
			return Permanent(fmt.Errorf("%w: the route for message type %s is nil", ErrInvalidConfig, typeText(msg.Type)))
		}
		return fn(ctx, tx, msg)
	}
}

// Ignore applies nothing. Route a type to it in ByType to consume that type
// without an effect: the message is marked as applied (in lease mode, done).
func Ignore[TTx any](context.Context, TTx, *Message) error { return nil }
