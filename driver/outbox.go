package driver

import (
	"context"
	"time"
)

// OutboxRow is one message in the transactional outbox.
type OutboxRow struct {
	// ID is the row's key, assigned by the store on insert; rows of one
	// ordering key are published in ID order.
	ID int64
	// Destination is the topic or subject the row is published to.
	Destination string
	// MessageID is the message's idem ID.
	MessageID string
	// OrderingKey groups the rows that must go out in order and never be
	// published by two relays at once: the aggregate ID, or the message
	// ID for a message without aggregate.
	OrderingKey string
	// AggregateID, Seq and Type are the message's.
	AggregateID string
	Seq         int64
	Type        string
	// Headers are the message's headers as a JSON object, or nil.
	Headers []byte
	// Payload and PayloadHash are the body and its SHA-256.
	Payload, PayloadHash []byte
	// CreatedAt is when the row was added.
	CreatedAt time.Time
	// Attempts counts failed publish attempts.
	Attempts int
}

// OutboxWriter is implemented by drivers that add outbox rows inside the
// caller's transaction.
type OutboxWriter[TTx any] interface {
	// OutboxAdd inserts rows in tx, in order: their IDs increase in
	// slice order.
	OutboxAdd(ctx context.Context, tx TTx, rows []OutboxRow) error
}

// OutboxNextAdder is implemented by drivers that allocate an aggregate's
// next version (as VersionStore.VersionNext) and insert its outbox row in
// one statement. The row's Seq is ignored and its MessageID is the ID's
// prefix: the driver sets Seq to the allocated version and MessageID to
// the prefix followed by the version in decimal, and returns the version.
type OutboxNextAdder[TTx any] interface {
	OutboxAddNext(ctx context.Context, tx TTx, row *OutboxRow) (int64, error)
}

// OutboxRelayStore is implemented by drivers a relay can drain.
//
// A relay claims ordering keys, not rows: OutboxClaim records (key, owner,
// until) for keys no other live claim holds, in one conditional upsert per
// key, and returns the pending rows of the keys it won in ID order. While
// the claim lives no other relay publishes those keys, so a key's rows go
// out one relay at a time and in order, and different keys spread across
// relays.
type OutboxRelayStore interface {
	// OutboxClaim claims up to limit pending rows for owner until ttl
	// from now and returns them in ID order, no more of them than
	// OutboxClaimFits admits under maxBytes, so that a relay holds about
	// maxBytes of payloads (plus the one row read past the bound). cut
	// reports that the bound left rows out: they stay pending, and the
	// claims of keys it left without a row are dropped at once, so that
	// other relays take those keys while this one publishes.
	OutboxClaim(ctx context.Context, owner string, limit, maxBytes int, ttl time.Duration) (rows []OutboxRow, cut bool, err error)
	// OutboxMarkPublished marks rows published.
	OutboxMarkPublished(ctx context.Context, ids []int64) error
	// OutboxFailed counts owner's failed publish attempt on a row, keeps
	// the error text, and keeps every relay off the row's ordering key for
	// holdFor: the key's claim passes to no owner (the empty string, which
	// no relay is named) until then, so OutboxClaim skips the key and
	// OutboxRelease leaves the hold in place. The other keys' rows go on
	// being claimed meanwhile. The hold replaces only owner's claim, a
	// hold or an expired claim: when owner's claim ran out during the
	// publish and another relay has claimed the key since, that relay
	// keeps its claim (a hold would end it while it still publishes).
	OutboxFailed(ctx context.Context, owner string, id int64, errText string, holdFor time.Duration) error
	// OutboxRelease drops owner's claims.
	OutboxRelease(ctx context.Context, owner string) error
	// OutboxStats counts pending and published rows and returns the
	// oldest pending row's time (zero when none is pending).
	OutboxStats(ctx context.Context) (OutboxStats, error)
	// OutboxPrune deletes up to limit rows published before before, with
	// IDs above after, in ID order, and returns how many it deleted and
	// the last ID it deleted. A call with after 0, the first of a pass,
	// may also delete expired claims and holds, and deletes the outbox
	// log's entries (OutboxAdmin's actions) made before before.
	OutboxPrune(ctx context.Context, before time.Time, after int64, limit int) (deleted int, last int64, err error)
}

// OutboxPrunableCounter is implemented by outbox stores that count what
// OutboxPrune would delete: the rows published before before. It serves
// a retention dry run.
type OutboxPrunableCounter interface {
	OutboxCountPrunable(ctx context.Context, before time.Time) (int64, error)
}

// OutboxStats describes the outbox.
type OutboxStats struct {
	// Pending rows await the relay, parked ones included; Published rows
	// await cleanup.
	Pending, Published int64
	// OldestPending is the creation time of the oldest pending row that
	// is not parked.
	OldestPending time.Time
	// Failing counts pending rows, not parked, with at least one failed
	// attempt; LastError is the most recent such row's error text.
	Failing   int64
	LastError string
	// Parked counts the rows an operator set aside (OutboxAdmin).
	Parked int64
}

// OutboxNotifier is implemented by drivers that can wake a relay when rows
// are committed (Postgres LISTEN/NOTIFY). The channel receives a value
// after commits of new rows (coalesced) and is closed when ctx ends.
type OutboxNotifier interface {
	OutboxListen(ctx context.Context) (<-chan struct{}, error)
}

// OutboxClaimFits reports whether a row with a payload of n bytes joins an
// OutboxClaim whose rows so far (count of them) hold used payload bytes:
// the first row always does, so a row larger than maxBytes is still
// published, alone; a maxBytes of zero or less sets no bound. A store
// stops reading a claim's rows at the first that does not fit.
func OutboxClaimFits(count, used, n, maxBytes int) bool {
	return count == 0 || maxBytes <= 0 || used+n <= maxBytes
}

// OutboxIdleKeys returns the keys of claimed that none of rows has: those
// an OutboxClaim cut by its byte bound must release.
func OutboxIdleKeys(claimed []string, rows []OutboxRow) []string {
	has := make(map[string]bool, len(rows))
	for i := range rows {
		has[rows[i].OrderingKey] = true
	}
	var idle []string
	for _, k := range claimed {
		if !has[k] {
			idle = append(idle, k)
		}
	}
	return idle
}
