package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// TestGapWaitDoesNotCountAnOutage: a message waiting under GapWait for its
// aggregate's missing event is not dead-lettered because the store was
// down for longer than WaitFor. While the store was down nothing could be
// applied, the missing event included: the outage is not the message's
// failure, and the wait it cut short goes on once the store answers.
func TestGapWaitDoesNotCountAnOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, drv := testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	if _, err := db.Exec(`CREATE TABLE events (agg TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (agg, seq))`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	const wait = time.Second
	h := &idem.Handler[*sql.Tx]{Name: "ledger", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: wait},
		Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO events VALUES (?, ?)`, m.AggregateID, m.Seq)
			return err
		}}
	hook := &outageHook{}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{hook}, Logger: testenv.Logger(t),
		ProbeBackoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	ev := waitOutOutage(t, c, path, hook, "a", wait)
	if got := appliedSeqs(t, db, "a"); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("applied %v, want [1 2 3]", got)
	}
	dls, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{})
	if err != nil || len(dls) != 0 {
		t.Fatalf("dead letters: %d (%v), want none", len(dls), err)
	}

	// A wait the store's downtime did not cut short still ends: past
	// WaitFor with the store up, a/5 without a/4 is dead-lettered.
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(5), Attempt: 1}); v.Ack {
		t.Fatalf("a/5 before a/4: %+v, want a retry", v)
	}
	time.Sleep(wait + 100*time.Millisecond)
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(5), Attempt: 2}); !v.DeadLettered {
		t.Fatalf("a/5 past WaitFor with the store up: %+v, want a dead letter", v)
	}
}

// TestLeaseGapWaitDoesNotCountAnOutage is TestGapWaitDoesNotCountAnOutage
// for a LeaseConsumer: its message waiting for the missing event is not
// dead-lettered because the store was down longer than WaitFor, and is
// called once, after the missing one.
func TestLeaseGapWaitDoesNotCountAnOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "idem.db")
	_, drv := testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "w", Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	const wait = time.Second
	var (
		mu    sync.Mutex
		calls []int64
	)
	h := &idem.LeaseHandler{Name: "shipper", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: wait},
		Call: func(_ context.Context, _ *idem.Lease, m *idem.Message) error {
			mu.Lock()
			defer mu.Unlock()
			calls = append(calls, m.Seq)
			return nil
		}}
	hook := &outageHook{}
	c, err := idem.NewLeaseConsumer(lp, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{hook}, Logger: testenv.Logger(t),
		ProbeBackoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	waitOutOutage(t, c, path, hook, "o", wait)
	mu.Lock()
	got := slices.Clone(calls)
	mu.Unlock()
	if !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("called for %v, want [1 2 3]", got)
	}
	dls, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{})
	if err != nil || len(dls) != 0 {
		t.Fatalf("dead letters: %d (%v), want none", len(dls), err)
	}
}

// TestGapWaitOutlastsMaxAttempts: with MaxAttempts 2 and a WaitFor of
// 1.5 s, a message waiting for its aggregate's missing event is
// redelivered many times within the wait and stays a retry; once the
// missing event comes it applies, in order. Waiting is not failing: it
// used to be dead-lettered as exhausted at its second delivery, 50 ms
// into a wait of seconds. A real failure still exhausts at 2, and a gap
// still ends in a dead letter once WaitFor has passed.
func TestGapWaitOutlastsMaxAttempts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	if _, err := db.Exec(`CREATE TABLE events (agg TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (agg, seq))`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	const wait = 1500 * time.Millisecond
	h := &idem.Handler[*sql.Tx]{Name: "ledger", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: wait},
		Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
			if string(m.Payload) == "fail" {
				return errors.New("a dependency failed")
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO events VALUES (?, ?)`, m.AggregateID, m.Seq)
			return err
		}}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{MaxAttempts: 2, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ev := func(agg string, q int64, payload string) *idem.Message {
		return &idem.Message{ID: fmt.Sprintf("%s-%d", agg, q), AggregateID: agg, Seq: q, Payload: []byte(payload)}
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev("a", 1, "x"), Attempt: 1}); !v.Ack {
		t.Fatalf("a/1: %+v, want applied", v)
	}
	for attempt := 1; attempt <= 6; attempt++ {
		v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev("a", 3, "x"), Attempt: attempt})
		if v.Ack || v.DeadLettered {
			t.Fatalf("a/3 before a/2, delivery %d: %+v, want a retry within WaitFor", attempt, v)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev("a", 2, "x"), Attempt: 1}); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("a/2: %+v, want applied", v)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev("a", 3, "x"), Attempt: 7}); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("a/3 after a/2: %+v, want applied", v)
	}
	if got := appliedSeqs(t, db, "a"); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("applied %v, want [1 2 3]", got)
	}

	// A failing handler still exhausts MaxAttempts.
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev("b", 1, "fail"), Attempt: 2}); !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterExhausted {
		t.Fatalf("b/1 failing at attempt 2: %+v, want an exhausted dead letter", v)
	}
	// And a gap whose wait ran out is dead-lettered, whatever the count.
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev("a", 5, "x"), Attempt: 1}); v.Ack {
		t.Fatalf("a/5 before a/4: %+v, want a retry", v)
	}
	time.Sleep(wait + 100*time.Millisecond)
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev("a", 5, "x"), Attempt: 1}); !v.DeadLettered {
		t.Fatalf("a/5 past WaitFor: %+v, want a dead letter", v)
	}
}

// TestGapWaitUnrecordedSightingCountsAttempts: a gap whose first sighting
// the store cannot record (here its table is gone: not an outage, the
// store answers) has no deadline, so nothing bounds its wait: its
// deliveries count toward MaxAttempts as failures do, and it ends in a
// dead letter rather than being retried for ever.
func TestGapWaitUnrecordedSightingCountsAttempts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "ledger", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Minute},
		Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{MaxAttempts: 2, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ev := func(q int64) *idem.Message {
		return &idem.Message{ID: fmt.Sprintf("a-%d", q), AggregateID: "a", Seq: q, Payload: []byte("x")}
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(1), Attempt: 1}); !v.Ack {
		t.Fatalf("a/1: %+v, want applied", v)
	}
	if _, err := db.Exec(`DROP TABLE idem_gaps`); err != nil {
		t.Fatal(err)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(3), Attempt: 1}); v.Ack {
		t.Fatalf("a/3, first delivery: %+v, want a retry", v)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(3), Attempt: 2}); !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterExhausted {
		t.Fatalf("a/3 at MaxAttempts with no sighting recorded: %+v, want an exhausted dead letter", v)
	}
}

// waitOutOutage applies agg/1, delivers agg/3 (a gap: a retry), holds the
// SQLite file at path for twice wait (WaitFor) while agg/3's retry waits
// on it, and checks that agg/3 is still a retry once the store answers,
// that hook saw one outage, and that agg/2 then agg/3 apply. It returns
// the events' constructor.
func waitOutOutage(t *testing.T, c idem.DeliveryHandler, path string, hook *outageHook, agg string, wait time.Duration) func(int64) *idem.Message {
	t.Helper()
	ctx := context.Background()
	ev := func(q int64) *idem.Message {
		return &idem.Message{ID: fmt.Sprintf("%s-%d", agg, q), AggregateID: agg, Seq: q, Payload: []byte{byte(q)}}
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(1), Attempt: 1}); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("%s/1: %+v, want applied", agg, v)
	}
	// agg/3 overtakes agg/2: a retriable gap, first seen now.
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(3), Attempt: 1}); v.Ack || v.DeadLettered {
		t.Fatalf("%s/3 before %s/2: %+v, want a retry", agg, agg, v)
	}
	// The store goes down for twice WaitFor while agg/3's retry is due.
	release := testenv.HoldSQLite(t, path)
	done := make(chan idem.Verdict, 1)
	go func() { done <- c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(3), Attempt: 2}) }()
	time.Sleep(2 * wait)
	release()
	var v idem.Verdict
	select {
	case v = <-done:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s/3 not decided 5 s after the store answered", agg)
	}
	if hook.downs.Load() != 1 {
		t.Fatalf("%d outages reported, want 1", hook.downs.Load())
	}
	if v.DeadLettered || v.Ack {
		t.Fatalf("%s/3 right after the outage: %+v, want a retry: the outage must not use up its wait", agg, v)
	}
	// agg/2 comes within WaitFor of the store's return, and agg/3 then
	// applies.
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(2), Attempt: 1}); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("%s/2: %+v, want applied", agg, v)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: ev(3), Attempt: 3}); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("%s/3 after %s/2: %+v, want applied", agg, agg, v)
	}
	return ev
}

// appliedSeqs returns the sequences of agg in the events table, in the
// order they were applied.
func appliedSeqs(t *testing.T, db *sql.DB, agg string) []int64 {
	t.Helper()
	rows, err := db.Query(`SELECT seq FROM events WHERE agg = ? ORDER BY rowid`, agg)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []int64
	for rows.Next() {
		var q int64
		if err := rows.Scan(&q); err != nil {
			t.Fatal(err)
		}
		got = append(got, q)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return got
}
