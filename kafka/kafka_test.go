package kafka_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/sqlite"
)

const topic = "credits"

// broker is adaptertest.Broker on an in-process kfake cluster.
type broker struct {
	addrs       []string
	concurrency int // Config.Concurrency of the members
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

// consumer returns a group member; opts come after (so override) the
// tests' own: 6 s session and rebalance timeouts.
func (b *broker) consumer(t testing.TB, h idem.DeliveryHandler, hook func(string), batch int, opts ...kgo.Opt) *kafka.Consumer {
	c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "idem", Topics: []string{topic}, Handler: h, MaxPoll: 50, FaultHook: hook, Batch: batch, Concurrency: b.concurrency,
		Logger: testenv.Logger(t), Options: append([]kgo.Opt{kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(6 * time.Second)}, opts...)})
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

// TestAdapterSuiteConcurrent runs it with members that handle up to four
// partitions of a poll at once.
func TestAdapterSuiteConcurrent(t *testing.T) {
	adaptertest.Run(t, newConcurrentBroker)
}

// newConcurrentBroker is newBroker with members that handle up to four
// partitions at once.
func newConcurrentBroker(t testing.TB) adaptertest.Broker {
	b := newBroker(t).(*broker)
	b.concurrency = 4
	return b
}

// TestNewRejectsBadConfig checks the required settings.
func TestNewRejectsBadConfig(t *testing.T) {
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	// A missing setting is named.
	for field, cfg := range map[string]*kafka.Config{
		"Brokers": {Group: "g", Topics: []string{"t"}, Handler: h},
		"Group":   {Brokers: []string{"x:9092"}, Topics: []string{"t"}, Handler: h},
		"Topics":  {Brokers: []string{"x:9092"}, Group: "g", Handler: h},
		"Handler": {Brokers: []string{"x:9092"}, Group: "g", Topics: []string{"t"}},
	} {
		if _, err := kafka.New(cfg); !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "Config."+field+" is required") {
			t.Errorf("New without %s: %v, want ErrInvalidConfig naming it", field, err)
		}
	}
	if _, err := kafka.New(&kafka.Config{Brokers: []string{"x:9092"}, Group: "g", Topics: []string{"t"}, Handler: h, MaxPoll: -1}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("New with MaxPoll -1: %v, want ErrInvalidConfig", err)
	}
	// A Batch the handler cannot take is refused, not ignored.
	if _, err := kafka.New(&kafka.Config{Brokers: []string{"x:9092"}, Group: "g", Topics: []string{"t"}, Handler: h, Batch: 10}); !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "BatchDeliveryHandler") {
		t.Errorf("New with Batch 10 and a one-at-a-time handler: %v, want ErrInvalidConfig", err)
	}
}

// A producer's trace context set in the message headers travels through
// Publisher, kfake and DefaultMap to the processing span.
func TestTraceContextReachesProcessingSpan(t *testing.T) {
	b := newBroker(t).(*broker)
	adaptertest.CheckTraceContext(t, topic, newPublisher(t, b), func(h idem.DeliveryHandler) { b.Start(t, h) })
}

// producePartitioned writes perPart records to each of the four
// partitions, with IDs p<partition>-<index>, and no key.
func (b *broker) producePartitioned(t *testing.T, perPart int) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for i := range perPart {
		for p := range int32(4) {
			id := fmt.Sprintf("p%d-%03d", p, i)
			recs = append(recs, &kgo.Record{Partition: p, Value: []byte(id), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(id)}}})
		}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// effects is an idem.Consumer whose handler records the IDs it applies,
// in order, in a table of the store (so a rolled-back batch leaves no
// trace), and fails message stuck while down is set.
type effects struct {
	down     atomic.Bool
	mu       sync.Mutex
	attempts []int // of stuck's deliveries
}

func (f *effects) consumer(t *testing.T, e *adaptertest.Env, stuck string) *idem.Consumer[*sql.Tx] {
	if _, err := e.DB.Exec(`CREATE TABLE IF NOT EXISTS effects (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		if m.ID == stuck && f.down.Load() {
			return errors.New("dependency down")
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO effects (id) VALUES (?)`, m.ID)
		return err
	}}
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{Logger: testenv.Logger(t),
		Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 50 * time.Millisecond},
		Hooks: []idem.Hook{idem.HookVerdict(verdictFunc(func(ev *idem.VerdictEvent) {
			if ev.MessageID == stuck {
				f.mu.Lock()
				defer f.mu.Unlock()
				f.attempts = append(f.attempts, ev.Attempt)
			}
		}))}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// check compares the effects with the unique intended records: each
// applied once, every partition's in offset order.
func (f *effects) check(t *testing.T, e *adaptertest.Env, perPart int) {
	t.Helper()
	checkEffects(t, e.DB, perPart)
}

// checkEffects compares the table effects in db with the unique intended
// records of producePartitioned: each applied once, every partition's in
// offset order.
func checkEffects(t *testing.T, db *sql.DB, perPart int) {
	t.Helper()
	rows, err := db.Query(`SELECT id FROM effects ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	next := map[string]int{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		p, i := id[:2], 0
		if _, err := fmt.Sscanf(id[3:], "%d", &i); err != nil {
			t.Fatal(err)
		}
		if i != next[p] {
			t.Fatalf("%s applied when %s-%03d was next", id, p, next[p])
		}
		next[p]++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for p := range 4 {
		if n := next[fmt.Sprintf("p%d", p)]; n != perPart {
			t.Fatalf("partition %d: %d records applied, want %d", p, n, perPart)
		}
	}
}

// waitTries waits until the stuck record was tried n times, then lets it
// pass.
func (f *effects) waitTries(t *testing.T, stuck string, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		f.mu.Lock()
		got := len(f.attempts)
		f.mu.Unlock()
		if got >= n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s tried %d times in 10 s, want it retried", stuck, got)
		}
	}
	f.down.Store(false)
}

// join starts a member with h and opts and fails t unless the group
// assigns it a partition within wait; why names what it would have waited
// for.
func (b *broker) join(t *testing.T, h idem.DeliveryHandler, wait time.Duration, why string, opts ...kgo.Opt) {
	t.Helper()
	assigned := make(chan struct{})
	var once sync.Once
	joined := time.Now()
	b.start(t, b.consumer(t, h, nil, 1, append(opts, kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, got map[string][]int32) {
		if len(got[topic]) > 0 {
			once.Do(func() { close(assigned) })
		}
	}))...))
	select {
	case <-assigned:
	case <-time.After(wait):
		t.Fatalf("the second member got no partition within %s: the rebalance waited for %s", wait, why)
	}
	t.Logf("second member assigned after %s", time.Since(joined).Round(time.Millisecond))
}

type verdictFunc func(ev *idem.VerdictEvent)

func (f verdictFunc) OnVerdict(_ context.Context, ev *idem.VerdictEvent) { f(ev) }

// A record that keeps asking for a retry holds its partition only: the
// partition is rewound to it and paused for the delay, the member's other
// partitions flow, and once the record applies its partition follows, in
// order. Each try counts as the next attempt. Checked one record at a
// time, in batches and with partitions handled at once.
func TestRetryHoldsOnlyItsPartition(t *testing.T) {
	t.Parallel()
	for _, cfg := range []struct {
		name               string
		batch, concurrency int
	}{{"one-at-a-time", 1, 1}, {"batches", 25, 1}, {"concurrent-batches", 25, 4}} {
		t.Run(cfg.name, func(t *testing.T) {
			t.Parallel()
			const perPart = 100
			b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
			b.producePartitioned(t, perPart)
			var f effects
			f.down.Store(true)
			b.concurrency = cfg.concurrency
			b.StartBatched(t, f.consumer(t, e, "p2-010"), cfg.batch)
			// Everything but p2-010 and the rest of partition 2.
			e.WaitMarkers(3*perPart + 10)
			f.waitTries(t, "p2-010", 4)
			e.WaitMarkers(4 * perPart)
			f.check(t, e, perPart)
			f.mu.Lock()
			defer f.mu.Unlock()
			for i, a := range f.attempts {
				if a != i+1 {
					t.Fatalf("p2-010's deliveries counted as attempts %v, want 1, 2, 3, …", f.attempts)
				}
			}
		})
	}
}

// A record retrying does not hold the group's rebalances: with a 30 s
// rebalance timeout, a member joining while the first one retries is
// assigned its partitions within seconds (a member holding its poll would
// keep the group waiting for the whole timeout). Once the first member
// leaves, the other applies the rest, each record once and in order.
func TestRetryDoesNotBlockRebalance(t *testing.T) {
	t.Parallel()
	const perPart = 50
	b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
	b.producePartitioned(t, perPart)
	var f effects
	f.down.Store(true)
	slow := kgo.RebalanceTimeout(30 * time.Second)
	killStuck := b.start(t, b.consumer(t, f.consumer(t, e, "p2-005"), nil, 1, slow))
	e.WaitMarkers(3*perPart + 5)
	b.join(t, f.consumer(t, e, ""), 15*time.Second, "the retrying member", slow)
	killStuck()
	e.WaitMarkers(4 * perPart)
	f.check(t, e, perPart)
}

// With Concurrency a member handles a poll's partitions at once; without
// it, one record at a time. A poll holds the partitions whose records have
// arrived: the first after the member joins can hold fewer than four (their
// start offsets resolve apart), so the records come in waves produced
// while the member idles on all four, until one wave has four in flight.
func TestConcurrencyOverlapsPartitions(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ concurrency, wantMax int64 }{{1, 1}, {4, 4}} {
		b := newBroker(t).(*broker)
		cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
		if err != nil {
			t.Fatal(err)
		}
		var inFlight, most, handled atomic.Int64
		h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
			n := inFlight.Add(1)
			for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
			}
			time.Sleep(30 * time.Millisecond)
			inFlight.Add(-1)
			handled.Add(1)
			return idem.Verdict{Ack: true}
		})
		b.concurrency = int(tc.concurrency)
		kill := b.Start(t, h)
		const waves, perWave = 4, 20
		for w := range waves {
			var recs []*kgo.Record
			for i := range perWave {
				id := strconv.Itoa(w*perWave + i)
				recs = append(recs, &kgo.Record{Partition: int32(i % 4), Value: []byte("x"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(id)}}})
			}
			if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
				t.Fatal(err)
			}
			want := int64((w + 1) * perWave)
			for deadline := time.Now().Add(20 * time.Second); handled.Load() < want; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("concurrency %d: %d of %d records handled after 20 s", tc.concurrency, handled.Load(), want)
				}
			}
			if most.Load() >= tc.wantMax {
				break
			}
		}
		kill()
		cl.Close()
		if m := most.Load(); m != tc.wantMax {
			t.Errorf("concurrency %d: at most %d records in flight at once, want %d", tc.concurrency, m, tc.wantMax)
		}
	}
}

// TestNewRejectsNegativeConcurrency checks Concurrency's bound.
func TestNewRejectsNegativeConcurrency(t *testing.T) {
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	if _, err := kafka.New(&kafka.Config{Brokers: []string{"x:9092"}, Group: "g", Topics: []string{"t"}, Handler: h, Concurrency: -1}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("New with Concurrency -1: %v", err)
	}
}

// In a batch, the records of other keys after one that is to be retried
// are decided with the batch, and come again with the retry: they are then
// settled as decided, not handled again. Here an undecodable record sits
// behind the retrying one; handled on every round it would be
// dead-lettered again each time (decode failures have no ID to dedupe).
func TestBatchRetryDoesNotRedecideLaterKeys(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	var recs []*kgo.Record
	for i := range 20 {
		id := fmt.Sprintf("p0-%03d", i)
		recs = append(recs, &kgo.Record{Partition: 0, Key: []byte(id), Value: []byte(id), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(id)}}})
		if i == 10 {
			recs = append(recs, &kgo.Record{Partition: 0, Value: []byte("no id header")})
		}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	var f effects
	f.down.Store(true)
	b.StartBatched(t, f.consumer(t, e, "p0-010"), 25)
	f.waitTries(t, "p0-010", 4)
	e.WaitMarkers(20)
	dls, err := e.Drv.DeadLetterList(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 || dls[0].Class != idem.DeadLetterDecode {
		t.Fatalf("%d dead letters, want the undecodable record's once: it was decided again on every retry", len(dls))
	}
	var applied int
	if err := e.DB.QueryRow(`SELECT count(*) FROM effects`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if applied != 20 {
		t.Fatalf("%d effects, want 20", applied)
	}
}

// A rebalance does not wait for a member's whole poll: told that one is
// blocked, the poll stops at its next record, commits what it settled,
// rewinds the rest and lets the rebalance through. With Concurrency the
// first member's poll holds all 4 × 500 records, at 20 ms each half a
// minute's work, yet the joining member is assigned partitions within
// seconds; the records then apply once each and in order.
func TestRebalanceDoesNotWaitForThePoll(t *testing.T) {
	t.Parallel()
	const perPart = 500
	b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
	b.producePartitioned(t, perPart)
	var (
		f       effects
		slow    atomic.Bool
		handled atomic.Int64
	)
	slow.Store(true)
	c := f.consumer(t, e, "")
	busy := make(chan struct{})
	h := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		if slow.Load() {
			time.Sleep(20 * time.Millisecond)
		}
		if handled.Add(1) == 20 {
			close(busy)
		}
		return c.HandleDelivery(ctx, d)
	})
	b.concurrency = 4
	timeout := kgo.RebalanceTimeout(60 * time.Second)
	b.start(t, b.consumer(t, h, nil, 1, timeout))
	<-busy // the first member is well into its poll
	b.join(t, h, 10*time.Second, "the first member's poll", timeout)
	slow.Store(false)
	e.WaitMarkers(4 * perPart)
	f.check(t, e, perPart)
}

// A retry waits out the verdict's RetryAfter before its record comes
// again: the partition is paused, not polled at once.
func TestRetryWaitsItsDelay(t *testing.T) {
	t.Parallel()
	const delay = 300 * time.Millisecond
	b := newBroker(t).(*broker)
	b.Publish(t, []*idem.Message{{ID: "r", AggregateID: "a", Payload: []byte("x")}}, 0)
	var (
		mu    sync.Mutex
		tries []time.Time
	)
	done := make(chan struct{})
	b.Start(t, idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
		mu.Lock()
		defer mu.Unlock()
		tries = append(tries, time.Now())
		if len(tries) < 4 {
			return idem.Verdict{RetryAfter: delay}
		}
		close(done)
		return idem.Verdict{Ack: true}
	}))
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the record was not acknowledged on its fourth try within 10 s")
	}
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < len(tries); i++ {
		if gap := tries[i].Sub(tries[i-1]); gap < delay {
			t.Fatalf("try %d came %v after the one before, want at least the %v RetryAfter", i+1, gap, delay)
		}
	}
}

// A record that fails behind another that is to be retried, in the same
// batch, counts each of its tries too: with MaxAttempts 3 both are
// dead-lettered on their third try, not the later one only once the
// earlier has settled (it used to be tried five times: three at attempt
// 1, while its partition retried the first).
func TestFailureBehindARetryCountsItsAttempts(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
	var msgs []*idem.Message
	for i := range 10 {
		id := fmt.Sprintf("r%d", i)
		msgs = append(msgs, &idem.Message{ID: id, AggregateID: id, Payload: []byte(id)})
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	var recs []*kgo.Record
	for _, m := range msgs {
		recs = append(recs, &kgo.Record{Partition: 0, Key: []byte(m.AggregateID), Value: m.Payload, Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(m.ID)}}})
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	failing := map[string]bool{"r3": true, "r7": true}
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
		if failing[m.ID] {
			return errors.New("dependency down")
		}
		return nil
	}}
	var mu sync.Mutex
	attempts := map[string][]int{}
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{Logger: testenv.Logger(t), MaxAttempts: 3,
		Backoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		Hooks: []idem.Hook{idem.HookVerdict(verdictFunc(func(ev *idem.VerdictEvent) {
			if failing[ev.MessageID] {
				mu.Lock()
				defer mu.Unlock()
				attempts[ev.MessageID] = append(attempts[ev.MessageID], ev.Attempt)
			}
		}))}})
	if err != nil {
		t.Fatal(err)
	}
	b.StartBatched(t, c, 25)
	e.WaitMarkers(8)
	// The verdict hook runs after the dead letter commits, so wait for
	// both: the listing alone can see r7's dead letter before its hook.
	reported := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(attempts["r3"]) >= 3 && len(attempts["r7"]) >= 3
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		dls, err := e.Drv.DeadLetterList(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(dls) == 2 && reported() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters after 10 s, want r3's and r7's", len(dls))
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range []string{"r3", "r7"} {
		if got := attempts[id]; !slices.Equal(got, []int{1, 2, 3}) {
			t.Errorf("%s tried at attempts %v, want [1 2 3]", id, got)
		}
	}
}

// Waiting behind an earlier record of its own aggregate is no attempt: a2
// waits while a1 (same key) is retried twice, then fails once on its own,
// and with MaxAttempts 3 it is retried and applied, not dead-lettered as
// if its waits had been tries. Also when a2 comes first in its partition
// but after a1 in sequence, so that under the ordering guard it is the
// partition's first record the batch did not settle.
func TestWaitingBehindItsAggregateIsNoAttempt(t *testing.T) {
	t.Parallel()
	t.Run("partition order", func(t *testing.T) {
		t.Parallel()
		waitingIsNoAttempt(t, nil, []*idem.Message{
			{ID: "a1", AggregateID: "A", Payload: []byte("a1")},
			{ID: "b1", AggregateID: "B", Payload: []byte("b1")},
			{ID: "a2", AggregateID: "A", Payload: []byte("a2")},
			{ID: "b2", AggregateID: "B", Payload: []byte("b2")},
		})
	})
	t.Run("sequence order", func(t *testing.T) {
		t.Parallel()
		waitingIsNoAttempt(t, &idem.Ordering{Gap: idem.GapAllow}, []*idem.Message{
			{ID: "a2", AggregateID: "A", Seq: 2, Payload: []byte("a2")},
			{ID: "b1", AggregateID: "B", Seq: 1, Payload: []byte("b1")},
			{ID: "a1", AggregateID: "A", Seq: 1, Payload: []byte("a1")},
			{ID: "b2", AggregateID: "B", Seq: 2, Payload: []byte("b2")},
		})
	})
}

func waitingIsNoAttempt(t *testing.T, ordering *idem.Ordering, msgs []*idem.Message) {
	b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
	b.Publish(t, msgs, 0)
	var retries sync.Map // message ID → *atomic.Int64: retry verdicts that were tries
	tries := func(id string) int64 {
		v, _ := retries.LoadOrStore(id, new(atomic.Int64))
		return v.(*atomic.Int64).Load()
	}
	failFor := map[string]int64{"a1": 2, "a2": 1}
	h := &idem.Handler[*sql.Tx]{Name: "balances", Ordering: ordering, Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
		if tries(m.ID) < failFor[m.ID] {
			return errors.New("dependency down")
		}
		return nil
	}}
	var mu sync.Mutex
	var a2 []int // a2's attempts at its verdicts
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{Logger: testenv.Logger(t), MaxAttempts: 3,
		Backoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		Hooks: []idem.Hook{idem.HookVerdict(verdictFunc(func(ev *idem.VerdictEvent) {
			if ev.MessageID == "a2" {
				mu.Lock()
				a2 = append(a2, ev.Attempt)
				mu.Unlock()
			}
			if !ev.Verdict.Ack && !errors.Is(ev.Verdict.Err, idem.ErrWaitsForAggregate) {
				tries(ev.MessageID)
				v, _ := retries.Load(ev.MessageID)
				v.(*atomic.Int64).Add(1)
			}
		}))}})
	if err != nil {
		t.Fatal(err)
	}
	b.StartBatched(t, c, 25)
	var dls []driver.DeadLetter
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var applied int
		if err := e.DB.QueryRow(`SELECT count(*) FROM idem_processed WHERE handler = 'balances'`).Scan(&applied); err != nil {
			t.Fatal(err)
		}
		if dls, err = e.Drv.DeadLetterList(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		if applied+len(dls) == len(msgs) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 10 s: %d applied, %d dead-lettered, of %d", applied, len(dls), len(msgs))
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(dls) != 0 {
		t.Fatalf("dead letter %s (%s) at a2's attempts %v: its waits were counted as tries", dls[0].MessageID, dls[0].Class, a2)
	}
	if tries("a1") != 2 || tries("a2") != 1 {
		t.Fatalf("tries a1 %d, a2 %d; want 2 and 1", tries("a1"), tries("a2"))
	}
}

// An unreachable cluster is logged, not waited on in silence.
func TestUnreachableClusterIsLogged(t *testing.T) {
	t.Parallel()
	var buf testenv.Buffer
	c, err := kafka.New(&kafka.Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"},
		Handler: idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} }),
		Logger:  slog.New(slog.NewTextHandler(&buf, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := c.Run(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run: %v", err)
	}
	if out := buf.String(); !strings.Contains(out, "level=WARN") && !strings.Contains(out, "level=ERROR") || !strings.Contains(out, "kafka: ") {
		t.Fatalf("nothing logged about the unreachable broker in 3 s: %q", out)
	}
}

// TestStopDuringStoreOutage: Run is cancelled while the store is down and
// a record waits for it. Run returns at once rather than when the store
// answers again, commits nothing past the record, and a member started
// once the store is back applies it, once.
func TestStopDuringStoreOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "idem.db")
	_, drv := testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var applied atomic.Int32
	h := &idem.Handler[*sql.Tx]{Name: "proj", Apply: func(context.Context, *sql.Tx, *idem.Message) error {
		applied.Add(1)
		return nil
	}}
	consumer, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	release := testenv.HoldSQLite(t, path) // the store is down
	b := newBroker(t).(*broker)
	b.produce(t, []*kgo.Record{{Key: []byte("k"), Value: []byte("v"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("m1")}}}})
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.consumer(t, consumer, nil, 1).Run(rctx) }()
	time.Sleep(2 * time.Second) // the record is fetched and held
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		release()
		<-done
		t.Fatal("Run went on for 5 s after its context ended, waiting for the store")
	}
	release()
	if n := applied.Load(); n != 0 {
		t.Fatalf("applied %d times while the store was down", n)
	}
	kill := b.start(t, b.consumer(t, consumer, nil, 1))
	defer kill()
	for deadline := time.Now().Add(15 * time.Second); applied.Load() == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the record was not applied once the store was back")
		}
	}
	time.Sleep(200 * time.Millisecond) // a second application would show by now
	kill()
	if n := applied.Load(); n != 1 {
		t.Fatalf("applied %d times, want once", n)
	}
}

// TestAbortedTransactionNotApplied: a transactional producer aborts a
// record; the Consumer hands over only the committed record after it.
func TestAbortedTransactionNotApplied(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := newBroker(t).(*broker)
	tcl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.TransactionalID("aborting"))
	if err != nil {
		t.Fatal(err)
	}
	defer tcl.Close()
	if err := tcl.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	rec := func(id string) *kgo.Record {
		return &kgo.Record{Key: []byte("k"), Value: []byte(id), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(id)}}}
	}
	if err := tcl.ProduceSync(ctx, rec("aborted")).FirstErr(); err != nil {
		t.Fatal(err)
	}
	if err := tcl.EndTransaction(ctx, kgo.TryAbort); err != nil {
		t.Fatal(err)
	}
	b.produce(t, []*kgo.Record{rec("committed")})
	var (
		mu   sync.Mutex
		seen []string
	)
	h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		mu.Lock()
		defer mu.Unlock()
		if d.Msg != nil {
			seen = append(seen, d.Msg.ID)
		}
		return idem.Verdict{Ack: true}
	})
	kill := b.Start(t, h)
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		mu.Lock()
		n := len(seen)
		mu.Unlock()
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the committed record was not handed over")
		}
	}
	time.Sleep(300 * time.Millisecond) // the partition's last record is the committed one
	kill()
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(seen, []string{"committed"}) {
		t.Fatalf("handed over %v, want only the committed record", seen)
	}
}
