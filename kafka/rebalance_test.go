package kafka_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
)

// readAll reads n records of topic from the start, without a group.
func readAll(t *testing.T, addrs []string, n int) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %d of %d records in 10 s", len(out), n)
		}
		out = append(out, fs.Records()...)
	}
	return out
}

// TestPublisherSpreadsKeylessMessages: a message without an aggregate is
// produced with a null key, which the partitioner spreads; an empty key
// ([]byte("")) was hashed like any key, sending every keyless message of
// an outbox to one partition (and making them wait for its leader).
func TestPublisherSpreadsKeylessMessages(t *testing.T) {
	b := newBroker(t).(*broker)
	pub := newPublisher(t, b)
	const n = 400
	payload := []byte(strings.Repeat("x", 1024))
	for i := range n { // one call per message, as a relay of unrelated rows may
		if err := pub.Publish(context.Background(), []*idem.Message{{ID: fmt.Sprintf("keyless-%03d", i), Stream: topic, Payload: payload}}); err != nil {
			t.Fatal(err)
		}
	}
	parts := map[int32]int{}
	var emptyKey bool
	for _, r := range readAll(t, b.addrs, n) {
		parts[r.Partition]++
		emptyKey = emptyKey || (r.Key != nil && len(r.Key) == 0)
	}
	if len(parts) == 1 {
		t.Fatalf("%d keyless messages (%d KiB) all on one partition %v (empty non-nil key on the wire: %v); want a null key, spread by the sticky partitioner", n, n, parts, emptyKey)
	}
}

// TestPartitionBackFromAnotherMemberIsNotHeld: a partition held for a
// retry and then revoked is no longer held: when it comes back (here:
// another member took it, settled the record, and left), its new records
// are consumed at once, not after the old retry's minute (kgo's pauses
// outlive assignments, and the member kept the hold).
func TestPartitionBackFromAnotherMemberIsNotHeld(t *testing.T) {
	t.Parallel()
	const hold = time.Minute
	b := newBroker(t).(*broker)
	b.producePartitioned(t, 1) // p0-000 … p3-000
	var (
		mu     sync.Mutex
		triedA = map[string]bool{}
		gotA   = map[string]time.Time{}
	)
	a := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		mu.Lock()
		defer mu.Unlock()
		if strings.HasSuffix(d.Msg.ID, "-000") {
			triedA[d.Msg.ID] = true
			return idem.Verdict{RetryAfter: hold} // a dependency down: long backoff
		}
		gotA[d.Msg.ID] = time.Now()
		return idem.Verdict{Ack: true}
	})
	b.start(t, b.consumer(t, a, nil, 1))
	waitFor(t, 10*time.Second, "A tried the four records", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(triedA) == 4
	})
	// B joins, takes some partitions and settles their records (the
	// dependency is back).
	var (
		bmu   sync.Mutex
		moved []int32
		ackB  atomic.Int64
	)
	killB := b.start(t, b.consumer(t, idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
		ackB.Add(1)
		return idem.Verdict{Ack: true}
	}), nil, 1, kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, got map[string][]int32) {
		bmu.Lock()
		defer bmu.Unlock()
		moved = append(moved, got[topic]...)
	})))
	waitFor(t, 15*time.Second, "B got partitions and settled their records", func() bool {
		bmu.Lock()
		defer bmu.Unlock()
		return len(moved) > 0 && ackB.Load() >= int64(len(moved))
	})
	time.Sleep(500 * time.Millisecond) // B's commit
	killB()                            // the partitions go back to A
	bmu.Lock()
	back := slices.Clone(moved)
	bmu.Unlock()
	// New records on the partitions that came back.
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var want []string
	for _, p := range back {
		id := fmt.Sprintf("p%d-001", p)
		want = append(want, id)
		if err := cl.ProduceSync(context.Background(), &kgo.Record{Partition: p, Value: []byte(id), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(id)}}}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	produced := time.Now()
	const wait = 12 * time.Second
	for time.Since(produced) < wait {
		mu.Lock()
		n := 0
		for _, id := range want {
			if _, ok := gotA[id]; ok {
				n++
			}
		}
		mu.Unlock()
		if n == len(want) {
			t.Logf("A handled %v %s after they were produced", want, time.Since(produced).Round(time.Millisecond))
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("partitions %v came back to A with nothing waiting, yet their new records %v were not handled within %s: still paused for A's old %s retry", back, want, wait, hold)
}

func waitFor(t *testing.T, d time.Duration, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !ok(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not within %s: %s", d, what)
		}
	}
}

// In batches, a keyless record that keeps failing holds its own partition
// only. Records without a key are all of aggregate "" to the Consumer,
// which holds the later ones of an aggregate behind the one being retried:
// a batch mixing partitions (one poll's records, Concurrency 1) made the
// keyless records of the other partitions wait for the failing one, and
// held their partitions for its delay.
func TestBatchKeylessRetryHoldsOnlyItsPartition(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for p := range int32(4) {
		for i := range 5 {
			id := fmt.Sprintf("p%d-%03d", p, i)
			recs = append(recs, &kgo.Record{Partition: p, Value: []byte(id), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(id)}}})
		}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	var waited atomic.Int64
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
		if m.ID == "p0-000" {
			return errors.New("dependency down")
		}
		return nil
	}}
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{Logger: testenv.Logger(t),
		Backoff: idem.Backoff{Base: 50 * time.Millisecond, Max: 50 * time.Millisecond},
		Hooks: []idem.Hook{idem.HookVerdict(verdictFunc(func(ev *idem.VerdictEvent) {
			if !strings.HasPrefix(ev.MessageID, "p0-") && errors.Is(ev.Verdict.Err, idem.ErrWaitsForAggregate) {
				waited.Add(1)
			}
		}))}})
	if err != nil {
		t.Fatal(err)
	}
	b.StartBatched(t, c, 100)
	e.WaitMarkers(3 * 5)
	if n := waited.Load(); n > 0 {
		t.Fatalf("%d verdicts of records of partitions 1–3 waited for p0-000 (keyless, so of one aggregate to the Consumer): a batch mixed partitions", n)
	}
}

// Under GapWait the event that fills a gap can only come later in the
// gapped record's own partition (a key has one partition), behind the
// record that is held for the retry: a partition holding a2 before a1
// (a producer's retry, a relay that republished) waited out the whole
// WaitFor, a2 was dead-lettered, and with it every later event of the
// aggregate. The record filling the gap is decided while the gapped one
// waits, so both apply at once, in sequence order; the partition's other
// records stay behind the retry, in order.
func TestGapFilledFromLaterInThePartition(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 3} {
		t.Run(fmt.Sprintf("batch-%d", batch), func(t *testing.T) {
			t.Parallel()
			b, e := newBroker(t).(*broker), adaptertest.NewEnv(t)
			cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			rec := func(key, id string, seq int) *kgo.Record {
				return &kgo.Record{Partition: 0, Key: []byte(key), Value: []byte(id), Headers: []kgo.RecordHeader{
					{Key: kafka.HeaderID, Value: []byte(id)}, {Key: kafka.HeaderSeq, Value: []byte(strconv.Itoa(seq))}}}
			}
			// One batch (Batch 3) of a1 b1 a3, then b2 a2 a4 in another: a3
			// is behind a gap its own batch cannot fill.
			recs := []*kgo.Record{rec("a", "a1", 1), rec("b", "b1", 1), rec("a", "a3", 3)}
			if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
				t.Fatal(err)
			}
			recs = []*kgo.Record{rec("b", "b2", 2), rec("a", "a2", 2), rec("a", "a4", 4)}
			if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var applied []string
			h := &idem.Handler[*sql.Tx]{Name: "balances", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Minute},
				Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
					mu.Lock()
					defer mu.Unlock()
					applied = append(applied, m.ID)
					return nil
				}}
			c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{Logger: testenv.Logger(t),
				Backoff: idem.Backoff{Base: 50 * time.Millisecond, Max: 100 * time.Millisecond}})
			if err != nil {
				t.Fatal(err)
			}
			b.StartBatched(t, c, batch)
			start := time.Now()
			for {
				var n int
				if err := e.DB.QueryRow(`SELECT count(*) FROM idem_processed WHERE handler = 'balances'`).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n == 6 {
					break
				}
				if time.Since(start) > 10*time.Second {
					mu.Lock()
					defer mu.Unlock()
					t.Fatalf("after 10 s %d of 6 applied (%v): a3 waits for a2, which is behind it in its partition (WaitFor is a minute)", n, applied)
				}
				time.Sleep(20 * time.Millisecond)
			}
			mu.Lock()
			defer mu.Unlock()
			var a, bs []string
			for _, id := range applied {
				if id[0] == 'a' {
					a = append(a, id)
				} else {
					bs = append(bs, id)
				}
			}
			if !slices.Equal(a, []string{"a1", "a2", "a3", "a4"}) || !slices.Equal(bs, []string{"b1", "b2"}) {
				t.Fatalf("applied %v; want each aggregate in sequence order", applied)
			}
			if dls, err := e.Drv.DeadLetterList(context.Background(), nil); err != nil || len(dls) != 0 {
				t.Fatalf("dead letters %v, %v; want none", dls, err)
			}
		})
	}
}
