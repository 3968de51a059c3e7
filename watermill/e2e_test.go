package watermill_test

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/sqlite"
	idemwm "github.com/idemhq/idem/watermill"
)

// brokers are the real pub/subs every end-to-end test runs on.
var brokers = []string{"amqp", "sql"}

// Two routers, each with its own subscriber, share a topic on RabbitMQ (a
// durable queue) and on watermill-sql (one consumer group) while every
// tenth event is published twice: the balances come out exactly as the
// unique events say, and the republished copies were seen as duplicates.
func TestTwoRoutersAtOnce(t *testing.T) {
	t.Parallel()
	for _, name := range brokers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newPGEnv(t, nil)
			b := brokerFor(t, name, e, unique("idem_wm_two_"), true)
			for range 2 {
				h, err := idemwm.New(e.consumer, nil)
				if err != nil {
					t.Fatal(err)
				}
				runRouter(t, b.newSub(t), b.topic, h.Handle)
			}
			events := idemtest.Events(1000)
			publishEvents(t, b.pub, b.topic, events, 10)
			e.waitExact(events, dupCount(len(events), 10))
		})
	}
}

// The outbox relay publishes through Watermill (Publisher), and a router
// consumes through idem. The first cycle stops after the pub/sub took the
// rows and before they were marked, as a crashed relay would: the next
// cycles publish them again, and the consumer takes the copies as
// duplicates.
func TestOutboxRelayThroughWatermill(t *testing.T) {
	t.Parallel()
	for _, name := range brokers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newPGEnv(t, nil)
			b := brokerFor(t, name, e, unique("idem_wm_outbox_"), true)
			h, err := idemwm.New(e.consumer, nil)
			if err != nil {
				t.Fatal(err)
			}
			runRouter(t, b.newSub(t), b.topic, h.Handle)

			ob, err := outbox.New(e.drv)
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			events := idemtest.Events(300)
			for i := 0; i < len(events); i += 50 {
				tx, err := e.pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				for _, ev := range events[i : i+50] {
					m := ev.Message()
					m.Stream = b.topic
					if err := ob.Add(ctx, tx, m); err != nil {
						t.Fatal(err)
					}
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
			}
			wp, err := idemwm.NewPublisher(b.pub)
			if err != nil {
				t.Fatal(err)
			}
			pub := &countingPublisher{next: wp}
			var (
				crash        atomic.Bool
				republishing atomic.Int64 // published by the crashed cycle: each comes twice
			)
			crash.Store(true)
			relay, err := outbox.NewRelay(e.drv, pub, &outbox.RelayConfig{BatchSize: 1000, ClaimTTL: time.Second, Logger: testenv.Logger(t),
				FaultHook: func(point string) {
					if point == outbox.FaultAfterPublish && crash.CompareAndSwap(true, false) {
						republishing.Store(pub.n.Load())
						runtime.Goexit() // published, not marked
					}
				}})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan struct{})
			go func() { defer close(done); _, _ = relay.RunOnce(ctx) }()
			<-done
			// Cycles until nothing is pending: the crashed cycle's claims
			// expire after ClaimTTL, and on a busy machine a cycle may
			// leave keys for the next (an error that says so).
			waitFor(t, 30*time.Second, "the outbox drained", func() bool {
				if _, err := relay.RunOnce(ctx); err != nil {
					t.Logf("relay cycle: %v", err)
				}
				st, err := relay.Stats(ctx)
				if err != nil {
					t.Fatal(err)
				}
				return st.Pending == 0
			})
			if republishing.Load() == 0 {
				t.Fatal("the crashed cycle published nothing")
			}
			e.waitExact(events, republishing.Load())
		})
	}
}

// countingPublisher counts the messages its Publisher took.
type countingPublisher struct {
	next outbox.Publisher
	n    atomic.Int64
}

func (p *countingPublisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	if err := p.next.Publish(ctx, msgs); err != nil {
		return err
	}
	p.n.Add(int64(len(msgs)))
	return nil
}

// On RabbitMQ, a message met by a store outage is held in the handler; a
// router closed meanwhile leaves it unacknowledged in the queue, with no
// dead letter, and the next router applies it once the store answers.
func TestStoreDownRouterClosedMessageKept(t *testing.T) {
	t.Parallel()
	e := newLiteEnv(t, idem.ConsumerConfig{MaxAttempts: 1}, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	b := newAMQPBroker(t, unique("idem_wm_outage_"), true)
	locker, err := sqlite.Open(e.path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lock, err := locker.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(context.Background(), "BEGIN EXCLUSIVE"); err != nil {
		t.Fatal(err)
	}
	rec := &attempts{next: e.c}
	h, err := idemwm.New(rec, nil)
	if err != nil {
		t.Fatal(err)
	}
	stop := runRouter(t, b.newSub(t), b.topic, h.Handle)
	if err := b.pub.Publish(b.topic, idemwm.ToMessage(context.Background(), &idem.Message{ID: "kept", Payload: []byte("x")})); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the message reached the handler", func() bool { return rec.n.Load() > 0 })
	time.Sleep(200 * time.Millisecond) // held: the store is locked
	stop()
	if _, err := lock.ExecContext(context.Background(), "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if n := e.seen(t); n != 0 {
		t.Fatalf("%d rows applied while the store was down", n)
	}
	if dls := e.deadLetters(t); len(dls) != 0 {
		t.Fatalf("dead letters %+v, want none: an outage is not the message's failure", dls)
	}

	// A new router gets the message again from the queue and applies it.
	h2, err := idemwm.New(rec, nil)
	if err != nil {
		t.Fatal(err)
	}
	runRouter(t, b.newSub(t), b.topic, h2.Handle)
	waitFor(t, 10*time.Second, "the kept message applied", func() bool { return e.seen(t) == 1 })
	if got := rec.of("kept"); got[len(got)-1] != 1 {
		t.Fatalf("attempts %v, want the last to be 1: the held deliveries counted none", got)
	}
}
