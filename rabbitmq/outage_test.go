package rabbitmq_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
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
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := sqlite.Open(path, &sqlite.OpenOptions{BusyTimeout: 100 * time.Millisecond, Synchronous: "NORMAL"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ctx := context.Background()
	drv, err := sqlite.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
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
	cons, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{MaxAttempts: 2, ProbeBackoff: idem.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
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
