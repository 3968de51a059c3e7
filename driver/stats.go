package driver

import "context"

// StatsStore keeps per-handler counters of the outcomes that leave no row
// of their own: duplicate and stale deliveries. Markers already count the
// applied messages and dead letters the failed ones.
type StatsStore interface {
	// StatsAdd adds d to the handler's counters in one statement.
	StatsAdd(ctx context.Context, handler string, d StatsDelta) error
	// StatsRead returns every handler's counters.
	StatsRead(ctx context.Context) (map[string]StatsDelta, error)
}

// StatsDelta is an increment of a handler's counters.
type StatsDelta struct {
	// Duplicates and Stale count deliveries skipped as such.
	Duplicates, Stale int64
}
