package jetstream_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
)

// runConsumer runs a Consumer with cfg (Stream, Durable "idem" and Logger
// filled in) and returns Run's result channel; Run is cancelled at cleanup.
func (b *broker) runConsumer(t *testing.T, cfg jetstream.Config) <-chan error {
	t.Helper()
	nc, js := b.connect(t)
	t.Cleanup(nc.Close)
	cfg.Stream, cfg.Durable, cfg.Logger = b.stream, "idem", testenv.Logger(t)
	c, err := jetstream.New(js, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done, finished := make(chan error, 1), make(chan struct{})
	go func() { defer close(finished); done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-finished })
	return done
}

// TestPrefetchedMessageKeptWhileItsHandlerRuns: a message pulled ahead
// (Prefetch) waits without InProgress, so its first InProgress goes out
// early once its handler starts (it went out AckWait/2 later, and a
// message that had waited more than that was redelivered while its slow
// handler still ran).
func TestPrefetchedMessageKeptWhileItsHandlerRuns(t *testing.T) {
	t.Parallel()
	b := newBroker(t, testenv.EmbeddedNATS(t))
	b.Publish(t, []*idem.Message{{ID: "first", AggregateID: "a"}, {ID: "second", AggregateID: "a"}}, 0)
	var (
		mu    sync.Mutex
		calls = map[string]int{}
		done  atomic.Int64
	)
	h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		mu.Lock()
		calls[d.Msg.ID]++
		mu.Unlock()
		switch d.Msg.ID {
		case "first":
			time.Sleep(850 * time.Millisecond) // below AckWait
		case "second":
			time.Sleep(2000 * time.Millisecond) // slower than AckWait: InProgress must cover it
		}
		done.Add(1)
		return idem.Verdict{Ack: true}
	})
	b.runConsumer(t, jetstream.Config{Handler: h, AckWait: time.Second, Prefetch: 2})
	for deadline := time.Now().Add(10 * time.Second); done.Load() < 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("handlers did not finish")
		}
	}
	time.Sleep(1500 * time.Millisecond) // a redelivered copy would be decided by now
	mu.Lock()
	defer mu.Unlock()
	if calls["second"] != 1 {
		t.Fatalf("second decided %d times, want 1: redelivered while its handler ran (calls %v)", calls["second"], calls)
	}
}

// TestStatusLookalikeMessageDoesNotEndRun: a stream message with an empty
// payload and a Status header is taken by nats.go for the server's status
// (here a bad request), which ended the subscription or the fetch, and
// Run with it, though the durable was there; never acked, the message
// came back every AckWait to stop every consumer again. Run now pulls
// again, and the messages after it are applied.
func TestStatusLookalikeMessageDoesNotEndRun(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 10} {
		t.Run(fmt.Sprintf("batch-%d", batch), func(t *testing.T) {
			t.Parallel()
			b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
			b.send(t, []*nats.Msg{{Subject: b.stream + ".x", Header: nats.Header{"Status": {"400"}, jetstream.HeaderID: {"poison"}}}})
			done := b.runConsumer(t, jetstream.Config{Handler: e.BatchConsumer(), AckWait: time.Second, Batch: batch})
			ev := idemtest.Events(20)
			b.Publish(t, adaptertest.Messages(ev), 0)
			e.WaitMarkers(len(ev))
			select {
			case err := <-done:
				t.Fatalf("batch %d: Run returned %v, on a producer's message, while its durable exists", batch, err)
			case <-time.After(1500 * time.Millisecond): // past the poison's AckWait
			}
			e.CheckBalances(ev)
		})
	}
}

// TestRunKeepsAHandMadeDurablesSettings: Run updates an existing durable
// with the settings it needs and keeps the others, including one that
// JetStream does not let an update change (DeliverPolicy): a config built
// afresh made Run fail on such a durable.
func TestRunKeepsAHandMadeDurablesSettings(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
	nc, js := b.connect(t)
	defer nc.Close()
	ctx := context.Background()
	if _, err := js.CreateOrUpdateConsumer(ctx, b.stream, natsjs.ConsumerConfig{Durable: "idem", AckPolicy: natsjs.AckExplicitPolicy, DeliverPolicy: natsjs.DeliverNewPolicy, MaxAckPending: 7}); err != nil {
		t.Fatal(err)
	}
	done := b.runConsumer(t, jetstream.Config{Handler: e.Consumer(false)})
	ev := idemtest.Events(10)
	waitDurable(t, js, b.stream, -1)
	b.Publish(t, adaptertest.Messages(ev), 0)
	e.WaitMarkers(len(ev))
	select {
	case err := <-done:
		t.Fatalf("Run on a hand-made durable returned %v", err)
	default:
	}
	e.CheckBalances(ev)
	cons, err := js.Consumer(ctx, b.stream, "idem")
	if err != nil {
		t.Fatal(err)
	}
	if cfg := cons.CachedInfo().Config; cfg.DeliverPolicy != natsjs.DeliverNewPolicy || cfg.MaxAckPending != 7 || cfg.MaxDeliver != -1 {
		t.Fatalf("durable after Run: DeliverPolicy %v, MaxAckPending %d, MaxDeliver %d; want its own kept and MaxDeliver -1", cfg.DeliverPolicy, cfg.MaxAckPending, cfg.MaxDeliver)
	}
}

// TestRunReturnsOnClosedConnection: Run returns once its connection is closed (docs: "Run returns when its
// durable or stream is gone (deleted, or the connection closed)"), one
// message at a time, with lanes, and in batches, without ctx being
// cancelled; and leaves no goroutine of the adapter behind.
func TestRunReturnsOnClosedConnection(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ batch, concurrency int }{{1, 1}, {1, 4}, {10, 1}, {10, 4}} {
		t.Run(fmt.Sprintf("batch-%d-concurrency-%d", tc.batch, tc.concurrency), func(t *testing.T) {
			t.Parallel()
			b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
			nc, js := b.connect(t)
			c, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: e.BatchConsumer(), Batch: tc.batch, Concurrency: tc.concurrency, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			waitDurable(t, js, b.stream, -1)
			time.Sleep(200 * time.Millisecond)
			nc.Close()
			select {
			case err := <-done:
				if err == nil {
					t.Fatal("Run returned nil")
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Run still running 10 s after its connection was closed")
			}
		})
	}
}

// TestNoGoroutineLeftAfterRun: after Run returns (ctx cancelled, durable
// or stream deleted), none of its goroutines (watch, lanes, keep-alive)
// is left.
func TestNoGoroutineLeftAfterRun(t *testing.T) {
	for _, tc := range []struct{ batch, concurrency int }{{1, 1}, {1, 4}, {10, 1}, {10, 4}} {
		for _, how := range []string{"cancel", "delete", "delete-stream"} {
			b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
			nc, js := b.connect(t)
			c, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: e.BatchConsumer(), Batch: tc.batch, Concurrency: tc.concurrency, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			waitDurable(t, js, b.stream, -1)
			b.Publish(t, adaptertest.Messages(idemtestEvents(50)), 0)
			e.WaitMarkers(50)
			if how == "cancel" {
				cancel()
			} else if how == "delete-stream" {
				if err := js.DeleteStream(context.Background(), b.stream); err != nil {
					t.Fatal(err)
				}
			} else if err := js.DeleteConsumer(context.Background(), b.stream, "idem"); err != nil {
				t.Fatal(err)
			}
			select {
			case <-done:
			case <-time.After(15 * time.Second):
				t.Fatalf("%+v %s: Run did not return", tc, how)
			}
			cancel()
			nc.Close()
			time.Sleep(100 * time.Millisecond)
			buf := make([]byte, 1<<22)
			stacks := string(buf[:runtime.Stack(buf, true)])
			for _, g := range strings.Split(stacks, "\n\n") {
				if strings.Contains(g, "idem/jetstream.(*Consumer)") || strings.Contains(g, "idem/jetstream.(*lanes)") {
					t.Fatalf("%+v %s: goroutine left after Run returned:\n%s", tc, how, g)
				}
			}
		}
	}
}

var idemtestEvents = idemtest.Events

// TestEmptyMessagesDeadLettered: an empty message with no headers, and
// one with only unrelated headers, is dead-lettered as undecodable, not
// dropped.
func TestEmptyMessagesDeadLettered(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
	b.send(t, []*nats.Msg{{Subject: b.stream + ".empty"}, {Subject: b.stream + ".hdr", Header: nats.Header{"X": {"y"}}}})
	b.runConsumer(t, jetstream.Config{Handler: e.Consumer(false), AckWait: time.Second})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		dls, err := e.Drv.DeadLetterList(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(dls) == 2 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters, want 2", len(dls))
		}
	}
}

// TestMapPanicIsADecodeFailure: a Config.Map that panics on a hostile
// message (a poison message meeting a bug in it) makes that delivery a
// decode failure, dead-lettered with the reason, and the consumer goes on
// with the next message. Before, the panic ended the process, and every
// restart met the message again.
func TestMapPanicIsADecodeFailure(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
	boom := &nats.Msg{Subject: b.stream + ".boom", Data: []byte("boom"), Header: nats.Header{jetstream.HeaderID: {"evt-boom"}}}
	good := &nats.Msg{Subject: b.stream + ".agg.acct-1", Data: []byte("acct-1:5"), Header: nats.Header{jetstream.HeaderID: {"evt-good"}}}
	b.send(t, []*nats.Msg{boom, good})
	panicky := func(m natsjs.Msg) (*idem.Message, error) {
		if string(m.Data()) == "boom" {
			var fields []string
			_ = fields[len(m.Data())] // the kind of bug a hostile payload finds
		}
		return jetstream.DefaultMap(m)
	}
	done := b.runConsumer(t, jetstream.Config{Handler: e.Consumer(false), Map: panicky, AckWait: time.Second})
	e.WaitMarkers(1)
	e.WaitPanickedMap("boom")
	select {
	case err := <-done:
		t.Fatalf("Run returned: %v", err)
	default:
	}
}

// TestMapReturningNothingIsADecodeFailure: a Config.Map that returns
// neither a message nor an error makes the delivery a decode failure,
// dead-lettered. Before, a message carrying an ID header panicked in the
// adapter's check for trimmed IDs, which read the missing message's ID.
func TestMapReturningNothingIsADecodeFailure(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
	b.send(t, []*nats.Msg{{Subject: b.stream + ".x", Data: []byte("x"), Header: nats.Header{jetstream.HeaderMsgID: {"evt-1"}}}})
	nothing := func(natsjs.Msg) (*idem.Message, error) { return nil, nil }
	done := b.runConsumer(t, jetstream.Config{Handler: e.Consumer(false), Map: nothing, AckWait: time.Second})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		dls, err := e.Drv.DeadLetterList(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(dls) == 1 && dls[0].Class == "decode" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters, want 1 decode failure", len(dls))
		}
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned: %v", err)
	default:
	}
}
