package watermill_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	idemwm "github.com/idemhq/idem/watermill"
)

// benchRounds is how many rounds the benchmark alternates between the
// plain and the idem-wrapped handler (the order flipped every other
// round), so that a slow spell of the shared machine falls on both.
const benchRounds = 10

// BenchmarkEndToEnd consumes max(b.N, 500) new credits into Postgres
// through a Watermill router, with a plain Watermill handler (the upsert
// in a transaction, then the ack) and with the same write through idem
// (Handler over an idem.Consumer: the marker in the same transaction),
// on GoChannel and on RabbitMQ. Both routers run side by side on their own
// topics and schemas; each round publishes a tenth of the credits to one,
// waits until it has handled them, then does the same on the other. It
// reports each handler's rate over all rounds and, as the ratio, the
// median of the rounds' idem/plain ratios.
//
//	go test -run '^$' -bench EndToEnd -benchtime 2000x
//
// workers is how many messages are handled at once: that many RabbitMQ
// subscribers (each handles one message at a time), or GoChannel's
// deliveries held to that many at once by a middleware.
func BenchmarkEndToEnd(b *testing.B) {
	for _, name := range []string{"gochannel", "amqp"} {
		for _, workers := range []int{1, 4} {
			b.Run(fmt.Sprintf("%s/postgres/workers-%d", name, workers), func(b *testing.B) { endToEnd(b, name, workers) })
		}
	}
}

// benchSide is one router consuming into its own schema.
type benchSide struct {
	e       *pgEnv
	pub     message.Publisher
	topic   string
	handled atomic.Int64
	took    time.Duration
}

func newBenchSide(b *testing.B, name string, workers int, withIdem bool) *benchSide {
	s := &benchSide{e: newPGEnv(b, nil), topic: "credits"}
	var subs []message.Subscriber
	switch name {
	case "gochannel":
		ch := gochannel.NewGoChannel(gochannel.Config{}, wmLogger(b))
		b.Cleanup(func() { ch.Close() })
		s.pub, subs = ch, []message.Subscriber{ch}
	case "amqp":
		br := newAMQPBroker(b, unique("idem_wm_bench_"), true)
		s.pub, s.topic = br.pub, br.topic
		for range workers {
			subs = append(subs, br.newSub(b))
		}
	}
	var handle message.NoPublishHandlerFunc
	if withIdem {
		// No stats hook: the plain handler has none.
		c, err := idem.NewConsumer(s.e.proc0(), s.e.handler(), s.e.drv, nil)
		if err != nil {
			b.Fatal(err)
		}
		h, err := idemwm.New(c, nil)
		if err != nil {
			b.Fatal(err)
		}
		handle = h.Handle
	} else {
		handle = func(msg *message.Message) error {
			acct, amt, err := idemtest.DecodeCredit(msg.Payload)
			if err != nil {
				return err
			}
			ctx := msg.Context()
			tx, err := s.e.pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			if err := s.e.credit(ctx, tx, acct, amt); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	}
	counted := func(msg *message.Message) error {
		err := handle(msg)
		if err == nil {
			s.handled.Add(1)
		}
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, wmLogger(b))
	if err != nil {
		b.Fatal(err)
	}
	if name == "gochannel" {
		r.AddMiddleware(limit(workers))
	}
	for i, sub := range subs {
		r.AddConsumerHandler(fmt.Sprintf("balances-%d", i), s.topic, sub, counted)
	}
	go func() { _ = r.Run(context.Background()) }()
	<-r.Running()
	b.Cleanup(func() { _ = r.Close() })
	return s
}

// round publishes events and returns the rate at which they were handled,
// from the first publish to the last one handled.
func (s *benchSide) round(b *testing.B, events []idemtest.Event) float64 {
	want := s.handled.Load() + int64(len(events))
	start := time.Now()
	publishEvents(b, s.pub, s.topic, events, 0)
	for s.handled.Load() < want {
		time.Sleep(200 * time.Microsecond)
	}
	took := time.Since(start)
	s.took += took
	return float64(len(events)) / took.Seconds()
}

func endToEnd(b *testing.B, name string, workers int) {
	n := max(b.N, 500)
	events := idemtest.Events(n)
	plain, withIdem := newBenchSide(b, name, workers, false), newBenchSide(b, name, workers, true)
	// A warm-up round each: connections, plans, the first pages.
	warm := idemtest.Events(50)
	for i := range warm {
		warm[i].ID = "warm-" + warm[i].ID
	}
	plain.round(b, warm)
	withIdem.round(b, warm)
	plain.took, withIdem.took = 0, 0

	b.ResetTimer()
	var ratios []float64
	chunk := n / benchRounds
	for r := range benchRounds {
		evs := events[r*chunk : (r+1)*chunk]
		var p, i float64
		if r%2 == 0 {
			p, i = plain.round(b, evs), withIdem.round(b, evs)
		} else {
			i, p = withIdem.round(b, evs), plain.round(b, evs)
		}
		ratios = append(ratios, i/p)
	}
	b.StopTimer()
	withIdem.e.waitExact(append(warm, events[:benchRounds*chunk]...), 0)
	b.ReportMetric(0, "ns/op")
	total := float64(benchRounds * chunk)
	b.ReportMetric(total/plain.took.Seconds(), "plain-msgs/s")
	b.ReportMetric(total/withIdem.took.Seconds(), "idem-msgs/s")
	b.ReportMetric(median(ratios), "ratio")
	b.Logf("ratios by round: %.2f", ratios)
}

// limit is a middleware letting at most n messages through at once.
func limit(n int) message.HandlerMiddleware {
	sem := make(chan struct{}, n)
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			sem <- struct{}{}
			defer func() { <-sem }()
			return h(msg)
		}
	}
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkHandleOverhead is the bridge's own cost per message (mapping,
// attempt counting, metadata), with a DeliveryHandler that acknowledges
// at once: what the bridge adds next to idem.Consumer's work.
//
//	go test -run '^$' -bench HandleOverhead
func BenchmarkHandleOverhead(b *testing.B) {
	h, err := idemwm.New(idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
		return idem.Verdict{Ack: true, Outcome: idem.Applied}
	}), nil)
	if err != nil {
		b.Fatal(err)
	}
	m := idemtest.Event{ID: "evt-1", Account: "acct-1", Amount: 5}.Message()
	m.Seq = 3
	msg := idemwm.ToMessage(context.Background(), m)
	b.ReportAllocs()
	for b.Loop() {
		delete(msg.Metadata, idemwm.MetadataAttempt) // a new delivery
		if err := h.Handle(msg); err != nil {
			b.Fatal(err)
		}
	}
}
