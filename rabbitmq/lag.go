package rabbitmq

import (
	"context"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Lag returns the messages ready in the consumer's queue, as a passive
// declare reports them: those not delivered yet. Deliveries awaiting
// their ack and messages waiting out a retry's delay in the retry queues
// are not counted. It uses the consumer's connection while Run has one,
// else a connection of its own for the call. The metrics package samples
// it as idem_consumer_lag.
func (c *Consumer) Lag(ctx context.Context) (int64, error) {
	conn := c.conn.Load()
	if conn == nil || conn.IsClosed() {
		var err error
		sock := &socket{}
		defer context.AfterFunc(ctx, sock.close)()
		if conn, err = dialContext(ctx, c.cfg.URL, c.cfg.AMQP, sock); err != nil {
			return 0, fmt.Errorf("rabbitmq: lag of queue %q: %w", c.cfg.Queue, err)
		}
		defer conn.Close()
	}
	// The channel's opening, the declare and the closing each wait for
	// the broker, on a connection that may be partitioned (no answer until
	// heartbeats fail): they run aside, and ctx bounds the call.
	type result struct {
		q   amqp.Queue
		err error
	}
	done := make(chan result, 1)
	go func() {
		ch, err := conn.Channel()
		if err != nil {
			done <- result{err: err}
			return
		}
		q, err := ch.QueueDeclarePassive(c.cfg.Queue, false, false, false, false, nil)
		done <- result{q, err}
		_ = ch.Close()
	}()
	select {
	case <-ctx.Done():
		return 0, fmt.Errorf("rabbitmq: lag of queue %q: %w", c.cfg.Queue, ctx.Err())
	case r := <-done:
		if r.err != nil {
			return 0, fmt.Errorf("rabbitmq: lag of queue %q: %w", c.cfg.Queue, r.err)
		}
		return int64(r.q.Messages), nil
	}
}

// LagSource names what Lag measures, for the metric's source label: the
// queue.
func (c *Consumer) LagSource() string { return c.cfg.Queue }
