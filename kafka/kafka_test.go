package kafka_test

import (
	"context"
	"errors"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
)

const topic = "credits"

// broker is adaptertest.Broker on an in-process kfake cluster.
type broker struct {
	addrs       []string
	concurrency int // Config.Concurrency of the members
}

func newBroker(t testing.TB) adaptertest.Broker {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, topic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return &broker{addrs: c.ListenAddrs()}
}

func (b *broker) produce(t testing.TB, recs []*kgo.Record) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// Publish keys records by aggregate, the ID in idem-id.
func (b *broker) Publish(t testing.TB, msgs []*idem.Message, dupEvery int) {
	var recs []*kgo.Record
	for i, m := range msgs {
		r := &kgo.Record{Key: []byte(m.AggregateID), Value: m.Payload, Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(m.ID)}}}
		if m.Seq > 0 {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: kafka.HeaderSeq, Value: []byte(strconv.FormatInt(m.Seq, 10))})
		}
		recs = append(recs, r)
		if dupEvery > 0 && i%dupEvery == 0 {
			recs = append(recs, &kgo.Record{Key: r.Key, Value: r.Value, Headers: r.Headers})
		}
	}
	b.produce(t, recs)
}

func (b *broker) PublishRaw(t testing.TB, value []byte) {
	b.produce(t, []*kgo.Record{{Key: []byte("raw"), Value: value}})
}

func (b *broker) consumer(t testing.TB, h idem.DeliveryHandler, hook func(string), batch int) *kafka.Consumer {
	c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "idem", Topics: []string{topic}, Handler: h, MaxPoll: 50, FaultHook: hook, Batch: batch, Concurrency: b.concurrency,
		Logger: testenv.Logger(t), Options: []kgo.Opt{kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(6 * time.Second)}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Start runs a group member; kill stops it.
func (b *broker) Start(t testing.TB, h idem.DeliveryHandler) func() {
	return b.start(t, b.consumer(t, h, nil, 1))
}

// StartBatched runs a member handing its records over in batches.
func (b *broker) StartBatched(t testing.TB, h idem.BatchDeliveryHandler, batch int) func() {
	return b.start(t, b.consumer(t, h, nil, batch))
}

func (b *broker) start(t testing.TB, c *kafka.Consumer) func() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	var once sync.Once
	kill := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(kill)
	return kill
}

// StartCrashing ends the member's goroutine at its first commit: the
// records it processed are never committed.
func (b *broker) StartCrashing(t testing.TB, h idem.DeliveryHandler) <-chan struct{} {
	var crashed atomic.Bool
	c := b.consumer(t, h, func(point string) {
		if point == kafka.FaultBeforeCommit && crashed.CompareAndSwap(false, true) {
			runtime.Goexit()
		}
	}, 1)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(context.Background()) }()
	return done
}

// TestAdapterSuite runs the shared adapter suite against kfake.
func TestAdapterSuite(t *testing.T) {
	adaptertest.Run(t, newBroker)
}

// TestAdapterSuiteConcurrent runs it with members that handle up to four
// partitions of a poll at once.
func TestAdapterSuiteConcurrent(t *testing.T) {
	adaptertest.Run(t, newConcurrentBroker)
}

// newConcurrentBroker is newBroker with members that handle up to four
// partitions at once.
func newConcurrentBroker(t testing.TB) adaptertest.Broker {
	b := newBroker(t).(*broker)
	b.concurrency = 4
	return b
}

// TestNewRejectsBadConfig checks the required settings.
func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := kafka.New(&kafka.Config{Brokers: []string{"x:9092"}}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New without Group, Topics, Handler: %v", err)
	}
}

// A producer's trace context set in the message headers travels through
// Publisher, kfake and DefaultMap to the processing span.
func TestTraceContextReachesProcessingSpan(t *testing.T) {
	b := newBroker(t).(*broker)
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	pub, err := kafka.NewPublisher(cl)
	if err != nil {
		t.Fatal(err)
	}
	adaptertest.CheckTraceContext(t, topic, pub, func(h idem.DeliveryHandler) { b.Start(t, h) })
}

// A member whose record keeps asking for a retry holds its poll, so it
// blocks the group's next rebalance; past the rebalance timeout the
// coordinator drops it, and the member that takes its partitions over
// applies every record, the stuck one included, with nothing lost and
// nothing applied twice.
func TestStuckMemberIsDroppedNothingLost(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
	events := idemtest.Events(400)
	msgs := adaptertest.Messages(events)
	stuck := msgs[0].ID
	healthy := e.Consumer(false)
	var stuckTries, calls atomic.Int64
	sticky := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		calls.Add(1)
		if d.Msg != nil && d.Msg.ID == stuck {
			stuckTries.Add(1)
			return idem.Verdict{RetryAfter: 20 * time.Millisecond, Err: errors.New("dependency down")}
		}
		return healthy.HandleDelivery(ctx, d)
	})
	member := func(h idem.DeliveryHandler) func() {
		c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "idem", Topics: []string{topic}, Handler: h, MaxPoll: 50,
			Logger: testenv.Logger(t), Options: []kgo.Opt{kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(2 * time.Second)}})
		if err != nil {
			t.Fatal(err)
		}
		return b.start(t, c)
	}
	b.Publish(t, msgs, 0)
	killStuck := member(sticky)
	for deadline := time.Now().Add(20 * time.Second); stuckTries.Load() < 3; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the first member never reached the stuck record (%d deliveries)", calls.Load())
		}
	}
	member(healthy)
	e.WaitMarkers(len(events))
	e.CheckBalances(events)
	before := stuckTries.Load()
	time.Sleep(100 * time.Millisecond)
	if stuckTries.Load() == before {
		t.Fatal("the stuck member stopped retrying: it was not still holding its poll when the other member took over")
	}
	killStuck()
}

// With Concurrency a member handles a poll's partitions at once; without
// it, one record at a time.
func TestConcurrencyOverlapsPartitions(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ concurrency, wantMax int64 }{{1, 1}, {4, 4}} {
		b := newBroker(t).(*broker)
		cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
		if err != nil {
			t.Fatal(err)
		}
		var recs []*kgo.Record
		for i := range 20 {
			recs = append(recs, &kgo.Record{Partition: int32(i % 4), Value: []byte("x"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(strconv.Itoa(i))}}})
		}
		if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
		cl.Close()
		var inFlight, most, handled atomic.Int64
		h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
			n := inFlight.Add(1)
			for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
			}
			time.Sleep(30 * time.Millisecond)
			inFlight.Add(-1)
			handled.Add(1)
			return idem.Verdict{Ack: true}
		})
		b.concurrency = int(tc.concurrency)
		kill := b.Start(t, h)
		for deadline := time.Now().Add(20 * time.Second); handled.Load() < 20; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("concurrency %d: %d of 20 records handled after 20 s", tc.concurrency, handled.Load())
			}
		}
		kill()
		if m := most.Load(); m != tc.wantMax {
			t.Errorf("concurrency %d: at most %d records in flight at once, want %d", tc.concurrency, m, tc.wantMax)
		}
	}
}

// TestNewRejectsNegativeConcurrency checks Concurrency's bound.
func TestNewRejectsNegativeConcurrency(t *testing.T) {
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	if _, err := kafka.New(&kafka.Config{Brokers: []string{"x:9092"}, Group: "g", Topics: []string{"t"}, Handler: h, Concurrency: -1}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New with Concurrency -1: %v", err)
	}
}
