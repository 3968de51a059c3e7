package rabbitmq_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/rabbitmq"
)

// TestMapPanicIsADecodeFailure: a Config.Map that panics on a hostile
// message (a poison message meeting a bug in it) makes that delivery a
// decode failure, dead-lettered with the reason, and the consumer goes on
// with the next message, one lane and several. Before, the panic ended
// the process, and every restart met the unacknowledged message again.
func TestMapPanicIsADecodeFailure(t *testing.T) {
	t.Parallel()
	for _, concurrency := range []int{1, 4} {
		b, e := newBroker(t, rabbitmq.QueueQuorum), adaptertest.NewEnv(t)
		b.concurrency = concurrency
		b.send(t, []amqp.Publishing{
			{MessageId: "evt-boom", Body: []byte("boom"), DeliveryMode: amqp.Persistent},
			{MessageId: "evt-good", Body: []byte("acct-1:5"), DeliveryMode: amqp.Persistent},
		})
		cfg := b.config(t, e.Consumer(false))
		cfg.Map = func(d *amqp.Delivery) (*idem.Message, error) {
			if string(d.Body) == "boom" {
				var fields []string
				_ = fields[len(d.Body)] // the kind of bug a hostile message finds
			}
			return rabbitmq.DefaultMap(d)
		}
		_, stop := run(t, cfg)
		e.WaitMarkers(1)
		e.WaitPanickedMap("boom")
		if err := stop(false); err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("Run: %v", err)
		}
	}
}

// TestMapReturningNothingIsADecodeFailure: a Config.Map that returns
// neither a message nor an error hands the Handler a delivery with a
// DecodeErr matching idem.ErrInvalidMessage, as idem.Delivery promises
// for a message that could not be mapped. Before, the Handler got a
// delivery with neither.
func TestMapReturningNothingIsADecodeFailure(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	b.send(t, []amqp.Publishing{{MessageId: "evt-1", Body: []byte("x")}})
	got := make(chan *idem.Delivery, 1)
	var once sync.Once
	h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		once.Do(func() { got <- d })
		return idem.Verdict{Ack: true}
	})
	cfg := b.config(t, h)
	cfg.Map = func(*amqp.Delivery) (*idem.Message, error) { return nil, nil }
	run(t, cfg)
	select {
	case d := <-got:
		if d.Msg != nil || !errors.Is(d.DecodeErr, idem.ErrInvalidMessage) {
			t.Fatalf("delivery with message %v and DecodeErr %v; want no message and an idem.ErrInvalidMessage", d.Msg, d.DecodeErr)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no delivery in 15 s")
	}
}
