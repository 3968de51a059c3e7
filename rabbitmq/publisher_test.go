package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/rabbitmq"
)

func newPublisher(t testing.TB) *rabbitmq.Publisher {
	t.Helper()
	return newPublisherURL(t, testenv.RabbitMQURL())
}

func newPublisherURL(t testing.TB, url string) *rabbitmq.Publisher {
	t.Helper()
	p, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// A message no queue takes is returned by the broker (mandatory), and
// Publish fails with ErrUnroutable instead of reporting a success; the
// publisher keeps working for the next call.
func TestPublisherUnroutableIsAFailure(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	p := newPublisher(t)
	ctx := context.Background()
	err := p.Publish(ctx, []*idem.Message{
		{ID: "ok-1", Stream: b.queue, Payload: []byte("1")},
		{ID: "lost", Stream: b.queue + ".nobody", Payload: []byte("2")},
	})
	if !errors.Is(err, rabbitmq.ErrUnroutable) {
		t.Fatalf("Publish to a routing key no queue takes: %v, want ErrUnroutable", err)
	}
	if err := p.Publish(ctx, []*idem.Message{{ID: "ok-2", Stream: b.queue, Payload: []byte("3")}}); err != nil {
		t.Fatalf("Publish after the failure: %v", err)
	}
	if n := b.ready(t); n != 2 {
		t.Fatalf("%d messages in the queue, want 2 (ok-1, ok-2)", n)
	}
}

// A publish to an exchange that does not exist makes the broker close the
// channel; the messages sent after it fail on the closed channel. Publish
// must name the broker's reason (NOT_FOUND), which a row's last error and
// an operator need, whichever message saw the close first: amqp091 marks
// the channel closed before it hands the reason over, and a publish in
// between used to report only "channel/connection is not open".
func TestPublisherNamesTheBrokersReason(t *testing.T) {
	t.Parallel()
	p, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: testenv.RabbitMQURL(), Exchange: "idem-test-no-such-exchange"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	msgs := make([]*idem.Message, 200)
	for i := range msgs {
		msgs[i] = &idem.Message{ID: fmt.Sprint("m-", i), Stream: "q", Payload: []byte("1")}
	}
	for i := range 20 {
		err := p.Publish(context.Background(), msgs)
		var ae *amqp.Error
		if !errors.As(err, &ae) || ae.Code != amqp.NotFound {
			t.Fatalf("Publish %d to a missing exchange: %v; want the broker's NOT_FOUND", i, err)
		}
	}
}

// Publish refuses invalid messages before sending anything.
func TestPublisherRefusesInvalidMessages(t *testing.T) {
	p := newPublisher(t)
	for name, m := range map[string]*idem.Message{
		"no ID":           {Stream: "q"},
		"no stream":       {ID: "e"},
		"reserved header": {ID: "e", Stream: "q", Headers: map[string]string{"idem-seq": "1"}},
	} {
		if err := p.Publish(context.Background(), []*idem.Message{m}); !errors.Is(err, idem.ErrInvalidMessage) {
			t.Errorf("%s: %v, want ErrInvalidMessage", name, err)
		}
	}
	if _, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("NewPublisher without URL: %v", err)
	}
}

// What Publisher writes, DefaultMap reads back: ID, aggregate, sequence,
// type, time, headers, payload and the routing key as Stream.
func TestPublisherRoundTrip(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueClassic)
	want := &idem.Message{ID: "evt-7", Stream: b.queue, Type: "Credited", AggregateID: "acct-1", Seq: 7,
		Payload: []byte(`{"amount":5}`), Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		Time: time.Date(2026, 11, 26, 12, 0, 0, 5, time.UTC)}
	if err := newPublisher(t).Publish(context.Background(), []*idem.Message{want}); err != nil {
		t.Fatal(err)
	}
	got := make(chan *idem.Message, 1)
	b.Start(t, idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		got <- d.Msg
		return idem.Verdict{Ack: true}
	}))
	var m *idem.Message
	select {
	case m = <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("nothing delivered")
	}
	if m == nil || m.ID != want.ID || m.Stream != want.Stream || m.Type != want.Type || m.AggregateID != want.AggregateID || m.Seq != want.Seq ||
		string(m.Payload) != string(want.Payload) || !m.Time.Equal(want.Time) || len(m.Headers) != 1 || m.Headers["traceparent"] != want.Headers["traceparent"] {
		t.Fatalf("delivered %+v, want %+v", m, want)
	}
}
