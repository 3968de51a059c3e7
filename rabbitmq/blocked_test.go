package rabbitmq_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/rabbitmq"
)

// TestPublisherBlockedByAlarm: under a memory alarm the broker stops
// reading from a connection that publishes, and says so with
// connection.blocked. A Publish then fails at once with ErrBlocked,
// which Unavailable takes for the broker out of reach, instead of
// waiting for its context; Probe fails with ErrBlocked until the alarm
// clears; then both work again.
func TestPublisherBlockedByAlarm(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewRabbitMQServer(t)
	conn, err := amqp.Dial(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare("q", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	pub, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: srv.URL()})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	msg := func(id string) *idem.Message { return &idem.Message{ID: id, Stream: "q", Payload: []byte(id)} }
	if err := pub.Publish(ctx, []*idem.Message{msg("m1")}); err != nil {
		t.Fatal(err)
	}

	srv.MemoryAlarm(true)
	// The broker reads the first publish after the alarm and blocks the
	// connection then: this one may still be confirmed, or fail blocked.
	_ = pub.Publish(ctx, []*idem.Message{msg("m2")})
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	start := time.Now()
	err = pub.Publish(pctx, []*idem.Message{msg("m3")})
	if !errors.Is(err, rabbitmq.ErrBlocked) || !pub.Unavailable(err) {
		t.Fatalf("Publish during the alarm: %v; want ErrBlocked, Unavailable", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("Publish failed after %s; want at once, not at its context's end", took)
	}
	probe := func() error {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		return pub.Probe(pctx)
	}
	if err := probe(); !errors.Is(err, rabbitmq.ErrBlocked) {
		t.Fatalf("Probe during the alarm: %v; want ErrBlocked", err)
	}

	srv.MemoryAlarm(false)
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err := probe()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Probe 15 s after the alarm cleared: %v", err)
		}
	}
	if err := pub.Publish(ctx, []*idem.Message{msg("m4")}); err != nil {
		t.Fatalf("Publish after the alarm: %v", err)
	}
}
