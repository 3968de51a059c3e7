package kafka_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/tracing"
)

const topic = "credits"

// broker is adaptertest.Broker on an in-process kfake cluster.
type broker struct {
	addrs []string
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
	c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "idem", Topics: []string{topic}, Handler: h, MaxPoll: 50, FaultHook: hook, Batch: batch,
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

// TestNewRejectsBadConfig checks the required settings.
func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := kafka.New(&kafka.Config{Brokers: []string{"x:9092"}}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New without Group, Topics, Handler: %v", err)
	}
}

// A producer's trace context set in the message headers travels through
// Publisher, the broker and DefaultMap to the processing span, which
// continues the producer's trace.
func TestTraceContextReachesProcessingSpan(t *testing.T) {
	b := newBroker(t).(*broker)
	ctx := context.Background()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(ctx)
	tr, err := tracing.New(tp, nil)
	if err != nil {
		t.Fatal(err)
	}

	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	pub, err := kafka.NewPublisher(cl)
	if err != nil {
		t.Fatal(err)
	}
	pctx, publish := tp.Tracer("shop").Start(ctx, "publish")
	msg := &idem.Message{ID: "order-1", Stream: topic, AggregateID: "order-1", Payload: []byte("placed"), Headers: map[string]string{}}
	tr.Inject(pctx, msg.Headers)
	publish.End()
	if err := pub.Publish(ctx, []*idem.Message{msg}); err != nil {
		t.Fatal(err)
	}

	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "traced.db"), nil)
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{tr}})
	if err != nil {
		t.Fatal(err)
	}
	applied := make(chan trace.SpanContext, 1)
	h := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(ctx context.Context, _ *sql.Tx, _ *idem.Message) error {
		applied <- trace.SpanContextFromContext(ctx)
		return nil
	}}
	c, err := idem.NewConsumer(proc, h, drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	b.Start(t, c)
	var got trace.SpanContext
	select {
	case got = <-applied:
	case <-time.After(20 * time.Second):
		t.Fatal("the message was not processed")
	}
	if got.TraceID() != publish.SpanContext().TraceID() {
		t.Fatalf("the handler ran in trace %v, want the producer's %v", got.TraceID(), publish.SpanContext().TraceID())
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		for _, s := range rec.Ended() {
			if s.Name() == "process mailer" {
				if s.Parent().SpanID() != publish.SpanContext().SpanID() {
					t.Fatalf("the processing span's parent is %v, want the producer's span %v", s.Parent().SpanID(), publish.SpanContext().SpanID())
				}
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no processing span ended")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
