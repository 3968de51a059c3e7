package idem

import (
	"context"
	"fmt"
	"time"

	"github.com/idemhq/idem/driver"
)

// LeaseConsumer is Consumer for lease mode: it decides the fate of broker
// deliveries for one LeaseHandler, so that the broker adapters (Kafka,
// JetStream, RabbitMQ, the Watermill bridge) drive handlers whose effect lives outside the database (an email, an
// HTTP call). It implements DeliveryHandler. It is safe for concurrent use.
//
// Besides what Consumer does, it maps InFlight: another worker holds the
// message's lease, or a failed attempt's retry is not due. Such a delivery
// is not acknowledged but asked again after the backoff, and no earlier
// than the holder's lease can run out or the failed attempt's retry is
// due; the worker holding the lease acknowledges its own delivery. On the broker's last delivery (Delivery.LastAttempt)
// an in-flight message is dead-lettered rather than dropped; replayed
// later, it is a Duplicate if the holder finished it.
//
// ConsumerConfig.MaxAttempts counts the broker's deliveries of failures;
// LeaseConfig.MaxAttempts counts claims. A message that failed for good
// (a Permanent error, or LeaseConfig.MaxAttempts reached) is
// dead-lettered; replaying its dead letter makes it claimable once more
// when the driver implements driver.LeaseRearmer (the SQLite, Postgres
// and MySQL drivers do).
type LeaseConsumer struct {
	*deliveries
}

// NewLeaseConsumer returns a LeaseConsumer running h through p, with dead
// letters in dl, normally the same driver as p's. As NewConsumer, it
// refuses with an error matching ErrInvalidConfig an Ordering every
// message would fail on (VersionOnly, an unknown gap policy, a driver
// without driver.LeaseSequencer).
func NewLeaseConsumer(p *LeaseProcessor, h *LeaseHandler, dl driver.DeadLetterStore, cfg *ConsumerConfig) (*LeaseConsumer, error) {
	if p == nil || dl == nil {
		return nil, fmt.Errorf("%w: NewLeaseConsumer needs a lease processor and a dead-letter store", ErrInvalidConfig)
	}
	if h == nil || h.Call == nil {
		return nil, fmt.Errorf("%w: NewLeaseConsumer needs a lease handler with a Call", ErrInvalidConfig)
	}
	if err := ValidateHandlerName(h.Name); err != nil {
		return nil, err
	}
	// As NewConsumer: a setup no message can pass is refused here.
	if err := p.checkSetup(h); err != nil {
		return nil, err
	}
	d, err := newDeliveries(h.Name, func(ctx context.Context, msg *Message) (Outcome, time.Duration, error) {
		// A failed attempt is claimable at its next attempt time, not
		// before: no point in asking earlier.
		var due time.Duration
		out, err := p.run(ctx, h, msg, &due)
		return out, due, err
	}, dl, p.drv, cfg)
	if err != nil {
		return nil, err
	}
	d.ordering = h.Ordering
	d.cuts = true
	if r, ok := p.drv.(driver.LeaseRearmer); ok {
		d.rearm = func(ctx context.Context, id string) error { return r.LeaseRearm(ctx, h.Name, id) }
	}
	return &LeaseConsumer{deliveries: d}, nil
}

// HandleDelivery implements DeliveryHandler.
func (c *LeaseConsumer) HandleDelivery(ctx context.Context, d *Delivery) Verdict {
	return c.handle(ctx, d)
}

// AggregateKey implements AggregateKeyer: aggregateID normalized by the
// handler's Ordering.Normalize, or unchanged without one.
func (c *LeaseConsumer) AggregateKey(aggregateID string) string { return c.aggregateKey(aggregateID) }

// Replay runs this handler's dead letters in state replay_requested, as
// Consumer.Replay does; a message that failed for good is made claimable
// again first (see LeaseConsumer).
func (c *LeaseConsumer) Replay(ctx context.Context) (ReplayResult, error) { return c.replay(ctx) }

// Run replays requested dead letters every interval until ctx is done,
// logging failures, and returns ctx's error.
func (c *LeaseConsumer) Run(ctx context.Context, interval time.Duration) error {
	return c.run(ctx, interval)
}
