package rabbitmq_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/rabbitmq"
)

// broker is adaptertest.Broker on one queue of the RabbitMQ server at
// IDEM_RABBITMQ_URL.
type broker struct {
	conn        *amqp.Connection
	queue       string
	queueType   string
	concurrency int // Config.Concurrency of the consumers
	maxDeliver  int
	logger      bool // consumers log through t (off: quiet)
}

// newBroker declares a fresh queue of queueType, deleted with its retry
// queues when t ends.
func newBroker(t testing.TB, queueType string) *broker {
	t.Helper()
	conn, name := testenv.RabbitMQ(t)
	b := &broker{conn: conn, queue: name, queueType: queueType, maxDeliver: 50, logger: true}
	ch := b.channel(t)
	if _, err := ch.QueueDeclare(b.queue, true, false, false, false, amqp.Table{"x-queue-type": queueType}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deleteQueues(t, b.queue) })
	return b
}

// deleteQueues deletes queue and every retry queue it may have, on a
// connection of its own (the test's may be closed by then).
func deleteQueues(t testing.TB, queue string) {
	conn, err := amqp.Dial(testenv.RabbitMQURL())
	if err != nil {
		t.Errorf("delete %s: %v", queue, err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Errorf("delete %s: %v", queue, err)
		return
	}
	names := []string{queue}
	for _, tier := range rabbitmq.RetryTiers() {
		names = append(names, rabbitmq.RetryQueueName(queue, tier))
	}
	for _, n := range names {
		if _, err := ch.QueueDelete(n, false, false, false); err != nil {
			t.Errorf("delete %s: %v", n, err)
			return
		}
	}
}

// channel opens a channel on the test's connection, in confirm mode.
func (b *broker) channel(t testing.TB) *amqp.Channel {
	t.Helper()
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ch.Close() })
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	return ch
}

// send publishes pubs to the queue, waiting for the broker's confirms.
func (b *broker) send(t testing.TB, pubs []amqp.Publishing) {
	t.Helper()
	ch := b.channel(t)
	defer ch.Close()
	var dcs []*amqp.DeferredConfirmation
	for _, p := range pubs {
		dc, err := ch.PublishWithDeferredConfirm("", b.queue, true, false, p)
		if err != nil {
			t.Fatal(err)
		}
		dcs = append(dcs, dc)
	}
	for _, dc := range dcs {
		if !dc.Wait() {
			t.Fatal("publish not confirmed")
		}
	}
}

// Publish sends the ID in the message-id property (every third message in
// the idem-id header instead), the aggregate and sequence in headers.
func (b *broker) Publish(t testing.TB, msgs []*idem.Message, dupEvery int) {
	var pubs []amqp.Publishing
	for i, m := range msgs {
		p := amqp.Publishing{Body: m.Payload, DeliveryMode: amqp.Persistent, Headers: amqp.Table{}}
		if i%3 == 2 {
			p.Headers[rabbitmq.HeaderID] = m.ID
		} else {
			p.MessageId = m.ID
		}
		if m.AggregateID != "" {
			p.Headers[rabbitmq.HeaderAggregate] = m.AggregateID
		}
		if m.Seq > 0 {
			p.Headers[rabbitmq.HeaderSeq] = m.Seq
		}
		pubs = append(pubs, p)
		if dupEvery > 0 && i%dupEvery == 0 {
			pubs = append(pubs, p)
		}
	}
	b.send(t, pubs)
}

// PublishRaw sends a message without an ID.
func (b *broker) PublishRaw(t testing.TB, value []byte) {
	b.send(t, []amqp.Publishing{{Body: value}})
}

// config returns the consumers' Config.
func (b *broker) config(t testing.TB, h idem.DeliveryHandler) *rabbitmq.Config {
	cfg := &rabbitmq.Config{URL: testenv.RabbitMQURL(), Queue: b.queue, QueueType: b.queueType, Handler: h,
		MaxDeliver: b.maxDeliver, Concurrency: b.concurrency,
		AMQP:      amqp.Config{Properties: amqp.Table{"connection_name": "idem test consumer " + b.queue}},
		Reconnect: idem.Backoff{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond}}
	if b.logger {
		cfg.Logger = testenv.Logger(t)
	}
	return cfg
}

// run runs a consumer of cfg until the returned stop is called (or t
// ends); kill closes its connection first, as a crash would.
func run(t testing.TB, cfg *rabbitmq.Config) (c *rabbitmq.Consumer, stop func(kill bool) error) {
	t.Helper()
	c, err := rabbitmq.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var (
		once sync.Once
		res  error
	)
	stop = func(kill bool) error {
		once.Do(func() {
			if kill {
				c.CloseConnection()
			}
			cancel()
			res = <-done
		})
		return res
	}
	t.Cleanup(func() { _ = stop(false) })
	return c, stop
}

// Start runs a consumer; kill closes its connection at once.
func (b *broker) Start(t testing.TB, h idem.DeliveryHandler) func() {
	_, stop := run(t, b.config(t, h))
	return func() { _ = stop(true) }
}

// StartBatched runs a consumer taking batches.
func (b *broker) StartBatched(t testing.TB, h idem.BatchDeliveryHandler, batch int) func() {
	cfg := b.config(t, h)
	cfg.Batch = batch
	_, stop := run(t, cfg)
	return func() { _ = stop(true) }
}

// StartCrashing closes the connection right after the 100th delivery was
// decided, before its ack can be sent.
func (b *broker) StartCrashing(t testing.TB, h idem.DeliveryHandler) <-chan struct{} {
	var (
		seen atomic.Int64
		c    atomic.Pointer[rabbitmq.Consumer]
		stop func(bool) error
	)
	crashed := make(chan struct{})
	ready := make(chan struct{})
	cfg := b.config(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		v := h.HandleDelivery(ctx, d)
		if seen.Add(1) == 100 {
			<-ready
			c.Load().CloseConnection()
			go func() { _ = stop(false) }()
			close(crashed)
		}
		return v
	}))
	cons, stopFn := run(t, cfg)
	c.Store(cons)
	stop = stopFn
	close(ready)
	return crashed
}

// TestAdapterSuite runs the shared adapter suite on quorum and classic
// queues, and on quorum queues with consumers deciding four aggregates at
// once.
func TestAdapterSuite(t *testing.T) {
	for _, tc := range []struct {
		name        string
		queueType   string
		concurrency int
	}{
		{"quorum", rabbitmq.QueueQuorum, 1},
		{"classic", rabbitmq.QueueClassic, 1},
		{"quorum-concurrent", rabbitmq.QueueQuorum, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			adaptertest.Run(t, func(t testing.TB) adaptertest.Broker {
				b := newBroker(t, tc.queueType)
				b.concurrency = tc.concurrency
				return b
			})
		})
	}
}

// TestNewRejectsBadConfig checks the required settings.
func TestNewRejectsBadConfig(t *testing.T) {
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	url := testenv.RabbitMQURL()
	for field, cfg := range map[string]*rabbitmq.Config{
		"URL":     {Queue: "q", Handler: h},
		"Queue":   {URL: url, Handler: h},
		"Handler": {URL: url, Queue: "q"},
	} {
		if _, err := rabbitmq.New(cfg); !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "Config."+field+" is required") {
			t.Errorf("New without %s: %v, want ErrInvalidConfig naming it", field, err)
		}
	}
	for name, cfg := range map[string]*rabbitmq.Config{
		"nil":                {},
		"bad URL":            {URL: "http://x", Queue: "q", Handler: h},
		"queue type":         {URL: url, Queue: "q", Handler: h, QueueType: "stream"},
		"negative batch":     {URL: url, Queue: "q", Handler: h, Batch: -1},
		"negative lanes":     {URL: url, Queue: "q", Handler: h, Concurrency: -1},
		"batch, no batcher":  {URL: url, Queue: "q", Handler: h, Batch: 10},
		"prefetch too small": {URL: url, Queue: "q", Handler: h, Concurrency: 4, Prefetch: 3},
		"recovery":           {URL: url, Queue: "q", Handler: h, AMQP: amqp.Config{Recovery: &amqp.Recovery{}}},
	} {
		if name == "nil" {
			cfg = nil
		}
		if _, err := rabbitmq.New(cfg); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("New with %s: %v, want ErrInvalidConfig", name, err)
		}
	}
}

// ready returns how many messages of the queue wait to be delivered.
func (b *broker) ready(t testing.TB) int {
	t.Helper()
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(b.queue, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// TestNewRejectsPrefetchAboveAMQPLimit: AMQP's prefetch count has 16
// bits, and the client library truncates a larger one: 65,536 becomes 0,
// which the broker takes for no limit, pushing the whole queue to the
// consumer. Before, New took such a Prefetch, given or computed from
// Concurrency.
func TestNewRejectsPrefetchAboveAMQPLimit(t *testing.T) {
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	url := testenv.RabbitMQURL()
	for name, cfg := range map[string]*rabbitmq.Config{
		"Prefetch 65536":                   {URL: url, Queue: "q", Handler: h, Prefetch: 65536},
		"Concurrency 65536, no Prefetch":   {URL: url, Queue: "q", Handler: h, Concurrency: 65536},
		"Concurrency 65536, Prefetch 2^17": {URL: url, Queue: "q", Handler: h, Concurrency: 65536, Prefetch: 1 << 17},
	} {
		if _, err := rabbitmq.New(cfg); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("New with %s: %v, want ErrInvalidConfig", name, err)
		}
	}
	if _, err := rabbitmq.New(&rabbitmq.Config{URL: url, Queue: "q", Handler: h, Concurrency: 65500}); err != nil {
		t.Errorf("New with Concurrency 65500: %v; want the default Prefetch capped at 65535", err)
	}
}
