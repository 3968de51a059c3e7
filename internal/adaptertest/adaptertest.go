// Package adaptertest is the test suite every broker adapter passes: a
// consumer crashed between the outcome and the ack or commit, three
// consumers with one killed, poison and undecodable records, batches, a
// lease-mode handler's effects sent once each, per-aggregate order with
// the ordering guard, and a stop while the store hangs. The final state is always
// checked against the unique intended events, never a fold of the
// delivered stream.
package adaptertest

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// Broker is one adapter on one broker, fresh for each test.
type Broker interface {
	// Publish sends the messages with the adapter's ID, aggregate and
	// sequence conventions; every dupEvery-th (when > 0) is sent twice,
	// as a producer's retry would.
	Publish(t testing.TB, msgs []*idem.Message, dupEvery int)
	// PublishRaw sends a record without an ID.
	PublishRaw(t testing.TB, value []byte)
	// Start runs one consumer (all share one group or durable); kill
	// stops it at once.
	Start(t testing.TB, h idem.DeliveryHandler) (kill func())
	// StartCrashing runs a consumer that crashes after its handler
	// decided at least one delivery and before that delivery is
	// acknowledged or committed. crashed is closed when it has.
	StartCrashing(t testing.TB, h idem.DeliveryHandler) (crashed <-chan struct{})
	// StartBatched runs one consumer configured for batches of batch.
	StartBatched(t testing.TB, h idem.BatchDeliveryHandler, batch int) (kill func())
}

// Env is a test's SQLite store and idem consumer.
type Env struct {
	t       testing.TB
	DB      *sql.DB
	Drv     *sqlite.Driver
	Proc    *idem.Processor[*sql.Tx]
	Dups    atomic.Int64
	applied sync.Map // aggregate → *[]int64 of applied Seq, in order
}

// NewEnv opens a migrated SQLite store with a balances table, at
// synchronous=NORMAL: the tests need no power-loss durability.
func NewEnv(t testing.TB) *Env {
	t.Helper()
	return newEnv(t, "NORMAL")
}

func newEnv(t testing.TB, synchronous string) *Env {
	t.Helper()
	return openEnv(t, filepath.Join(t.TempDir(), "idem.db"), synchronous)
}

// OpenEnv is NewEnv on the SQLite file at path, created if need be: a
// store that a test shares with a child process it kills.
func OpenEnv(t testing.TB, path string) *Env {
	t.Helper()
	return openEnv(t, path, "NORMAL")
}

func openEnv(t testing.TB, path, synchronous string) *Env {
	t.Helper()
	db, err := sqlite.Open(path, &sqlite.OpenOptions{Synchronous: synchronous})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	e := &Env{t: t, DB: db}
	ctx := context.Background()
	if e.Drv, err = sqlite.New(db, nil); err != nil {
		t.Fatal(err)
	}
	if err := e.Drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if e.Proc, err = idem.NewProcessor(e.Drv, nil); err != nil {
		t.Fatal(err)
	}
	return e
}

// Consumer returns an idem.Consumer crediting balances (with the ordering
// guard when ordering), counting Duplicate verdicts in Dups.
func (e *Env) Consumer(ordering bool) idem.DeliveryHandler {
	c := e.creditConsumer(ordering)
	return idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		v := c.HandleDelivery(ctx, d)
		if v.Outcome == idem.Duplicate {
			e.Dups.Add(1)
		}
		return v
	})
}

// OrderedBatchConsumer is Consumer(true) for batches: the ordering guard
// runs inside each batch's transaction.
func (e *Env) OrderedBatchConsumer() idem.BatchDeliveryHandler {
	return &countingBatch{c: e.creditConsumer(true), dups: &e.Dups}
}

// creditConsumer is the idem.Consumer behind Consumer: one credit per
// message, recording the sequences applied per aggregate.
func (e *Env) creditConsumer(ordering bool) *idem.Consumer[*sql.Tx] {
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		acct, amt, err := idemtest.DecodeCredit(m.Payload)
		if err != nil {
			return idem.Permanent(err)
		}
		if m.Seq > 0 {
			v, _ := e.applied.LoadOrStore(m.AggregateID, &[]int64{})
			*v.(*[]int64) = append(*v.(*[]int64), m.Seq)
		}
		return credit(ctx, tx, acct, amt)
	}}
	if ordering {
		h.Ordering = &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Minute}
	}
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// BatchConsumer returns an idem.Consumer whose handler applies a batch's
// new credits with one upsert per account (a poison payload fails the
// batch permanently, so its deliveries are decided one by one), counting
// Duplicate verdicts in Dups.
func (e *Env) BatchConsumer() idem.BatchDeliveryHandler { return e.batchConsumer(false, false) }

// batchConsumer is BatchConsumer; perEvent applies one upsert per credit
// instead of one per account (see applyCredits), ordered turns the
// ordering guard on (GapFail).
func (e *Env) batchConsumer(perEvent, ordered bool) idem.BatchDeliveryHandler {
	h := &idem.Handler[*sql.Tx]{Name: "balances", ApplyBatch: func(ctx context.Context, tx *sql.Tx, msgs []*idem.Message) error {
		return applyCreditsTx(ctx, tx, payloadsOf(msgs), perEvent)
	}}
	if ordered {
		h.Ordering = &idem.Ordering{}
	}
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		e.t.Fatal(err)
	}
	return &countingBatch{c: c, dups: &e.Dups}
}

// countingBatch counts the Duplicate verdicts of a batch consumer.
type countingBatch struct {
	c    *idem.Consumer[*sql.Tx]
	dups *atomic.Int64
}

func (b *countingBatch) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	v := b.c.HandleDelivery(ctx, d)
	if v.Outcome == idem.Duplicate {
		b.dups.Add(1)
	}
	return v
}

func (b *countingBatch) HandleDeliveries(ctx context.Context, ds []*idem.Delivery) []idem.Verdict {
	vs := b.c.HandleDeliveries(ctx, ds)
	for _, v := range vs {
		if v.Outcome == idem.Duplicate {
			b.dups.Add(1)
		}
	}
	return vs
}

// credit adds amt to acct's balance.
func credit(ctx context.Context, tx *sql.Tx, acct string, amt int64) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?) ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, acct, amt)
	return err
}

// applyCredits applies a batch's credit payloads with credit: summed per
// account, one call per account, or with perEvent one call per credit, as a
// loop over a poll's records does. A payload that does not decode fails the
// batch permanently.
func applyCredits(payloads [][]byte, perEvent bool, credit func(acct string, amt int64) error) error {
	sums := map[string]int64{}
	for _, p := range payloads {
		acct, amt, err := idemtest.DecodeCredit(p)
		if err != nil {
			return idem.Permanent(err)
		}
		if perEvent {
			if err := credit(acct, amt); err != nil {
				return err
			}
			continue
		}
		sums[acct] += amt
	}
	for acct, amt := range sums {
		if err := credit(acct, amt); err != nil {
			return err
		}
	}
	return nil
}

// applyCreditsTx is applyCredits in a SQLite transaction.
func applyCreditsTx(ctx context.Context, tx *sql.Tx, payloads [][]byte, perEvent bool) error {
	return applyCredits(payloads, perEvent, func(acct string, amt int64) error { return credit(ctx, tx, acct, amt) })
}

// payloadsOf returns the messages' payloads.
func payloadsOf(msgs []*idem.Message) [][]byte {
	out := make([][]byte, len(msgs))
	for i, m := range msgs {
		out[i] = m.Payload
	}
	return out
}

// WaitMarkers waits until at least n messages are applied. (At least: a
// count passing through n on its way further must not be missed.)
func (e *Env) WaitMarkers(n int) {
	e.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var got int
		if err := e.DB.QueryRow(`SELECT count(*) FROM idem_processed WHERE handler = 'balances'`).Scan(&got); err != nil {
			e.t.Fatal(err)
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%d of %d messages applied after 60 s", got, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// WaitDups waits until at least n deliveries came back as Duplicate. A
// message's last marker can commit before a republished copy of it is
// delivered, so the count is awaited rather than read once; why says what a
// shortfall means.
func (e *Env) WaitDups(n int, why string) {
	e.t.Helper()
	for deadline := time.Now().Add(15 * time.Second); e.Dups.Load() < int64(n); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			e.t.Fatalf("%d deliveries came back as Duplicate after 15 s, want at least %d: %s", e.Dups.Load(), n, why)
		}
	}
}

// WaitPanickedMap waits until the store holds one dead letter, and checks
// that it is the delivery of raw as a decode failure saying the Map
// panicked (what the adapters make of a custom Map that panics).
func (e *Env) WaitPanickedMap(raw string) {
	e.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		dls, err := e.Drv.DeadLetterList(context.Background(), nil)
		if err != nil {
			e.t.Fatal(err)
		}
		if len(dls) == 1 {
			if dls[0].Class != idem.DeadLetterDecode || !strings.Contains(dls[0].Error, "panicked") || string(dls[0].Raw) != raw {
				e.t.Fatalf("dead letter %s: %s (%q); want %q as a decode failure saying the Map panicked", dls[0].Class, dls[0].Error, dls[0].Raw, raw)
			}
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%d dead letters after 10 s, want 1", len(dls))
		}
	}
}

// CheckBalances compares the balances with the unique intended events.
func (e *Env) CheckBalances(events []idemtest.Event) {
	e.t.Helper()
	rows, err := e.DB.Query(`SELECT account, amount FROM balances`)
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

// WaitExact waits until balances equals the balances of the unique
// intended events and dups (the deliveries counted as Duplicate) is at
// least minDups. A balance above its expected value is a double apply and
// fails at once; so does anything short of exact after 60 s. It serves the
// end-to-end tests on stores other than Env's.
func WaitExact(t testing.TB, events []idemtest.Event, minDups int64, balances func(context.Context) (map[string]int64, error), dups func(context.Context) (int64, error)) {
	t.Helper()
	want := idemtest.Expected(events)
	ctx := context.Background()
	deadline := time.Now().Add(60 * time.Second)
	for {
		got, err := balances(ctx)
		if err != nil {
			t.Fatal(err)
		}
		n, err := dups(ctx)
		if err != nil {
			t.Fatal(err)
		}
		exact := len(got) == len(want)
		for a, w := range want {
			exact = exact && got[a] == w
			if got[a] > w {
				t.Fatalf("%s = %d, above the %d of the unique events: applied twice", a, got[a], w)
			}
		}
		if exact && n >= minDups {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 60 s: balances %v, want %v; %d duplicates counted, want ≥ %d", got, want, n, minDups)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// StoredDuplicates returns WaitExact's dups for a store that keeps the
// duplicate counts: what stats has counted for handler, flushed to st and
// read back.
func StoredDuplicates(stats *idem.StatsRecorder, st driver.StatsStore, handler string) func(context.Context) (int64, error) {
	return func(ctx context.Context) (int64, error) {
		if err := stats.Flush(ctx); err != nil {
			return 0, err
		}
		got, err := st.StatsRead(ctx)
		return got[handler].Duplicates, err
	}
}

// Messages turns events into messages keyed by account (one account, one
// partition or subject).
func Messages(events []idemtest.Event) []*idem.Message {
	out := make([]*idem.Message, len(events))
	for i, ev := range events {
		out[i] = ev.Message()
		out[i].AggregateID = ev.Account
	}
	return out
}

// Run runs the suite; newBroker returns a fresh broker for each test.
func Run(t *testing.T, newBroker func(t testing.TB) Broker) {
	t.Run("CrashBeforeAckIsDuplicate", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), NewEnv(t)
		events := idemtest.Events(600)
		b.Publish(t, Messages(events), 0)
		<-b.StartCrashing(t, e.Consumer(false))
		b.Start(t, e.Consumer(false))
		e.WaitMarkers(len(events))
		e.WaitDups(1, "the crash left nothing unacknowledged")
		e.CheckBalances(events)
	})
	t.Run("ThreeConsumersOneKilled", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), NewEnv(t)
		events := idemtest.Events(1500)
		kills := make([]func(), 3)
		for i := range kills {
			kills[i] = b.Start(t, e.Consumer(false))
		}
		b.Publish(t, Messages(events), 10)
		time.Sleep(100 * time.Millisecond)
		kills[1]()
		e.WaitMarkers(len(events))
		e.WaitDups(len(events)/10, "want at least one per message published twice")
		e.CheckBalances(events)
	})
	t.Run("PoisonDeadLetteredOthersFlow", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), NewEnv(t)
		events := idemtest.Events(100)
		poison := &idem.Message{ID: "poison", AggregateID: events[0].Account, Payload: []byte("not a credit")}
		b.Publish(t, append([]*idem.Message{poison}, Messages(events)...), 0)
		b.PublishRaw(t, []byte("no id"))
		b.Start(t, e.Consumer(false))
		e.WaitMarkers(len(events))
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			dls, err := e.Drv.DeadLetterList(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(dls) == 2 {
				if dls[0].MessageID != "poison" && dls[1].MessageID != "poison" {
					t.Fatalf("dead letters %+v, want the poison message among them", dls)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d dead letters, want 2", len(dls))
			}
		}
		e.CheckBalances(events)
	})
	t.Run("BatchedDuplicatesPoisonAndKill", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), NewEnv(t)
		events := idemtest.Events(1200)
		poison := &idem.Message{ID: "poison", AggregateID: events[0].Account, Payload: []byte("not a credit")}
		msgs := Messages(events)
		msgs = append(msgs[:600:600], append([]*idem.Message{poison}, msgs[600:]...)...)
		kill := b.StartBatched(t, e.BatchConsumer(), 50)
		b.StartBatched(t, e.BatchConsumer(), 50)
		b.Publish(t, msgs, 10)
		time.Sleep(100 * time.Millisecond)
		kill()
		e.WaitMarkers(len(events))
		e.WaitDups(len(events)/10, "want at least one per message published twice")
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			dls, err := e.Drv.DeadLetterList(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(dls) == 1 && dls[0].MessageID == "poison" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("dead letters %+v, want the poison message alone", dls)
			}
		}
		e.CheckBalances(events)
	})
	t.Run("LeaseModeEachEffectOnce", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), NewEnv(t)
		leaseEffectsOnce(t, b, e)
	})
	t.Run("OrderKeptWithGuard", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), NewEnv(t)
		orderKept(t, b, e, func() func() { return b.Start(t, e.Consumer(true)) })
	})
	t.Run("OrderKeptWithGuardBatched", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), NewEnv(t)
		orderKept(t, b, e, func() func() { return b.StartBatched(t, e.OrderedBatchConsumer(), 25) })
	})
	t.Run("StopWhileTheStoreHangs", func(t *testing.T) {
		t.Parallel()
		stopWhileTheStoreHangs(t, newBroker(t))
	})
}

// orderKept publishes 20 sequenced events of each of 10 aggregates (7%
// published twice), runs two consumers from start, kills one after 100 ms,
// and checks that every aggregate's events applied once each, in order.
func orderKept(t *testing.T, b Broker, e *Env, start func() (kill func())) {
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
	b.Publish(t, msgs, 7)
	kill := start()
	start()
	time.Sleep(100 * time.Millisecond)
	kill()
	e.WaitMarkers(len(msgs))
	for a := range 10 {
		v, ok := e.applied.Load(fmt.Sprintf("agg%d", a))
		if !ok {
			t.Fatalf("agg%d: nothing applied", a)
		}
		got := *v.(*[]int64)
		for i, s := range got {
			if s != int64(i+1) || len(got) != 20 {
				t.Fatalf("agg%d applied %v, want 1..20 in order, once each", a, got)
			}
		}
	}
	e.CheckBalances(events)
}

// leaseEffectsOnce runs a lease-mode handler behind the adapter: three
// consumers send an "email" per message through idem.LeaseConsumer while
// every tenth message is published twice and one consumer is killed
// mid-stream. Each message's email goes out exactly once: redeliveries are
// Duplicates, or InFlight while another consumer holds the lease.
func leaseEffectsOnce(t *testing.T, b Broker, e *Env) {
	lp, err := idem.NewLeaseProcessor(e.Drv, &idem.LeaseConfig{TTL: 10 * time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		sent = map[string]int{}
	)
	h := &idem.LeaseHandler{Name: "mailer", Call: func(ctx context.Context, l *idem.Lease, m *idem.Message) error {
		time.Sleep(time.Millisecond) // the SMTP round trip
		mu.Lock()
		defer mu.Unlock()
		sent[m.ID]++
		return nil
	}}
	c, err := idem.NewLeaseConsumer(lp, h, e.Drv, &idem.ConsumerConfig{Logger: testenv.Logger(t), Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	events := idemtest.Events(300)
	kills := make([]func(), 3)
	for i := range kills {
		kills[i] = b.Start(t, c)
	}
	b.Publish(t, Messages(events), 10)
	time.Sleep(50 * time.Millisecond)
	kills[1]()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		mu.Lock()
		n := len(sent)
		mu.Unlock()
		if n == len(events) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d emails sent after 30 s", n, len(events))
		}
	}
	time.Sleep(300 * time.Millisecond) // let the republished copies arrive
	mu.Lock()
	defer mu.Unlock()
	for _, ev := range events {
		if sent[ev.ID] != 1 {
			t.Fatalf("%s: %d emails, want 1", ev.ID, sent[ev.ID])
		}
	}
	if len(sent) != len(events) {
		t.Fatalf("%d distinct emails, want %d", len(sent), len(events))
	}
}
