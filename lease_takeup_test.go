package idem_test

import (
	"context"
	"errors"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// slowTakeUp is the SQLite driver as seen over a slow, failing network:
// its first claim is written but answered with an error (the connection
// broke after the commit), the answer of every later claim arrives late,
// and no heartbeat gets through.
type slowTakeUp struct {
	*sqlite.Driver
	late   time.Duration
	claims atomic.Int32
}

func (s *slowTakeUp) LeaseClaim(ctx context.Context, p *driver.LeaseClaimParams) (driver.LeaseClaimResult, error) {
	res, err := s.Driver.LeaseClaim(ctx, p)
	if s.claims.Add(1) == 1 && err == nil {
		return driver.LeaseClaimResult{}, errors.New("read: connection reset by peer")
	}
	time.Sleep(s.late) // the answer, read as the store had it, arrives late
	return res, err
}

func (s *slowTakeUp) LeaseHeartbeat(context.Context, *driver.LeaseHeartbeatParams) (driver.LeaseWriteResult, error) {
	return driver.LeaseWriteResult{}, errors.New("write: connection reset by peer")
}

// TestLeaseTakenUpNeverOutlivesTheStoresLease: a worker that takes up its
// own claim whose answer was lost counts the lease's end from the store's
// answer. Its handler's context must be cancelled no later than the lease
// ends in the store, when another worker may claim the message and run
// the effect too. It was counted from the moment the late answer arrived,
// so the handler kept running for as long as the answer took, beside the
// other worker's call.
func TestLeaseTakenUpNeverOutlivesTheStoresLease(t *testing.T) {
	t.Parallel()
	const (
		ttl  = 1500 * time.Millisecond
		late = 600 * time.Millisecond
	)
	base := leaseDriver(t)
	drv := &slowTakeUp{Driver: base, late: late}
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: ttl, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var cancelledAt atomic.Int64 // Unix microseconds
	h := &idem.LeaseHandler{Name: "mailer", Call: func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		<-ctx.Done() // a call slower than the lease
		cancelledAt.Store(time.Now().UnixMicro())
		return context.Cause(ctx)
	}}
	msg := &idem.Message{ID: "mail-1", Payload: []byte("hello")}
	ctx := context.Background()
	if out, err := p.Process(ctx, h, msg); out != idem.OutcomeNone || err == nil {
		t.Fatalf("claim whose answer was lost: (%v, %v); want the store's error", out, err)
	}
	row, err := base.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: msg.ID})
	if err != nil || row == nil || row.Status != driver.LeaseRunning {
		t.Fatalf("row after the lost answer: %+v, %v; want running", row, err)
	}
	until := row.LeaseUntil // the store's (SQLite's clock is this host's)

	_, err = p.Process(ctx, h, msg) // takes the lease up; the handler runs until it is lost
	if !errors.Is(err, idem.ErrLeaseExpired) {
		t.Fatalf("taken-up call: %v; want it cancelled as the lease expired", err)
	}
	at := time.UnixMicro(cancelledAt.Load())
	if over := at.Sub(until); over > 20*time.Millisecond {
		t.Fatalf("the handler's context was cancelled %s after the lease ended in the store (the answer took %s): another worker could run the effect meanwhile",
			over.Round(time.Millisecond), late)
	}
}

// TestLeaseFailureWrittenDuringAnOutageRetriesAfterTheBackoff: the
// handler fails (a retriable error) just as the store goes down, so the
// failed attempt cannot be recorded: the row stays running under this
// worker's lease. The consumer holds the delivery through the outage;
// once the store answers, the worker records the failure it held and the
// message is retried after the lease backoff, as without the outage.
// Before, the worker found its own lease in flight and the message waited
// for the whole TTL (a minute here, 15 by default) before any retry.
func TestLeaseFailureWrittenDuringAnOutageRetriesAfterTheBackoff(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	_, drv := testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: time.Minute,
		BackoffBase: 10 * time.Millisecond, BackoffMax: 10 * time.Millisecond, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	errSMTP := errors.New("smtp: 451 try again later")
	var calls atomic.Int32
	h := &idem.LeaseHandler{Name: "mailer", Call: func(_ context.Context, l *idem.Lease, _ *idem.Message) error {
		if calls.Add(1) > 1 {
			return nil
		}
		release := testenv.HoldSQLite(t, path) // the store goes down as the call fails
		time.AfterFunc(500*time.Millisecond, release)
		return errSMTP
	}}
	c, err := idem.NewLeaseConsumer(p, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t),
		Backoff:      idem.Backoff{Base: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		ProbeBackoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	msg := &idem.Message{ID: "mail-1", Payload: []byte("hello")}
	ctx := context.Background()
	v := c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Attempt: 1})
	if v.Ack || !errors.Is(v.Err, errSMTP) || v.RetryAfter > 5*time.Second {
		t.Fatalf("verdict of the failed call after the outage: %+v; want a retry with the handler's error after the backoff, not after the lease's minute", v)
	}
	row, err := drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: msg.ID})
	if err != nil || row == nil || row.Status != driver.LeaseFailed || row.Attempts != 1 || row.LastError == "" {
		t.Fatalf("row after the outage: %+v, %v; want the failed attempt recorded", row, err)
	}
	time.Sleep(v.RetryAfter)
	v = c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Attempt: 2})
	if !v.Ack || v.Outcome != idem.Applied || calls.Load() != 2 {
		t.Fatalf("redelivery: %+v after %d calls; want applied on the second call", v, calls.Load())
	}
}
