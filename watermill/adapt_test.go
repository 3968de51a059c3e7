package watermill_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	idemwm "github.com/idemhq/idem/watermill"
)

// An existing Watermill handler runs in idem's transaction through Apply:
// its write and the marker commit together, a failure after its write
// leaves nothing behind, and messages it returns to publish are refused
// (dead-lettered with ErrProduced) rather than lost after the commit.
func TestApplyRunsAWatermillHandlerInTheTransaction(t *testing.T) {
	t.Parallel()
	db, drv := testenv.SQLite(t, t.TempDir()+"/idem.db", nil)
	if _, err := db.Exec(`CREATE TABLE seen (id TEXT PRIMARY KEY, topic TEXT)`); err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		calls = map[string]int{}
	)
	wmHandler := func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := idemwm.Tx[*sql.Tx](msg)
		if !ok {
			return nil, errors.New("no transaction in the message's context")
		}
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO seen VALUES (?, ?)`, msg.UUID, message.SubscribeTopicFromCtx(msg.Context())); err != nil {
			return nil, err
		}
		mu.Lock()
		calls[msg.UUID]++
		n := calls[msg.UUID]
		mu.Unlock()
		switch {
		case msg.Metadata.Get("fail-once") == "yes" && n == 1:
			return nil, errors.New("failed after its write")
		case msg.Metadata.Get("produce") == "yes":
			return []*message.Message{message.NewMessage("out-1", nil)}, nil
		}
		return nil, nil
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := idem.NewConsumer(p, &idem.Handler[*sql.Tx]{Name: "seen", Apply: idemwm.Apply[*sql.Tx](wmHandler)}, drv,
		&idem.ConsumerConfig{Logger: testenv.Logger(t), Backoff: idem.Backoff{Base: time.Millisecond, Max: 5 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	h, err := idemwm.New(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch := blockingChannel(t)
	runRouter(t, ch, "in", h.Handle)

	plain := message.NewMessage("m-1", []byte("x"))
	publishAcked(t, ch, "in", plain, 10*time.Second)
	publishAcked(t, ch, "in", plain.Copy(), 10*time.Second) // republished: a Duplicate, the handler not called
	flaky := message.NewMessage("m-2", []byte("x"))
	flaky.Metadata.Set("fail-once", "yes")
	publishAcked(t, ch, "in", flaky, 10*time.Second)
	producer := message.NewMessage("m-3", []byte("x"))
	producer.Metadata.Set("produce", "yes")
	publishAcked(t, ch, "in", producer, 10*time.Second)

	rows, err := db.Query(`SELECT id, topic FROM seen ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var id, topic string
		if err := rows.Scan(&id, &topic); err != nil {
			t.Fatal(err)
		}
		got = append(got, id+"@"+topic)
	}
	if len(got) != 2 || got[0] != "m-1@in" || got[1] != "m-2@in" {
		t.Fatalf("rows %v, want m-1 and m-2 once each (m-2's first write rolled back, m-3's refused)", got)
	}
	if calls["m-1"] != 1 || calls["m-2"] != 2 {
		t.Fatalf("handler calls %v, want m-1 once (its copy a Duplicate) and m-2 twice", calls)
	}
	dls, err := drv.DeadLetterList(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 || dls[0].MessageID != "m-3" || dls[0].Class != idem.DeadLetterPermanent {
		t.Fatalf("dead letters %+v, want m-3 permanent (ErrProduced)", dls)
	}
}

// Lease mode through Call: GoChannel hands every message to two routers
// (four at a time each) at once, and each message's effect (an email) is
// sent exactly once: the router that finds the lease held retries and
// then sees a Duplicate. The handler gets the lease, with its idempotency key, from
// the message's context.
func TestLeaseModeEachEffectOnce(t *testing.T) {
	t.Parallel()
	_, drv := testenv.SQLite(t, t.TempDir()+"/idem.db", nil)
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: 10 * time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		sent = map[string]int{}
		keys = map[string]bool{}
	)
	mailer := func(msg *message.Message) ([]*message.Message, error) {
		l := idemwm.LeaseOf(msg)
		if l == nil {
			return nil, errors.New("no lease in the message's context")
		}
		time.Sleep(time.Millisecond) // the SMTP round trip
		mu.Lock()
		defer mu.Unlock()
		sent[msg.UUID]++
		keys[l.IdempotencyKey] = true
		return nil, nil
	}
	lc, err := idem.NewLeaseConsumer(lp, &idem.LeaseHandler{Name: "mailer", Call: idemwm.Call(mailer)}, drv,
		&idem.ConsumerConfig{Logger: testenv.Logger(t), Backoff: idem.Backoff{Base: 5 * time.Millisecond, Max: 20 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	ch := gochannel.NewGoChannel(gochannel.Config{}, wmLogger(t))
	t.Cleanup(func() { ch.Close() })
	for range 2 {
		// A copy finding the lease held is asked to retry once the lease
		// can have run out (TTL 10 s): MaxWait Nacks it sooner, and the
		// redelivery asks again.
		h, err := idemwm.New(lc, &idemwm.Config{MaxWait: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		runRouter(t, ch, "signups", h.Handle, limit(4))
	}
	const n = 100
	for i := range n {
		m := &idem.Message{ID: fmt.Sprintf("signup-%03d", i), Payload: []byte("x")}
		if err := ch.Publish("signups", idemwm.ToMessage(context.Background(), m)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 30*time.Second, "every email sent", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(sent) == n
	})
	time.Sleep(200 * time.Millisecond) // the second router's retries
	mu.Lock()
	defer mu.Unlock()
	for id, k := range sent {
		if k != 1 {
			t.Fatalf("%s: %d emails, want 1", id, k)
		}
	}
	if len(keys) != n {
		t.Fatalf("%d idempotency keys, want %d", len(keys), n)
	}
}

// A dead letter of a handler adapted with Apply replays without a
// Watermill message: the handler gets one built from the stored envelope,
// with the transaction in its context.
func TestApplyReplaysADeadLetter(t *testing.T) {
	t.Parallel()
	db, drv := testenv.SQLite(t, t.TempDir()+"/idem.db", nil)
	if _, err := db.Exec(`CREATE TABLE seen (id TEXT PRIMARY KEY, aggregate TEXT)`); err != nil {
		t.Fatal(err)
	}
	var frozen atomic.Bool
	frozen.Store(true)
	wmHandler := func(msg *message.Message) ([]*message.Message, error) {
		if frozen.Load() {
			return nil, idem.Permanent(errors.New("account frozen"))
		}
		tx, ok := idemwm.Tx[*sql.Tx](msg)
		if !ok {
			return nil, errors.New("no transaction in the message's context")
		}
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO seen VALUES (?, ?)`, msg.UUID, msg.Metadata.Get(idemwm.MetadataAggregate))
		return nil, err
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := idem.NewConsumer(p, &idem.Handler[*sql.Tx]{Name: "seen", Apply: idemwm.Apply[*sql.Tx](wmHandler)}, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	h, err := idemwm.New(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := h.Handle(idemwm.ToMessage(ctx, &idem.Message{ID: "m-1", AggregateID: "acct-1", Payload: []byte("x")})); err != nil {
		t.Fatalf("Handle: %v, want nil (dead-lettered)", err)
	}
	frozen.Store(false)
	if n, err := idem.RequestReplay(ctx, drv, nil, "test"); err != nil || n != 1 {
		t.Fatalf("RequestReplay: %d, %v", n, err)
	}
	res, err := c.Replay(ctx)
	if err != nil || res.Replayed != 1 {
		t.Fatalf("Replay: %+v, %v; want one replayed", res, err)
	}
	var agg string
	if err := db.QueryRow(`SELECT aggregate FROM seen WHERE id = 'm-1'`).Scan(&agg); err != nil || agg != "acct-1" {
		t.Fatalf("replayed row: %q, %v; want acct-1 from the envelope's metadata", agg, err)
	}
}
