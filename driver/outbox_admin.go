package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// OutboxState is where an unpublished outbox row stands, as an operator
// sees it.
type OutboxState string

// The states of an unpublished outbox row.
const (
	// OutboxPending rows have not failed a publish yet.
	OutboxPending OutboxState = "pending"
	// OutboxFailing rows failed at least one publish; the relay retries
	// them after the key's backoff.
	OutboxFailing OutboxState = "failing"
	// OutboxParked rows were set aside by an operator: no relay publishes
	// them, nor the later rows of their ordering key, until they are
	// retried (OutboxRetryNow) or discarded.
	OutboxParked OutboxState = "parked"
)

// Valid reports whether s is one of the states, or empty (any state).
func (s OutboxState) Valid() bool {
	switch s {
	case "", OutboxPending, OutboxFailing, OutboxParked:
		return true
	}
	return false
}

// OutboxFilter selects unpublished outbox rows for OutboxList. The zero
// value selects every unpublished row, up to the store's default limit.
type OutboxFilter struct {
	// State keeps the rows in one state; empty keeps all.
	State OutboxState
	// Destination keeps the rows published to this topic or subject
	// (exact match); empty keeps all.
	Destination string
	// OrderingKey keeps one ordering key's rows: the aggregate ID, or
	// "msg:" and the message ID for a message without aggregate. Empty
	// keeps all.
	OrderingKey string
	// IDs, when non-nil, keeps these rows only; an empty non-nil slice
	// keeps none.
	IDs []int64
	// AfterID keeps rows with a higher ID: the previous page's Next.
	AfterID int64
	// Limit bounds the rows returned; 0 means 100, and a store may cap
	// it at 1,000.
	Limit int
}

// OutboxEntry is one unpublished outbox row as an operator sees it.
type OutboxEntry struct {
	// OutboxRow is the row, its payload and headers included.
	OutboxRow
	// State is the row's state.
	State OutboxState
	// LastError is the last failed publish's text; empty before any.
	LastError string
	// HeldUntil is when the key's backoff after a failed publish ends;
	// zero when the key is not held.
	HeldUntil time.Time
	// ClaimedBy names the relay publishing the row's key right now, with
	// its claim's end in ClaimedUntil; empty when none is.
	ClaimedBy    string
	ClaimedUntil time.Time
	// ParkedAt, ParkedBy and ParkReason say when, by whom and why the row
	// was parked; zero and empty unless State is OutboxParked.
	ParkedAt   time.Time
	ParkedBy   string
	ParkReason string
	// BlockedBy is the ID of a parked row earlier in the same ordering
	// key, which keeps this one from being published; 0 when none does.
	BlockedBy int64
}

// OutboxCounts counts unpublished rows by state.
type OutboxCounts struct {
	Pending, Failing, Parked int64
}

// OutboxPage is one page of OutboxList.
type OutboxPage struct {
	// Rows are the selected rows in ID order.
	Rows []OutboxEntry
	// Next is the AfterID of the following page; 0 when this is the last.
	Next int64
	// Counts are the unpublished rows matching the filter's Destination
	// and OrderingKey, whatever their state and page.
	Counts OutboxCounts
}

// SetListed fills in what a store's list derives from an unpublished row
// read with its key's claim: the state (parked when parkedAt is set,
// failing after a failed attempt, else pending) and the claim. claimed
// says a claim row was read; its empty owner is a hold after a failed
// publish (HeldUntil), any other a relay's claim (ClaimedBy,
// ClaimedUntil). ParkedBy and ParkReason are the store's to set.
func (e *OutboxEntry) SetListed(parkedAt time.Time, claimed bool, owner string, until time.Time) {
	switch {
	case !parkedAt.IsZero():
		e.State, e.ParkedAt = OutboxParked, parkedAt
	case e.Attempts > 0:
		e.State = OutboxFailing
	default:
		e.State = OutboxPending
	}
	switch {
	case !claimed:
	case owner == "":
		e.HeldUntil = until
	default:
		e.ClaimedBy, e.ClaimedUntil = owner, until
	}
}

// Trim cuts a page a store read with one row more than limit (to learn
// whether another page follows) to limit rows, and sets Next.
func (p *OutboxPage) Trim(limit int) {
	if len(p.Rows) > limit {
		p.Rows = p.Rows[:limit]
		p.Next = p.Rows[limit-1].ID
	}
}

// OutboxActionResult reports what an operator's action did to each row
// it named.
type OutboxActionResult struct {
	// Done lists the rows the action applied to, in ID order.
	Done []int64
	// Busy lists rows left alone because a relay was publishing their
	// key at that moment: the action may be repeated shortly.
	Busy []int64
	// Missing lists rows that are unknown, already published, or (Park)
	// parked already.
	Missing []int64
}

// OutboxAdmin is implemented by outbox stores an operator can inspect and
// act on: list the unpublished rows, and retry, park or discard some.
//
// Park and Discard take each row's ordering key the way a relay claims
// it, inside their transaction, and leave alone (Busy) the rows of a key
// a relay holds live: once they return, no relay publishes a row they
// parked or deleted. A key held only for a failure's backoff is theirs to
// take. Each action appends one entry per row it applied to, with the
// actor and reason, to the outbox log table.
type OutboxAdmin interface {
	// OutboxList returns one page of unpublished rows matching f, and
	// the counts by state.
	OutboxList(ctx context.Context, f OutboxFilter) (OutboxPage, error)
	// OutboxRetryNow makes the unpublished rows ids publishable at once:
	// it unparks them and ends their keys' backoff, so that the next
	// relay cycle takes them. Their attempts are kept.
	OutboxRetryNow(ctx context.Context, ids []int64, actor string) (OutboxActionResult, error)
	// OutboxPark sets the unpublished rows ids aside, with who did it and
	// why: no relay publishes them, nor the later rows of their keys,
	// until they are retried or discarded. They stay listed as parked.
	OutboxPark(ctx context.Context, ids []int64, actor, reason string) (OutboxActionResult, error)
	// OutboxDiscard deletes the unpublished rows ids: they are never
	// published. The later rows of their keys go on, with a gap in the
	// aggregate's sequence that consumers' ordering guard sees.
	OutboxDiscard(ctx context.Context, ids []int64, actor, reason string) (OutboxActionResult, error)
}

// ErrInvalidOutboxFilter is returned by OutboxList for a filter with an
// unknown state or a negative limit.
var ErrInvalidOutboxFilter = errors.New("invalid outbox filter")

// Default and largest page sizes of OutboxList.
const (
	OutboxListDefault = 100
	OutboxListMax     = 1000
)

// Check validates f and returns the page size it asks for: Limit, 100 if
// zero, at most 1,000. Stores call it first.
func (f *OutboxFilter) Check() (limit int, err error) {
	if !f.State.Valid() {
		return 0, fmt.Errorf("%w: state %q is not pending, failing or parked", ErrInvalidOutboxFilter, f.State)
	}
	if f.Limit < 0 || f.AfterID < 0 {
		return 0, fmt.Errorf("%w: negative limit or after-ID", ErrInvalidOutboxFilter)
	}
	switch {
	case f.Limit == 0:
		return OutboxListDefault, nil
	case f.Limit > OutboxListMax:
		return OutboxListMax, nil
	}
	return f.Limit, nil
}

// OutboxResult builds an action's result for stores: asked are the IDs
// the action named, done those it applied to, busy those it left to a
// relay; every other asked ID is Missing. Each list is sorted, without
// repeats.
func OutboxResult(asked, done, busy []int64) OutboxActionResult {
	clean := func(ids []int64) []int64 {
		out := slices.Clone(ids)
		slices.Sort(out)
		return slices.Compact(out)
	}
	r := OutboxActionResult{Done: clean(done), Busy: clean(busy)}
	for _, id := range clean(asked) {
		if _, ok := slices.BinarySearch(r.Done, id); ok {
			continue
		}
		if _, ok := slices.BinarySearch(r.Busy, id); ok {
			continue
		}
		r.Missing = append(r.Missing, id)
	}
	return r
}
