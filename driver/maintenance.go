package driver

import (
	"context"
	"time"
)

// Clock is implemented by drivers whose store stamps rows with its own
// clock (Postgres: now()). Retention takes its cutoff from it, so that a
// host whose clock runs ahead does not delete markers early.
type Clock interface {
	// Now returns the store's current time.
	Now(ctx context.Context) (time.Time, error)
}

// MarkerPruner is implemented by drivers whose markers can be deleted by
// age. idem.Pruner drives it: one bounded batch per call, each in its own
// short transaction, walking the table with a cursor (the primary key, or
// a driver's own position) so that no batch re-reads rows an earlier one
// deleted. Rows of running leases, and of
// failed leases (to be retried, or failed for good), are never deleted,
// whatever their age: their fencing token must go on growing, and a
// replay of a failed one's dead letter may come at any time. Done lease
// rows are deleted like markers; a lease row's processing time is that
// of its last decision.
type MarkerPruner interface {
	// PruneMarkers deletes up to p.Limit markers processed before
	// p.Before that come after p.After, in the driver's walking order.
	PruneMarkers(ctx context.Context, p *PruneParams) (PruneResult, error)
	// CountPrunable counts, per handler, the markers PruneMarkers would
	// delete for the cutoff before, and returns the oldest marker's time
	// (zero when there are none).
	CountPrunable(ctx context.Context, before time.Time) (counts map[string]int64, oldest time.Time, err error)
	// TryMaintenanceLock takes the store-wide maintenance lock without
	// waiting. ok is false when another instance holds it. unlock releases
	// it; it must be called when ok is true.
	TryMaintenanceLock(ctx context.Context) (unlock func(), ok bool, err error)
}

// MarkerKey is the pruning cursor: a marker's primary key, or a position
// in the store's own order.
type MarkerKey struct {
	// Handler and MessageID are the primary key's columns.
	Handler   string
	MessageID string
	// Position is a driver's own cursor, for a table it walks in another
	// order than the key (Postgres: physical position). Zero where
	// unused; the core hands it back unchanged.
	Position int64
}

// PruneParams are the parameters of MarkerPruner.PruneMarkers.
type PruneParams struct {
	// Before is the cutoff: markers processed at or after it stay.
	Before time.Time
	// After is the cursor: only markers after it are considered (by key:
	// byte order of handler, then message ID; by Position where the
	// driver sets one). The zero key starts at the beginning.
	After MarkerKey
	// Limit bounds the rows deleted, at least 1.
	Limit int
}

// PruneResult is the result of one PruneMarkers batch.
type PruneResult struct {
	// Deleted is the number of markers deleted.
	Deleted int
	// Last is where the batch stopped: the next batch's After.
	// Meaningless when Done.
	Last MarkerKey
	// Done is true when no prunable marker comes after the cursor.
	Done bool
}

// GapPruner is implemented by drivers that keep the ordering guard's gap
// sightings (GapWait's first sightings) in a table. PruneGaps deletes up
// to limit sightings that no longer matter, because their aggregate's
// last applied sequence has reached them, or that were first seen before
// before, and returns how many it deleted. idem.Pruner calls it after the
// markers until fewer than limit are deleted.
type GapPruner interface {
	PruneGaps(ctx context.Context, before time.Time, limit int) (int, error)
}
