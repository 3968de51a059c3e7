package idem

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"unicode/utf8"
)

var (
	// ErrInvalidMessage matches every error about a malformed envelope.
	ErrInvalidMessage = errors.New("idem: invalid message")
	// ErrInvalidHandlerName matches every error about a bad handler name.
	ErrInvalidHandlerName = errors.New("idem: invalid handler name")
	// ErrConflict matches a *ConflictError: the same message ID was seen
	// before with a different payload.
	ErrConflict = errors.New("idem: same message ID, different payload")
	// ErrInvalidConfig matches errors about a bad Config or driver option.
	ErrInvalidConfig = errors.New("idem: invalid configuration")
	// ErrWaitsForAggregate matches the Err of a retry verdict for a
	// delivery that a batch did not process: an earlier delivery of the
	// same aggregate in the batch is to be retried first, and this one
	// must not overtake it. Such a retry is no attempt of its own:
	// adapters that count attempts themselves (Kafka, RabbitMQ) do not
	// count it. Behind a delivery held by an outage or cut by a stop, it
	// wraps that one's error too (ErrStoreUnavailable, ErrStopped). The
	// Consumer sets it. A handler's Apply that returns it has its message
	// dead-lettered as permanent, with that reason (retried, it would
	// come back for ever, no attempt counted); a DeliveryHandler of your
	// own must not put it in a verdict.
	ErrWaitsForAggregate = errors.New("idem: waits for an earlier message of its aggregate")
	// ErrStoreUnavailable matches the Err of a retry verdict for a
	// delivery held while its store was down, when the adapter stopped
	// before the store answered again. The delivery did not fail: it is
	// no attempt, and adapters that count attempts themselves (Kafka) do
	// not count it.
	ErrStoreUnavailable = errors.New("idem: store unavailable")
	// ErrStopped matches the Err of a retry verdict for a delivery still
	// running ConsumerConfig.StopGrace after its adapter stopped, and
	// cancelled then: its transaction was rolled back, nothing of it
	// applied, unless the cut came during the commit, whose outcome is
	// then unknown (the delivery again is then a Duplicate). Like a held
	// delivery (ErrStoreUnavailable), it is no
	// attempt: adapters that count attempts themselves (Kafka) do not
	// count it, and those that requeue held deliveries at a stop
	// (RabbitMQ, JetStream on a last delivery) requeue it as well.
	ErrStopped = errors.New("idem: stopped before the delivery was decided")
	// ErrSequenceMismatch matches the error of a batch whose store
	// advanced an aggregate's sequence (driver.SequenceManyAdvancer) to
	// another value than idem decided from the sequence before: a driver
	// bug. The batch's transaction is rolled back, so nothing of it is
	// applied.
	ErrSequenceMismatch = errors.New("idem: the store's sequence advance disagrees with idem's decision")
)

// ValidationError describes why an envelope or a handler name was refused.
// It matches ErrInvalidMessage or ErrInvalidHandlerName with errors.Is.
// Validation errors are never retriable: the same input fails the same way.
type ValidationError struct {
	// Field names what was wrong: "ID", "AggregateID", "handler name", ...
	Field string
	// Reason says why, in words.
	Reason string
	// Value is the offending value, possibly long or binary; Error quotes a
	// bounded prefix of it.
	Value string

	err error
}

// Error implements error.
func (e *ValidationError) Error() string {
	msg := e.err.Error() + ": " + e.Field + " " + e.Reason
	if e.Value != "" {
		msg += " (" + quoteBounded(e.Value, 80) + ")"
	}
	return msg
}

// quoteBounded quotes s (escaping invalid and unprintable bytes) and cuts
// the quoted form at a rune boundary so it is at most max bytes plus "…".
func quoteBounded(s string, max int) string {
	if len(s) > max {
		s = s[:max]
	}
	q := strconv.Quote(s)
	if len(q) <= max {
		return q
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(q[cut]) {
		cut--
	}
	return q[:cut] + "…"
}

// Unwrap returns the sentinel (ErrInvalidMessage or ErrInvalidHandlerName).
func (e *ValidationError) Unwrap() error { return e.err }

// ConflictError reports that a message ID already has a marker with a
// different payload hash. The message was not applied. It matches
// ErrConflict.
type ConflictError struct {
	// Handler and MessageID name the marker.
	Handler   string
	MessageID string
	// StoredHash is the payload hash in the marker; ReceivedHash the
	// hash of the payload just delivered (SHA-256).
	StoredHash   []byte
	ReceivedHash []byte
}

// Error implements error.
func (e *ConflictError) Error() string {
	return fmt.Sprintf("idem: handler %q, message %q: payload hash %s differs from the stored %s",
		e.Handler, e.MessageID, shortHash(e.ReceivedHash), shortHash(e.StoredHash))
}

// Is makes errors.Is(err, ErrConflict) true.
func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

func shortHash(h []byte) string {
	if len(h) > 8 {
		h = h[:8]
	}
	return hex.EncodeToString(h)
}

// PanicError is returned when a handler panicked. The transaction was rolled
// back; the panic did not escape the processor.
type PanicError struct {
	// Value is what the handler passed to panic.
	Value any
	// Stack is the goroutine stack at the panic.
	Stack []byte
}

// Error implements error.
func (e *PanicError) Error() string { return fmt.Sprintf("idem: handler panicked: %v", e.Value) }

// Unwrap returns Value when it is an error.
func (e *PanicError) Unwrap() error {
	if err, ok := e.Value.(error); ok {
		return err
	}
	return nil
}

// PermanentError marks an error as non-retriable: retrying the same message
// fails the same way, so it belongs in the dead-letter store at once.
// Create one with Permanent.
type PermanentError struct {
	// Err is the underlying error.
	Err error
}

// Error implements error.
func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so that IsPermanent reports true for it: return it
// from a handler for input that can never succeed (a payload that does not
// decode, an unknown event type). Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err is non-retriable: it wraps a
// *PermanentError, a *ValidationError, a *ConflictError, an
// *UnknownTypeError, a final *GapError or a final *RowGuardError. Every
// other error is treated as retriable.
func IsPermanent(err error) bool {
	var (
		pe *PermanentError
		ve *ValidationError
		ce *ConflictError
		ue *UnknownTypeError
		ge *GapError
		re *RowGuardError
	)
	return errors.As(err, &pe) || errors.As(err, &ve) || errors.As(err, &ce) ||
		errors.As(err, &ue) || (errors.As(err, &ge) && ge.Final) || (errors.As(err, &re) && re.Final)
}
