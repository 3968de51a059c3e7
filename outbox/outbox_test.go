package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// TestAddIsTransactional: a row exists if and only if its transaction
// committed; an invalid message adds nothing.
func TestAddIsTransactional(t *testing.T) {
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := open(t)
			ctx := context.Background()
			if _, err := p.credit(ctx, "credits.ledger", "acct-1", 5, true); !errors.Is(err, errRollback) {
				t.Fatalf("rolled-back credit: %v", err)
			}
			if s := outboxStats(t, p); s.Pending != 0 {
				t.Fatalf("%d rows pending after a rollback, want 0", s.Pending)
			}
			m, err := p.credit(ctx, "credits.ledger", "acct-1", 5, false)
			if err != nil {
				t.Fatal(err)
			}
			// The rolled-back transaction's sequence was not used.
			if m.ID != "14:credits.ledger-acct-1-1" || m.Seq != 1 {
				t.Fatalf("message %q seq %d, want 14:credits.ledger-acct-1-1 seq 1", m.ID, m.Seq)
			}
			if s := outboxStats(t, p); s.Pending != 1 || s.OldestPending.IsZero() {
				t.Fatalf("stats %+v, want 1 pending with its time", s)
			}
			// The stored row carries the same ID and sequence.
			rs := p.drv.(driver.OutboxRelayStore)
			rows, _, err := rs.OutboxClaim(ctx, "check", 10, 0, time.Second)
			if err != nil || len(rows) != 1 || rows[0].MessageID != m.ID || rows[0].Seq != 1 || rows[0].AggregateID != "acct-1" {
				t.Fatalf("claimed %+v, %v; want %s seq 1", rows, err, m.ID)
			}
			if err := rs.OutboxRelease(ctx, "check"); err != nil {
				t.Fatal(err)
			}
			if m2, err := p.credit(ctx, "credits.ledger", "acct-1", 5, false); err != nil || m2.ID != "14:credits.ledger-acct-1-2" {
				t.Fatalf("second credit: %v, %v", m2, err)
			}
			if _, err := p.credit(ctx, strings.Repeat("s", 200), strings.Repeat("a", 40), 1, false); !errors.Is(err, idem.ErrInvalidMessage) {
				t.Fatalf("credit with a 240-byte stream and aggregate: %v, want ErrInvalidMessage", err)
			}
			for _, bad := range []*idem.Message{
				{ID: "", Stream: "s"},
				{ID: "x", Stream: ""},
				{ID: "bad\x00id", Stream: "s"},
			} {
				err := p.add(ctx, &idem.Message{ID: "fine", Stream: "s"}, bad)
				if !errors.Is(err, idem.ErrInvalidMessage) {
					t.Errorf("Add(%q, stream %q) = %v, want ErrInvalidMessage", bad.ID, bad.Stream, err)
				}
			}
			if s := outboxStats(t, p); s.Pending != 2 {
				t.Fatalf("%d rows pending after refused adds, want 2", s.Pending)
			}
		})
	}
}

// TestAddManyInOneCall: one Add of 10,000 messages (more than a
// statement's 65,535 parameters would hold as a VALUES list on Postgres)
// stores every one, in the order given, headers and payloads intact.
func TestAddManyInOneCall(t *testing.T) {
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := open(t)
			ctx := context.Background()
			const n = 10_000
			msgs := make([]*idem.Message, n)
			for i := range msgs {
				agg := fmt.Sprintf("acct-%d", i%10)
				msgs[i] = &idem.Message{ID: fmt.Sprintf("m-%05d", i), Stream: "credits.ledger", AggregateID: agg, Seq: int64(i/10 + 1), Payload: []byte(strconv.Itoa(i))}
				if i%3 == 0 {
					msgs[i].Headers = map[string]string{"n": strconv.Itoa(i)}
				}
			}
			if err := p.add(ctx, msgs...); err != nil {
				t.Fatal(err)
			}
			rs := p.drv.(driver.OutboxRelayStore)
			rows, _, err := rs.OutboxClaim(ctx, "check", 2*n, 0, time.Minute)
			if err != nil || len(rows) != n {
				t.Fatalf("claimed %d rows, %v; want %d", len(rows), err, n)
			}
			for i, r := range rows {
				want := fmt.Sprintf("m-%05d", i)
				wantHeaders := ""
				if i%3 == 0 {
					wantHeaders = fmt.Sprintf(`{"n":"%d"}`, i)
				}
				if r.MessageID != want || string(r.Payload) != strconv.Itoa(i) || string(r.Headers) != wantHeaders || r.Seq != int64(i/10+1) {
					t.Fatalf("row %d: %s payload %q headers %q seq %d; want %s payload %d headers %q seq %d",
						i, r.MessageID, r.Payload, r.Headers, r.Seq, want, i, wantHeaders, i/10+1)
				}
			}
		})
	}
}

// TestRelaysKeepOrderAndNeverOverlap: four relays drain 1,500 rows over 30
// aggregates into one JetStream stream. No aggregate is ever being
// published by two relays at once, each aggregate's events are in the
// stream exactly once each, in sequence order, and the work spread over
// the relays.
func TestRelaysKeepOrderAndNeverOverlap(t *testing.T) {
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			const aggregates, perAggregate, relays = 30, 50, 4
			p := open(t)
			b := newNATSBroker(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()

			pub := newCountingPublisher(b.publisher(t))
			perRelay := make([]*countingPublisher, relays)
			var wg sync.WaitGroup
			for i := range relays {
				perRelay[i] = newCountingPublisher(pub)
				r, err := outbox.NewRelay(p.drv, perRelay[i], &outbox.RelayConfig{Owner: fmt.Sprintf("relay-%d", i), BatchSize: 40,
					PollInterval: 10 * time.Millisecond, Concurrency: 4})
				if err != nil {
					t.Fatal(err)
				}
				wg.Add(1)
				go func() { defer wg.Done(); _ = r.Run(ctx) }()
			}
			// Write while the relays run, aggregates interleaved.
			for i := range aggregates * perAggregate {
				if _, err := p.credit(ctx, b.stream(), fmt.Sprintf("acct-%02d", i%aggregates), 1, false); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, "the outbox to drain", time.Minute, func() bool { return pub.overlaps.Load() > 0 || outboxStats(t, p).Pending == 0 })
			cancel()
			wg.Wait()

			if n := pub.overlaps.Load(); n != 0 {
				t.Fatalf("%d publishes of an aggregate overlapped another relay's", n)
			}
			msgs := b.messages(t)
			if len(msgs) != aggregates*perAggregate {
				t.Fatalf("%d messages in the stream, want %d", len(msgs), aggregates*perAggregate)
			}
			last := map[string]int64{}
			for _, m := range msgs {
				if m.Seq != last[m.AggregateID]+1 {
					t.Fatalf("aggregate %s: seq %d after %d", m.AggregateID, m.Seq, last[m.AggregateID])
				}
				last[m.AggregateID] = m.Seq
			}
			busy := 0
			for i, rp := range perRelay {
				t.Logf("relay-%d published %d rows", i, rp.acked.Load())
				if rp.acked.Load() > 0 {
					busy++
				}
			}
			if busy < 2 {
				t.Fatalf("only %d of %d relays published anything", busy, relays)
			}
		})
	}
}

// TestRelayRetriesBrokerFailures: a row for a subject no stream covers
// fails (a real broker error), is recorded, holds its aggregate's later
// row back, and goes out in order once the broker accepts it; nothing is
// marked published that the broker did not take.
func TestRelayRetriesBrokerFailures(t *testing.T) {
	p := sqliteProducer(t)
	b := newNATSBroker(t)
	ctx := context.Background()
	for seq := int64(1); seq <= 2; seq++ {
		m := &idem.Message{ID: fmt.Sprintf("late-%d", seq), Stream: "late.acct", AggregateID: "acct-9", Seq: seq, Payload: []byte("1")}
		if err := p.add(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	// A failed key is held for 0.5–1 s.
	r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r", Backoff: idem.Backoff{Base: time.Second, Max: time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.RunOnce(ctx)
	if err == nil || res.Published != 0 || res.Failed != 2 {
		t.Fatalf("cycle against a missing stream: %+v, %v; want 2 failed and an error", res, err)
	}
	s := outboxStats(t, p)
	if s.Pending != 2 || s.Failing != 1 || !strings.Contains(s.LastError, "late-1") {
		t.Fatalf("stats %+v, want 2 pending, 1 failing with late-1's error", s)
	}
	if _, err := b.js.CreateStream(ctx, natsStreamConfig("LATE", "late.>")); err != nil {
		t.Fatal(err)
	}
	// The key waits out its backoff, then goes out.
	if res, err := r.RunOnce(ctx); err != nil || res.Claimed != 0 {
		t.Fatalf("cycle right after the failure: %+v, %v; want the key held", res, err)
	}
	waitFor(t, "the held key's rows published", 5*time.Second, func() bool {
		res, err := r.RunOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return res.Published == 2
	})
	if s := outboxStats(t, p); s.Pending != 0 || s.Published != 2 {
		t.Fatalf("stats %+v, want 2 published", s)
	}
}

// TestFailingKeyDoesNotHoldUpOthers: a key whose rows the broker refuses
// fills a whole claim (BatchSize rows of it, the oldest pending); after it
// fails, it waits out its backoff and the next cycle publishes the other
// keys instead of claiming the same rows again.
func TestFailingKeyDoesNotHoldUpOthers(t *testing.T) {
	b := newNATSBroker(t)
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			p := open(t)
			ctx := context.Background()
			for seq := int64(1); seq <= 5; seq++ { // no stream takes nostream.x
				if err := p.add(ctx, &idem.Message{ID: fmt.Sprintf("bad-%d", seq), Stream: "nostream.x", AggregateID: "acct-bad", Seq: seq, Payload: []byte("1")}); err != nil {
					t.Fatal(err)
				}
			}
			if err := p.add(ctx, &idem.Message{ID: "good-1", Stream: b.stream(), AggregateID: "acct-good", Seq: 1, Payload: []byte("1")}); err != nil {
				t.Fatal(err)
			}
			// A failed key is held for 0.5–1 s.
			r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r", BatchSize: 5, Backoff: idem.Backoff{Base: time.Second, Max: time.Second}})
			if err != nil {
				t.Fatal(err)
			}
			if res, err := r.RunOnce(ctx); err == nil || res.Claimed != 5 || res.Failed != 5 {
				t.Fatalf("first cycle: %+v, %v; want the failing key's 5 rows claimed and failed", res, err)
			}
			if res, err := r.RunOnce(ctx); err != nil || res.Claimed != 1 || res.Published != 1 {
				t.Fatalf("second cycle: %+v, %v; want the other key's row published", res, err)
			}
			if s := outboxStats(t, p); s.Pending != 5 || s.Published != 1 || s.Failing != 1 {
				t.Fatalf("stats %+v, want the failing key's 5 rows pending and the other published", s)
			}
		})
	}
}

// TestRefusedKeyDoesNotDelayNewRows: after a cycle whose only key the
// broker refused, a running relay does not back off as a whole: another
// key's new row goes out at once (woken by the commit on Postgres, at the
// next poll on SQLite), long before a relay-wide backoff of up to 20 s
// would have ended.
func TestRefusedKeyDoesNotDelayNewRows(t *testing.T) {
	b := newNATSBroker(t)
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			p := open(t)
			ctx := context.Background()
			if err := p.add(ctx, &idem.Message{ID: "bad-1", Stream: "nostream.x", AggregateID: "acct-bad", Seq: 1, Payload: []byte("1")}); err != nil {
				t.Fatal(err)
			}
			r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r", PollInterval: 100 * time.Millisecond,
				Backoff: idem.Backoff{Base: 20 * time.Second, Max: 20 * time.Second}})
			if err != nil {
				t.Fatal(err)
			}
			rctx, stop := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); _ = r.Run(rctx) }()
			t.Cleanup(func() { stop(); <-done })
			waitFor(t, "the refused key's failure", 5*time.Second, func() bool { return outboxStats(t, p).Failing == 1 })
			if err := p.add(ctx, &idem.Message{ID: "good-1", Stream: b.stream(), AggregateID: "acct-good", Seq: 1, Payload: []byte("1")}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "the other key's new row published", 2*time.Second, func() bool { return outboxStats(t, p).Published == 1 })
		})
	}
}

// markFailingStore is a real relay store whose marks fail, as when the
// database refuses writes but still answers reads.
type markFailingStore struct {
	driver.OutboxRelayStore
	claims atomic.Int64
}

func (s *markFailingStore) OutboxClaim(ctx context.Context, owner string, limit, maxBytes int, ttl time.Duration) ([]driver.OutboxRow, bool, error) {
	s.claims.Add(1)
	return s.OutboxRelayStore.OutboxClaim(ctx, owner, limit, maxBytes, ttl)
}

func (s *markFailingStore) OutboxMarkPublished(context.Context, []int64) error {
	return errors.New("mark: disk I/O error")
}

// TestStoreFailureBacksOffTheRelay: a cycle the store failed (here the
// marks) backs off the whole relay, rather than publishing the same rows
// again at every poll.
func TestStoreFailureBacksOffTheRelay(t *testing.T) {
	p := sqliteProducer(t)
	b := newNATSBroker(t)
	ctx := context.Background()
	if err := p.add(ctx, &idem.Message{ID: "m-1", Stream: b.stream(), AggregateID: "acct-1", Seq: 1, Payload: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	st := &markFailingStore{OutboxRelayStore: p.drv.(driver.OutboxRelayStore)}
	r, err := outbox.NewRelay(st, b.publisher(t), &outbox.RelayConfig{Owner: "r", PollInterval: 20 * time.Millisecond,
		Backoff: idem.Backoff{Base: 5 * time.Second, Max: 30 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_ = r.Run(rctx)
	if n := st.claims.Load(); n > 5 {
		t.Fatalf("%d cycles in 1 s with a 5 s relay backoff: a failing mark did not back the relay off", n)
	}
}

// holdFailingStore is a real relay store that cannot record a failed
// publish, as when the database went away during the cycle.
type holdFailingStore struct {
	driver.OutboxRelayStore
}

func (holdFailingStore) OutboxFailed(context.Context, string, int64, string, time.Duration) error {
	return errors.New("record failure: connection refused")
}

// TestUnrecordedFailuresLogOneLine: when the store cannot record the
// failures of a cycle's refused keys, the relay says so in one line, not
// one per key. Before, a claim of 40 refused keys wrote 40 lines.
func TestUnrecordedFailuresLogOneLine(t *testing.T) {
	p := sqliteProducer(t)
	ctx := context.Background()
	const keys = 40
	if err := p.fill(ctx, "credits.ledger", keys, keys); err != nil {
		t.Fatal(err)
	}
	logs := &testenv.Buffer{}
	r, err := outbox.NewRelay(holdFailingStore{p.drv.(driver.OutboxRelayStore)}, hostileErrPublisher{}, &outbox.RelayConfig{
		Logger: slog.New(slog.NewTextHandler(logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.RunOnce(ctx); err == nil {
		t.Fatal("a cycle of refused keys returned no error")
	}
	if n := strings.Count(logs.String(), "recording a failed publish failed"); n != 1 {
		t.Errorf("%d lines for %d unrecorded failures of one cycle, want 1", n, keys)
	}
}

// TestLateFailureKeepsAnotherRelaysClaim: relay A's claim runs out while
// it publishes and B claims the key; A's failure, recorded late, counts the
// attempt but does not turn B's live claim into a short hold, after which
// a third relay would publish the key while B still does.
func TestLateFailureKeepsAnotherRelaysClaim(t *testing.T) {
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := open(t)
			ctx := context.Background()
			if err := p.add(ctx, &idem.Message{ID: "m-1", Stream: "s", AggregateID: "acct-1", Seq: 1, Payload: []byte("1")}); err != nil {
				t.Fatal(err)
			}
			rs := p.drv.(driver.OutboxRelayStore)
			a, _, err := rs.OutboxClaim(ctx, "A", 10, 0, 50*time.Millisecond)
			if err != nil || len(a) != 1 {
				t.Fatalf("A's claim: %+v, %v", a, err)
			}
			time.Sleep(100 * time.Millisecond) // A's claim runs out mid-publish
			if b, _, err := rs.OutboxClaim(ctx, "B", 10, 0, time.Minute); err != nil || len(b) != 1 {
				t.Fatalf("B's claim: %+v, %v", b, err)
			}
			if err := rs.OutboxFailed(ctx, "A", a[0].ID, "boom", time.Millisecond); err != nil {
				t.Fatal(err)
			}
			time.Sleep(20 * time.Millisecond) // a hold would have ended
			if c, _, err := rs.OutboxClaim(ctx, "C", 10, 0, time.Minute); err != nil || len(c) != 0 {
				t.Fatalf("C claimed %d rows, %v, while B's claim is live: two relays would publish the key", len(c), err)
			}
			if s := outboxStats(t, p); s.Failing != 1 {
				t.Fatalf("stats %+v: A's failed attempt was not counted", s)
			}
			// A's own claim, by contrast, becomes the hold.
			if err := rs.OutboxRelease(ctx, "B"); err != nil {
				t.Fatal(err)
			}
			a, _, err = rs.OutboxClaim(ctx, "A", 10, 0, time.Minute)
			if err != nil || len(a) != 1 {
				t.Fatalf("A's second claim: %+v, %v", a, err)
			}
			if err := rs.OutboxFailed(ctx, "A", a[0].ID, "boom", time.Minute); err != nil {
				t.Fatal(err)
			}
			if c, _, err := rs.OutboxClaim(ctx, "C", 10, 0, time.Minute); err != nil || len(c) != 0 {
				t.Fatalf("C claimed %d rows, %v, of a key held for a minute", len(c), err)
			}
		})
	}
}

// stalledPublisher holds every publish until its context ends, then hands
// it to the real publisher with that context: a relay stopped mid-publish.
type stalledPublisher struct {
	next    outbox.Publisher
	started chan struct{}
}

func (p *stalledPublisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	close(p.started)
	<-ctx.Done()
	return p.next.Publish(ctx, msgs)
}

// TestStoppedRelayLeavesNoFailure: a relay stopped in the middle of a
// publish, its context cancelled or past its deadline, records no failed
// attempt and leaves no hold on the key, so the next relay publishes it at
// once. Before, only a cancellation counted as a stop: the deadline failed
// the key, counting an attempt and keeping every relay off it for its
// backoff.
func TestStoppedRelayLeavesNoFailure(t *testing.T) {
	for _, c := range []struct {
		name string
		stop func(ctx context.Context, started <-chan struct{}) (context.Context, context.CancelFunc)
	}{
		{"cancelled", func(ctx context.Context, started <-chan struct{}) (context.Context, context.CancelFunc) {
			rctx, stop := context.WithCancel(ctx)
			go func() { <-started; stop() }()
			return rctx, stop
		}},
		{"deadline", func(ctx context.Context, _ <-chan struct{}) (context.Context, context.CancelFunc) {
			return context.WithTimeout(ctx, 300*time.Millisecond)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := sqliteProducer(t)
			b := newNATSBroker(t)
			ctx := context.Background()
			if err := p.add(ctx, &idem.Message{ID: "m-1", Stream: b.stream(), AggregateID: "acct-1", Seq: 1, Payload: []byte("1")}); err != nil {
				t.Fatal(err)
			}
			stalled := &stalledPublisher{next: b.publisher(t), started: make(chan struct{})}
			r1, err := outbox.NewRelay(p.drv, stalled, &outbox.RelayConfig{Owner: "r1", Backoff: idem.Backoff{Base: time.Minute, Max: time.Minute}})
			if err != nil {
				t.Fatal(err)
			}
			rctx, stop := c.stop(ctx, stalled.started)
			defer stop()
			if res, err := r1.RunOnce(rctx); err == nil || res.Published != 0 {
				t.Fatalf("stopped cycle: %+v, %v; want nothing published and the stop's error", res, err)
			}
			if s := outboxStats(t, p); s.Failing != 0 || s.Pending != 1 {
				t.Fatalf("stats %+v after a stop, want 1 pending and no failing row", s)
			}
			r2, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r2"})
			if err != nil {
				t.Fatal(err)
			}
			if res, err := r2.RunOnce(ctx); err != nil || res.Published != 1 {
				t.Fatalf("next relay: %+v, %v; want the row published at once", res, err)
			}
		})
	}
}

// TestRelayWakesOnCommit: on Postgres, with SetOutboxNotify on, a
// committed row wakes an idle relay through LISTEN/NOTIFY, long before its
// poll interval.
func TestRelayWakesOnCommit(t *testing.T) {
	p := postgresProducer(t)
	if err := p.drv.(*postgres.Driver).SetOutboxNotify(context.Background(), true); err != nil {
		t.Fatal(err)
	}
	b := newNATSBroker(t)
	pub := newCountingPublisher(b.publisher(t))
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wait := runBackground(ctx, r.Run)
	defer wait()
	time.Sleep(300 * time.Millisecond) // the relay's first cycle finds nothing and sleeps
	start := time.Now()
	if _, err := p.credit(ctx, b.stream(), "acct-1", 1, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the relay to publish", 10*time.Second, func() bool { return pub.acked.Load() == 1 })
	t.Logf("published %s after commit (poll interval 1h)", time.Since(start).Round(time.Millisecond))
	cancel()
}

// failOnce refuses its first publish, then passes on.
type failOnce struct {
	next  outbox.Publisher
	calls atomic.Int64
}

func (p *failOnce) Publish(ctx context.Context, msgs []*idem.Message) error {
	if p.calls.Add(1) == 1 {
		return errors.New("broker blip")
	}
	return p.next.Publish(ctx, msgs)
}

// A key held after a failed publish is retried after its backoff, not
// after PollInterval: no commit wakes the relay for it.
func TestRelayRetriesHeldKeyAfterBackoff(t *testing.T) {
	p := postgresProducer(t)
	if err := p.drv.(*postgres.Driver).SetOutboxNotify(context.Background(), true); err != nil {
		t.Fatal(err)
	}
	b := newNATSBroker(t)
	pub := newCountingPublisher(&failOnce{next: b.publisher(t)})
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{PollInterval: time.Hour, Backoff: idem.Backoff{Base: 100 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wait := runBackground(ctx, r.Run)
	defer func() { cancel(); wait() }()
	time.Sleep(300 * time.Millisecond) // the relay's first cycle finds nothing and sleeps
	if _, err := p.credit(ctx, b.stream(), "acct-1", 1, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the held key to be published after its 100-200 ms backoff (poll interval 1h)", 10*time.Second, func() bool { return pub.acked.Load() == 1 })
}

// A row committed while the relay's LISTEN connection is being re-made is
// published once it is back, not after PollInterval.
func TestRelayWakesAfterListenerReconnect(t *testing.T) {
	p := postgresProducer(t)
	if err := p.drv.(*postgres.Driver).SetOutboxNotify(context.Background(), true); err != nil {
		t.Fatal(err)
	}
	b := newNATSBroker(t)
	pub := newCountingPublisher(b.publisher(t))
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wait := runBackground(ctx, r.Run)
	defer func() { cancel(); wait() }()
	time.Sleep(300 * time.Millisecond)
	admin := testenv.PostgresPool(t, 2)
	var n int
	if err := admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND query LIKE 'LISTEN %' AND strpos(query, $1) > 0`, p.schema+".").Scan(&n); err != nil || n != 1 {
		t.Fatalf("terminated %d listeners, %v; want this relay's one", n, err)
	}
	if _, err := p.credit(ctx, b.stream(), "acct-1", 1, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a row committed during the listener's reconnect to be published (poll interval 1h)", 10*time.Second, func() bool { return pub.acked.Load() == 1 })
}

// A row whose headers do not decode (written other than by Add) fails its
// key as a refused publish does: recorded and held, while the other keys
// are published.
func TestRelayUnreadableRowIsHeld(t *testing.T) {
	p := postgresProducer(t)
	b := newNATSBroker(t)
	pub := newCountingPublisher(b.publisher(t))
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Backoff: idem.Backoff{Base: time.Minute, Max: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	admin := testenv.PostgresPool(t, 2)
	if _, err := admin.Exec(ctx, `INSERT INTO `+p.schema+`.idem_outbox (destination, message_id, ordering_key, headers, payload, payload_hash)
VALUES ($1, 'foreign-1', 'foreign', '{"n": 1}', 'x', 'h')`, b.stream()); err != nil {
		t.Fatal(err)
	}
	if _, err := p.credit(ctx, b.stream(), "acct-1", 1, false); err != nil {
		t.Fatal(err)
	}
	res, err := r.RunOnce(ctx)
	if res.Published != 1 || res.Failed != 1 || err == nil || !strings.Contains(err.Error(), "headers") {
		t.Fatalf("cycle %+v, %v; want acct-1 published and the foreign row failed on its headers", res, err)
	}
	st, err := r.Stats(ctx)
	if err != nil || st.Failing != 1 || !strings.Contains(st.LastError, "headers") {
		t.Fatalf("stats %+v, %v; want the foreign row failing with its reason", st, err)
	}
	if res, err := r.RunOnce(ctx); res.Claimed != 0 || err != nil {
		t.Fatalf("next cycle %+v, %v; want the held key left alone", res, err)
	}
}

// TestRelayCrashEndToEnd: outbox → broker → idem consumer, with the relay
// stopped for good at each point of a cycle and a new relay started. The
// consumer's balances equal those of the intended credits in every case;
// a crash after publishing republishes (more acknowledged sends than
// events), which the consumer absorbs.
func TestRelayCrashEndToEnd(t *testing.T) {
	brokers := map[string]func(testing.TB) broker{
		"jetstream": func(t testing.TB) broker { return newNATSBroker(t) },
		"kafka":     func(t testing.TB) broker { return newKafkaBroker(t) },
		"rabbitmq":  func(t testing.TB) broker { return newRabbitBroker(t) },
	}
	for store, open := range producers() {
		for bname, newBroker := range brokers {
			for _, point := range []string{outbox.FaultBeforePublish, outbox.FaultAfterPublish, outbox.FaultAfterMark} {
				t.Run(store+"/"+bname+"/"+point, func(t *testing.T) {
					t.Parallel()
					relayCrash(t, open(t), newBroker(t), point)
				})
			}
		}
	}
}

func relayCrash(t *testing.T, p *producer, b broker, point string) {
	const accounts, events = 6, 120
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The intended credits, and the balances they must produce.
	want := map[string][2]int64{}
	for i := range events {
		acct := fmt.Sprintf("acct-%d", i%accounts)
		amount := int64(i%7 + 1)
		if _, err := p.credit(ctx, b.stream(), acct, amount, false); err != nil {
			t.Fatal(err)
		}
		w := want[acct]
		want[acct] = [2]int64{w[0] + amount, w[1] + 1}
	}

	pub := newCountingPublisher(b.publisher(t))
	var (
		cycles                int
		ackedBefore, unmarked int64 // acknowledged sends before the cycle; those of the crashed cycle
	)
	crashed := make(chan struct{})
	first, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Owner: "first", BatchSize: 30, ClaimTTL: time.Second, PollInterval: 10 * time.Millisecond,
		FaultHook: func(at string) {
			if at == outbox.FaultBeforePublish {
				cycles++
				ackedBefore = pub.acked.Load()
			}
			// From the second cycle on; after publishing, one that
			// published something (on a loaded machine a cycle's keys
			// can all come too late in its claim).
			if at == point && cycles >= 2 && (at != outbox.FaultAfterPublish || pub.acked.Load() > ackedBefore) {
				unmarked = pub.acked.Load() - ackedBefore
				close(crashed)
				runtime.Goexit() // the relay stops here: no further code of the cycle runs
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = first.Run(ctx) }()
	select {
	case <-crashed:
	case <-ctx.Done():
		t.Fatal("the relay never reached", point)
	}
	before := outboxStats(t, p)

	second, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Owner: "second", BatchSize: 30, ClaimTTL: time.Second, PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stopRelay := context.WithCancel(ctx)
	waitRelay := runBackground(rctx, second.Run)
	v := newView(t)
	cctx, stopConsumer := context.WithCancel(ctx)
	waitConsumer := b.consume(t, cctx, v)
	waitFor(t, "the outbox to drain", time.Minute, func() bool { return outboxStats(t, p).Pending == 0 })
	waitFor(t, "every event applied", time.Minute, func() bool { return v.applied.Load() >= events })
	stopRelay()
	waitRelay()
	time.Sleep(200 * time.Millisecond) // let any straggling redelivery arrive
	stopConsumer()
	waitConsumer()

	got := v.balances(t)
	if len(got) != len(want) {
		t.Fatalf("%d accounts, want %d", len(got), len(want))
	}
	for acct, w := range want {
		if got[acct] != w {
			t.Errorf("%s: balance, last seq = %v, want %v", acct, got[acct], w)
		}
	}
	if n := v.applied.Load(); n != events {
		t.Errorf("%d applied, want %d", n, events)
	}
	sent := pub.acked.Load()
	t.Logf("crash at %s: %d pending at the crash; %d sends acknowledged for %d events; consumer saw %d duplicates",
		point, before.Pending, sent, events, v.duplicates.Load())
	switch point {
	case outbox.FaultAfterPublish:
		if sent < events+unmarked {
			t.Errorf("%d sends for %d events: the %d rows published but not marked were not all republished", sent, events, unmarked)
		}
	default:
		if sent != events {
			t.Errorf("%d sends for %d events, want exactly one each", sent, events)
		}
	}
}

// TestPrunerDeletesPublishedRows: idem.Pruner deletes published outbox rows
// past the retention in bounded batches, and never a pending row however
// old.
func TestPrunerDeletesPublishedRows(t *testing.T) {
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := open(t)
			b := newNATSBroker(t)
			ctx := context.Background()
			for i := range 25 {
				if _, err := p.credit(ctx, b.stream(), fmt.Sprintf("acct-%d", i%5), 1, false); err != nil {
					t.Fatal(err)
				}
			}
			r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r"})
			if err != nil {
				t.Fatal(err)
			}
			if res, err := r.RunOnce(ctx); err != nil || res.Published != 25 {
				t.Fatalf("relay: %+v, %v", res, err)
			}
			for i := range 3 { // pending: no stream takes them
				if err := p.add(ctx, &idem.Message{ID: fmt.Sprintf("stuck-%d", i), Stream: "nowhere", Payload: []byte("1")}); err != nil {
					t.Fatal(err)
				}
			}
			pr, err := idem.NewPruner(p.drv, &idem.RetentionConfig{Retention: time.Hour, BatchSize: 10,
				Now: func() time.Time { return time.Now().Add(2 * time.Hour) }})
			if err != nil {
				t.Fatal(err)
			}
			st, err := pr.Prune(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if st.OutboxDeleted != 25 {
				t.Fatalf("pruned %d outbox rows, want 25", st.OutboxDeleted)
			}
			if s := outboxStats(t, p); s.Pending != 3 || s.Published != 0 {
				t.Fatalf("after pruning: %+v, want the 3 pending rows only", s)
			}
		})
	}
}

// An action's actor and reason are stored as given; text a store would
// refuse or mangle (not UTF-8, a NUL, more than MaxActionText bytes) is
// ErrInvalidText on every store, before anything changes, not a driver's
// SQL error.
func TestAdminRefusesTextNoStoreKeeps(t *testing.T) {
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			p := open(t)
			ctx := context.Background()
			if err := p.fill(ctx, "credits.ledger", 1, 1); err != nil {
				t.Fatal(err)
			}
			adm, err := outbox.NewAdmin(p.drv, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			page, err := adm.List(ctx, driver.OutboxFilter{Limit: 10})
			if err != nil || len(page.Rows) != 1 {
				t.Fatalf("list: %d rows, %v", len(page.Rows), err)
			}
			ids := []int64{page.Rows[0].ID}
			for _, c := range []struct{ actor, reason string }{
				{"ops\xff", "broken subject"},
				{"ops", "broken\x00subject"},
				{"ops", strings.Repeat("r", outbox.MaxActionText+1)},
				{strings.Repeat("a", outbox.MaxActionText+1), ""},
			} {
				if _, err := adm.Park(ctx, ids, c.actor, c.reason); !errors.Is(err, outbox.ErrInvalidText) {
					t.Errorf("Park by %.20q for %.20q: %v, want ErrInvalidText", c.actor, c.reason, err)
				}
				if _, err := adm.Discard(ctx, ids, c.actor, c.reason); !errors.Is(err, outbox.ErrInvalidText) {
					t.Errorf("Discard by %.20q for %.20q: %v, want ErrInvalidText", c.actor, c.reason, err)
				}
			}
			if st := outboxStats(t, p); st.Pending != 1 || st.Parked != 0 {
				t.Errorf("after refused actions: %d pending, %d parked; want the row pending as it was", st.Pending, st.Parked)
			}
		})
	}
}

// Add keeps no Message.Time (the row's own time is published), so a time
// no header could carry does not refuse the row, as it refuses a message
// published directly (ValidatePublish).
func TestAddIgnoresTheTimeItDoesNotKeep(t *testing.T) {
	p := sqliteProducer(t)
	m := &idem.Message{ID: "m-1", Stream: "credits.ledger", AggregateID: "acct-1", Seq: 1, Payload: []byte("1"),
		Time: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}
	if err := m.ValidatePublish(); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("ValidatePublish of a year-10000 time: %v, want ErrInvalidMessage", err)
	}
	if err := p.add(context.Background(), m); err != nil {
		t.Fatalf("Add with a year-10000 time: %v", err)
	}
	if st := outboxStats(t, p); st.Pending != 1 {
		t.Fatalf("%d rows pending, want 1", st.Pending)
	}
}
