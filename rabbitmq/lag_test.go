package rabbitmq_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/rabbitmq"
)

// TestLagCountsReadyMessages: messages published and not consumed are
// the queue's lag, all of them, asked with a connection of its own; once
// a running consumer has acknowledged them it is 0, asked on the
// consumer's connection.
func TestLagCountsReadyMessages(t *testing.T) {
	t.Parallel()
	b := newBroker(t, "quorum")
	ctx := context.Background()
	const n = 19
	var msgs []*idem.Message
	for i := range n {
		msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("lag-%d", i), AggregateID: fmt.Sprintf("agg%d", i%4), Payload: []byte("1")})
	}
	b.Publish(t, msgs, 0)
	ack := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	idle, err := rabbitmq.New(b.config(t, ack))
	if err != nil {
		t.Fatal(err)
	}
	if lag, err := idle.Lag(ctx); err != nil || lag != n {
		t.Fatalf("lag before consuming: %d, %v; want %d", lag, err, n)
	}
	if idle.LagSource() != b.queue {
		t.Fatalf("lag source %q, want the queue", idle.LagSource())
	}
	c, _ := run(t, b.config(t, ack))
	deadline := time.Now().Add(30 * time.Second)
	for {
		lag, err := c.Lag(ctx)
		if err == nil && lag == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("lag after consuming: %d, %v; want 0", lag, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
