package watermill_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemhq/idem"
	idemwm "github.com/idemhq/idem/watermill"
)

// Publisher sends the messages in order, each topic's run in one call,
// with the UUID and metadata DefaultMap reads back; a call holding an
// invalid message sends nothing.
func TestPublisherOrderAndRefusal(t *testing.T) {
	t.Parallel()
	ch := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, wmLogger(t)) // one message after the other
	t.Cleanup(func() { ch.Close() })
	pub, err := idemwm.NewPublisher(ch)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	subA, err := ch.Subscribe(t.Context(), "a")
	if err != nil {
		t.Fatal(err)
	}
	subB, err := ch.Subscribe(t.Context(), "b")
	if err != nil {
		t.Fatal(err)
	}
	bad := []*idem.Message{{ID: "ok", Stream: "a", Payload: []byte("x")}, {ID: "no-stream", Payload: []byte("x")}}
	if err := pub.Publish(ctx, bad); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("Publish with a message without Stream: %v, want ErrInvalidMessage", err)
	}
	msgs := []*idem.Message{
		{ID: "1", Stream: "a", AggregateID: "x", Seq: 1, Type: "T", Payload: []byte("p1")},
		{ID: "2", Stream: "a", AggregateID: "x", Seq: 2, Type: "T", Payload: []byte("p2")},
		{ID: "3", Stream: "b", AggregateID: "x", Seq: 3, Type: "T", Payload: []byte("p3"), Headers: map[string]string{"traceparent": "00-1"}},
	}
	published := make(chan error, 1)
	go func() { published <- pub.Publish(ctx, msgs) }()
	read := func(topic string, sub <-chan *message.Message, n int) []*message.Message {
		var got []*message.Message
		for range n {
			select {
			case m := <-sub:
				m.Ack()
				got = append(got, m)
			case <-time.After(5 * time.Second):
				t.Fatalf("topic %s: %d of %d messages", topic, len(got), n)
			}
		}
		select {
		case m := <-sub:
			t.Fatalf("topic %s: unexpected message %q (the refused call sent something)", topic, m.UUID)
		case <-time.After(50 * time.Millisecond):
		}
		return got
	}
	a, b := read("a", subA, 2), read("b", subB, 1)
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if a[0].UUID != "1" || a[1].UUID != "2" || b[0].UUID != "3" {
		t.Fatalf("topics a %q %q, b %q; want 1 2 and 3", a[0].UUID, a[1].UUID, b[0].UUID)
	}
	m, err := idemwm.DefaultMap(b[0])
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "3" || m.AggregateID != "x" || m.Seq != 3 || m.Type != "T" || string(m.Payload) != "p3" || m.Headers["traceparent"] != "00-1" {
		t.Fatalf("read back %+v", m)
	}
}

// The constructors refuse what cannot work.
func TestConstructorsRefuse(t *testing.T) {
	t.Parallel()
	if _, err := idemwm.New(nil, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New(nil): %v", err)
	}
	if _, err := idemwm.New(idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{} }), &idemwm.Config{Retry: 9}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New with RetryMode 9: %v", err)
	}
	if _, err := idemwm.NewPublisher(nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("NewPublisher(nil): %v", err)
	}
	if _, err := idemwm.PoisonQueue(nil, ""); err == nil {
		t.Fatal("PoisonQueue without a topic: no error")
	}
}

// Config.Stopping ends a delivery held while the store is down, as the
// message's context ending does.
func TestStoppingEndsAHeldDelivery(t *testing.T) {
	t.Parallel()
	held := make(chan struct{})
	dh := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		close(held)
		<-d.Stopping // as the Consumer's wait for the store does
		return idem.Verdict{RetryAfter: time.Hour, Err: idem.ErrStoreUnavailable}
	})
	stop := make(chan struct{})
	h, err := idemwm.New(dh, &idemwm.Config{Stopping: stop})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- h.Handle(message.NewMessage("m", nil)) }()
	<-held
	close(stop)
	select {
	case err := <-done:
		if !errors.Is(err, idem.ErrStoreUnavailable) {
			t.Fatalf("Handle: %v, want ErrStoreUnavailable", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Handle did not return after Stopping closed (nor wait out the hour's RetryAfter)")
	}
}
