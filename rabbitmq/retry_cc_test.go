package rabbitmq_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/rabbitmq"
)

// TestRetryCopyIsNotSentToCCQueues: a message whose producer named other
// queues in its CC header (RabbitMQ's sender-selected distribution) was
// routed to them once, when it was published. Its retry copy is for the
// consumer's own queue only. Before, the copy kept the CC header, so the
// broker routed each retry to those queues too: one more delivery there
// for every failed attempt here.
func TestRetryCopyIsNotSentToCCQueues(t *testing.T) {
	t.Parallel()
	b, other := newBroker(t, rabbitmq.QueueQuorum), newBroker(t, rabbitmq.QueueQuorum)
	b.send(t, []amqp.Publishing{{MessageId: "evt-cc", Body: []byte("x"), DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"CC": []any{other.queue}}}})
	if n := other.ready(t); n != 1 {
		t.Fatalf("%d messages in the CC queue after the publish, want 1", n)
	}
	var calls atomic.Int32
	acked := make(chan struct{})
	h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		if calls.Add(1) < 3 {
			return idem.Verdict{RetryAfter: 10 * time.Millisecond, Err: errors.New("dependency down")}
		}
		close(acked)
		return idem.Verdict{Ack: true}
	})
	run(t, b.config(t, h))
	select {
	case <-acked:
	case <-time.After(20 * time.Second):
		t.Fatalf("not acked after %d attempts", calls.Load())
	}
	time.Sleep(200 * time.Millisecond)
	if n := other.ready(t); n != 1 {
		t.Fatalf("%d messages in the CC queue after 2 retries, want still 1", n)
	}
}
