package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// TestLeaseGapWaitRetryGoesByTheStoresClock: under GapWait the consumer
// caps the retry delay at the gap's deadline, as the store's clock
// measures it. Compared with the host's time.Now(), a store clock behind
// the host by more than WaitFor made every retry immediate (RetryAfter 0)
// for the whole wait: a redelivery storm, each one a claim, two reads and
// a release.
func TestLeaseGapWaitRetryGoesByTheStoresClock(t *testing.T) {
	t.Parallel()
	for _, skew := range []time.Duration{0, time.Hour} {
		drv := &skewedStore{Driver: leaseDriver(t), skew: -skew}
		p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		h := &idem.LeaseHandler{Name: "shipper", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: 10 * time.Minute},
			Call: func(context.Context, *idem.Lease, *idem.Message) error { return nil }}
		c, err := idem.NewLeaseConsumer(p, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t),
			Backoff: idem.Backoff{Base: time.Second, Max: time.Second}})
		if err != nil {
			t.Fatal(err)
		}
		var zero int
		for i := 1; i <= 3; i++ {
			v := c.HandleDelivery(context.Background(), &idem.Delivery{Msg: &idem.Message{ID: "order-1-2", AggregateID: "order-1", Seq: 2}, Attempt: i})
			var ge *idem.GapError
			if v.Ack || !errors.As(v.Err, &ge) || ge.Final {
				t.Fatalf("skew %s, delivery %d: %+v; want a retriable gap", skew, i, v)
			}
			if v.RetryAfter == 0 {
				zero++
			}
		}
		// The wait has 10 minutes to go on the store's clock; the backoff
		// is uniform in [0, 1s], so three zero delays are no accident.
		if zero == 3 {
			t.Errorf("store clock %s behind the host: RetryAfter 0 on all 3 deliveries, though the gap's deadline is 10 minutes away on the store's clock", skew)
		}
	}
}

// flakyDone is the SQLite driver whose first LeaseComplete fails, as a
// dropped pooled connection would: before writing, or (written) after.
type flakyDone struct {
	*sqlite.Driver
	written bool // the failing write lands; only its answer is lost
	failed  atomic.Bool
}

func (f *flakyDone) LeaseComplete(ctx context.Context, p *driver.LeaseCompleteParams) (driver.LeaseWriteResult, error) {
	if f.failed.CompareAndSwap(false, true) {
		if f.written {
			if _, err := f.Driver.LeaseComplete(ctx, p); err != nil {
				return driver.LeaseWriteResult{}, err
			}
		}
		return driver.LeaseWriteResult{}, errors.New("conn reset by peer")
	}
	return f.Driver.LeaseComplete(ctx, p)
}

// TestLeaseDoneWriteIsRetriedWhileTheLeaseLasts: the handler's external
// call succeeded and the worker still holds its lease, but the done write
// fails once (a dropped connection), before or after it lands. It is
// tried again: the delivery is Applied, and the charge made once. (Not
// retried, the row stayed running until the TTL ran out, and the next
// claim charged again.)
func TestLeaseDoneWriteIsRetriedWhileTheLeaseLasts(t *testing.T) {
	t.Parallel()
	for _, written := range []bool{false, true} {
		drv := &flakyDone{Driver: leaseDriver(t), written: written}
		p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: 2 * time.Second, Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int32
		h := &idem.LeaseHandler{Name: "payments.charge", Call: func(context.Context, *idem.Lease, *idem.Message) error {
			calls.Add(1) // the charge went through
			return nil
		}}
		msg := &idem.Message{ID: "charge-1", Payload: []byte("42 EUR")}
		if out, err := p.Process(context.Background(), h, msg); out != idem.Applied || err != nil {
			t.Fatalf("written %v: (%v, %v); want applied after the done write's retry", written, out, err)
		}
		if out, err := p.Process(context.Background(), h, msg); out != idem.Duplicate || err != nil || calls.Load() != 1 {
			t.Fatalf("written %v: redelivery (%v, %v), %d calls; want a duplicate and one charge", written, out, err, calls.Load())
		}
	}
}

// TestLeaseFailureRetriesAtTheRowsNextAttempt: after a retriable failure
// the LeaseConsumer asks again no earlier than the row's next attempt time
// (the lease backoff). After its own Backoff alone, the redelivery found
// the message InFlight, so each failure cost two broker deliveries, and
// ConsumerConfig.MaxAttempts ran out at about half the handler calls.
func TestLeaseFailureRetriesAtTheRowsNextAttempt(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{BackoffBase: time.Second, BackoffMax: time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	h := &idem.LeaseHandler{Name: "mailer", Call: func(context.Context, *idem.Lease, *idem.Message) error {
		calls.Add(1)
		return errors.New("smtp: 451 try again later")
	}}
	c, err := idem.NewLeaseConsumer(p, h, drv, &idem.ConsumerConfig{MaxAttempts: 3, Logger: testenv.Logger(t),
		Backoff: idem.Backoff{Base: time.Millisecond, Max: time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	msg := &idem.Message{ID: "mail-1", Payload: []byte("hello")}
	var inflight int
	var v idem.Verdict
	for attempt := 1; attempt <= 10; attempt++ {
		v = c.HandleDelivery(context.Background(), &idem.Delivery{Msg: msg, Attempt: attempt})
		if v.Ack {
			break
		}
		if v.Outcome == idem.InFlight {
			inflight++
		}
		time.Sleep(v.RetryAfter) // the broker honours the verdict
	}
	if !v.DeadLettered {
		t.Fatalf("last verdict %+v; want a dead letter", v)
	}
	if inflight > 0 || calls.Load() != 3 {
		t.Errorf("MaxAttempts 3: %d handler calls and %d deliveries wasted as InFlight behind the consumer's own failure verdicts; want 3 calls, none wasted", calls.Load(), inflight)
	}
}

// TestLeaseStoppedBeforeTheCallIsNoAttempt: a caller whose context is
// cancelled right after the claim (a shutdown) releases the claim without
// a call, and no attempt is counted: the next worker applies it even under
// MaxAttempts 1. (The handler used to be called with a context already
// done, and the attempt counted, failing the message for good.)
func TestLeaseStoppedBeforeTheCallIsNoAttempt(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	ctx, cancel := context.WithCancel(context.Background())
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{MaxAttempts: 1, Logger: testenv.Logger(t),
		FaultHook: func(point string) {
			if point == idem.FaultAfterClaim {
				cancel() // the worker is told to stop as the claim returns
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	var deadCalls, liveCalls atomic.Int32
	h := &idem.LeaseHandler{Name: "mailer", Call: func(hctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		if hctx.Err() != nil {
			deadCalls.Add(1)
			return hctx.Err()
		}
		liveCalls.Add(1)
		return nil
	}}
	msg := &idem.Message{ID: "mail-1", Payload: []byte("hello")}
	if out, err := p.Process(ctx, h, msg); out != idem.OutcomeNone || !errors.Is(err, context.Canceled) {
		t.Fatalf("shutdown delivery: (%v, %v); want context.Canceled and no outcome", out, err)
	}
	// Another worker (no shutdown) gets the redelivery.
	p2, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{MaxAttempts: 1, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	out, err := p2.Process(context.Background(), h, msg)
	if deadCalls.Load() != 0 || out != idem.Applied {
		t.Errorf("handler called %d times with a context already cancelled; the redelivery got (%v, %v), live calls %d; want no call after the cancellation and the redelivery applied",
			deadCalls.Load(), out, err, liveCalls.Load())
	}
}

// TestLeaseCrashedHolderIsTakenOverNotDeadLettered: a worker crashed
// after its claim; its lease runs out after the TTL. The other deliveries
// find the message in flight and are asked again once the lease can be
// taken over, so that under a broker delivery limit (JetStream MaxDeliver
// 5 here) the message is applied rather than dead-lettered. Asked again
// after ConsumerConfig.Backoff alone, the five deliveries ran out long
// before the TTL and the last dead-lettered the message.
func TestLeaseCrashedHolderIsTakenOverNotDeadLettered(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	ctx := context.Background()
	const ttl = 400 * time.Millisecond
	msg := &idem.Message{ID: "mail-1", Payload: []byte("hello")}
	// The crashed worker's claim.
	if r, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "mailer", MessageID: msg.ID, PayloadHash: msg.PayloadHash(), Owner: "crashed", TTL: ttl}); err != nil || !r.Claimed {
		t.Fatalf("claim: %+v, %v", r, err)
	}
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: ttl, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	h := &idem.LeaseHandler{Name: "mailer", Call: func(context.Context, *idem.Lease, *idem.Message) error {
		calls.Add(1)
		return nil
	}}
	c, err := idem.NewLeaseConsumer(p, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t),
		Backoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 20 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	const maxDeliver = 5
	var v idem.Verdict
	start := time.Now()
	for attempt := 1; attempt <= maxDeliver; attempt++ {
		v = c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Attempt: attempt, LastAttempt: attempt == maxDeliver})
		if v.Ack {
			break
		}
		if v.RetryAfter > ttl {
			t.Fatalf("delivery %d: asked again after %s, beyond the lease's %s", attempt, v.RetryAfter, ttl)
		}
		time.Sleep(v.RetryAfter) // the broker honours the verdict
	}
	if !v.Ack || v.DeadLettered || v.Outcome != idem.Applied || calls.Load() != 1 {
		t.Fatalf("after %s (lease TTL %s): verdict %+v, %d calls; want the expired lease taken over and applied, not a dead letter",
			time.Since(start).Round(time.Millisecond), ttl, v, calls.Load())
	}
}

// TestLeaseCallerDeadlineIsAFailure: a call that runs out the caller's
// deadline (a per-message timeout) is a failed attempt, retried after the
// lease backoff; it was taken for a shutdown and handed on at once.
func TestLeaseCallerDeadlineIsAFailure(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{BackoffBase: time.Minute, BackoffMax: time.Minute, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.LeaseHandler{Name: "mailer", Call: func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		<-ctx.Done() // the SMTP server never answers
		return ctx.Err()
	}}
	msg := &idem.Message{ID: "mail-1", Payload: []byte("hello")}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := p.Process(ctx, h, msg); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Process: %v, want the deadline", err)
	}
	row, err := drv.LeaseGet(context.Background(), &driver.LeaseGetParams{Handler: "mailer", MessageID: msg.ID})
	if err != nil || row == nil || row.Status != driver.LeaseFailed || row.Attempts != 1 || row.NextAttemptAt.Sub(row.Now) <= 0 {
		t.Fatalf("row after the deadline: %+v, %v; want failed, one attempt, a retry time ahead (the backoff)", row, err)
	}
}

// TestNewLeaseConsumerRefusesSetupNoMessagePasses: as NewConsumer, a lease
// handler whose Ordering fails every message (VersionOnly, which lease
// mode refuses; an unknown gap policy) is refused by NewLeaseConsumer with
// ErrInvalidConfig, not retried with every delivery as the message's
// failure.
func TestNewLeaseConsumerRefusesSetupNoMessagePasses(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	call := func(context.Context, *idem.Lease, *idem.Message) error { return nil }
	for name, o := range map[string]*idem.Ordering{
		"version-only":       {VersionOnly: true},
		"unknown gap policy": {Gap: 9},
	} {
		h := &idem.LeaseHandler{Name: "shipper", Ordering: o, Call: call}
		if _, err := idem.NewLeaseConsumer(p, h, drv, nil); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: NewLeaseConsumer: %v; want ErrInvalidConfig", name, err)
		}
	}
	h := &idem.LeaseHandler{Name: "shipper", Ordering: &idem.Ordering{Gap: idem.GapWait}, Call: call}
	if _, err := idem.NewLeaseConsumer(p, h, drv, nil); err != nil {
		t.Errorf("a valid Ordering: %v", err)
	}
}
