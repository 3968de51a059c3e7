package jetstream_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// TestLagCountsUnacknowledgedMessages: messages published and not
// consumed are the durable's lag, all of them; once a consumer has
// acknowledged them it is 0. Against the real server.
func TestLagCountsUnacknowledgedMessages(t *testing.T) {
	t.Parallel()
	testenv.NATSConn(t) // skip loudly (or fail in CI) when it is down
	b := newBroker(t, testenv.NATSURL())
	ctx := context.Background()
	const n = 23
	b.Publish(t, lagMessages(n), 0)
	nc, c := b.consumer(t, idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} }))
	defer nc.Close()
	if _, err := c.Lag(ctx); err == nil {
		t.Fatal("lag of a durable that does not exist yet: no error")
	}
	_, js := b.connect(t)
	if _, err := js.CreateOrUpdateConsumer(ctx, b.stream, natsjs.ConsumerConfig{Durable: "idem", AckPolicy: natsjs.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	if lag, err := c.Lag(ctx); err != nil || lag != n {
		t.Fatalf("lag before consuming: %d, %v; want %d", lag, err, n)
	}
	if c.LagSource() != b.stream+"/idem" {
		t.Fatalf("lag source %q", c.LagSource())
	}
	b.start(t, idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} }))
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

// lagMessages returns n messages of distinct IDs over 5
// aggregates.
func lagMessages(n int) []*idem.Message {
	var msgs []*idem.Message
	for i := range n {
		msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("lag-%d", i), AggregateID: fmt.Sprintf("agg%d", i%5), Payload: []byte("1")})
	}
	return msgs
}
