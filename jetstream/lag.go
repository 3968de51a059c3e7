package jetstream

import (
	"context"
	"fmt"
)

// Lag returns the messages of the durable consumer's stream not yet
// acknowledged: those not delivered yet (the consumer's NumPending) plus
// those delivered and awaiting their ack (NumAckPending), as the server
// counts them. It reads the consumer's info, one request; the durable
// must exist (Run creates it). The metrics package samples it as
// idem_consumer_lag.
func (c *Consumer) Lag(ctx context.Context) (int64, error) {
	cons, err := c.js.Consumer(ctx, c.cfg.Stream, c.cfg.Durable)
	if err != nil {
		return 0, fmt.Errorf("jetstream: lag of %s/%s: %w", c.cfg.Stream, c.cfg.Durable, err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("jetstream: lag of %s/%s: %w", c.cfg.Stream, c.cfg.Durable, err)
	}
	return int64(info.NumPending) + int64(info.NumAckPending), nil
}

// LagSource names what Lag measures, for the metric's source label: the
// stream and the durable.
func (c *Consumer) LagSource() string { return c.cfg.Stream + "/" + c.cfg.Durable }
