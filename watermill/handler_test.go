package watermill_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
	idemwm "github.com/idemhq/idem/watermill"
)

// liteEnv is a SQLite store whose handler records each applied ID and
// fails with a retriable error while fail is set.
type liteEnv struct {
	path string
	db   *sql.DB
	drv  *sqlite.Driver
	fail atomic.Bool
	c    *idem.Consumer[*sql.Tx]
}

func newLiteEnv(t *testing.T, cfg idem.ConsumerConfig, opts *sqlite.OpenOptions) *liteEnv {
	t.Helper()
	e := &liteEnv{path: filepath.Join(t.TempDir(), "idem.db")}
	e.db, e.drv = testenv.SQLite(t, e.path, opts)
	if _, err := e.db.Exec(`CREATE TABLE seen (id TEXT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(e.drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "seen", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		if e.fail.Load() {
			return errors.New("downstream busy")
		}
		if string(m.Payload) == "poison" {
			return idem.Permanent(errors.New("not a credit"))
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO seen VALUES (?)`, m.ID)
		return err
	}}
	cfg.Logger = testenv.Logger(t)
	if cfg.Backoff.Base == 0 {
		cfg.Backoff = idem.Backoff{Base: 5 * time.Millisecond, Max: 20 * time.Millisecond}
	}
	cfg.ProbeBackoff = idem.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	if e.c, err = idem.NewConsumer(p, h, e.drv, &cfg); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *liteEnv) seen(t *testing.T) int {
	t.Helper()
	var n int
	if err := e.db.QueryRow(`SELECT count(*) FROM seen`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (e *liteEnv) deadLetters(t *testing.T) []driver.DeadLetter {
	t.Helper()
	dls, err := e.drv.DeadLetterList(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	return dls
}

// blockingChannel returns a GoChannel whose Publish returns only once the
// subscriber acknowledged: a Publish that returns proves the Ack.
func blockingChannel(t *testing.T) *gochannel.GoChannel {
	ch := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, wmLogger(t))
	t.Cleanup(func() { ch.Close() })
	return ch
}

// publishAcked publishes msg and fails unless a subscriber acknowledges it
// within limit.
func publishAcked(t *testing.T, pub message.Publisher, topic string, msg *message.Message, limit time.Duration) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- pub.Publish(topic, msg) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(limit):
		t.Fatalf("message %q not acknowledged after %s", msg.UUID, limit)
	}
}

// Applied, duplicate, decode failure and permanent failure are all
// acknowledged; the last two only once their dead letters are committed,
// each with its reason.
func TestVerdictsAcknowledged(t *testing.T) {
	t.Parallel()
	e := newLiteEnv(t, idem.ConsumerConfig{}, nil)
	h, err := idemwm.New(e.c, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch := blockingChannel(t)
	runRouter(t, ch, "in", h.Handle)
	ok := &idem.Message{ID: "evt-1", Payload: []byte("x"), AggregateID: "a", Seq: 1, Type: "Credited"}
	publishAcked(t, ch, "in", idemwm.ToMessage(context.Background(), ok), 10*time.Second)
	publishAcked(t, ch, "in", idemwm.ToMessage(context.Background(), ok), 10*time.Second) // republished
	publishAcked(t, ch, "in", message.NewMessage("", []byte("no id")), 10*time.Second)
	publishAcked(t, ch, "in", message.NewMessage("evt-2", []byte("poison")), 10*time.Second)
	bad := message.NewMessage("evt-3", []byte("x"))
	bad.Metadata.Set(idemwm.MetadataSeq, "zero")
	publishAcked(t, ch, "in", bad, 10*time.Second)
	if n := e.seen(t); n != 1 {
		t.Fatalf("%d rows applied, want 1 (evt-1 once)", n)
	}
	dls := e.deadLetters(t)
	if len(dls) != 3 {
		t.Fatalf("dead letters %+v, want 3", dls)
	}
	var noID, badSeq, poison bool
	for _, dl := range dls {
		switch {
		case dl.Class == idem.DeadLetterDecode && strings.Contains(dl.Error, "no UUID"):
			noID = string(dl.Raw) == "no id" && strings.HasPrefix(dl.Source, "watermill:in@")
		case dl.Class == idem.DeadLetterDecode && strings.Contains(dl.Error, idemwm.MetadataSeq):
			badSeq = dl.Source == "watermill:in@evt-3"
		case dl.Class == idem.DeadLetterPermanent && dl.MessageID == "evt-2":
			poison = true
		}
	}
	if !noID || !badSeq || !poison {
		t.Fatalf("dead letters %+v, want the UUID-less message and evt-3's bad sequence as decode failures with their reasons and payloads, evt-2 permanent", dls)
	}
}

// DefaultMap reads the ID, aggregate, sequence, type and time, keeps other
// metadata as headers and leaves out the reserved keys.
func TestDefaultMapRoundTrip(t *testing.T) {
	t.Parallel()
	in := &idem.Message{ID: "evt-9", Stream: "orders", AggregateID: "order-1", Seq: 4, Type: "Shipped",
		Time: time.Date(2026, 11, 26, 12, 0, 0, 5, time.UTC), Payload: []byte(`{"a":1}`), Headers: map[string]string{"traceparent": "00-abc"}}
	wm := idemwm.ToMessage(context.Background(), in)
	wm.Metadata.Set(idemwm.MetadataAttempt, "2")
	got, err := idemwm.DefaultMap(wm)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != in.ID || got.AggregateID != in.AggregateID || got.Seq != in.Seq || got.Type != in.Type || !got.Time.Equal(in.Time) ||
		string(got.Payload) != string(in.Payload) || len(got.Headers) != 1 || got.Headers["traceparent"] != "00-abc" {
		t.Fatalf("DefaultMap(ToMessage(m)) = %+v, want %+v (Stream is the router's topic)", got, in)
	}
	for _, md := range []map[string]string{{idemwm.MetadataSeq: "-1"}, {idemwm.MetadataTime: "yesterday"}} {
		m := message.NewMessage("x", nil)
		for k, v := range md {
			m.Metadata.Set(k, v)
		}
		if _, err := idemwm.DefaultMap(m); err == nil {
			t.Fatalf("DefaultMap accepted metadata %v", md)
		}
	}
	if _, err := idemwm.DefaultMap(message.NewMessage("a\x00b", nil)); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("DefaultMap of a NUL-bearing UUID: %v, want ErrInvalidMessage", err)
	}
}

// NackAfterDelay: a retry verdict waits out idem's backoff, then Nacks;
// GoChannel redelivers and the attempts count 1, 2, 3 until the message
// applies, or until MaxAttempts makes it an exhausted dead letter, which
// is acknowledged.
func TestNackAfterDelayCountsAttempts(t *testing.T) {
	t.Parallel()
	e := newLiteEnv(t, idem.ConsumerConfig{MaxAttempts: 3}, nil)
	rec := &attempts{next: e.c}
	h, err := idemwm.New(rec, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch := blockingChannel(t)
	runRouter(t, ch, "in", h.Handle)

	e.fail.Store(true)
	publishAcked(t, ch, "in", message.NewMessage("never", []byte("x")), 10*time.Second)
	if got := rec.of("never"); len(got) != 3 || got[0] != 1 || got[1] != 2 || got[2] != 3 {
		t.Fatalf("attempts %v, want [1 2 3]", got)
	}
	dls := e.deadLetters(t)
	if len(dls) != 1 || dls[0].Class != idem.DeadLetterExhausted || dls[0].Attempts != 3 {
		t.Fatalf("dead letters %+v, want one exhausted after 3 attempts", dls)
	}

	// Fails twice, then applies on the third delivery.
	var calls atomic.Int64
	rec.next = idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		e.fail.Store(calls.Add(1) <= 2)
		return e.c.HandleDelivery(ctx, d)
	})
	publishAcked(t, ch, "in", message.NewMessage("later", []byte("x")), 10*time.Second)
	if got := rec.of("later"); len(got) != 3 || got[2] != 3 {
		t.Fatalf("attempts %v, want [1 2 3]", got)
	}
	if n := e.seen(t); n != 1 {
		t.Fatalf("%d rows applied, want 1", n)
	}
}

// With Watermill's Retry middleware (ErrorAtOnce) and the PoisonQueue
// filtered by Poisonable, each call counts one attempt, across Retry's
// loops and the pub/sub's redeliveries alike; idem's MaxAttempts alone
// ends it, in idem's dead-letter store, and nothing reaches the poison
// topic.
func TestRetryMiddlewareCountsEachAttemptOnce(t *testing.T) {
	t.Parallel()
	e := newLiteEnv(t, idem.ConsumerConfig{MaxAttempts: 5}, nil)
	rec := &attempts{next: e.c}
	h, err := idemwm.New(rec, &idemwm.Config{Retry: idemwm.ErrorAtOnce})
	if err != nil {
		t.Fatal(err)
	}
	ch := blockingChannel(t)
	poisonCh := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, wmLogger(t))
	t.Cleanup(func() { poisonCh.Close() })
	pq, err := idemwm.PoisonQueue(poisonCh, "poison")
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 1, InitialInterval: 2 * time.Millisecond, ShouldRetry: idemwm.ShouldRetry}
	runRouter(t, ch, "in", h.Handle, pq, retry.Middleware)

	e.fail.Store(true)
	publishAcked(t, ch, "in", message.NewMessage("stuck", []byte("x")), 10*time.Second)
	if got := rec.of("stuck"); len(got) != 5 || got[0] != 1 || got[4] != 5 {
		t.Fatalf("attempts %v, want [1 2 3 4 5]: Retry's loops of 2 and GoChannel's redeliveries, each call once", got)
	}
	dls := e.deadLetters(t)
	if len(dls) != 1 || dls[0].Class != idem.DeadLetterExhausted || dls[0].Attempts != 5 {
		t.Fatalf("dead letters %+v, want one exhausted after 5 attempts", dls)
	}
	sub, err := poisonCh.Subscribe(t.Context(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-sub:
		t.Fatalf("message %q reached the poison topic: idem's dead-letter store holds it", m.UUID)
	case <-time.After(100 * time.Millisecond):
	}

	// An error from elsewhere still goes to the poison queue.
	if !idemwm.Poisonable(errors.New("other")) || idemwm.Poisonable(&idemwm.RetryError{}) {
		t.Fatal("Poisonable: want true for other errors, false for a RetryError")
	}
}

// While the store is down the Handler waits inside the call and never
// returns nil; stopped meanwhile it returns a RetryError matching
// idem.ErrStoreUnavailable, counting no attempt. Once the store answers
// the message applies, as attempt 1.
func TestStoreDownNeverAcknowledged(t *testing.T) {
	t.Parallel()
	e := newLiteEnv(t, idem.ConsumerConfig{MaxAttempts: 1}, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	rec := &attempts{next: e.c}
	h, err := idemwm.New(rec, nil)
	if err != nil {
		t.Fatal(err)
	}
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

	ctx, cancel := context.WithCancel(context.Background())
	msg := idemwm.ToMessage(ctx, &idem.Message{ID: "held", Payload: []byte("x")})
	done := make(chan error, 1)
	go func() { done <- h.Handle(msg) }()
	select {
	case err := <-done:
		t.Fatalf("returned %v while the store was down", err)
	case <-time.After(300 * time.Millisecond):
	}
	cancel()
	var re *idemwm.RetryError
	if err := <-done; !errors.Is(err, idem.ErrStoreUnavailable) || !errors.As(err, &re) {
		t.Fatalf("stopped during the outage: %v, want a RetryError matching ErrStoreUnavailable", err)
	}
	if !idemwm.Poisonable(errors.New("x")) || idemwm.Poisonable(re) {
		t.Fatal("a held delivery must never go to a poison queue")
	}
	if a := msg.Metadata.Get(idemwm.MetadataAttempt); a != "" {
		t.Fatalf("the held delivery left %s=%q on the message, want none: Retry would call again with it counted", idemwm.MetadataAttempt, a)
	}

	// Held, then applied as attempt 1 once the lock goes.
	msg = idemwm.ToMessage(context.Background(), &idem.Message{ID: "held", Payload: []byte("x")})
	go func() { done <- h.Handle(msg) }()
	select {
	case err := <-done:
		t.Fatalf("returned %v while the store was down", err)
	case <-time.After(300 * time.Millisecond):
	}
	if _, err := lock.ExecContext(context.Background(), "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("after the outage: %v, want nil (applied)", err)
	}
	if got := rec.of("held"); len(got) != 2 || got[1] != 1 {
		t.Fatalf("attempts %v, want [1 1]: a held delivery is no attempt", got)
	}
	if len(e.deadLetters(t)) != 0 || e.seen(t) != 1 {
		t.Fatal("want the message applied once and no dead letter")
	}
	if msg.Metadata.Get(idemwm.MetadataOutcome) != idem.Applied.String() {
		t.Fatalf("outcome metadata %q, want %q", msg.Metadata.Get(idemwm.MetadataOutcome), idem.Applied)
	}
}

// GoChannel hands every message to both routers at once: each is applied
// by exactly one, the other sees a Duplicate, republished copies included.
func TestGoChannelTwoRoutersAtOnce(t *testing.T) {
	t.Parallel()
	e := newPGEnv(t, nil)
	ch := gochannel.NewGoChannel(gochannel.Config{}, wmLogger(t))
	t.Cleanup(func() { ch.Close() })
	for range 2 {
		h, err := idemwm.New(e.consumer, nil)
		if err != nil {
			t.Fatal(err)
		}
		runRouter(t, ch, "credits", h.Handle)
	}
	events := idemtest.Events(600)
	publishEvents(t, ch, "credits", events, 10)
	// Every copy reaches both routers: 2×(600+60) deliveries, 600 applied.
	e.waitExact(events, int64(len(events))+2*dupCount(len(events), 10))
}

// NackAfterDelay waits out a retry's delay, but no longer than MaxWait.
func TestMaxWaitBoundsTheWait(t *testing.T) {
	t.Parallel()
	dh := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
		return idem.Verdict{RetryAfter: time.Hour, Outcome: idem.InFlight}
	})
	if _, err := idemwm.New(dh, &idemwm.Config{MaxWait: -time.Second}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New with a negative MaxWait: %v", err)
	}
	h, err := idemwm.New(dh, &idemwm.Config{MaxWait: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var re *idemwm.RetryError
	if err := h.Handle(message.NewMessage("m", nil)); !errors.As(err, &re) || re.RetryAfter != time.Hour {
		t.Fatalf("Handle: %v, want a RetryError asking for an hour", err)
	}
	if took := time.Since(start); took < 50*time.Millisecond || took > 5*time.Second {
		t.Fatalf("Handle waited %s, want MaxWait (50ms)", took)
	}
}
