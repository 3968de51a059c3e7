package driver

import "context"

// Prober is implemented by drivers that can tell an outage of their store
// from the failure of one message. With it, a Consumer, a LeaseConsumer
// and an outbox Relay pause while the store is down instead of counting
// each delivery that fails meanwhile as an attempt (see the "When the
// store is down" section of docs/operations.md). Without it they treat
// every error as the message's own, as before.
type Prober interface {
	// Unavailable reports whether err looks like the store being out of
	// reach: connection refused or reset, the server shutting down, too
	// many connections, a read-only failover, a pool exhausted past its
	// deadline, a lock held past the driver's wait. It is a hint only:
	// idem confirms it with Probe before pausing.
	Unavailable(err error) bool
	// Probe returns nil when the store answers and takes writes now. It
	// must not wait past ctx.
	Probe(ctx context.Context) error
}
