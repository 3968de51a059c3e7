package jetstream_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
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

// Another consumer of the durable (a rolling deploy with new settings)
// lowers its MaxDeliver after this one started with 20: the delivery that
// reaches the durable's limit is still dead-lettered, not dropped by
// JetStream with no more than an advisory.
func TestLastAttemptFollowsTheDurablesMaxDeliver(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
	var tries atomic.Int64
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		tries.Add(1)
		return errors.New("dependency down")
	}}
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{
		Backoff: idem.Backoff{Base: time.Millisecond, Max: 2 * time.Millisecond}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	nc, js := b.connect(t)
	defer nc.Close()
	cons, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: c, AckWait: time.Second, MaxDeliver: 20, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = cons.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitDurable(t, js, b.stream, 20)
	// The other consumer's Run, later than the tenth of a second within
	// which this one goes by the limits it read last.
	time.Sleep(250 * time.Millisecond)
	if _, err := js.CreateOrUpdateConsumer(ctx, b.stream, natsjs.ConsumerConfig{Durable: "idem", AckPolicy: natsjs.AckExplicitPolicy, AckWait: time.Second, MaxDeliver: 3}); err != nil {
		t.Fatal(err)
	}
	b.publishQueue(t, "stuck", "ok", 0)
	waitDeadLetter(t, e, idem.DeadLetterExhausted, 3)
	if n := tries.Load(); n != 3 {
		t.Fatalf("the stuck message was tried %d times, want 3 (the durable's MaxDeliver)", n)
	}
}

// waitDurable waits until the stream's durable "idem" exists with
// MaxDeliver maxDeliver.
func waitDurable(t *testing.T, js natsjs.JetStream, stream string, maxDeliver int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		c, err := js.Consumer(context.Background(), stream, "idem")
		if err == nil && c.CachedInfo().Config.MaxDeliver == maxDeliver {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("durable not created with MaxDeliver %d: %v", maxDeliver, err)
		}
	}
}

// Run returns when its durable is deleted, fetching in batches as one at a
// time, rather than fetching (and logging) again forever.
func TestRunEndsWhenTheDurableIsDeleted(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 10} {
		b, e := newBroker(t, testenv.EmbeddedNATS(t)), adaptertest.NewEnv(t)
		nc, js := b.connect(t)
		defer nc.Close()
		cons, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: e.BatchConsumer(), Batch: batch, Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- cons.Run(ctx) }()
		waitDurable(t, js, b.stream, -1) // the default: no limit
		if err := js.DeleteConsumer(ctx, b.stream, "idem"); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-done:
			if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "idem") {
				t.Fatalf("batch %d: Run returned %v, want the failure naming the durable", batch, err)
			}
		case <-time.After(15 * time.Second): // the iterator may need the 5 s watch
			t.Fatalf("batch %d: Run still running 15 s after its durable was deleted", batch)
		}
	}
}

// The JetStream server acts on the Nats- headers of a publish: Nats-Rollup
// would purge the subject's earlier messages, Nats-Expected-Last-Sequence
// would fail the relay's republished copy for good, Nats-Schedule would
// store a schedule instead of the message. The Publisher refuses a
// message's own header of that namespace, publishing nothing of the call;
// another spelling is an ordinary header.
func TestPublisherRefusesServerHeaders(t *testing.T) {
	t.Parallel()
	b, js, p := newPublisher(t)
	ctx := context.Background()
	for _, h := range []string{"Nats-Rollup", "Nats-Expected-Last-Sequence", "Nats-Schedule", "Nats-Msg-Id"} {
		err := p.Publish(ctx, []*idem.Message{
			{ID: "before", Stream: b.stream + ".x", Payload: []byte("x")},
			{ID: "with-" + h, Stream: b.stream + ".x", Payload: []byte("x"), Headers: map[string]string{h: "1"}},
		})
		if !errors.Is(err, idem.ErrInvalidMessage) || !strings.Contains(err.Error(), h) {
			t.Fatalf("%s: Publish: %v, want ErrInvalidMessage naming the header", h, err)
		}
	}
	info, err := js.Stream(ctx, b.stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != 0 {
		t.Fatalf("%d messages in the stream, want none", n)
	}
	if err := p.Publish(ctx, []*idem.Message{{ID: "lower", Stream: b.stream + ".x", Payload: []byte("x"), Headers: map[string]string{"nats-rollup": "all"}}}); err != nil {
		t.Fatalf("a header spelt nats-rollup: %v, want it published", err)
	}
}

// A message with an empty payload and a Status header would be taken by
// nats.go for a status message and never reach a consumer: the Publisher
// refuses the call, publishing nothing of it.
func TestPublisherRefusesEmptyMessageWithStatusHeader(t *testing.T) {
	t.Parallel()
	b, js, p := newPublisher(t)
	err := p.Publish(context.Background(), []*idem.Message{
		{ID: "before", Stream: b.stream + ".x", Payload: []byte("x")},
		{ID: "tombstone", Stream: b.stream + ".x", Headers: map[string]string{"Status": "deleted"}},
	})
	if !errors.Is(err, jetstream.ErrStatusHeader) || !strings.Contains(err.Error(), "tombstone") {
		t.Fatalf("Publish: %v, want ErrStatusHeader naming the message", err)
	}
	info, err := js.Stream(context.Background(), b.stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != 0 {
		t.Fatalf("%d messages in the stream, want none", n)
	}
	// With a payload, or another header, it goes through.
	if err := p.Publish(context.Background(), []*idem.Message{
		{ID: "with-payload", Stream: b.stream + ".x", Payload: []byte("{}"), Headers: map[string]string{"Status": "deleted"}},
		{ID: "lower-case", Stream: b.stream + ".x", Headers: map[string]string{"status": "deleted"}},
	}); err != nil {
		t.Fatal(err)
	}
}

// Message.Time travels from the Publisher to DefaultMap in idem-time.
func TestPublisherCarriesTime(t *testing.T) {
	t.Parallel()
	b, js, p := newPublisher(t)
	at := time.Date(2026, 11, 25, 10, 30, 0, 123456789, time.FixedZone("x", 3600))
	if err := p.Publish(context.Background(), []*idem.Message{
		{ID: "timed", Stream: b.stream + ".x", Payload: []byte("x"), Time: at},
		{ID: "untimed", Stream: b.stream + ".x", Payload: []byte("x")},
	}); err != nil {
		t.Fatal(err)
	}
	cons, err := js.OrderedConsumer(context.Background(), b.stream, natsjs.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []time.Time{at, {}} {
		m, err := cons.Next(natsjs.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatal(err)
		}
		msg, err := jetstream.DefaultMap(m)
		if err != nil {
			t.Fatal(err)
		}
		if !msg.Time.Equal(want) || (want.IsZero() && m.Headers().Get(jetstream.HeaderTime) != "") {
			t.Fatalf("message %s: Time %v, want %v", msg.ID, msg.Time, want)
		}
	}
	bad := &nats.Msg{Subject: b.stream + ".x", Data: []byte("x"), Header: nats.Header{jetstream.HeaderID: {"bad-time"}, jetstream.HeaderTime: {"yesterday"}}}
	b.send(t, []*nats.Msg{bad})
	m, err := cons.Next(natsjs.FetchMaxWait(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := jetstream.DefaultMap(m); err == nil || !strings.Contains(err.Error(), jetstream.HeaderTime) {
		t.Fatalf("DefaultMap of an unreadable idem-time: %v, want an error naming the header", err)
	}
}

// newPublisher returns a stream on the embedded server, a JetStream
// connection and a Publisher on it.
func newPublisher(t *testing.T) (*broker, natsjs.JetStream, *jetstream.Publisher) {
	t.Helper()
	b := newBroker(t, testenv.EmbeddedNATS(t))
	nc, js := b.connect(t)
	t.Cleanup(nc.Close)
	p, err := jetstream.NewPublisher(js)
	if err != nil {
		t.Fatal(err)
	}
	return b, js, p
}

// A message a consumer could only dead-letter as undecodable (no ID, a
// sequence without an aggregate, no subject) is refused by the Publisher,
// the whole call publishing nothing.
func TestPublisherRefusesInvalidMessages(t *testing.T) {
	t.Parallel()
	b, js, p := newPublisher(t)
	subj := b.stream + ".x"
	for _, bad := range []*idem.Message{
		{Stream: subj, Payload: []byte("no ID")},
		{ID: "seq-only", Stream: subj, Seq: 1, Payload: []byte("x")},
		{ID: "no-subject", Payload: []byte("x")},
		{ID: "nul-type", Stream: subj, Type: "Cred\x00ited", Payload: []byte("x")},
		{ID: "own-seq", Stream: subj, Payload: []byte("x"), Headers: map[string]string{jetstream.HeaderSeq: "n/a"}},
		{ID: "own-aggregate", Stream: subj, Payload: []byte("x"), Headers: map[string]string{jetstream.HeaderAggregate: "acct-9"}},
		{ID: "spaced-id ", Stream: subj, Payload: []byte("x")}, // NATS trims header values: it would arrive as "spaced-id"
		{ID: " ", Stream: subj, Payload: []byte("x")},
		{ID: "a\nb", Stream: subj, Payload: []byte("x")},
		{ID: "bad-header-name", Stream: subj, Payload: []byte("x"), Headers: map[string]string{"a b": "x"}},
		{ID: "wildcard", Stream: subj + ".*", Payload: []byte("x")},
		{ID: "empty-token", Stream: subj + "..x", Payload: []byte("x")},
		{ID: "inner-space", Stream: "a b", Payload: []byte("x")},
		// The server's API: it would act on the publish (delete the stream).
		{ID: "api", Stream: "$JS.API.STREAM.DELETE." + b.stream, Payload: []byte("{}")},
		{ID: "ack", Stream: "$JS.ACK." + b.stream + ".c.1.1.1.1.0", Payload: []byte("+TERM")},
		{ID: "sys", Stream: "$SYS.REQ.SERVER.PING", Payload: []byte("x")},
	} {
		err := p.Publish(context.Background(), []*idem.Message{{ID: "before", Stream: subj, Payload: []byte("x")}, bad})
		if !errors.Is(err, idem.ErrInvalidMessage) {
			t.Fatalf("Publish of %+v: %v, want ErrInvalidMessage", bad, err)
		}
	}
	info, err := js.Stream(context.Background(), b.stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != 0 {
		t.Fatalf("%d messages in the stream, want none", n)
	}
}
