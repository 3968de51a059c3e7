package jetstream_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
)

// broker is adaptertest.Broker on one JetStream stream.
type broker struct {
	url, stream string
	concurrency int // Config.Concurrency of the consumers
}

func newBroker(t testing.TB, url string) *broker {
	t.Helper()
	b := &broker{url: url, stream: fmt.Sprintf("IDEMT%d", time.Now().UnixNano())}
	nc, js := b.connect(t)
	defer nc.Close()
	if _, err := js.CreateStream(context.Background(), natsjs.StreamConfig{Name: b.stream, Subjects: []string{b.stream + ".>"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		nc, js := b.connect(t)
		defer nc.Close()
		_ = js.DeleteStream(context.Background(), b.stream)
	})
	return b
}

func (b *broker) connect(t testing.TB) (*nats.Conn, natsjs.JetStream) {
	t.Helper()
	nc, err := nats.Connect(b.url)
	if err != nil {
		t.Fatal(err)
	}
	js, err := natsjs.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

func (b *broker) send(t testing.TB, msgs []*nats.Msg) {
	t.Helper()
	nc, js := b.connect(t)
	defer nc.Close()
	for _, m := range msgs {
		if _, err := js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}
	}
}

// Publish puts each aggregate on its own subject, the ID in idem-id.
func (b *broker) Publish(t testing.TB, msgs []*idem.Message, dupEvery int) {
	var out []*nats.Msg
	for i, m := range msgs {
		n := &nats.Msg{Subject: b.stream + ".agg." + m.AggregateID, Data: m.Payload, Header: nats.Header{}}
		n.Header.Set(jetstream.HeaderID, m.ID)
		n.Header.Set(jetstream.HeaderAggregate, m.AggregateID)
		if m.Seq > 0 {
			n.Header.Set(jetstream.HeaderSeq, strconv.FormatInt(m.Seq, 10))
		}
		out = append(out, n)
		if dupEvery > 0 && i%dupEvery == 0 {
			out = append(out, n)
		}
	}
	b.send(t, out)
}

func (b *broker) PublishRaw(t testing.TB, value []byte) {
	b.send(t, []*nats.Msg{{Subject: b.stream + ".raw", Data: value}})
}

func (b *broker) consumer(t testing.TB, h idem.DeliveryHandler, batch ...int) (*nats.Conn, *jetstream.Consumer) {
	nc, js := b.connect(t)
	cfg := &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: h, AckWait: time.Second, MaxDeliver: 50, Concurrency: b.concurrency, Logger: testenv.Logger(t)}
	if len(batch) > 0 {
		cfg.Batch = batch[0]
	}
	c, err := jetstream.New(js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return nc, c
}

// Start runs a consumer; kill closes its connection at once.
func (b *broker) Start(t testing.TB, h idem.DeliveryHandler) func() {
	return b.start(t, h)
}

// StartBatched runs a consumer fetching batches.
func (b *broker) StartBatched(t testing.TB, h idem.BatchDeliveryHandler, batch int) func() {
	return b.start(t, h, batch)
}

func (b *broker) start(t testing.TB, h idem.DeliveryHandler, batch ...int) func() {
	nc, c := b.consumer(t, h, batch...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	var once sync.Once
	kill := func() { once.Do(func() { nc.Close(); cancel(); <-done }) }
	t.Cleanup(kill)
	return kill
}

// StartCrashing closes the connection right after the 100th delivery was
// decided, before its ack can be sent.
func (b *broker) StartCrashing(t testing.TB, h idem.DeliveryHandler) <-chan struct{} {
	var (
		seen atomic.Int64
		nc   *nats.Conn
	)
	crashed := make(chan struct{})
	nc, c := b.consumer(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		v := h.HandleDelivery(ctx, d)
		if seen.Add(1) == 100 {
			nc.Close()
			close(crashed)
		}
		return v
	}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done }) // it logs through t: end it first
	return crashed
}

// TestAdapterSuite runs the shared adapter suite against an embedded
// server and the real one at IDEM_NATS_URL.
func TestAdapterSuite(t *testing.T) {
	t.Run("embedded", func(t *testing.T) {
		t.Parallel()
		adaptertest.Run(t, func(t testing.TB) adaptertest.Broker { return newBroker(t, testenv.EmbeddedNATS(t)) })
	})
	t.Run("server", func(t *testing.T) {
		t.Parallel()
		testenv.NATSConn(t) // skip loudly (or fail in CI) when it is down
		adaptertest.Run(t, func(t testing.TB) adaptertest.Broker { return newBroker(t, testenv.NATSURL()) })
	})
	t.Run("embedded-concurrent", func(t *testing.T) {
		t.Parallel()
		adaptertest.Run(t, newConcurrentBroker)
	})
}

// newConcurrentBroker is newBroker on an embedded server, with consumers
// deciding up to four aggregates at once.
func newConcurrentBroker(t testing.TB) adaptertest.Broker {
	b := newBroker(t, testenv.EmbeddedNATS(t))
	b.concurrency = 4
	return b
}

// TestNewRejectsBadConfig checks the required settings.
func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := jetstream.New(nil, &jetstream.Config{}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New without JetStream: %v", err)
	}
	nc, js := newBroker(t, testenv.EmbeddedNATS(t)).connect(t)
	defer nc.Close()
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	// A missing setting is named.
	for field, cfg := range map[string]*jetstream.Config{
		"Stream":  {Durable: "d", Handler: h},
		"Durable": {Stream: "S", Handler: h},
		"Handler": {Stream: "S", Durable: "d"},
	} {
		if _, err := jetstream.New(js, cfg); !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "Config."+field+" is required") {
			t.Errorf("New without %s: %v, want ErrInvalidConfig naming it", field, err)
		}
	}
	if _, err := jetstream.New(js, &jetstream.Config{Stream: "S", Durable: "d", Handler: h, MaxDeliver: -2}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New with MaxDeliver -2: %v", err)
	}
	if _, err := jetstream.New(js, &jetstream.Config{Stream: "S", Durable: "d", Handler: h, Prefetch: -1}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New with Prefetch -1: %v", err)
	}
	if _, err := jetstream.New(js, &jetstream.Config{Stream: "S", Durable: "d", Handler: h, Concurrency: -1}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New with Concurrency -1: %v", err)
	}
	if _, err := jetstream.New(js, &jetstream.Config{Stream: "S", Durable: "d", Handler: h, MaxDeliver: -1}); err != nil {
		t.Fatalf("New with MaxDeliver -1 (no limit): %v", err)
	}
	if _, err := jetstream.New(js, &jetstream.Config{Stream: "S", Durable: "d", Handler: h, AckWait: time.Second, BatchWait: 500 * time.Millisecond}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New with BatchWait half of AckWait: %v, want ErrInvalidConfig", err)
	}
	// A Batch the handler cannot take is refused, not ignored.
	if _, err := jetstream.New(js, &jetstream.Config{Stream: "S", Durable: "d", Handler: h, Batch: 10}); !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "BatchDeliveryHandler") {
		t.Fatalf("New with Batch 10 and a one-at-a-time handler: %v, want ErrInvalidConfig", err)
	}
}

// A producer's trace context set in the message headers travels through
// Publisher, the embedded server and DefaultMap to the processing span.
func TestTraceContextReachesProcessingSpan(t *testing.T) {
	b := newBroker(t, testenv.EmbeddedNATS(t))
	nc, js := b.connect(t)
	defer nc.Close()
	pub, err := jetstream.NewPublisher(js)
	if err != nil {
		t.Fatal(err)
	}
	adaptertest.CheckTraceContext(t, b.stream+".orders", pub, func(h idem.DeliveryHandler) { b.Start(t, h) })
}

// publishQueue publishes head and then n messages prefix-0 … prefix-(n-1),
// all of aggregate "a", and returns them in order.
func (b *broker) publishQueue(t testing.TB, head, prefix string, n int) []*idem.Message {
	msgs := queue(head, prefix, n)
	b.Publish(t, msgs, 0)
	return msgs
}

// queue returns head and then n messages prefix-0 … prefix-(n-1), all of
// aggregate "a".
func queue(head, prefix string, n int) []*idem.Message {
	msgs := []*idem.Message{{ID: head, AggregateID: "a"}}
	for i := range n {
		msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("%s-%d", prefix, i), AggregateID: "a"})
	}
	return msgs
}

// publishBehind publishes msgs while the consumer on nc is held in a
// handler, and returns once they have all reached nc. JetStream counts a
// message as pending ack before its send loop hands it to the connection,
// and a subscription that ends in between never receives it (it is
// redelivered after AckWait, or dropped on its last delivery): a test of
// what a stopping consumer does with the messages it holds waits here
// rather than for the server's ack-pending count. While the consumer is
// held, its connection receives nothing else but the messages: its pull
// heartbeats come every 15 s, and the tests set its durable watch to an
// hour (jetstream.SetWatchEvery).
func (b *broker) publishBehind(t *testing.T, nc *nats.Conn, msgs []*idem.Message) {
	t.Helper()
	before := nc.Stats().InMsgs
	b.Publish(t, msgs, 0)
	for deadline := time.Now().Add(10 * time.Second); nc.Stats().InMsgs < before+uint64(len(msgs)); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d messages reached the consumer's connection after 10 s", nc.Stats().InMsgs-before, len(msgs))
		}
	}
}

// runFailing runs one consumer with the given MaxDeliver and
// idem.ConsumerConfig.MaxAttempts on a message "stuck" whose handler fails
// its first failures deliveries, followed by five healthy messages. It
// waits until the five are applied and returns the env and the count of
// the stuck message's tries.
func runFailing(t *testing.T, maxDeliver, maxAttempts int, failures int64) (*adaptertest.Env, *atomic.Int64) {
	t.Helper()
	b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
	tries := new(atomic.Int64)
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		if m.ID == "stuck" && tries.Add(1) <= failures {
			return errors.New("dependency down")
		}
		return nil
	}}
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{MaxAttempts: maxAttempts,
		Backoff: idem.Backoff{Base: time.Millisecond, Max: 2 * time.Millisecond}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b.publishQueue(t, "stuck", "ok", 5)
	nc, js := b.connect(t)
	t.Cleanup(nc.Close)
	cons, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: c, AckWait: time.Second, MaxDeliver: maxDeliver, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = cons.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	e.WaitMarkers(5)
	return e, tries
}

// waitDeadLetter waits for the stuck message's dead letter and checks it.
func waitDeadLetter(t *testing.T, e *adaptertest.Env, class string, attempts int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		dls, err := e.Drv.DeadLetterList(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(dls) == 1 {
			if dl := dls[0]; dl.MessageID != "stuck" || dl.Class != class || dl.Attempts != attempts {
				t.Fatalf("dead letter %s class %s after %d attempts, want stuck, %s, %d", dl.MessageID, dl.Class, dl.Attempts, class, attempts)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters after 10 s, want the stuck message's", len(dls))
		}
	}
}

// The delivery that reaches MaxDeliver is dead-lettered and terminated:
// not dropped, and not delivered again.
func TestMaxDeliverEndsInDeadLetter(t *testing.T) {
	t.Parallel()
	e, tries := runFailing(t, 3, 0, 1<<30)
	waitDeadLetter(t, e, idem.DeadLetterExhausted, 3)
	time.Sleep(300 * time.Millisecond) // a redelivery would come within ms
	if n := tries.Load(); n != 3 {
		t.Fatalf("the stuck message was tried %d times, want 3 (MaxDeliver)", n)
	}
}

// With MaxDeliver -1, and by default, JetStream redelivers past 20 (a
// common limit) until the message is decided: here it succeeds on its
// 26th delivery. A dependency down for a while costs time, not a dead
// letter.
func TestMaxDeliverUnlimitedRedeliversUntilDecided(t *testing.T) {
	t.Parallel()
	for _, maxDeliver := range []int{-1, 0} {
		e, tries := runFailing(t, maxDeliver, 0, 25)
		e.WaitMarkers(6)
		if n := tries.Load(); n != 26 {
			t.Fatalf("MaxDeliver %d: the stuck message was tried %d times, want 26", maxDeliver, n)
		}
		if dls, err := e.Drv.DeadLetterList(context.Background(), nil); err != nil || len(dls) != 0 {
			t.Fatalf("MaxDeliver %d: dead letters %v (%v), want none", maxDeliver, dls, err)
		}
	}
}

// With MaxDeliver -1, idem's MaxAttempts decides when a failure is a dead
// letter.
func TestMaxDeliverUnlimitedMaxAttemptsDeadLetters(t *testing.T) {
	t.Parallel()
	e, tries := runFailing(t, -1, 4, 1<<30)
	waitDeadLetter(t, e, idem.DeadLetterExhausted, 4)
	time.Sleep(300 * time.Millisecond)
	if n := tries.Load(); n != 4 {
		t.Fatalf("the stuck message was tried %d times, want 4 (MaxAttempts)", n)
	}
}

// A handler slower than AckWait keeps its message: the consumer resets
// AckWait while it runs, so JetStream does not redeliver it meanwhile.
func TestSlowHandlerKeepsItsMessage(t *testing.T) {
	t.Parallel()
	b := newBroker(t, testenv.EmbeddedNATS(t))
	var calls, done atomic.Int64
	b.Start(t, idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
		if calls.Add(1) == 1 {
			time.Sleep(2500 * time.Millisecond) // AckWait is 1 s
		}
		done.Add(1)
		return idem.Verdict{Ack: true}
	}))
	b.Publish(t, []*idem.Message{{ID: "slow", AggregateID: "a", Payload: []byte("x")}}, 0)
	for deadline := time.Now().Add(10 * time.Second); done.Load() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the handler did not return")
		}
	}
	time.Sleep(1500 * time.Millisecond) // a redelivery would arrive by now
	if n := calls.Load(); n != 1 {
		t.Fatalf("handler called %d times, want 1: the message was redelivered while it ran", n)
	}
}

// recorder is a handler, one message or a batch at a time, that records
// how many calls overlap, overall and per aggregate, and the order in
// which each aggregate's messages were first decided. (A message pulled
// ahead can wait past AckWait and come again: at-least-once.)
type recorder struct {
	mu       sync.Mutex
	inFlight int            // calls running now
	most     int            // the most calls running at once
	busy     map[string]int // calls running now per aggregate
	overlap  []string       // aggregates seen in two calls at once
	seqs     map[string][]int64
	seen     map[string]bool
	handled  atomic.Int64 // distinct messages decided
}

func newRecorder() *recorder {
	return &recorder{busy: map[string]int{}, seqs: map[string][]int64{}, seen: map[string]bool{}}
}

func (r *recorder) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	return r.HandleDeliveries(ctx, []*idem.Delivery{d})[0]
}

func (r *recorder) HandleDeliveries(_ context.Context, ds []*idem.Delivery) []idem.Verdict {
	aggs := map[string]bool{}
	for _, d := range ds {
		aggs[d.Msg.AggregateID] = true
	}
	r.mu.Lock()
	r.inFlight++
	r.most = max(r.most, r.inFlight)
	for a := range aggs {
		if r.busy[a]++; r.busy[a] > 1 {
			r.overlap = append(r.overlap, a)
		}
	}
	fresh := 0
	for _, d := range ds {
		if !r.seen[d.Msg.ID] {
			r.seen[d.Msg.ID] = true
			r.seqs[d.Msg.AggregateID] = append(r.seqs[d.Msg.AggregateID], d.Msg.Seq)
			fresh++
		}
	}
	r.mu.Unlock()
	time.Sleep(20 * time.Millisecond)
	r.mu.Lock()
	r.inFlight--
	for a := range aggs {
		r.busy[a]--
	}
	r.mu.Unlock()
	r.handled.Add(int64(fresh))
	vs := make([]idem.Verdict, len(ds))
	for i := range vs {
		vs[i] = idem.Verdict{Ack: true}
	}
	return vs
}

// With Concurrency a consumer decides several aggregates at once, one
// message or one lane's part of a batch at a time, yet never two calls of
// one aggregate at once, and each aggregate's messages in their order.
// Without it, one call at a time.
func TestConcurrencyOverlapsAggregates(t *testing.T) {
	t.Parallel()
	const aggs, perAgg = 16, 4
	for _, tc := range []struct {
		concurrency, batch int
	}{{1, 1}, {4, 1}, {1, 8}, {4, 8}} {
		t.Run(fmt.Sprintf("concurrency-%d-batch-%d", tc.concurrency, tc.batch), func(t *testing.T) {
			t.Parallel()
			b := newBroker(t, testenv.EmbeddedNATS(t))
			var msgs []*idem.Message
			for s := range perAgg {
				for a := range aggs {
					msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("%d-%d", a, s), AggregateID: strconv.Itoa(a), Seq: int64(s + 1)})
				}
			}
			b.Publish(t, msgs, 0)
			r := newRecorder()
			b.concurrency = tc.concurrency
			kill := b.start(t, r, tc.batch)
			for deadline := time.Now().Add(20 * time.Second); r.handled.Load() < aggs*perAgg; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("%d of %d messages handled after 20 s", r.handled.Load(), aggs*perAgg)
				}
			}
			kill()
			r.mu.Lock()
			defer r.mu.Unlock()
			if tc.concurrency == 1 && r.most != 1 {
				t.Errorf("%d calls at once, want 1", r.most)
			}
			if tc.concurrency > 1 && (r.most < 2 || r.most > tc.concurrency) {
				t.Errorf("at most %d calls at once, want 2 to %d", r.most, tc.concurrency)
			}
			if len(r.overlap) > 0 {
				t.Errorf("aggregates %v decided in two calls at once", r.overlap)
			}
			for a, seqs := range r.seqs {
				for i, s := range seqs {
					if s != int64(i+1) {
						t.Fatalf("aggregate %s decided in order %v, want 1 to %d", a, seqs, perAgg)
					}
				}
			}
		})
	}
}

// waitAckPending waits until the durable "idem" has n messages delivered
// and not yet acknowledged: pulled by its consumers.
func (b *broker) waitAckPending(t *testing.T, n int) {
	t.Helper()
	nc, js := b.connect(t)
	defer nc.Close()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		cons, err := js.Consumer(context.Background(), b.stream, "idem")
		if err != nil {
			t.Fatal(err)
		}
		info, err := cons.Info(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if info.NumAckPending == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d messages pending ack after 10 s, want %d", info.NumAckPending, n)
		}
	}
}

// onBothServers runs test as subtests against an embedded server and the
// real one at IDEM_NATS_URL (a loud skip, or a failure in CI, when it is
// down), with Config.Concurrency 1 and 2; embedded tells which.
func onBothServers(t *testing.T, test func(t *testing.T, url string, embedded bool, concurrency int)) {
	for _, server := range []string{"embedded", "server"} {
		for _, concurrency := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/concurrency-%d", server, concurrency), func(t *testing.T) {
				t.Parallel()
				url := testenv.NATSURL()
				if server == "embedded" {
					url = testenv.EmbeddedNATS(t)
				} else {
					testenv.NATSConn(t)
				}
				test(t, url, server == "embedded", concurrency)
			})
		}
	}
}

// Messages pulled but not started when Run ends, ahead in the prefetch
// buffer or held by a lane, are Nak'd: a second consumer gets them at
// once, not after AckWait (here 30 s). The v2.9 server on the CI machine
// hands some of them out again only after AckWait (as it would without the
// Naks), so there AckWait is 2 s and the test checks that none is lost.
func TestStopNaksUnstartedMessages(t *testing.T) {
	t.Parallel()
	onBothServers(t, func(t *testing.T, url string, embedded bool, concurrency int) {
		ackWait := 30 * time.Second
		if !embedded {
			ackWait = 2 * time.Second
		}
		b := newBroker(t, url)
		// One aggregate, so one lane: "first" runs, the rest wait behind
		// it in the lane and the prefetch buffer.
		msgs := queue("first", "later", 4)
		b.Publish(t, msgs[:1], 0)
		var firstConn *nats.Conn
		run := func(h idem.DeliveryHandler) (cancel func(), done chan struct{}) {
			nc, js := b.connect(t)
			t.Cleanup(nc.Close)
			if firstConn == nil {
				firstConn = nc
			}
			c, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: h, AckWait: ackWait, Concurrency: concurrency, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			jetstream.SetWatchEvery(c, time.Hour)
			ctx, cancel := context.WithCancel(context.Background())
			done = make(chan struct{})
			go func() { defer close(done); _ = c.Run(ctx) }()
			return cancel, done
		}
		started, release := make(chan struct{}), make(chan struct{})
		var firstSaw []string
		cancel1, done1 := run(idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
			firstSaw = append(firstSaw, d.Msg.ID)
			if d.Msg.ID == "first" {
				close(started)
				<-release
			}
			return idem.Verdict{Ack: true}
		}))
		<-started
		b.publishBehind(t, firstConn, msgs[1:])
		b.waitAckPending(t, len(msgs)) // all pulled: the rest wait behind first
		cancel1()
		close(release) // "first" finishes and is acked; the rest are not started
		<-done1
		if len(firstSaw) != 1 {
			t.Fatalf("the stopped consumer decided %v, want only first", firstSaw)
		}
		got := make(chan string, len(msgs))
		cancel2, done2 := run(idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
			got <- d.Msg.ID
			return idem.Verdict{Ack: true}
		}))
		defer func() { cancel2(); <-done2 }()
		// Once each, or more: JetStream delivers at least once, and a
		// v2.9 server was seen to hand a Nak'd message out twice.
		seen := map[string]bool{}
		for deadline := time.After(10 * time.Second); len(seen) < len(msgs)-1; {
			select {
			case id := <-got:
				if id == "first" {
					t.Fatal("the second consumer got first, which was acked")
				}
				seen[id] = true
			case <-deadline:
				t.Fatalf("the second consumer got %v within 10 s, want the 4 later messages: the rest waited for AckWait instead of a Nak", seen)
			}
		}
	})
}

// A message pulled but not started when Run ends is decided rather than
// Nak'd when this is its last delivery: put back, JetStream would drop it.
// MaxDeliver 1 makes every delivery the last.
func TestStopDecidesLastDeliveries(t *testing.T) {
	t.Parallel()
	onBothServers(t, func(t *testing.T, url string, _ bool, concurrency int) {
		b := newBroker(t, url)
		msgs := queue("first", "later", 6)
		b.Publish(t, msgs[:1], 0)
		nc, js := b.connect(t)
		t.Cleanup(nc.Close)
		started, release := make(chan struct{}), make(chan struct{})
		var (
			mu       sync.Mutex
			saw      []string
			inFlight atomic.Int64
		)
		h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
			if n := inFlight.Add(1); n > 1 {
				t.Errorf("%s decided while %d other calls ran: one aggregate at a time", d.Msg.ID, n-1)
			}
			defer inFlight.Add(-1)
			mu.Lock()
			saw = append(saw, d.Msg.ID)
			mu.Unlock()
			if !d.LastAttempt {
				t.Errorf("%s: delivery %d of MaxDeliver 1 is not LastAttempt", d.Msg.ID, d.Attempt)
			}
			if d.Msg.ID == "first" {
				close(started)
				<-release
			}
			time.Sleep(10 * time.Millisecond) // long enough to overlap a second call
			return idem.Verdict{Ack: true}
		})
		c, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: h, AckWait: 30 * time.Second, MaxDeliver: 1, Concurrency: concurrency, Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		jetstream.SetWatchEvery(c, time.Hour)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = c.Run(ctx) }()
		<-started
		b.publishBehind(t, nc, msgs[1:])
		b.waitAckPending(t, len(msgs))
		cancel()
		close(release)
		<-done
		mu.Lock()
		defer mu.Unlock()
		want := make([]string, len(msgs))
		for i, m := range msgs {
			want[i] = m.ID
		}
		if !slices.Equal(saw, want) {
			t.Fatalf("the stopped consumer decided %v, want %v: the rest were on their last delivery, and in order", saw, want)
		}
	})
}
