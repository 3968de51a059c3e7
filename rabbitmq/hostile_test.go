package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/rabbitmq"
)

// A message whose header table holds more entries than amqp091-go reads
// (8,192), which the broker accepts, closes the consumer's connection each
// time it is delivered: the client library fails to parse the frame, and
// the adapter never sees the delivery. Each session then ends at once, so
// the reconnections are one failure streak: one warning, and the backoff
// grows to Reconnect.Max instead of reconnecting at the base delay (and
// returning the prefetch, one attempt more each time) every few
// milliseconds for ever. The message stays in the queue.
func TestUnparsableHeadersDoNotSpinReconnecting(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, rabbitmq.QueueQuorum), adaptertest.NewEnv(t)
	big := amqp.Table{}
	for i := range 8200 {
		big[fmt.Sprint("h", i)] = nil
	}
	b.send(t, []amqp.Publishing{{MessageId: "too-many-headers", Body: []byte("x"), Headers: big}})
	var logs testenv.Buffer
	cfg := b.config(t, e.Consumer(false))
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	cfg.Reconnect = idem.Backoff{Base: 100 * time.Millisecond, Max: time.Second}
	c, stop := run(t, cfg)
	time.Sleep(3 * time.Second)
	_ = stop(false)
	n, warns := c.Sessions(), strings.Count(logs.String(), "level=WARN")
	t.Logf("%d sessions, %d warnings in 3 s", n, warns)
	if n < 2 {
		t.Fatalf("%d sessions: the message did not close the connection; the test proves nothing", n)
	}
	if n > 10 || warns != 1 {
		t.Fatalf("%d sessions and %d warnings in 3 s, want at most 10 (the backoff growing: 100 ms doubling to 1 s) and 1 warning for the streak:\n%.3000s", n, warns, logs.String())
	}
	for deadline := time.Now().Add(5 * time.Second); b.ready(t) != 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d messages ready, want the unparsable one back in the queue", b.ready(t))
		}
	}
}

// A retry queue that exists with other arguments (here a classic queue
// without a TTL where the consumer declares a quorum one) is refused by
// the server, which closes the channel the retry copies go out on. Run
// ends with ErrTopology, as for the work queue, and the message is back in
// its queue: before, the session went on without that channel, every
// later retry of every message failed ("channel/connection is not open")
// and was returned to the queue after its delay, one attempt more, for
// as long as the process ran.
func TestRetryQueueRefusedEndsRun(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	ch := b.channel(t)
	if _, err := ch.QueueDeclare(rabbitmq.RetryQueueName(b.queue, 1024*time.Millisecond), true, false, false, false, amqp.Table{"x-queue-type": rabbitmq.QueueClassic}); err != nil {
		t.Fatal(err)
	}
	b.Publish(t, []*idem.Message{{ID: "m1", Payload: []byte("x")}}, 0)
	c, err := rabbitmq.New(b.config(t, idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
		return idem.Verdict{RetryAfter: time.Second, Err: errors.New("dependency down")}
	})))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Run(ctx); !errors.Is(err, rabbitmq.ErrTopology) {
		t.Fatalf("Run returned %v, want ErrTopology naming the retry queue", err)
	}
	for deadline := time.Now().Add(5 * time.Second); b.ready(t) != 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d messages ready, want the retried one back in the queue", b.ready(t))
		}
	}
}

// A classic queue does not write x-delivery-count: a message that carries
// one has it from its producer (moved from a quorum queue by a shovel, or
// by hand from a dead-letter queue, it keeps the count it had there). It
// is no attempt of this consumer: the first delivery is attempt 1, not
// the last one under MaxDeliver 3 (before: attempt 8, LastAttempt, so a
// first failure was dead-lettered as exhausted), and a redelivery after a
// lost connection is attempt 2.
func TestProducersDeliveryCountIsNoAttempt(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, rabbitmq.QueueClassic), adaptertest.NewEnv(t)
	b.maxDeliver = 3
	events := idemtest.Events(1)
	m := adaptertest.Messages(events)[0]
	b.send(t, []amqp.Publishing{{MessageId: m.ID, Body: m.Payload, DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"x-delivery-count": int64(7)}}})
	inner := e.Consumer(false)
	var (
		mu       sync.Mutex
		attempts []string
	)
	first, release := make(chan struct{}), make(chan struct{})
	c, stop := run(t, b.config(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		mu.Lock()
		attempts = append(attempts, fmt.Sprintf("%d/%v", d.Attempt, d.LastAttempt))
		n := len(attempts)
		mu.Unlock()
		if n == 1 {
			close(first)
			<-release // the connection is closed meanwhile: redelivered
			return idem.Verdict{RetryAfter: time.Millisecond, Err: errors.New("lost with its connection")}
		}
		return inner.HandleDelivery(ctx, d)
	})))
	select {
	case <-first:
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery after 10 s")
	}
	c.CloseConnection()
	close(release)
	e.WaitMarkers(1)
	e.CheckBalances(events)
	_ = stop(false)
	mu.Lock()
	defer mu.Unlock()
	if got := strings.Join(attempts, " "); got != "1/false 2/false" {
		t.Fatalf("attempt/last of the deliveries: %s, want 1/false 2/false", got)
	}
}

// closingBatch closes the consumer's connection once, inside a batch,
// after its effects committed and before its acks.
type closingBatch struct {
	inner idem.BatchDeliveryHandler
	once  sync.Once
	close func()
}

func (h *closingBatch) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	return h.HandleDeliveries(ctx, []*idem.Delivery{d})[0]
}

func (h *closingBatch) HandleDeliveries(ctx context.Context, ds []*idem.Delivery) []idem.Verdict {
	vs := h.inner.HandleDeliveries(ctx, ds)
	if len(ds) > 1 {
		h.once.Do(h.close)
	}
	return vs
}

// A lost connection under a batch of 100 decided deliveries fails their
// acks: one warning says so for the session, not one per delivery (the
// rest are Debug). The balances end exact, the batch's deliveries coming
// back as Duplicates.
func TestLostConnectionWarnsOncePerSession(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, rabbitmq.QueueQuorum), adaptertest.NewEnv(t)
	events := idemtest.Events(400)
	b.Publish(t, adaptertest.Messages(events), 0)
	var (
		logs  testenv.Buffer
		c     *rabbitmq.Consumer
		ready = make(chan struct{})
	)
	h := &closingBatch{inner: e.BatchConsumer(), close: func() { <-ready; c.CloseConnection() }}
	cfg := b.config(t, h)
	cfg.Batch = 100
	cfg.BatchWait = time.Second
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	c, _ = run(t, cfg)
	close(ready)
	e.WaitMarkers(len(events))
	e.CheckBalances(events)
	failed := strings.Count(logs.String(), "ack failed")
	t.Logf("%d ack failure lines, %d warnings", failed, strings.Count(logs.String(), "level=WARN"))
	if failed != 1 {
		t.Fatalf("%d warnings of failed acks for one lost connection, want 1:\n%.3000s", failed, logs.String())
	}
}
