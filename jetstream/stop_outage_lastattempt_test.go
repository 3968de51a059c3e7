package jetstream_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
)

// outageSeen is a HookOutage that signals an outage's start.
type outageSeen struct{ down chan struct{} }

func (o *outageSeen) OnOutage(_ context.Context, ev *idem.OutageEvent) {
	if ev.Down {
		select {
		case o.down <- struct{}{}:
		default:
		}
	}
}

// stopDuringOutage publishes one message, has it delivered and Nak'd
// preDeliveries times by a plain JetStream consumer on the durable, takes
// the store down, runs the idem consumer until it holds the message, stops
// it, brings the store back and runs the consumer again. It returns the
// deliveries the handler saw, the effects, the dead letters and the
// max-deliveries advisories.
// With natsMsgID the ID is in Nats-Msg-Id (as Publisher writes it), not
// idem-id; with preApplied the message's effect is committed before the
// outage (a delivery applied whose ack was lost): it must stay one effect.
func stopDuringOutage(t *testing.T, maxDeliver, preDeliveries int, natsMsgID, preApplied bool, tune ...func(*jetstream.Config)) {
	t.Parallel()
	b := newBroker(t, testenv.EmbeddedNATS(t))
	path, db, drv, p, h := outageStore(t)
	seen := &outageSeen{down: make(chan struct{}, 1)}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t), Hooks: []idem.Hook{seen}})
	if err != nil {
		t.Fatal(err)
	}
	type call struct {
		id      string
		attempt int
		last    bool
		verdict idem.Verdict
	}
	var (
		mu    sync.Mutex
		calls []call
	)
	record := func(d *idem.Delivery, v idem.Verdict) {
		mu.Lock()
		defer mu.Unlock()
		id := ""
		if d.Msg != nil {
			id = d.Msg.ID
		}
		calls = append(calls, call{id, d.Attempt, d.LastAttempt, v})
	}
	rec := &outageRecorder{c: c, record: record}

	nc, js := b.connect(t)
	defer nc.Close()
	// Max-deliveries advisories: JetStream's only trace of a dropped message.
	adv, err := nc.SubscribeSync("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES." + b.stream + ".idem")
	if err != nil {
		t.Fatal(err)
	}
	const ackWait = time.Second
	pre, err := js.CreateOrUpdateConsumer(context.Background(), b.stream, natsjs.ConsumerConfig{
		Durable: "idem", AckPolicy: natsjs.AckExplicitPolicy, AckWait: ackWait, MaxDeliver: maxDeliver,
	})
	if err != nil {
		t.Fatal(err)
	}
	if natsMsgID {
		nm := &nats.Msg{Subject: b.stream + ".agg.a", Data: []byte("x"), Header: nats.Header{}}
		nm.Header.Set(jetstream.HeaderMsgID, "m-1")
		nm.Header.Set(jetstream.HeaderAggregate, "a")
		b.send(t, []*nats.Msg{nm})
	} else {
		b.Publish(t, []*idem.Message{{ID: "m-1", AggregateID: "a", Payload: []byte("x")}}, 0)
	}
	if preApplied {
		if out, err := p.Process(context.Background(), h, &idem.Message{ID: "m-1", AggregateID: "a", Payload: []byte("x")}); err != nil || out != idem.Applied {
			t.Fatalf("pre-apply: %v %v", out, err)
		}
	}
	for i := range preDeliveries {
		mb, err := pre.Fetch(1, natsjs.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range mb.Messages() {
			n++
			if err := m.Nak(); err != nil {
				t.Fatal(err)
			}
		}
		if n != 1 {
			t.Fatalf("pre-delivery %d: fetched %d messages", i+1, n)
		}
	}

	release := testenv.HoldSQLite(t, path)
	cfg := &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: rec, AckWait: ackWait, MaxDeliver: maxDeliver, Logger: testenv.Logger(t)}
	for _, f := range tune {
		f(cfg)
	}
	jc, err := jetstream.New(js, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- jc.Run(ctx) }()
	select {
	case <-seen.down:
	case <-time.After(10 * time.Second):
		t.Fatal("no outage seen 10 s after the consumer started")
	}
	// Held past an AckWait: InProgress keeps the delivery.
	time.Sleep(2 * ackWait)
	stopAt := time.Now()
	cancel()
	select {
	case err := <-done:
		t.Logf("first Run returned %v after %s (store still down)", err, time.Since(stopAt).Round(time.Millisecond))
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return 30 s after its context was cancelled (store down)")
	}
	if info, err := pre.Info(context.Background()); err == nil {
		t.Logf("after the stop: delivered=%d ack_pending=%d redelivered=%d pending=%d ack_floor=%d",
			info.Delivered.Consumer, info.NumAckPending, info.NumRedelivered, info.NumPending, info.AckFloor.Stream)
	}

	release()
	ctx2, cancel2 := context.WithCancel(context.Background())
	done2 := make(chan error, 1)
	go func() { done2 <- jc.Run(ctx2) }()
	count := func() int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM applied`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	dead := func() []driver.DeadLetter {
		dls, err := drv.DeadLetterList(context.Background(), &driver.DeadLetterFilter{})
		if err != nil {
			t.Fatal(err)
		}
		return dls
	}
	// Long enough for an AckWait redelivery and a Nak's backoff.
	for deadline := time.Now().Add(5 * ackWait); time.Now().Before(deadline) && count() == 0 && len(dead()) == 0; {
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(ackWait) // a second effect or dead letter, if any, shows up
	cancel2()
	<-done2

	mu.Lock()
	for i, cl := range calls {
		t.Logf("delivery %d: id=%s attempt=%d last=%v verdict: ack=%v outcome=%v dead-lettered=%v err=%v", i+1, cl.id, cl.attempt, cl.last, cl.verdict.Ack, cl.verdict.Outcome, cl.verdict.DeadLettered, cl.verdict.Err)
	}
	mu.Unlock()
	if info, err := pre.Info(context.Background()); err == nil {
		t.Logf("at the end: delivered=%d ack_pending=%d redelivered=%d pending=%d ack_floor=%d",
			info.Delivered.Consumer, info.NumAckPending, info.NumRedelivered, info.NumPending, info.AckFloor.Stream)
	}
	for {
		m, err := adv.NextMsg(100 * time.Millisecond)
		if err != nil {
			break
		}
		var a struct {
			StreamSeq  uint64 `json:"stream_seq"`
			Deliveries int    `json:"deliveries"`
		}
		_ = json.Unmarshal(m.Data, &a)
		t.Logf("advisory %s: stream_seq=%d deliveries=%d", m.Subject, a.StreamSeq, a.Deliveries)
	}
	applied, dls := count(), dead()
	for _, d := range dls {
		t.Logf("dead letter: class=%s attempts=%d error=%s", d.Class, d.Attempts, d.Error)
	}
	switch {
	case applied == 0 && len(dls) == 0:
		t.Errorf("message LOST: not applied, not dead-lettered")
	case applied > 1:
		t.Errorf("applied %d times", applied)
	case applied == 0 && len(dls) > 0:
		t.Errorf("dead-lettered (%s) although it never failed: only the store was down", dls[0].Class)
	}
}

// TestStopDuringOutageOnLastDelivery: MaxDeliver 2, delivered and Nak'd
// once, so the idem consumer holds the broker's last delivery when it is
// stopped during the outage.
func TestStopDuringOutageOnLastDelivery(t *testing.T) { stopDuringOutage(t, 2, 1, false, false) }

// TestStopDuringOutageOnLastDeliveryNatsMsgID: the same, the ID in
// Nats-Msg-Id and the effect already applied before the outage: the
// stream's duplicate window must not drop a requeued copy, and the copy
// must keep the ID (a Duplicate, one effect).
func TestStopDuringOutageOnLastDeliveryNatsMsgID(t *testing.T) { stopDuringOutage(t, 2, 1, true, true) }

// TestStopDuringOutageOnLastDeliveryNatsMsgIDNew: the ID in Nats-Msg-Id,
// not applied yet: the copy, within the duplicate window, must arrive.
func TestStopDuringOutageOnLastDeliveryNatsMsgIDNew(t *testing.T) {
	stopDuringOutage(t, 2, 1, true, false)
}

// TestStopDuringOutageOnLastDeliveryLanes: with Concurrency (lanes).
func TestStopDuringOutageOnLastDeliveryLanes(t *testing.T) {
	stopDuringOutage(t, 2, 1, false, false, func(c *jetstream.Config) { c.Concurrency = 2 })
}

// TestStopDuringOutageOnLastDeliveryBatch: fetching in batches.
func TestStopDuringOutageOnLastDeliveryBatch(t *testing.T) {
	stopDuringOutage(t, 2, 1, false, false, func(c *jetstream.Config) { c.Batch = 4 })
}

// TestStopDuringOutageOnEarlierDelivery: MaxDeliver 5, first delivery.
func TestStopDuringOutageOnEarlierDelivery(t *testing.T) { stopDuringOutage(t, 5, 0, false, false) }

// outageRecorder passes deliveries to c, single or batched, and records them.
type outageRecorder struct {
	c      *idem.Consumer[*sql.Tx]
	record func(*idem.Delivery, idem.Verdict)
}

func (r *outageRecorder) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	v := r.c.HandleDelivery(ctx, d)
	r.record(d, v)
	return v
}

func (r *outageRecorder) HandleDeliveries(ctx context.Context, ds []*idem.Delivery) []idem.Verdict {
	vs := r.c.HandleDeliveries(ctx, ds)
	for i, d := range ds {
		r.record(d, vs[i])
	}
	return vs
}

// A handler's own retry verdict on the last delivery, with no stop, is
// not requeued: MaxDeliver ends it as JetStream does (a handler that always
// retries would otherwise be requeued for ever, and every durable on the
// stream would receive the copies).
func TestRetryOnLastDeliveryWithoutStopIsNotRequeued(t *testing.T) {
	t.Parallel()
	b := newBroker(t, testenv.EmbeddedNATS(t))
	nc, js := b.connect(t)
	defer nc.Close()
	var mu sync.Mutex
	var attempts []int
	h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		mu.Lock()
		attempts = append(attempts, d.Attempt)
		mu.Unlock()
		return idem.Verdict{RetryAfter: 10 * time.Millisecond}
	})
	jc, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: h, MaxDeliver: 2, AckWait: time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b.Publish(t, []*idem.Message{{ID: "m-1", AggregateID: "a", Payload: []byte("x")}}, 0)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- jc.Run(ctx) }()
	time.Sleep(2 * time.Second)
	cancel()
	<-done
	info, err := js.Stream(context.Background(), b.stream)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if n := info.CachedInfo().State.Msgs; n != 1 || len(attempts) != 2 {
		t.Fatalf("%d messages in the stream, attempts %v; want the one published, delivered twice (MaxDeliver 2)", n, attempts)
	}
}
