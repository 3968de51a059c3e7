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

// benchRounds is how many times the benchmark measures each handler, plain
// and idem back to back in each round (in flipped order every other
// round), so that a slow spell of the shared machine falls on both.
const benchRounds = 5

// BenchmarkEndToEnd consumes max(b.N, 500) new credits into Postgres
// through a Watermill router, with a plain Watermill handler (the upsert
// in a transaction, then the ack) and with the same write through idem
// (Handler over an idem.Consumer: the marker in the same transaction),
// on GoChannel and on RabbitMQ. It reports the median rate of each and,
// as the ratio, the median of the rounds' idem/plain ratios.
//
//	go test -run '^$' -bench EndToEnd -benchtime 2000x
//
// workers is how many messages are handled at once: that many AMQP
// subscribers (each handles one message at a time), or GoChannel's
// deliveries held to that many at once by a middleware.
func BenchmarkEndToEnd(b *testing.B) {
	for _, name := range []string{"gochannel", "amqp"} {
		for _, workers := range []int{1, 4} {
			b.Run(fmt.Sprintf("%s/postgres/workers-%d", name, workers), func(b *testing.B) { endToEnd(b, name, workers) })
		}
	}
}

func endToEnd(b *testing.B, name string, workers int) {
	n := max(b.N, 500)
	events := idemtest.Events(n)
	rate := func(withIdem bool) float64 {
		e := newPGEnv(b, nil)
		c, err := idem.NewConsumer(e.proc0(), e.handler(), e.drv, nil) // no stats hook: the plain handler has none
		if err != nil {
			b.Fatal(err)
		}
		var (
			pub   message.Publisher
			subs  []message.Subscriber
			topic = "credits"
		)
		switch name {
		case "gochannel":
			ch := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, wmLogger(b))
			defer ch.Close()
			pub, subs = ch, []message.Subscriber{ch}
		case "amqp":
			br := newAMQPBroker(b, unique("idem_wm_bench_"), true)
			pub, topic = br.pub, br.topic
			for range workers {
				subs = append(subs, br.newSub(b))
			}
		}
		publishEvents(b, pub, topic, events, 0)

		var handle message.NoPublishHandlerFunc
		if withIdem {
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
				tx, err := e.pool.Begin(ctx)
				if err != nil {
					return err
				}
				defer tx.Rollback(context.WithoutCancel(ctx))
				if err := e.credit(ctx, tx, acct, amt); err != nil {
					return err
				}
				return tx.Commit(ctx)
			}
		}
		// The clock starts at the first message handled, so that the
		// subscribers' start is not counted.
		var (
			handled atomic.Int64
			first   atomic.Int64
		)
		counted := func(msg *message.Message) error {
			err := handle(msg)
			if err == nil && handled.Add(1) == 1 {
				first.Store(time.Now().UnixNano())
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
			r.AddConsumerHandler("balances-"+string(rune('a'+i)), topic, sub, counted)
		}
		go func() { _ = r.Run(context.Background()) }()
		for handled.Load() < int64(n) {
			time.Sleep(time.Millisecond)
		}
		rate := float64(n-1) / time.Since(time.Unix(0, first.Load())).Seconds()
		_ = r.Close()
		if withIdem {
			e.waitExact(events, 0)
		}
		return rate
	}
	b.ResetTimer()
	var plain, withIdem, ratios []float64
	for round := range benchRounds {
		var p, i float64
		if round%2 == 0 {
			p, i = rate(false), rate(true)
		} else {
			i, p = rate(true), rate(false)
		}
		plain, withIdem, ratios = append(plain, p), append(withIdem, i), append(ratios, i/p)
	}
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(median(plain), "plain-msgs/s")
	b.ReportMetric(median(withIdem), "idem-msgs/s")
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
