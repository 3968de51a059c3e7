package driver

import (
	"context"
	"time"
)

// DeadLetterStore is implemented by drivers that keep dead letters in the
// same database as the markers.
type DeadLetterStore interface {
	// DeadLetterPut records a dead letter and returns its ID once it is
	// committed. A second dead letter for the same (handler, message ID)
	// updates the row: error, class, fingerprint, attempts and last
	// failure time, and parks it again; first_failed_at is kept. Parking
	// again one in another state (discarded, replayed, replay requested)
	// is logged (dl.Actor and dl.Outcome, by default RefailActor and
	// RefailOutcome(Error)), so that its history says why it is back.
	// Without
	// a message ID (the delivery did not decode), a dead letter with the
	// same handler, Source, Raw and Error as a stored one updates it the
	// same way when Source is set: the delivery again, after a crash
	// before its ack. Concurrent writes of one such dead letter leave one
	// row.
	DeadLetterPut(ctx context.Context, dl *DeadLetter) (int64, error)
	// DeadLetterList returns the dead letters matching f, oldest first.
	DeadLetterList(ctx context.Context, f *DeadLetterFilter) ([]DeadLetter, error)
	// DeadLetterSetState moves the dead letters in c.IDs whose state is
	// one of c.From to c.To, records each move in the dead-letter log in
	// the same transaction, and returns how many moved.
	DeadLetterSetState(ctx context.Context, c *DeadLetterStateChange) (int, error)
	// DeadLetterHistory returns the log of a dead letter, oldest first.
	DeadLetterHistory(ctx context.Context, id int64) ([]DeadLetterEvent, error)
}

// DeadLetterStateChange is the parameter of DeadLetterSetState.
type DeadLetterStateChange struct {
	// IDs are the dead letters to move; only those now in one of the
	// From states move, to To.
	IDs  []int64
	From []string
	To   string
	// Actor is who asked: an operator ("alice@host") or a consumer.
	Actor string
	// Outcome is the result, for replays ("applied", "duplicate", the
	// new error); empty for a request.
	Outcome string
}

// DeadLetterEvent is one entry of a dead letter's log.
type DeadLetterEvent struct {
	// At is when the dead letter entered State.
	At    time.Time
	State string
	// Actor and Outcome are as in DeadLetterStateChange.
	Actor   string
	Outcome string
}

// RefailActor is the default actor of the log entry DeadLetterPut writes
// when it parks again a dead letter in another state.
const RefailActor = "delivery"

// RefailOutcome is the default outcome of that log entry: the new error.
func RefailOutcome(errText string) string { return "failed again: " + errText }

// RefailLog returns the actor and outcome of the log entry DeadLetterPut
// writes for dl, with their defaults applied.
func RefailLog(dl *DeadLetter) (actor, outcome string) {
	actor, outcome = dl.Actor, dl.Outcome
	if actor == "" {
		actor = RefailActor
	}
	if outcome == "" {
		outcome = RefailOutcome(dl.Error)
	}
	return actor, outcome
}

// DeadLetter states.
const (
	DeadLetterParked          = "parked"
	DeadLetterReplayRequested = "replay_requested"
	DeadLetterReplayed        = "replayed"
	DeadLetterDiscarded       = "discarded"
)

// DeadLetter is one stored dead letter.
type DeadLetter struct {
	// ID is the store's identity for the dead letter.
	ID int64
	// Handler is the handler that could not process the message.
	Handler   string
	MessageID string // "" when the delivery did not decode
	// Envelope is the message as JSON; nil when the delivery did not
	// decode.
	Envelope []byte
	// Raw is the broker payload as received.
	Raw []byte
	// Source says where the delivery came from (topic/partition@offset,
	// stream/consumer/sequence).
	Source string
	// Error is the last error's text; Class why it was dead-lettered
	// (idem.DeadLetterDecode, DeadLetterConflict, …); Fingerprint groups
	// dead letters failing the same way.
	Error       string
	Class       string
	Fingerprint string
	// Attempts is the broker's delivery count at the last failure.
	Attempts int
	// FirstFailed and LastFailed bound the failures recorded.
	FirstFailed time.Time
	LastFailed  time.Time
	// State is one of the DeadLetter* states.
	State string
	// Actor and Outcome are written by DeadLetterPut only: the log entry
	// it adds when it parks again a dead letter in another state
	// (discarded, replayed, replay requested). Empty: RefailActor and
	// RefailOutcome(Error).
	Actor, Outcome string
}

// DeadLetterFilter selects dead letters. Zero fields match everything.
type DeadLetterFilter struct {
	// Handler, Fingerprint and State each restrict the selection when set.
	Handler     string
	Fingerprint string
	State       string
	// IDs restricts the selection to these dead letters when non-nil. An
	// empty non-nil slice matches none, so that a selection built from
	// empty input (say, no rows ticked) never widens to every dead letter.
	IDs   []int64
	Since time.Time // last failure at or after
	Until time.Time // last failure before
	Limit int       // 0: no limit
}
