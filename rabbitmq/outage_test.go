package rabbitmq_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/rabbitmq"
	"github.com/idemhq/idem/sqlite"
)

// While the store is down (another connection holds SQLite's exclusive
// lock past the busy timeout for 3 s), the consumer's lanes wait inside
// HandleDelivery: the queue's ready count does not move (nothing more is
// pulled past the prefetch, nothing is requeued), no delivery gets a retry
// verdict, none is dead-lettered although MaxAttempts is 2, and every
// delivery stays on attempt 1. Once the lock is released the rest flows
// and the balances equal those of the unique events.
func TestStoreDownHoldsDeliveries(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	b.concurrency = 2
	cons, path, e := balancesOnSQLite(t, 2)
	ctx := context.Background()
	var (
		applied, retries, deadLetters, maxAttempt atomic.Int64
	)
	// Half the events now; the other half once the store is locked, so
	// that messages wait in the queue during the outage however fast the
	// consumer drained the first half (it once applied all 600 before the
	// lock was taken).
	events := idemtest.Events(1200)
	msgs := adaptertest.Messages(events)
	b.Publish(t, msgs[:600], 0)
	b.Start(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		if int64(d.Attempt) > maxAttempt.Load() {
			maxAttempt.Store(int64(d.Attempt))
		}
		v := cons.HandleDelivery(ctx, d)
		switch {
		case v.DeadLettered:
			deadLetters.Add(1)
		case v.Ack:
			applied.Add(1)
		default:
			retries.Add(1)
		}
		return v
	}))
	for deadline := time.Now().Add(30 * time.Second); applied.Load() < 100; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("100 deliveries not applied after 30 s")
		}
	}
	locker, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lock, err := locker.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err = lock.ExecContext(ctx, "BEGIN EXCLUSIVE"); err == nil {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.Publish(t, msgs[600:], 0)
	time.Sleep(500 * time.Millisecond) // the lanes meet the lock and hold
	readyAt, appliedAt := b.ready(t), applied.Load()
	time.Sleep(2500 * time.Millisecond)
	readyEnd, appliedEnd := b.ready(t), applied.Load()
	if _, err := lock.ExecContext(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	lock.Close()
	t.Logf("during the outage: ready %d → %d, applied %d → %d", readyAt, readyEnd, appliedAt, appliedEnd)
	if readyEnd != readyAt || readyAt == 0 {
		t.Fatalf("the queue's ready count went %d → %d during the outage, want it unchanged (and messages left)", readyAt, readyEnd)
	}
	if appliedEnd != appliedAt {
		t.Fatalf("%d deliveries applied while the store was locked", appliedEnd-appliedAt)
	}
	e.WaitMarkers(len(events))
	e.CheckBalances(events)
	if n, d, a := retries.Load(), deadLetters.Load(), maxAttempt.Load(); n != 0 || d != 0 || a != 1 {
		t.Fatalf("%d retry verdicts, %d dead letters, highest attempt %d; want 0, 0, 1", n, d, a)
	}
}

// Graceful stops during one store outage spend no attempt. On a quorum
// queue a requeue raises x-delivery-count, which counts in the attempt
// (and in the broker's delivery-limit): three stops with MaxDeliver 3 once
// made the held deliveries' next one their last attempt (on a classic
// queue the redelivered flag made it attempt 2). Now a stop while
// the store is down returns the held and the unstarted deliveries as
// copies that keep their attempt. The store (SQLite, locked past its busy
// timeout by another connection) is down before the messages are
// published; three consumers in turn hold deliveries and are stopped.
// After each stop every message is back in the queue, none unacked. Once
// the lock is released a fourth consumer applies them all: every delivery
// of every session was attempt 1 and none the last, no retry verdict but
// the stops' ErrStoreUnavailable, no dead letter, no Duplicate, and the
// balances equal those of the intended events.
func TestStopsDuringOutageSpendNoAttempt(t *testing.T) {
	for _, qt := range []string{rabbitmq.QueueQuorum, rabbitmq.QueueClassic} {
		t.Run(qt, func(t *testing.T) {
			t.Parallel()
			stopsDuringOutage(t, qt)
		})
	}
}

func stopsDuringOutage(t *testing.T, queueType string) {
	b := newBroker(t, queueType)
	b.concurrency = 2
	b.maxDeliver = 3
	cons, path, e := balancesOnSQLite(t, 3)
	release := testenv.HoldSQLite(t, path)
	events := idemtest.Events(60)
	b.Publish(t, adaptertest.Messages(events), 0)
	var (
		entered, maxAttempt, last, held, applied, dups, deadLetters, retries atomic.Int64
	)
	wrap := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		entered.Add(1)
		if a := int64(d.Attempt); a > maxAttempt.Load() {
			maxAttempt.Store(a)
		}
		if d.LastAttempt {
			last.Add(1)
		}
		v := cons.HandleDelivery(ctx, d)
		switch {
		case v.DeadLettered:
			deadLetters.Add(1)
		case v.Outcome == idem.Duplicate:
			dups.Add(1)
		case v.Ack:
			applied.Add(1)
		case errors.Is(v.Err, idem.ErrStoreUnavailable):
			held.Add(1)
		default:
			retries.Add(1)
		}
		return v
	})
	const stops = 3
	for i := range stops {
		from := entered.Load()
		_, stop := run(t, b.config(t, wrap))
		for deadline := time.Now().Add(30 * time.Second); entered.Load() == from; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("stop %d: no delivery reached the handler after 30 s", i+1)
			}
		}
		time.Sleep(300 * time.Millisecond) // the lanes hold what they took
		if err := stop(false); !errors.Is(err, context.Canceled) {
			t.Fatalf("stop %d: Run returned %v, want context.Canceled", i+1, err)
		}
		// Every message is back in the queue (as itself or as its
		// copy): nothing lost, nothing left unacknowledged.
		for deadline := time.Now().Add(5 * time.Second); b.ready(t) != len(events); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("stop %d: %d messages ready, want %d", i+1, b.ready(t), len(events))
			}
		}
	}
	if n := applied.Load(); n != 0 {
		t.Fatalf("%d deliveries applied while the store was locked", n)
	}
	if n := held.Load(); n < stops {
		t.Fatalf("%d deliveries held at a stop, want at least one per stop (%d)", n, stops)
	}
	t.Logf("during the outage: %d deliveries held at %d stops, highest attempt %d", held.Load(), stops, maxAttempt.Load())
	release()
	b.Start(t, wrap)
	e.WaitMarkers(len(events))
	e.CheckBalances(events)
	if a, l := maxAttempt.Load(), last.Load(); a != 1 || l != 0 {
		t.Fatalf("highest attempt %d, %d last attempts; want attempt 1 throughout: the stops spent attempts", a, l)
	}
	if r, d, u := retries.Load(), deadLetters.Load(), dups.Load(); r != 0 || d != 0 || u != 0 {
		t.Fatalf("%d retry verdicts, %d dead letters, %d duplicates; want none", r, d, u)
	}
	if n := applied.Load(); n != int64(len(events)) {
		t.Fatalf("%d deliveries applied, want %d", n, len(events))
	}
}

// balancesOnSQLite returns a Consumer of the balances handler with
// maxAttempts, on a new SQLite file whose busy timeout (100 ms) makes a
// lock held by another connection an outage soon; the file's path; and
// the env that checks the balances.
func balancesOnSQLite(t *testing.T, maxAttempts int) (*idem.Consumer[*sql.Tx], string, *adaptertest.Env) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "idem.db")
	_, drv := testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 100 * time.Millisecond, Synchronous: "NORMAL"})
	e := adaptertest.OpenEnv(t, path) // the balances table, and CheckBalances
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		acct, amt, err := idemtest.DecodeCredit(m.Payload)
		if err != nil {
			return idem.Permanent(err)
		}
		_, err = tx.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?) ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, acct, amt)
		return err
	}}
	cons, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{MaxAttempts: maxAttempts, ProbeBackoff: idem.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	return cons, path, e
}
