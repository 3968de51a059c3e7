package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/rabbitmq"
)

// The Publisher is an outbox.BrokerProber: Probe answers whether the
// broker takes a channel, and Unavailable tells a refusal of a message
// from what may be the broker out of reach, so that an outbox relay
// pauses during an outage instead of counting attempts.
func TestPublisherProbe(t *testing.T) {
	var _ outbox.BrokerProber = (*rabbitmq.Publisher)(nil)
	t.Parallel()
	ctx := context.Background()
	b := newBroker(t, rabbitmq.QueueQuorum)
	p := newPublisher(t)
	if err := p.Probe(ctx); err != nil {
		t.Fatalf("Probe of a running broker: %v", err)
	}
	// The probe's channel serves the next Publish.
	if err := p.Publish(ctx, []*idem.Message{{ID: "after-probe", Stream: b.queue, Payload: []byte("1")}}); err != nil {
		t.Fatalf("Publish after Probe: %v", err)
	}
	unroutable := p.Publish(ctx, []*idem.Message{{ID: "lost", Stream: b.queue + ".nobody", Payload: []byte("2")}})
	invalid := p.Publish(ctx, []*idem.Message{{Stream: b.queue, Payload: []byte("no ID")}})
	for _, err := range []error{unroutable, invalid} {
		if err == nil || p.Unavailable(err) {
			t.Errorf("Unavailable(%v) = true (or no error); a refusal is no outage", err)
		}
	}

	// Nothing listens on the port: the broker is out of reach.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	down, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: fmt.Sprintf("amqp://guest:guest@%s/", addr)})
	if err != nil {
		t.Fatal(err)
	}
	defer down.Close()
	perr := down.Publish(ctx, []*idem.Message{{ID: "x", Stream: b.queue, Payload: []byte("3")}})
	if perr == nil || !down.Unavailable(perr) {
		t.Errorf("Publish with no broker: %v; Unavailable says %v, want an error it suspects", perr, perr != nil && down.Unavailable(perr))
	}
	if err := down.Probe(ctx); err == nil {
		t.Error("Probe with no broker: nil")
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := p.Probe(cctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Probe with a cancelled context: %v, want context.Canceled", err)
	}
}
