package driver

import (
	"context"
	"time"
)

// SequenceGuard is implemented by drivers that support idem's per-aggregate
// ordering guard and version-only mode.
type SequenceGuard[TTx any] interface {
	// SequenceAdvance moves the last applied sequence of (Handler,
	// AggregateID) to Seq inside tx, if and only if Seq is the next one
	// (last+1), or any later one when AllowGap is set. A missing row counts
	// as last = 0. Concurrent calls for one aggregate serialize on its row:
	// a caller waits for the other transaction and then decides on the
	// committed value. When it does not advance, the result reports the
	// committed last sequence so the core can tell stale from gap.
	SequenceAdvance(ctx context.Context, tx TTx, p *SequenceAdvanceParams) (SequenceAdvanceResult, error)

	// GapSighting records, in its own committed statement, that Seq of
	// (Handler, AggregateID) was seen while an earlier sequence was
	// missing, and returns when it was first seen together with the
	// store's current time (the same clock), so the Wait policy's deadline
	// holds across retries, restarts and instances.
	GapSighting(ctx context.Context, p *GapSightingParams) (GapSightingResult, error)
}

// BeginSequenceAdvancer is an optional fast path for version-only handlers:
// open a transaction and run SequenceAdvance in it, in as few round trips
// as the store allows. On error no transaction is left open.
type BeginSequenceAdvancer[TTx any] interface {
	BeginSequenceAdvance(ctx context.Context, p *SequenceAdvanceParams) (TTx, SequenceAdvanceResult, error)
}

// SequenceBatchStore is an optional fast path for batches of a handler with
// an ordering guard: read and lock many aggregates' sequences at once, and
// write them back, so that a batch costs two statements rather than one
// per message. The core decides each message between the two calls;
// without this interface it calls SequenceAdvance once per message.
type SequenceBatchStore[TTx any] interface {
	// SequenceLockMany returns the last applied sequence of (Handler,
	// each of AggregateIDs), 0 for one never seen, parallel to
	// AggregateIDs, and ensures that no other transaction moves them
	// before tx ends: it locks their rows (creating missing ones), or
	// relies on a store-wide write lock. AggregateIDs are unique and
	// sorted (byte order): lock them in that order, the same in every
	// batch, so that concurrent batches queue instead of deadlocking.
	SequenceLockMany(ctx context.Context, tx TTx, p *SequenceLockManyParams) ([]int64, error)
	// SequenceSetMany sets the last applied sequences of aggregates that
	// SequenceLockMany locked in tx.
	SequenceSetMany(ctx context.Context, tx TTx, p *SequenceSetManyParams) error
}

// SequenceManyAdvancer is an optional fast path beyond SequenceBatchStore:
// decide and advance many aggregates' sequences with one statement, which
// takes each row's lock with its one write instead of a locking read and
// a write. The core checks the store's decision against its own (see
// SequenceAdvanceMany) and fails the batch, rolling it back, if they
// differ.
type SequenceManyAdvancer[TTx any] interface {
	// SequenceAdvanceMany moves the last applied sequence L of (Handler,
	// AggregateIDs[i]) (0 for one never seen) to the end of the run of
	// consecutive sequences in Seqs[i] that starts at L+1, if there is
	// one; with AllowGap, to the largest of Seqs[i] when it is greater
	// than L. It returns, parallel to AggregateIDs, L before and the last
	// applied sequence after. Concurrent calls serialize on each row, as
	// SequenceAdvance's do, and take the rows in AggregateIDs' order
	// (unique, sorted by byte order) so that batches queue instead of
	// deadlocking.
	SequenceAdvanceMany(ctx context.Context, tx TTx, p *SequenceAdvanceManyParams) (before, after []int64, err error)
}

// SequenceAdvanceManyParams are the parameters of
// SequenceManyAdvancer.SequenceAdvanceMany.
type SequenceAdvanceManyParams struct {
	// Handler names the sequences' handler.
	Handler string
	// AggregateIDs are unique and sorted ascending (byte order).
	AggregateIDs []string
	// Seqs[i] are the sequences (≥ 1) of AggregateIDs[i]'s messages in the
	// batch, ascending and unique.
	Seqs [][]int64
	// AllowGap advances to the largest sequence greater than the last.
	AllowGap bool
}

// SequenceLockManyParams are the parameters of
// SequenceBatchStore.SequenceLockMany.
type SequenceLockManyParams struct {
	// Handler names the sequences' handler.
	Handler string
	// AggregateIDs are unique and sorted ascending (byte order).
	AggregateIDs []string
}

// SequenceSetManyParams are the parameters of
// SequenceBatchStore.SequenceSetMany.
type SequenceSetManyParams struct {
	// Handler names the sequences' handler.
	Handler string
	// AggregateIDs (unique) and Seqs are parallel: the new last applied
	// sequence of each.
	AggregateIDs []string
	Seqs         []int64
}

// SequenceAdvanceParams are the parameters of SequenceGuard.SequenceAdvance.
type SequenceAdvanceParams struct {
	// Handler and AggregateID name the sequence.
	Handler     string
	AggregateID string
	// Seq is ≥ 1.
	Seq int64
	// AllowGap advances to any Seq greater than the last one.
	AllowGap bool
}

// SequenceAdvanceResult reports what SequenceAdvance did.
type SequenceAdvanceResult struct {
	// Advanced is true when the last applied sequence is now Seq.
	Advanced bool
	// Last is the committed last applied sequence when Advanced is false.
	Last int64
}

// GapSightingParams are the parameters of SequenceGuard.GapSighting.
type GapSightingParams struct {
	// Handler and AggregateID name the sequence; Seq is the sequence of
	// the message that found the gap.
	Handler     string
	AggregateID string
	Seq         int64
}

// GapSightingResult is the answer of SequenceGuard.GapSighting.
type GapSightingResult struct {
	// FirstSeen is when this sequence was first seen with a gap before it.
	FirstSeen time.Time
	// Now is the store's current time, on the same clock as FirstSeen.
	Now time.Time
}

// VersionStore is implemented by drivers that support write-side
// sequencing: a per-aggregate version counter advanced inside the caller's
// transaction.
type VersionStore[TTx any] interface {
	// VersionNext allocates the next version of (Stream, AggregateID) in
	// one statement and returns it (1 for a new aggregate). The row stays
	// locked until tx ends, so a rolled-back transaction gives its number
	// back and committed numbers have no gaps.
	VersionNext(ctx context.Context, tx TTx, p *VersionParams) (int64, error)
	// VersionAdvance moves the version from Expected to Expected+1 in one
	// conditional statement (Expected 0 creates the aggregate). It reports
	// false, with the current version, when the version was not Expected.
	VersionAdvance(ctx context.Context, tx TTx, p *VersionParams) (advanced bool, current int64, err error)
	// VersionCurrent reads the version (0 for an unknown aggregate).
	VersionCurrent(ctx context.Context, tx TTx, p *VersionParams) (int64, error)
}

// VersionParams name an aggregate on the write side.
type VersionParams struct {
	// Stream and AggregateID name the aggregate.
	Stream      string
	AggregateID string
	// Expected is the version the caller read, for VersionAdvance.
	Expected int64
}
