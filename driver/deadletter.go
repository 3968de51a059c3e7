package driver

import (
	"context"
	"time"
)

// DeadLetterStore is implemented by drivers that keep dead letters in the
// same database as the markers.
type DeadLetterStore interface {
	// DeadLetterPut records a dead letter and returns its ID once it is
	// committed. A second dead letter for the same (handler, message ID,
	// PayloadHash) updates the row: error, class, fingerprint, attempts
	// and last failure time, and parks it again; first_failed_at is kept.
	// The same message ID with another payload is another dead letter:
	// the first payload is evidence, never overwritten. A row written
	// before payload hashes were stored (its hash empty) is the same dead
	// letter when its Raw equals dl.Raw, and takes dl's hash. Parking
	// again one in another state (discarded, replayed, replay requested,
	// replaying) is logged (dl.Actor and dl.Outcome, by default
	// RefailActor and RefailOutcome(Error)), so that its history says why
	// it is back. With dl.Repeat, a stored dead letter keeps its error,
	// class and fingerprint, and the write is always logged.
	// Without
	// a message ID (the delivery did not decode), a dead letter with the
	// same handler, Source, Raw and Error as a stored one updates it the
	// same way when Source is set: the delivery again, after a crash
	// before its ack. Concurrent writes of one such dead letter leave one
	// row.
	DeadLetterPut(ctx context.Context, dl *DeadLetter) (int64, error)
	// DeadLetterList returns the dead letters matching f, oldest first.
	// With f.Summary set, their Envelope and Raw are left nil (and not
	// read, where the store allows it): what a listing shows, without
	// the bodies, whose size has no bound.
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
	// DeadLetterReplaying is a dead letter a consumer claimed from
	// replay_requested and is running now: no other consumer runs it.
	// The consumer moves it on (replayed, parked, or back to
	// replay_requested when stopped); one left here by a consumer that
	// crashed is requested again once ConsumerConfig.ReplayClaimTimeout
	// has passed.
	DeadLetterReplaying = "replaying"
)

// DeadLetter is one stored dead letter.
type DeadLetter struct {
	// ID is the store's identity for the dead letter.
	ID int64
	// Handler is the handler that could not process the message.
	Handler   string
	MessageID string // "" when the delivery did not decode
	// PayloadHash is the message's payload hash (Message.PayloadHash);
	// nil when the delivery did not decode. With Handler and MessageID
	// it is the dead letter's key.
	PayloadHash []byte
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
	// Repeat, written by DeadLetterPut only, says the failure is one
	// recorded earlier seen again (a lease-mode message that failed for
	// good, delivered again): a stored dead letter keeps its Error, Class
	// and Fingerprint, so that its group stays the same, and the write is
	// logged even when it was parked already. Without a stored dead
	// letter the write is as usual.
	Repeat bool
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
	// AfterID restricts the selection to IDs above it: the next page
	// after a page whose last ID it is.
	AfterID int64
	Limit   int // 0: no limit
	// Summary leaves Envelope and Raw out of the result.
	Summary bool
}
