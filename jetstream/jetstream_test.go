package jetstream_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/sqlite"
)

// embedded starts an in-process NATS server with JetStream.
func embedded(t testing.TB) string {
	t.Helper()
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("embedded NATS did not start")
	}
	t.Cleanup(ns.Shutdown)
	return ns.ClientURL()
}

// brokers runs fn against an embedded server and the real one.
func brokers(t *testing.T, fn func(t *testing.T, url string)) {
	t.Run("embedded", func(t *testing.T) { t.Parallel(); fn(t, embedded(t)) })
	t.Run("server", func(t *testing.T) {
		t.Parallel()
		testenv.NATSConn(t) // skip loudly (or fail in CI) when it is down
		fn(t, testenv.NATSURL())
	})
}

// env is one test's broker stream and SQLite store.
type env struct {
	t       testing.TB
	url     string
	stream  string
	db      *sql.DB
	proc    *idem.Processor[*sql.Tx]
	drv     *sqlite.Driver
	applied sync.Map // aggregate → []int64 of applied Seq, in order
	dups    atomic.Int64
}

func newEnv(t testing.TB, url string) *env {
	t.Helper()
	e := &env{t: t, url: url, stream: fmt.Sprintf("IDEMT%d", time.Now().UnixNano())}
	nc, js := e.connect()
	defer nc.Close()
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, natsjs.StreamConfig{Name: e.stream, Subjects: []string{e.stream + ".>"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		nc, js := e.connect()
		defer nc.Close()
		_ = js.DeleteStream(context.Background(), e.stream)
	})
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "idem.db"), &sqlite.OpenOptions{Synchronous: "NORMAL"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if e.drv, err = sqlite.New(db, nil); err != nil {
		t.Fatal(err)
	}
	if err := e.drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	e.db = db
	if e.proc, err = idem.NewProcessor(e.drv, nil); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) connect() (*nats.Conn, natsjs.JetStream) {
	e.t.Helper()
	nc, err := nats.Connect(e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	js, err := natsjs.New(nc)
	if err != nil {
		e.t.Fatal(err)
	}
	return nc, js
}

// handler credits balances; with ordering it records applied sequences.
func (e *env) consumer(ordering bool) *idem.Consumer[*sql.Tx] {
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		acct, amt, err := idemtest.DecodeCredit(m.Payload)
		if err != nil {
			return idem.Permanent(err)
		}
		if m.Seq > 0 {
			v, _ := e.applied.LoadOrStore(m.AggregateID, &[]int64{})
			*v.(*[]int64) = append(*v.(*[]int64), m.Seq)
		}
		_, err = tx.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?) ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, acct, amt)
		return err
	}}
	if ordering {
		h.Ordering = &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Minute}
	}
	c, err := idem.NewConsumer(e.proc, h, e.drv, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// publish sends events with idem headers; dupEvery > 0 republishes every
// dupEvery-th one (a producer retry: a new JetStream message, same ID).
func (e *env) publish(msgs []*idem.Message, dupEvery int) {
	e.t.Helper()
	nc, js := e.connect()
	defer nc.Close()
	ctx := context.Background()
	for i, m := range msgs {
		n := &nats.Msg{Subject: e.stream + ".acct", Data: m.Payload, Header: nats.Header{}}
		n.Header.Set(jetstream.HeaderID, m.ID)
		if m.Seq > 0 {
			n.Subject = e.stream + ".agg." + m.AggregateID
			n.Header.Set(jetstream.HeaderAggregate, m.AggregateID)
			n.Header.Set(jetstream.HeaderSeq, strconv.FormatInt(m.Seq, 10))
		}
		copies := 1
		if dupEvery > 0 && i%dupEvery == 0 {
			copies = 2
		}
		for range copies {
			if _, err := js.PublishMsg(ctx, n); err != nil {
				e.t.Fatal(err)
			}
		}
	}
}

// run starts a jetstream.Consumer with its own connection; kill closes the
// connection at once, as a crash would, leaving unacknowledged messages to
// JetStream's redelivery.
func (e *env) run(h idem.DeliveryHandler) (kill func()) {
	nc, js := e.connect()
	c, err := jetstream.New(js, &jetstream.Config{Stream: e.stream, Durable: "idem", Handler: h, AckWait: time.Second, MaxDeliver: 5})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	var once sync.Once
	kill = func() { once.Do(func() { nc.Close(); cancel(); <-done }) }
	e.t.Cleanup(kill)
	return kill
}

// waitMarkers waits until the handler has n markers.
func (e *env) waitMarkers(n int) {
	e.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var got int
		if err := e.db.QueryRow(`SELECT count(*) FROM idem_processed WHERE handler = 'balances'`).Scan(&got); err != nil {
			e.t.Fatal(err)
		}
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%d of %d messages applied after 30 s", got, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// checkBalances compares the balances with the unique intended events.
func (e *env) checkBalances(events []idemtest.Event) {
	e.t.Helper()
	rows, err := e.db.Query(`SELECT account, amount FROM balances`)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	got := map[string]int64{}
	for rows.Next() {
		var a string
		var n int64
		if err := rows.Scan(&a, &n); err != nil {
			e.t.Fatal(err)
		}
		got[a] = n
	}
	want := idemtest.Expected(events)
	if len(got) != len(want) {
		e.t.Fatalf("%d accounts, want %d", len(got), len(want))
	}
	for a, w := range want {
		if got[a] != w {
			e.t.Fatalf("%s = %d, want %d", a, got[a], w)
		}
	}
}

func messages(events []idemtest.Event) []*idem.Message {
	out := make([]*idem.Message, len(events))
	for i, ev := range events {
		out[i] = ev.Message()
		out[i].AggregateID = "" // no ordering: the accounts are not sequenced
	}
	return out
}

// counting wraps a handler, counting Duplicate verdicts and calling after
// once the n-th delivery was decided (before it is acknowledged).
type counting struct {
	idem.DeliveryHandler
	dups  *atomic.Int64
	n     int64
	seen  atomic.Int64
	after func()
}

func (c *counting) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	v := c.DeliveryHandler.HandleDelivery(ctx, d)
	if v.Outcome == idem.Duplicate {
		c.dups.Add(1)
	}
	if c.seen.Add(1) == c.n && c.after != nil {
		c.after()
	}
	return v
}

// TestKilledBeforeAck: the consumer dies after the outcome committed and
// before the ack; JetStream redelivers to a new consumer, idem reports a
// Duplicate, and the balances are exact.
func TestKilledBeforeAck(t *testing.T) {
	brokers(t, func(t *testing.T, url string) {
		e := newEnv(t, url)
		events := idemtest.Events(300)
		e.publish(messages(events), 0)
		var dups atomic.Int64
		var kill func()
		h := &counting{DeliveryHandler: e.consumer(false), dups: &dups, n: 100}
		h.after = func() { go kill() } // dies while this delivery is being acknowledged
		kill = e.run(h)
		time.Sleep(200 * time.Millisecond)
		kill()
		e.run(&counting{DeliveryHandler: e.consumer(false), dups: &dups})
		e.waitMarkers(len(events))
		// The delivery whose ack died with the connection comes back after
		// AckWait (1 s) and must be a Duplicate.
		for deadline := time.Now().Add(15 * time.Second); dups.Load() == 0; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("no redelivery reached idem as a Duplicate: the kill did not leave an unacknowledged message")
			}
		}
		e.checkBalances(events)
	})
}

// TestThreeConsumersOneKilled: three consumers share a durable, one is
// killed mid-stream; with producer retries in the stream, the balances are
// exact and nothing is lost.
func TestThreeConsumersOneKilled(t *testing.T) {
	brokers(t, func(t *testing.T, url string) {
		e := newEnv(t, url)
		events := idemtest.Events(1500)
		var dups atomic.Int64
		kills := make([]func(), 3)
		for i := range kills {
			kills[i] = e.run(&counting{DeliveryHandler: e.consumer(false), dups: &dups})
		}
		e.publish(messages(events), 10)
		time.Sleep(100 * time.Millisecond)
		kills[1]()
		e.waitMarkers(len(events))
		if dups.Load() < int64(len(events)/10) {
			t.Fatalf("%d duplicates, want at least the %d republished", dups.Load(), len(events)/10)
		}
		e.checkBalances(events)
	})
}

// TestPoisonDeadLettered: a message the handler can never apply is
// dead-lettered (and terminated in JetStream); later messages flow.
func TestPoisonDeadLettered(t *testing.T) {
	brokers(t, func(t *testing.T, url string) {
		e := newEnv(t, url)
		events := idemtest.Events(50)
		msgs := messages(events)
		poison := &idem.Message{ID: "poison", Payload: []byte("not a credit")}
		e.publish(append([]*idem.Message{poison}, msgs...), 0)
		nc, js := e.connect()
		defer nc.Close()
		raw := &nats.Msg{Subject: e.stream + ".acct", Data: []byte("no id")} // undecodable: no ID header
		if _, err := js.PublishMsg(context.Background(), raw); err != nil {
			t.Fatal(err)
		}
		e.run(e.consumer(false))
		e.waitMarkers(len(events))
		deadline := time.Now().Add(10 * time.Second)
		for {
			dls, err := e.drv.DeadLetterList(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(dls) == 2 {
				if dls[0].MessageID != "poison" || dls[1].Class != idem.DeadLetterDecode || string(dls[1].Raw) != "no id" {
					t.Fatalf("dead letters %+v", dls)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d dead letters, want 2", len(dls))
			}
			time.Sleep(20 * time.Millisecond)
		}
		e.checkBalances(events)
	})
}

// TestOrderingKeptPerSubject: with the ordering guard on, each aggregate's
// events apply in sequence order, once, despite republished copies.
func TestOrderingKeptPerSubject(t *testing.T) {
	brokers(t, func(t *testing.T, url string) {
		e := newEnv(t, url)
		var msgs []*idem.Message
		var events []idemtest.Event
		for s := int64(1); s <= 20; s++ {
			for a := range 10 {
				ev := idemtest.Event{ID: fmt.Sprintf("agg%d-%d", a, s), Account: fmt.Sprintf("acct-%d", a), Amount: s}
				events = append(events, ev)
				m := ev.Message()
				m.AggregateID, m.Seq = fmt.Sprintf("agg%d", a), s
				msgs = append(msgs, m)
			}
		}
		e.publish(msgs, 7)
		e.run(e.consumer(true))
		e.waitMarkers(len(msgs))
		for a := range 10 {
			v, _ := e.applied.Load(fmt.Sprintf("agg%d", a))
			got := *v.(*[]int64)
			if len(got) != 20 {
				t.Fatalf("agg%d applied %v, want 1..20 once each", a, got)
			}
			for i, s := range got {
				if s != int64(i+1) {
					t.Fatalf("agg%d applied %v, want 1..20 in order", a, got)
				}
			}
		}
		e.checkBalances(events)
	})
}

// TestNewRejectsBadConfig checks the required settings.
func TestNewRejectsBadConfig(t *testing.T) {
	if _, err := jetstream.New(nil, &jetstream.Config{}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New without JetStream: %v", err)
	}
}
