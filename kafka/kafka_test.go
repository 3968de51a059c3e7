package kafka_test

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
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
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/sqlite"
)

const topic = "credits"

// env is one test's in-process Kafka cluster and SQLite store.
type env struct {
	t       *testing.T
	brokers []string
	db      *sql.DB
	drv     *sqlite.Driver
	proc    *idem.Processor[*sql.Tx]
	applied sync.Map // aggregate → *[]int64 of applied Seq
	dups    atomic.Int64
}

func newEnv(t *testing.T) *env {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, topic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	e := &env{t: t, brokers: c.ListenAddrs()}
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "idem.db"), &sqlite.OpenOptions{Synchronous: "NORMAL"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ctx := context.Background()
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

// consumer returns an idem.Consumer crediting balances; it counts
// Duplicate verdicts.
func (e *env) consumer(ordering bool) idem.DeliveryHandler {
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
	return idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		v := c.HandleDelivery(ctx, d)
		if v.Outcome == idem.Duplicate {
			e.dups.Add(1)
		}
		return v
	})
}

// produce writes the messages (key = aggregate, idem-* headers); dupEvery
// > 0 writes every dupEvery-th twice, as a producer retry would.
func (e *env) produce(msgs []*idem.Message, dupEvery int) {
	e.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		e.t.Fatal(err)
	}
	defer cl.Close()
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
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		e.t.Fatal(err)
	}
}

// run starts a group member; kill stops it at once without committing
// what it is in the middle of.
func (e *env) run(h idem.DeliveryHandler) (kill func()) {
	c, err := kafka.New(&kafka.Config{Brokers: e.brokers, Group: "idem", Topics: []string{topic}, Handler: h, MaxPoll: 50,
		Options: []kgo.Opt{kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(6 * time.Second)}})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	var once sync.Once
	kill = func() { once.Do(func() { cancel(); <-done }) }
	e.t.Cleanup(kill)
	return kill
}

func (e *env) waitMarkers(n int) {
	e.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var got int
		if err := e.db.QueryRow(`SELECT count(*) FROM idem_processed WHERE handler = 'balances'`).Scan(&got); err != nil {
			e.t.Fatal(err)
		}
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%d of %d messages applied after 60 s", got, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

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
		out[i].AggregateID = ev.Account // the key: one account, one partition
	}
	return out
}

// TestKilledBeforeCommit: a member stops after applying records it has not
// committed; they are redelivered to the next member as Duplicates and the
// balances are exact.
func TestKilledBeforeCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	events := idemtest.Events(600)
	e.produce(messages(events), 0)
	var crashed atomic.Bool
	c, err := kafka.New(&kafka.Config{Brokers: e.brokers, Group: "idem", Topics: []string{topic}, Handler: e.consumer(false), MaxPoll: 50,
		FaultHook: func(point string) {
			if point == kafka.FaultBeforeCommit && crashed.CompareAndSwap(false, true) {
				runtime.Goexit() // the consumer dies: no commit, no further code
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(context.Background()) }()
	<-done
	e.run(e.consumer(false))
	e.waitMarkers(len(events))
	if e.dups.Load() == 0 {
		t.Fatal("no record came back as a Duplicate: the kill left nothing uncommitted")
	}
	e.checkBalances(events)
}

// TestThreeMembersOneKilled: three group members, one killed mid-stream,
// producer retries in the topic: exact balances, nothing lost.
func TestThreeMembersOneKilled(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	events := idemtest.Events(1500)
	kills := make([]func(), 3)
	for i := range kills {
		kills[i] = e.run(e.consumer(false))
	}
	e.produce(messages(events), 10)
	time.Sleep(300 * time.Millisecond)
	kills[1]()
	e.waitMarkers(len(events))
	if e.dups.Load() < int64(len(events)/10) {
		t.Fatalf("%d duplicates, want at least the %d produced twice", e.dups.Load(), len(events)/10)
	}
	e.checkBalances(events)
}

// TestPoisonDeadLettered: an undecodable and an unprocessable record are
// dead-lettered and committed; the records after them apply.
func TestPoisonDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	events := idemtest.Events(100)
	msgs := messages(events)
	poison := &idem.Message{ID: "poison", AggregateID: events[0].Account, Payload: []byte("not a credit")}
	e.produce(append([]*idem.Message{poison}, msgs...), 0)
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		t.Fatal(err)
	}
	if err := cl.ProduceSync(context.Background(), &kgo.Record{Key: []byte(events[1].Account), Value: []byte("no id")}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	e.run(e.consumer(false))
	e.waitMarkers(len(events))
	deadline := time.Now().Add(10 * time.Second)
	for {
		dls, err := e.drv.DeadLetterList(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(dls) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters, want 2: %+v", len(dls), dls)
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.checkBalances(events)
}

// TestOrderingKeptPerKey: with the ordering guard, each key's events apply
// once, in sequence order, across a rebalance.
func TestOrderingKeptPerKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
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
	e.produce(msgs, 7)
	kill := e.run(e.consumer(true))
	e.run(e.consumer(true))
	time.Sleep(100 * time.Millisecond)
	kill()
	e.waitMarkers(len(msgs))
	for a := range 10 {
		v, _ := e.applied.Load(fmt.Sprintf("agg%d", a))
		got := *v.(*[]int64)
		for i, s := range got {
			if s != int64(i+1) || len(got) != 20 {
				t.Fatalf("agg%d applied %v, want 1..20 in order, once each", a, got)
			}
		}
	}
	e.checkBalances(events)
}
