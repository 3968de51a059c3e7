package jetstream_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
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
	cfg := &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: h, AckWait: time.Second, MaxDeliver: 50, Logger: testenv.Logger(t)}
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
}

// TestNewRejectsBadConfig checks the required settings.
func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := jetstream.New(nil, &jetstream.Config{}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New without JetStream: %v", err)
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
