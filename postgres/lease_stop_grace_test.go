package postgres_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// hungLease is a LeaseConsumer whose store's one connection runs through
// a Blackhole, with a handler that calls call (when set) and counts its
// calls.
type hungLease struct {
	drv   *postgres.Driver
	hole  *testenv.Blackhole
	cons  *idem.LeaseConsumer
	calls atomic.Int32
	call  func(ctx context.Context) error
	// entered is closed when a call begins.
	entered chan struct{}
}

// leaseOpts varies newHungLease's processor: its MaxAttempts, and a
// wrapper around the driver it writes the leases through.
type leaseOpts struct {
	maxAttempts int
	wrap        func(driver.LeaseDriver) driver.LeaseDriver
}

func newHungLease(t *testing.T, grace time.Duration, o leaseOpts) *hungLease {
	t.Helper()
	pool, hole := testenv.PostgresPoolThrough(t, 1)
	direct := testenv.PostgresPool(t, 1)
	drv, err := postgres.New(pool, &postgres.Config{Schema: testenv.FreshSchema(t, direct)})
	if err != nil {
		t.Fatal(err)
	}
	// First of the cleanups: the schema's drop waits for the locks of
	// sessions left hanging.
	t.Cleanup(hole.Close)
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	hl := &hungLease{drv: drv, hole: hole, entered: make(chan struct{})}
	var ld driver.LeaseDriver = drv
	if o.wrap != nil {
		ld = o.wrap(drv)
	}
	lp, err := idem.NewLeaseProcessor(ld, &idem.LeaseConfig{TTL: time.Minute, MaxAttempts: o.maxAttempts, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.LeaseHandler{Name: "mailer", Call: func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		if hl.calls.Add(1) == 1 && hl.call != nil {
			close(hl.entered)
			return hl.call(ctx)
		}
		return nil
	}}
	hl.cons, err = idem.NewLeaseConsumer(lp, h, drv, &idem.ConsumerConfig{StopGrace: grace, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	// The pool's one connection is open, and every later write takes it.
	if v := hl.deliver("warm-up", nil); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("warm-up delivery: %+v; want applied", v)
	}
	hl.calls.Store(0)
	return hl
}

func (hl *hungLease) deliver(id string, stop <-chan struct{}) idem.Verdict {
	return hl.cons.HandleDelivery(context.Background(), &idem.Delivery{
		Msg: &idem.Message{ID: id, Payload: []byte("hello")}, Attempt: 1, Stopping: stop,
	})
}

// decide delivers id, closes stop once the call began (with inCall; else
// a moment after the delivery), and returns the verdict and how long
// after the stop it came; it fails the test if it does not come within
// limit of the stop.
func (hl *hungLease) decide(t *testing.T, id string, inCall bool, limit time.Duration) (idem.Verdict, time.Duration) {
	t.Helper()
	stop := make(chan struct{})
	res := make(chan idem.Verdict, 1)
	go func() { res <- hl.deliver(id, stop) }()
	if inCall {
		select {
		case <-hl.entered:
		case v := <-res:
			t.Fatalf("decided before the call: %+v", v)
		}
	} else {
		time.Sleep(200 * time.Millisecond)
	}
	close(stop)
	stopped := time.Now()
	select {
	case v := <-res:
		return v, time.Since(stopped)
	case <-time.After(limit):
		t.Fatalf("still deciding %s after the stop: the stop waits on a store that hangs", time.Since(stopped).Round(time.Second))
		return idem.Verdict{}, 0
	}
}

// row returns id's lease row; the test fails if there is none.
func (hl *hungLease) row(t *testing.T, id string) *driver.LeaseRow {
	t.Helper()
	row, err := hl.drv.LeaseGet(context.Background(), &driver.LeaseGetParams{Handler: "mailer", MessageID: id})
	if err != nil || row == nil {
		t.Fatalf("lease row of %s: %+v, %v", id, row, err)
	}
	return row
}

// checkStopped checks that v hands the delivery back as no attempt.
func checkStopped(t *testing.T, v idem.Verdict) {
	t.Helper()
	if v.Ack || v.DeadLettered || !errors.Is(v.Err, idem.ErrStopped) {
		t.Fatalf("verdict %+v; want a retry matching ErrStopped", v)
	}
}

// TestLeaseStopCutsAHungClaim: the path to the store dies while a
// LeaseConsumer claims a message. The claim used to wait for as long as
// TCP keeps trying, and the stop with it; StopGrace after the stop it is
// cancelled, nothing was called, and the next delivery calls once.
func TestLeaseStopCutsAHungClaim(t *testing.T) {
	t.Parallel()
	const grace = 500 * time.Millisecond
	hl := newHungLease(t, grace, leaseOpts{})
	hl.hole.Cut()
	v, took := hl.decide(t, "mail-1", false, grace+10*time.Second)
	checkStopped(t, v)
	if took < grace-50*time.Millisecond {
		t.Fatalf("cut %s after the stop; StopGrace is %s", took, grace)
	}
	if n := hl.calls.Load(); n != 0 {
		t.Fatalf("%d calls during a claim that never reached the store; want 0", n)
	}
	hl.hole.Reset()
	if v := hl.deliver("mail-1", nil); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("delivered again: %+v; want applied", v)
	}
	if n := hl.calls.Load(); n != 1 {
		t.Fatalf("%d calls; want 1", n)
	}
}

// TestLeaseStopNeverCutsACall: a call still running when the grace ends
// is not cancelled, and the write recording its result gets a grace of
// its own: the message is done, once, on a store that answers.
func TestLeaseStopNeverCutsACall(t *testing.T) {
	t.Parallel()
	const grace = 300 * time.Millisecond
	hl := newHungLease(t, grace, leaseOpts{})
	var callErr atomic.Value
	hl.call = func(ctx context.Context) error {
		select {
		case <-time.After(grace + 600*time.Millisecond):
		case <-ctx.Done():
			callErr.Store(context.Cause(ctx))
		}
		return nil
	}
	v, _ := hl.decide(t, "mail-2", true, 10*time.Second)
	if err, _ := callErr.Load().(error); err != nil {
		t.Fatalf("the call was cancelled: %v", err)
	}
	if !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("verdict %+v; want applied (the result written after the grace)", v)
	}
	if row := hl.row(t, "mail-2"); row.Status != driver.LeaseDone {
		t.Fatalf("row %+v; want done", row)
	}
}

// TestLeaseStopCutsAHungDoneWrite: the path dies during the call. The
// call ends after the grace; the write recording it hangs. It used to
// wait for the lease's TTL (a minute here, 15 by default), retrying;
// now it gets StopGrace of its own, then the delivery is handed back and
// the row is left to its lease, as after a crash.
func TestLeaseStopCutsAHungDoneWrite(t *testing.T) {
	t.Parallel()
	const grace = 300 * time.Millisecond
	hl := newHungLease(t, grace, leaseOpts{})
	hl.call = func(context.Context) error {
		hl.hole.Cut()
		time.Sleep(grace + 500*time.Millisecond)
		return nil
	}
	v, took := hl.decide(t, "mail-3", true, 20*time.Second)
	checkStopped(t, v)
	// The call began just before the stop and ends grace+500ms after it
	// began; its write then gets grace. Cut at the call's end, the verdict
	// would come sooner.
	if min := 2*grace + 300*time.Millisecond; took < min {
		t.Fatalf("cut %s after the stop; the write began after the grace and should get %s of its own", took, grace)
	}
	if n := hl.calls.Load(); n != 1 {
		t.Fatalf("%d calls; want 1", n)
	}
	hl.hole.Reset()
	if row := hl.row(t, "mail-3"); row.Status != driver.LeaseRunning {
		t.Fatalf("row %+v; want running, left to its lease", row)
	}
}

// TestLeaseStopKeepsARecordedFailure: a call that fails after the grace
// is the message's failure, recorded by the store, not a stop: with
// MaxAttempts 1 it fails for good and is dead-lettered, with the
// handler's error, instead of being handed back as no attempt (which on a
// broker's last delivery would lose it without a dead letter).
func TestLeaseStopKeepsARecordedFailure(t *testing.T) {
	t.Parallel()
	const grace = 300 * time.Millisecond
	hl := newHungLease(t, grace, leaseOpts{maxAttempts: 1})
	errMail := errors.New("mail server said no")
	hl.call = func(context.Context) error {
		time.Sleep(grace + 500*time.Millisecond)
		return errMail
	}
	v, _ := hl.decide(t, "mail-4", true, 10*time.Second)
	if !v.DeadLettered || !errors.Is(v.Err, errMail) || errors.Is(v.Err, idem.ErrStopped) {
		t.Fatalf("verdict %+v; want dead-lettered with the handler's error", v)
	}
	if row := hl.row(t, "mail-4"); row.Status != driver.LeaseFailed || !row.NextAttemptAt.IsZero() || !strings.Contains(row.LastError, errMail.Error()) {
		t.Fatalf("row %+v; want failed for good with the handler's error", row)
	}
}

// failingDone is a lease store whose first n done writes fail at once, as
// a store failing over does.
type failingDone struct {
	driver.LeaseDriver
	n atomic.Int32
}

func (f *failingDone) LeaseComplete(ctx context.Context, p *driver.LeaseCompleteParams) (driver.LeaseWriteResult, error) {
	if f.n.Add(-1) >= 0 {
		return driver.LeaseWriteResult{}, errors.New("connection reset by peer")
	}
	return f.LeaseDriver.LeaseComplete(ctx, p)
}

// TestLeaseStopRetriesAFastFailingDoneWrite: after the grace, a done write
// the store fails at once is tried again for a grace more (a failover
// under way), not given up after one try, which would leave the row to
// its lease and the effect to be repeated.
func TestLeaseStopRetriesAFastFailingDoneWrite(t *testing.T) {
	t.Parallel()
	const grace = 500 * time.Millisecond
	fd := &failingDone{}
	hl := newHungLease(t, grace, leaseOpts{wrap: func(d driver.LeaseDriver) driver.LeaseDriver { fd.LeaseDriver = d; return fd }})
	hl.call = func(context.Context) error {
		fd.n.Store(2)
		time.Sleep(grace + 200*time.Millisecond)
		return nil
	}
	v, _ := hl.decide(t, "mail-5", true, 10*time.Second)
	if !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("verdict %+v; want applied on the third try", v)
	}
	if n := hl.calls.Load(); n != 1 {
		t.Fatalf("%d calls; want 1", n)
	}
}
