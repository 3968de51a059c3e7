package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Retry delays go by tiers: a retry waits in the retry queue of the
// smallest tier at or above its delay, a power of two of milliseconds
// from minTierMs to maxTierMs. Each tier's queue has one message TTL, so
// its messages expire in the order they came (RabbitMQ expires only a
// queue's head: one queue with per-message TTLs would hold a short delay
// behind a long one).
const (
	minTierMs = 1 << 4  // 16 ms
	maxTierMs = 1 << 24 // about 4.7 hours
)

// ErrUnroutable is returned when the broker returned a message published
// with the mandatory flag: no queue was bound to take it (basic.return).
// Publisher returns it for the messages of an exchange without a matching
// binding; the consumer meets it when a retry queue was deleted.
var ErrUnroutable = errors.New("rabbitmq: message returned unroutable")

// ErrNacked is returned when the broker refused a published message
// (basic.nack): it is not stored.
var ErrNacked = errors.New("rabbitmq: message refused by the broker")

// confirmWait bounds the wait for a retry copy's confirm.
const confirmWait = 30 * time.Second

// RetryQueueName returns the name of the retry queue holding the retries
// of queue that wait for tier (a power of two of milliseconds, see
// docs/rabbitmq.md): "<queue>.idem-retry.<tier>ms".
func RetryQueueName(queue string, tier time.Duration) string {
	return queue + ".idem-retry." + strconv.FormatInt(tier.Milliseconds(), 10) + "ms"
}

// RetryTiers returns every tier a retry queue may be declared for, from
// the shortest: for tools (and tests) that delete a queue's retry queues.
func RetryTiers() []time.Duration {
	var out []time.Duration
	for ms := int64(minTierMs); ms <= maxTierMs; ms <<= 1 {
		out = append(out, time.Duration(ms)*time.Millisecond)
	}
	return out
}

// tierOf returns the tier a retry after d waits in: the smallest at or
// above d, at most the largest.
func tierOf(d time.Duration) time.Duration {
	ms := uint64(0)
	if d > 0 {
		ms = uint64((d + time.Millisecond - 1) / time.Millisecond) // rounded up
	}
	ms = max(ms, minTierMs)
	if ms >= maxTierMs {
		return maxTierMs * time.Millisecond
	}
	return time.Duration(uint64(1)<<bits.Len64(ms-1)) * time.Millisecond // smallest power of two >= ms
}

// retrier publishes retry copies on a channel of its own in confirm mode,
// one at a time, declaring each tier's queue on first use.
type retrier struct {
	queue, queueType string
	mu               sync.Mutex
	ch               *amqp.Channel
	returns          chan amqp.Return
	declared         map[time.Duration]bool
}

// newRetrier opens the retrier's channel on conn.
func newRetrier(conn *amqp.Connection, queue, queueType string) (*retrier, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: open retry channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return nil, fmt.Errorf("rabbitmq: confirm mode: %w", err)
	}
	r := &retrier{queue: queue, queueType: queueType, ch: ch, declared: map[time.Duration]bool{}}
	// One publish at a time: a return, which the broker sends before
	// its publish's confirm, is in this buffer by the time the confirm
	// is seen, and it is the one publish's.
	r.returns = ch.NotifyReturn(make(chan amqp.Return, 4))
	return r, nil
}

// declareTier declares the retry queue of tier: durable, of the work
// queue's type, its messages expiring after tier into the work queue
// through the default exchange. A quorum retry queue dead-letters at
// least once (the broker confirms the move internally), which needs
// overflow reject-publish.
func declareTier(ch *amqp.Channel, queue, queueType string, tier time.Duration) error {
	args := amqp.Table{
		"x-queue-type":              queueType,
		"x-message-ttl":             tier.Milliseconds(),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": queue,
	}
	if queueType == QueueQuorum {
		args["x-dead-letter-strategy"] = "at-least-once"
		args["x-overflow"] = "reject-publish"
	}
	name := RetryQueueName(queue, tier)
	if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
		return refused("declare retry queue "+name, err)
	}
	return nil
}

// republish puts a copy of m for attempt into the retry queue of the tier
// of delay and waits for the broker's confirm. The copy keeps m's body,
// properties and headers (but an expiration, and the x-death history the
// retry queues add), with the attempt in HeaderAttempt and m's first
// routing key in HeaderRoutingKey.
func (r *retrier) republish(m *amqp.Delivery, attempt int, delay time.Duration) error {
	tier := tierOf(delay)
	pub := copyOf(m, attempt)
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.declared[tier] {
		if err := declareTier(r.ch, r.queue, r.queueType, tier); err != nil {
			return err
		}
		r.declared[tier] = true
	}
	name := RetryQueueName(r.queue, tier)
	ctx, cancel := context.WithTimeout(context.Background(), confirmWait)
	defer cancel()
	dc, err := r.ch.PublishWithDeferredConfirmWithContext(ctx, "", name, true, false, pub)
	if err != nil {
		return fmt.Errorf("rabbitmq: publish retry copy to %s: %w", name, err)
	}
	ok, err := dc.WaitContext(ctx)
	returned := r.drainReturns()
	switch {
	case err != nil:
		return fmt.Errorf("rabbitmq: confirm of retry copy to %s: %w", name, err)
	case returned:
		delete(r.declared, tier) // declare it again next time
		return fmt.Errorf("%w: retry copy to %s", ErrUnroutable, name)
	case !ok:
		return fmt.Errorf("%w: retry copy to %s", ErrNacked, name)
	}
	return nil
}

// putBack puts a copy of each of ms, in order, straight into the work
// queue (through the default exchange, mandatory), each for the attempt
// it was (attemptOf: its idem-attempt plus the returns the queue counted,
// which the copy no longer carries), and waits for the broker's confirm of
// every one. An error means some copy may be missing: the caller must then
// return the originals.
func (r *retrier) putBack(ms []*amqp.Delivery) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), confirmWait)
	defer cancel()
	dcs := make([]*amqp.DeferredConfirmation, 0, len(ms))
	for _, m := range ms {
		dc, err := r.ch.PublishWithDeferredConfirmWithContext(ctx, "", r.queue, true, false, copyOf(m, attemptOf(m.Headers, m.Redelivered, r.queueType == QueueQuorum)))
		if err != nil {
			return fmt.Errorf("rabbitmq: publish a copy to %s: %w", r.queue, err)
		}
		dcs = append(dcs, dc)
	}
	// The confirms come in order, each publish's return (if any) before
	// its confirm. Returns are taken while waiting: the client hands them
	// over on the connection's reader, which a full buffer would block.
	returned, nacked := false, false
	for _, dc := range dcs {
		for waiting := true; waiting; {
			select {
			case <-dc.Done():
				waiting = false
			case _, open := <-r.returns:
				if !open {
					return fmt.Errorf("rabbitmq: copies to %s: %w", r.queue, amqp.ErrClosed)
				}
				returned = true
			case <-ctx.Done():
				return fmt.Errorf("rabbitmq: confirm of the copies to %s: %w", r.queue, ctx.Err())
			}
		}
		nacked = nacked || !dc.Acked()
	}
	returned = r.drainReturns() || returned
	switch {
	case returned:
		return fmt.Errorf("%w: copy to %s", ErrUnroutable, r.queue)
	case nacked:
		// Also a channel closed before the confirm.
		return fmt.Errorf("%w: copy to %s", ErrNacked, r.queue)
	}
	return nil
}

// copyOf returns a copy of m for attempt: m's body, properties and headers
// (but an expiration, x-delivery-count, the x-death history the retry
// queues add, and the CC and BCC headers, whose queues the broker routed
// m to when it was published: a copy is for this consumer's queue only),
// with the attempt in HeaderAttempt and m's first routing key in
// HeaderRoutingKey.
func copyOf(m *amqp.Delivery, attempt int) amqp.Publishing {
	h := amqp.Table{}
	for k, v := range m.Headers {
		switch k {
		case "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
			"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", headerDeliveryCount,
			"CC", "BCC":
			continue
		}
		h[k] = v
	}
	h[HeaderAttempt] = int64(attempt)
	if _, ok := h[HeaderRoutingKey]; !ok {
		h[HeaderRoutingKey] = m.RoutingKey
	}
	pub := amqp.Publishing{
		Headers: h, ContentType: m.ContentType, ContentEncoding: m.ContentEncoding,
		DeliveryMode: m.DeliveryMode, Priority: m.Priority, CorrelationId: m.CorrelationId,
		ReplyTo: m.ReplyTo, MessageId: m.MessageId, Timestamp: m.Timestamp, Type: m.Type,
		AppId: m.AppId, Body: m.Body,
	}
	if pub.DeliveryMode == 0 {
		pub.DeliveryMode = amqp.Persistent
	}
	return pub
}

// drainReturns takes the returns already handed over, without waiting,
// and reports whether there was one. A closed channel ends it: the
// confirms failed too.
func (r *retrier) drainReturns() bool {
	returned := false
	for {
		select {
		case _, open := <-r.returns:
			if !open {
				return returned
			}
			returned = true
		default:
			return returned
		}
	}
}
