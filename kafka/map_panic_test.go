package kafka_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
)

// TestMapPanicIsADecodeFailure: a Config.Map that panics on a hostile
// record (a poison record meeting a bug in it) makes that record a decode
// failure, dead-lettered with the reason, and the member goes on with the
// next record, one at a time and with Concurrency. Before, the panic ended
// the process, and every restart met the uncommitted record again.
func TestMapPanicIsADecodeFailure(t *testing.T) {
	t.Parallel()
	for _, concurrency := range []int{1, 4} {
		b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
		b.concurrency = concurrency
		b.produce(t, []*kgo.Record{
			{Key: []byte("acct-1"), Value: []byte("boom"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("evt-boom")}}},
			{Key: []byte("acct-1"), Value: []byte("acct-1:5"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("evt-good")}}},
		})
		c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "idem", Topics: []string{topic}, Handler: e.Consumer(false), Concurrency: concurrency, Logger: testenv.Logger(t),
			Map: func(r *kgo.Record) (*idem.Message, error) {
				if string(r.Value) == "boom" {
					var fields []string
					_ = fields[len(r.Value)] // the kind of bug a hostile record finds
				}
				return kafka.DefaultMap(r)
			}})
		if err != nil {
			t.Fatal(err)
		}
		b.start(t, c)
		e.WaitMarkers(1)
		e.WaitPanickedMap("boom")
	}
}

// TestMapReturningNothingIsADecodeFailure: a Config.Map that returns
// neither a message nor an error hands the Handler a delivery with a
// DecodeErr matching idem.ErrInvalidMessage, as idem.Delivery promises
// for a record without a message. Before, the Handler got a delivery with
// neither.
func TestMapReturningNothingIsADecodeFailure(t *testing.T) {
	t.Parallel()
	b := newBroker(t).(*broker)
	b.produce(t, []*kgo.Record{{Key: []byte("k"), Value: []byte("x"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("evt-1")}}}})
	got := make(chan *idem.Delivery, 1)
	var once sync.Once
	h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		once.Do(func() { got <- d })
		return idem.Verdict{Ack: true}
	})
	c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "idem", Topics: []string{topic}, Handler: h,
		Map: func(*kgo.Record) (*idem.Message, error) { return nil, nil }})
	if err != nil {
		t.Fatal(err)
	}
	b.start(t, c)
	select {
	case d := <-got:
		if d.Msg != nil || !errors.Is(d.DecodeErr, idem.ErrInvalidMessage) {
			t.Fatalf("delivery with message %v and DecodeErr %v; want no message and an idem.ErrInvalidMessage", d.Msg, d.DecodeErr)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no delivery in 15 s")
	}
}
