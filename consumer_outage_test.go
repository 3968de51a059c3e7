package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"net"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// outageHook records a consumer's outages.
type outageHook struct{ downs, ups atomic.Int64 }

func (h *outageHook) OnOutage(_ context.Context, ev *idem.OutageEvent) {
	if ev.Down {
		h.downs.Add(1)
	} else {
		h.ups.Add(1)
	}
}

// A handler whose own dependency refuses connections fails its message:
// the store answers, so it is no outage. The delivery is tried once more
// at once (the store may have been going down), then retried as any
// failure, and the attempt counts.
func TestNetworkErrorOfAHandlerIsNoOutage(t *testing.T) {
	t.Parallel()
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	h := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(context.Context, *sql.Tx, *idem.Message) error {
		calls.Add(1)
		return refused
	}}
	hook := &outageHook{}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{MaxAttempts: 2, Hooks: []idem.Hook{hook}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	msg := &idem.Message{ID: "m-1", Payload: []byte("x")}
	v := c.HandleDelivery(context.Background(), &idem.Delivery{Msg: msg, Attempt: 1})
	if v.Ack || !errors.Is(v.Err, syscall.ECONNREFUSED) || errors.Is(v.Err, idem.ErrStoreUnavailable) {
		t.Fatalf("verdict %+v, want a retry with the handler's error", v)
	}
	if n := calls.Load(); n != 2 {
		t.Fatalf("handler called %d times, want 2 (once more at once)", n)
	}
	v = c.HandleDelivery(context.Background(), &idem.Delivery{Msg: msg, Attempt: 2})
	if !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterExhausted {
		t.Fatalf("second attempt: %+v, want an exhausted dead letter (MaxAttempts 2 counts it)", v)
	}
	if hook.downs.Load() != 0 {
		t.Fatal("an outage was reported while the store answered")
	}
}

// While the store cannot be written (another connection holds its lock
// past the busy timeout), a delivery is held: not processed, not counted,
// never dead-lettered, even on the broker's last delivery; it applies once
// the store answers. One stopped meanwhile ends with ErrStoreUnavailable.
func TestConsumerHoldsDeliveriesWhileTheStoreIsDown(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, drv := testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	if _, err := db.Exec(`CREATE TABLE seen (id TEXT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "projection", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO seen VALUES (?)`, m.ID)
		return err
	}}
	hook := &outageHook{}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{MaxAttempts: 1, Hooks: []idem.Hook{hook}, Logger: testenv.Logger(t),
		ProbeBackoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	locker, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	lock, err := locker.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(context.Background(), "BEGIN EXCLUSIVE"); err != nil {
		t.Fatal(err)
	}

	// Stopped while the store is down: no attempt, no dead letter.
	stop := make(chan struct{})
	time.AfterFunc(300*time.Millisecond, func() { close(stop) })
	v := c.HandleDelivery(context.Background(), &idem.Delivery{Msg: &idem.Message{ID: "a", Payload: []byte("x")}, Attempt: 1, LastAttempt: true, Stopping: stop})
	if v.Ack || v.DeadLettered || !errors.Is(v.Err, idem.ErrStoreUnavailable) {
		t.Fatalf("verdict of a delivery stopped during the outage: %+v, want a retry with ErrStoreUnavailable", v)
	}
	if hook.downs.Load() != 1 {
		t.Fatalf("%d outages reported, want 1", hook.downs.Load())
	}

	// Held, then applied once the lock goes.
	done := make(chan idem.Verdict, 1)
	go func() {
		done <- c.HandleDelivery(context.Background(), &idem.Delivery{Msg: &idem.Message{ID: "b", Payload: []byte("x")}, Attempt: 1, LastAttempt: true})
	}()
	select {
	case v := <-done:
		t.Fatalf("decided while the store was down: %+v", v)
	case <-time.After(300 * time.Millisecond):
	}
	if _, err := lock.ExecContext(context.Background(), "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	select {
	case v := <-done:
		if !v.Ack || v.Outcome != idem.Applied {
			t.Fatalf("after the outage: %+v, want applied", v)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("not decided 5 s after the store answered")
	}
	if hook.ups.Load() != 1 {
		t.Fatalf("%d outage ends reported, want 1", hook.ups.Load())
	}
	dls, err := drv.DeadLetterList(context.Background(), &driver.DeadLetterFilter{})
	if err != nil || len(dls) != 0 {
		t.Fatalf("dead letters: %d (%v), want none", len(dls), err)
	}
}

// A lease handler's refused connection, once the store recorded the failed
// attempt, is the message's failure at once: no second claim, no probe
// (the store just answered), and the retry carries the handler's error.
func TestNetworkErrorOfALeaseHandlerIsNoOutage(t *testing.T) {
	t.Parallel()
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "w"})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	h := &idem.LeaseHandler{Name: "mailer", Call: func(context.Context, *idem.Lease, *idem.Message) error {
		calls.Add(1)
		return refused
	}}
	hook := &outageHook{}
	c, err := idem.NewLeaseConsumer(lp, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{hook}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	v := c.HandleDelivery(context.Background(), &idem.Delivery{Msg: &idem.Message{ID: "m-1", Payload: []byte("x")}, Attempt: 1})
	if v.Ack || !errors.Is(v.Err, syscall.ECONNREFUSED) {
		t.Fatalf("verdict %+v, want a retry with the handler's error", v)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("handler called %d times, want once", n)
	}
	if hook.downs.Load() != 0 {
		t.Fatal("an outage was reported while the store answered")
	}
}
