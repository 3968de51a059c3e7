package idemtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// LeaseHarness tells RunLease how to get a lease-mode store.
type LeaseHarness struct {
	// Open returns a lease driver on a fresh, migrated, empty store. It is
	// called once per test; register clean-up with t.Cleanup. Required.
	Open func(t testing.TB) driver.LeaseDriver
	// Workers and IDs size the concurrent-workers test: every worker
	// processes every ID. Defaults 16 and 500.
	Workers, IDs int
	// TTL is the short lease of the tests that wait for one to expire.
	// Default 400ms; raise it on a slow store.
	TTL time.Duration
}

func (h *LeaseHarness) ttl() time.Duration {
	if h.TTL > 0 {
		return h.TTL
	}
	return 400 * time.Millisecond
}

// RunLease runs the conformance suite of lease mode. The tests run in
// parallel, each on its own store.
func RunLease(t *testing.T, h *LeaseHarness) {
	w, n := h.Workers, h.IDs
	if w == 0 {
		w = 16
	}
	if n == 0 {
		n = 500
	}
	ttl := h.ttl()
	tests := []struct {
		name string
		fn   func(t *testing.T, drv driver.LeaseDriver)
	}{
		{"AppliedOnceThenDuplicate", testLeaseApplied},
		{"InvalidInputRejected", testLeaseInvalid},
		{"HandlersLeaseIndependently", testLeaseHandlersIndependent},
		{"DriverClaimAndFencing", testLeaseDriverFencing},
		{"DriverFailedRows", testLeaseDriverFailed},
		{"DriverClaimIsAtomic", testLeaseClaimAtomic},
		{"LiveLeaseIsInFlight", testLeaseInFlight},
		{"ClaimWhoseAnswerWasLostIsTakenUp", testLeaseClaimAnswerLost},
		{"ConflictNeverClaimed", testLeaseConflict},
		{"FailedRetriedAfterBackoff", testLeaseRetry},
		{"PermanentFailureNotRetried", testLeasePermanent},
		{"MaxAttemptsMakesFailurePermanent", testLeaseMaxAttempts},
		{"ReplayAfterMaxAttemptsCallsAgain", testLeaseReplayAfterMaxAttempts},
		{"PanicMarksFailed", testLeasePanic},
		{"ShutdownHandsOverAtOnce", testLeaseShutdown},
		{"OrderingGapFailHolds", testLeaseOrderingFail},
		{"OrderingGapWaitRetriable", testLeaseOrderingWait},
		{"OrderingAllowShuffled", testLeaseOrderingAllowShuffled},
		{"ConsumerVerdicts", testLeaseConsumer},
		{"PermanentFailureRedeliveredKeepsItsGroup", testLeasePermanentRedelivered},
		// Half as long again, and at least 2 s: heartbeats must get
		// through on a loaded machine (at load 35 on 2 cores a MySQL
		// heartbeat missed a 600 ms lease).
		{"HeartbeatKeepsLease", func(t *testing.T, drv driver.LeaseDriver) { testLeaseHeartbeat(t, drv, max(ttl*3/2, 2*time.Second)) }},
		{"ExpiredLeaseReclaimed", func(t *testing.T, drv driver.LeaseDriver) { testLeaseExpired(t, drv, ttl) }},
		{"ZombieDoneIsFenced", func(t *testing.T, drv driver.LeaseDriver) { testLeaseZombie(t, drv, ttl, false) }},
		{"ZombieFailedIsFenced", func(t *testing.T, drv driver.LeaseDriver) { testLeaseZombie(t, drv, ttl, true) }},
		{"ConcurrentWorkers", func(t *testing.T, drv driver.LeaseDriver) {
			inflight, err := CheckConcurrentLeaseWorkers(context.Background(), drv, w, n)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d workers × %d IDs: each ran once, after %d in-flight answers", w, n, inflight)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, h.Open(t))
		})
	}
}

func leaseProc(t testing.TB, drv driver.LeaseDriver, cfg *idem.LeaseConfig) *idem.LeaseProcessor {
	t.Helper()
	if cfg == nil {
		cfg = &idem.LeaseConfig{}
	}
	if cfg.Owner == "" {
		cfg.Owner = "idemtest-" + strings.ReplaceAll(t.Name(), "/", ".")
	}
	p, err := idem.NewLeaseProcessor(drv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// callCounter is a lease handler that counts its calls and records the
// leases it was given.
type callCounter struct {
	mu     sync.Mutex
	calls  map[string]int
	leases []idem.Lease
}

func (c *callCounter) handler(name string, fn func(ctx context.Context, l *idem.Lease, m *idem.Message) error) *idem.LeaseHandler {
	return &idem.LeaseHandler{Name: name, Call: func(ctx context.Context, l *idem.Lease, m *idem.Message) error {
		c.mu.Lock()
		if c.calls == nil {
			c.calls = map[string]int{}
		}
		c.calls[m.ID]++
		c.leases = append(c.leases, *l)
		c.mu.Unlock()
		if fn != nil {
			return fn(ctx, l, m)
		}
		return nil
	}}
}

func (c *callCounter) count(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[id]
}

func (c *callCounter) last() idem.Lease {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.leases) == 0 {
		return idem.Lease{}
	}
	return c.leases[len(c.leases)-1]
}

func leaseRow(t testing.TB, drv driver.LeaseDriver, handler, id string) *driver.LeaseRow {
	t.Helper()
	row, err := drv.LeaseGet(context.Background(), &driver.LeaseGetParams{Handler: handler, MessageID: id})
	if err != nil {
		t.Fatal(err)
	}
	if row == nil {
		t.Fatalf("no row for (%s, %s)", handler, id)
	}
	return row
}

// claimedBy reports whether a row's owner is a claim by the worker named
// owner: LeaseConfig.Owner, a slash and the claim's own suffix when a
// LeaseProcessor claimed it, owner itself when a test called the driver.
func claimedBy(rowOwner, owner string) bool {
	return rowOwner == owner || strings.HasPrefix(rowOwner, owner+"/") && !strings.Contains(rowOwner[len(owner)+1:], "/")
}

// wantRow checks the fields of a row that a test can predict.
func wantRow(t testing.TB, what string, row *driver.LeaseRow, status driver.LeaseStatus, token int64, attempts int, owner string) {
	t.Helper()
	if row.Status != status || row.Token != token || row.Attempts != attempts || (owner != "" && !claimedBy(row.Owner, owner)) {
		t.Fatalf("%s: row is %s token %d attempts %d owner %q; want %s token %d attempts %d owner %q",
			what, row.Status, row.Token, row.Attempts, row.Owner, status, token, attempts, owner)
	}
}

// processUntilSettled repeats Process while it answers InFlight (as a broker
// redelivering later would), for at most timeout. It returns the final
// outcome and how many InFlight answers came first.
func processUntilSettled(ctx context.Context, p *idem.LeaseProcessor, h *idem.LeaseHandler, msg *idem.Message, timeout time.Duration) (idem.Outcome, int, error) {
	deadline := time.Now().Add(timeout)
	inflight := 0
	for {
		out, err := p.Process(ctx, h, msg)
		if err != nil || out != idem.InFlight {
			return out, inflight, err
		}
		inflight++
		if time.Now().After(deadline) {
			return out, inflight, fmt.Errorf("still in flight after %s (%d tries)", timeout, inflight)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func testLeaseApplied(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, &idem.LeaseConfig{Owner: "worker-1"})
	var c callCounter
	h := c.handler("mailer.welcome", nil)
	msg := &idem.Message{ID: "user-42", Payload: []byte(`{"email":"a@example.com"}`)}
	out, err := p.Process(ctx, h, msg)
	wantOutcome(t, "first delivery", out, err, idem.Applied)
	l := c.last()
	if l.Token != 1 || l.Attempt != 1 || l.Owner != "worker-1" {
		t.Fatalf("lease %+v, want token 1, attempt 1, owner worker-1", l)
	}
	if want := idem.IdempotencyKey("mailer.welcome", "user-42"); l.IdempotencyKey != want || len(want) != 64 {
		t.Fatalf("idempotency key %q, want %q (64 hex characters)", l.IdempotencyKey, want)
	}
	for range 3 {
		out, err := p.Process(ctx, h, msg)
		wantOutcome(t, "redelivery", out, err, idem.Duplicate)
	}
	if n := c.count(msg.ID); n != 1 {
		t.Fatalf("handler called %d times, want 1", n)
	}
	row := leaseRow(t, drv, h.Name, msg.ID)
	wantRow(t, "after done", row, driver.LeaseDone, 1, 1, "worker-1")
	if !row.LeaseUntil.IsZero() || !row.NextAttemptAt.IsZero() || row.LastError != "" {
		t.Fatalf("done row keeps lease state: %+v", row)
	}
}

func testLeaseInvalid(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, nil)
	var c callCounter
	good := c.handler("mailer", nil)
	cases := []struct {
		name string
		h    *idem.LeaseHandler
		msg  *idem.Message
		want error
	}{
		{"nil handler", nil, &idem.Message{ID: "m1"}, idem.ErrInvalidConfig},
		{"no Call", &idem.LeaseHandler{Name: "mailer"}, &idem.Message{ID: "m1"}, idem.ErrInvalidConfig},
		{"bad name", &idem.LeaseHandler{Name: "has space", Call: good.Call}, &idem.Message{ID: "m1"}, idem.ErrInvalidHandlerName},
		{"nil message", good, nil, idem.ErrInvalidMessage},
		{"empty ID", good, &idem.Message{ID: ""}, idem.ErrInvalidMessage},
		{"NUL in ID", good, &idem.Message{ID: "m\x001"}, idem.ErrInvalidMessage},
	}
	for _, tc := range cases {
		out, err := p.Process(ctx, tc.h, tc.msg)
		if out != idem.OutcomeNone || !errors.Is(err, tc.want) {
			t.Errorf("%s: got (%v, %v), want (none, %v)", tc.name, out, err, tc.want)
		}
	}
	if n := c.count("m1"); n != 0 {
		t.Fatalf("handler ran %d times on invalid input", n)
	}
	row, err := drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: "m1"})
	if err != nil || row != nil {
		t.Fatalf("invalid input left a row: %+v, %v", row, err)
	}
}

func testLeaseHandlersIndependent(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, nil)
	var a, b callCounter
	ha, hb := a.handler("email", nil), b.handler("sms", nil)
	msg := &idem.Message{ID: "order-1", Payload: []byte("x")}
	for _, h := range []*idem.LeaseHandler{ha, hb} {
		out, err := p.Process(ctx, h, msg)
		wantOutcome(t, h.Name, out, err, idem.Applied)
	}
	if a.last().IdempotencyKey == b.last().IdempotencyKey {
		t.Fatal("two handlers got the same idempotency key for one message")
	}
	if a.last().Token != 1 || b.last().Token != 1 {
		t.Fatalf("tokens %d and %d, want 1 each (tokens are per handler and message)", a.last().Token, b.last().Token)
	}
	for _, h := range []*idem.LeaseHandler{ha, hb} {
		out, err := p.Process(ctx, h, msg)
		wantOutcome(t, h.Name+" redelivery", out, err, idem.Duplicate)
	}
}

// testLeaseDriverFencing drives the store contract directly: one claim at a
// time, a live lease blocks, an expired one is taken over with the next
// token, and every write with a stale token is refused.
func testLeaseDriverFencing(t *testing.T, drv driver.LeaseDriver) {
	const ttl = time.Minute // leases end by a short heartbeat, never by a slow test
	ctx := context.Background()
	hash := []byte("0123456789abcdef0123456789abcdef")
	claim := func(owner string, h []byte, d time.Duration) driver.LeaseClaimResult {
		t.Helper()
		r, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "h", MessageID: "m", PayloadHash: h, Owner: owner, TTL: d})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	hbFor := func(tok int64, d time.Duration) driver.LeaseWriteResult {
		t.Helper()
		r, err := drv.LeaseHeartbeat(ctx, &driver.LeaseHeartbeatParams{Handler: "h", MessageID: "m", Token: tok, TTL: d})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	hb := func(tok int64) driver.LeaseWriteResult {
		t.Helper()
		return hbFor(tok, ttl)
	}
	complete := func(tok int64) driver.LeaseWriteResult {
		t.Helper()
		r, err := drv.LeaseComplete(ctx, &driver.LeaseCompleteParams{Handler: "h", MessageID: "m", Token: tok})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	fail := func(tok int64) driver.LeaseWriteResult {
		t.Helper()
		r, err := drv.LeaseFail(ctx, &driver.LeaseFailParams{Handler: "h", MessageID: "m", Token: tok, LastError: "late", RetryIn: 0})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	if r := hb(1); r.OK || r.Current != nil {
		t.Fatalf("heartbeat on a missing row: %+v", r)
	}
	c1 := claim("a", hash, ttl)
	if !c1.Claimed || c1.Token != 1 || c1.Attempt != 1 || c1.LeaseUntil.IsZero() {
		t.Fatalf("first claim: %+v", c1)
	}
	c2 := claim("b", hash, ttl)
	if c2.Claimed || c2.Existing == nil || c2.Existing.Status != driver.LeaseRunning || c2.Existing.Token != 1 || c2.Existing.Owner != "a" {
		t.Fatalf("claim during a live lease: %+v (existing %+v)", c2, c2.Existing)
	}
	if !c2.Existing.LeaseUntil.After(c2.Existing.Now) {
		t.Fatalf("live lease until %v is not after the store's now %v", c2.Existing.LeaseUntil, c2.Existing.Now)
	}
	if r := hb(1); !r.OK {
		t.Fatalf("heartbeat with the current token refused: %+v", r)
	}
	// A heartbeat sets the expiry TTL from now: a tiny TTL ends the lease.
	if r := hbFor(1, time.Millisecond); !r.OK {
		t.Fatalf("heartbeat with the current token refused: %+v", r)
	}
	time.Sleep(20 * time.Millisecond)
	c3 := claim("b", hash, ttl)
	if !c3.Claimed || c3.Token != 2 || c3.Attempt != 2 {
		t.Fatalf("claim after expiry: %+v", c3)
	}
	for name, r := range map[string]driver.LeaseWriteResult{"heartbeat": hb(1), "complete": complete(1), "fail": fail(1)} {
		if r.OK || r.Current == nil || r.Current.Token != 2 || r.Current.Owner != "b" {
			t.Fatalf("%s with stale token 1: %+v, want refused with current token 2 owner b", name, r)
		}
	}
	wantRow(t, "after stale writes", leaseRow(t, drv, "h", "m"), driver.LeaseRunning, 2, 2, "b")
	if r := hb(2); !r.OK {
		t.Fatal("heartbeat with token 2 refused")
	}
	if r := complete(2); !r.OK {
		t.Fatal("complete with token 2 refused")
	}
	// A finished row takes no more writes, not even with its own token.
	for name, r := range map[string]driver.LeaseWriteResult{"heartbeat": hb(2), "complete": complete(2), "fail": fail(2)} {
		if r.OK || r.Current == nil || r.Current.Status != driver.LeaseDone {
			t.Fatalf("%s after done: %+v, want refused", name, r)
		}
	}
	if c := claim("c", hash, ttl); c.Claimed || c.Existing.Status != driver.LeaseDone {
		t.Fatalf("claim of a done row: %+v", c)
	}
	other := []byte("fedcba9876543210fedcba9876543210")
	if c := claim("c", other, ttl); c.Claimed || string(c.Existing.PayloadHash) != string(hash) {
		t.Fatalf("claim with another payload hash: %+v", c)
	}
	wantRow(t, "final", leaseRow(t, drv, "h", "m"), driver.LeaseDone, 2, 2, "b")
}

// testLeaseDriverFailed checks failed rows: claimable from their next
// attempt time, never when permanent, and the expired lease of another
// payload is never taken over.
func testLeaseDriverFailed(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	hash := []byte("0123456789abcdef0123456789abcdef")
	claim := func(id string) driver.LeaseClaimResult {
		t.Helper()
		r, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "h", MessageID: id, PayloadHash: hash, Owner: "w", TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	fail := func(id string, tok int64, retryIn time.Duration, permanent bool) {
		t.Helper()
		r, err := drv.LeaseFail(ctx, &driver.LeaseFailParams{Handler: "h", MessageID: id, Token: tok, LastError: "503 from downstream", RetryIn: retryIn, Permanent: permanent})
		if err != nil || !r.OK {
			t.Fatalf("fail %s token %d: %+v, %v", id, tok, r, err)
		}
	}

	// Retry in an hour: not claimable now.
	claim("later")
	fail("later", 1, time.Hour, false)
	row := leaseRow(t, drv, "h", "later")
	wantRow(t, "failed, retry later", row, driver.LeaseFailed, 1, 1, "w")
	if row.LastError != "503 from downstream" || !row.LeaseUntil.IsZero() {
		t.Fatalf("failed row: %+v", row)
	}
	if d := row.NextAttemptAt.Sub(row.Now); d < 59*time.Minute || d > 61*time.Minute {
		t.Fatalf("next attempt in %s, want about 1h", d)
	}
	if c := claim("later"); c.Claimed || c.Existing.Status != driver.LeaseFailed {
		t.Fatalf("claim before the next attempt time: %+v", c)
	}

	// Retry at once: claimable, the token and attempts move on, the last
	// error stays for diagnosis until done.
	claim("now")
	fail("now", 1, 0, false)
	c := claim("now")
	if !c.Claimed || c.Token != 2 || c.Attempt != 2 {
		t.Fatalf("claim after the next attempt time: %+v", c)
	}
	row = leaseRow(t, drv, "h", "now")
	wantRow(t, "re-claimed", row, driver.LeaseRunning, 2, 2, "w")
	if !row.NextAttemptAt.IsZero() || row.LastError != "503 from downstream" {
		t.Fatalf("re-claimed row: %+v", row)
	}

	// Permanent: never claimable again.
	fail("now", 2, 0, true)
	row = leaseRow(t, drv, "h", "now")
	if row.Status != driver.LeaseFailed || !row.NextAttemptAt.IsZero() {
		t.Fatalf("permanently failed row: %+v", row)
	}
	if c := claim("now"); c.Claimed {
		t.Fatalf("claimed a permanently failed row: %+v", c)
	}
}

// testLeaseClaimAtomic has many goroutines claim one key at once, three
// times: a fresh key (the insert races), a failed row due for retry and an
// expired lease (the take-over races). Exactly one wins each time, with the
// next token. The racing claims ask for a long lease, so that however slowly
// the goroutines get to run, no lease expires within a round.
func testLeaseClaimAtomic(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	const n = 12
	hash := []byte("0123456789abcdef0123456789abcdef")
	round := func(what string, wantToken int64) {
		t.Helper()
		var wg sync.WaitGroup
		var won atomic.Int64
		tokens := make([]int64, n)
		errs := make([]error, n)
		start := make(chan struct{})
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				r, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "h", MessageID: "race", PayloadHash: hash, Owner: fmt.Sprintf("w%d", i), TTL: time.Minute})
				errs[i] = err
				if err == nil && r.Claimed {
					won.Add(1)
					tokens[i] = r.Token
				}
			}()
		}
		close(start)
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		if won.Load() != 1 {
			t.Fatalf("%s: %d of %d concurrent claims won, want 1", what, won.Load(), n)
		}
		for _, tok := range tokens {
			if tok != 0 && tok != wantToken {
				t.Fatalf("%s: winning token %d, want %d", what, tok, wantToken)
			}
		}
	}
	round("fresh key", 1)
	if r, err := drv.LeaseFail(ctx, &driver.LeaseFailParams{Handler: "h", MessageID: "race", Token: 1, LastError: "x", RetryIn: 0}); err != nil || !r.OK {
		t.Fatalf("fail: %+v, %v", r, err)
	}
	round("failed row due for retry", 2)
	// A heartbeat sets the expiry TTL from now: a tiny TTL ends the lease.
	if r, err := drv.LeaseHeartbeat(ctx, &driver.LeaseHeartbeatParams{Handler: "h", MessageID: "race", Token: 2, TTL: time.Millisecond}); err != nil || !r.OK {
		t.Fatalf("heartbeat: %+v, %v", r, err)
	}
	time.Sleep(20 * time.Millisecond)
	round("expired lease", 3)
	wantRow(t, "after three rounds", leaseRow(t, drv, "h", "race"), driver.LeaseRunning, 3, 3, "")
}

// answerLost is a store whose next LeaseClaim is written but answered
// with an error, as when the connection breaks or the server crashes
// between its commit and its reply.
type answerLost struct {
	driver.LeaseDriver
	lose atomic.Bool
}

var errAnswerLost = errors.New("read: connection reset by peer")

func (a *answerLost) LeaseClaim(ctx context.Context, p *driver.LeaseClaimParams) (driver.LeaseClaimResult, error) {
	res, err := a.LeaseDriver.LeaseClaim(ctx, p)
	if err == nil && a.lose.CompareAndSwap(true, false) {
		return driver.LeaseClaimResult{}, errAnswerLost
	}
	return res, err
}

// testLeaseClaimAnswerLost: a claim the store wrote but whose answer was
// lost is taken up by the same processor's next claim of the message, at
// once rather than when its hour-long lease runs out; a worker of the same
// name in another process (another LeaseProcessor) cannot take it up.
func testLeaseClaimAnswerLost(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	lossy := &answerLost{LeaseDriver: drv}
	a := leaseProc(t, lossy, &idem.LeaseConfig{Owner: "worker", TTL: time.Hour})
	twin := leaseProc(t, drv, &idem.LeaseConfig{Owner: "worker", TTL: time.Hour})
	var c callCounter
	h := c.handler("mailer", nil)
	msg := &idem.Message{ID: "welcome-7", Payload: []byte("p")}
	lossy.lose.Store(true)
	if out, err := a.Process(ctx, h, msg); !errors.Is(err, errAnswerLost) || out != idem.OutcomeNone {
		t.Fatalf("claim with a lost answer: (%v, %v), want the store's error", out, err)
	}
	wantRow(t, "after the lost answer", leaseRow(t, drv, "mailer", msg.ID), driver.LeaseRunning, 1, 1, "worker")
	out, err := twin.Process(ctx, h, msg)
	wantOutcome(t, "a twin worker of the same name", out, err, idem.InFlight)
	out, err = a.Process(ctx, h, msg)
	wantOutcome(t, "the same worker again", out, err, idem.Applied)
	if n := c.count(msg.ID); n != 1 {
		t.Fatalf("handler called %d times, want once", n)
	}
	wantRow(t, "after the take-up", leaseRow(t, drv, "mailer", msg.ID), driver.LeaseDone, 1, 1, "worker")
	out, err = a.Process(ctx, h, msg)
	wantOutcome(t, "a redelivery", out, err, idem.Duplicate)
}

func testLeaseInFlight(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	a := leaseProc(t, drv, &idem.LeaseConfig{Owner: "a"})
	b := leaseProc(t, drv, &idem.LeaseConfig{Owner: "b"})
	var c callCounter
	started, release := make(chan struct{}), make(chan struct{})
	slow := c.handler("webhook", func(context.Context, *idem.Lease, *idem.Message) error {
		close(started)
		<-release
		return nil
	})
	msg := &idem.Message{ID: "evt-1", Payload: []byte("p")}
	type result struct {
		out idem.Outcome
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := a.Process(ctx, slow, msg)
		done <- result{out, err}
	}()
	<-started
	var other callCounter
	for range 3 {
		out, err := b.Process(ctx, other.handler("webhook", nil), msg)
		wantOutcome(t, "delivery while another worker holds the lease", out, err, idem.InFlight)
	}
	if other.count(msg.ID) != 0 {
		t.Fatal("handler ran while another worker held the lease")
	}
	close(release)
	r := <-done
	wantOutcome(t, "the lease holder", r.out, r.err, idem.Applied)
	out, err := b.Process(ctx, other.handler("webhook", nil), msg)
	wantOutcome(t, "delivery after done", out, err, idem.Duplicate)
	if c.count(msg.ID)+other.count(msg.ID) != 1 {
		t.Fatalf("handler ran %d times in all, want 1", c.count(msg.ID)+other.count(msg.ID))
	}
}

func testLeaseConflict(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, &idem.LeaseConfig{BackoffBase: time.Hour})
	var c callCounter
	h := c.handler("charge", nil)
	v1 := &idem.Message{ID: "order-7", Payload: []byte("amount=100")}
	v2 := &idem.Message{ID: "order-7", Payload: []byte("amount=999")}
	out, err := p.Process(ctx, h, v1)
	wantOutcome(t, "first delivery", out, err, idem.Applied)

	out, err = p.Process(ctx, h, v2)
	var ce *idem.ConflictError
	if out != idem.Conflict || !errors.As(err, &ce) || !errors.Is(err, idem.ErrConflict) || !idem.IsPermanent(err) {
		t.Fatalf("same ID, other payload after done: (%v, %v), want a permanent *ConflictError", out, err)
	}
	if ce.Handler != "charge" || ce.MessageID != "order-7" || string(ce.StoredHash) == string(ce.ReceivedHash) {
		t.Fatalf("ConflictError fields: %+v", ce)
	}
	warn := *h
	warn.OnConflict = idem.OnConflictWarn
	out, err = p.Process(ctx, &warn, v2)
	wantOutcome(t, "conflict under the warn policy", out, err, idem.Duplicate)

	// A failed row that may be retried is not taken over by another
	// payload either: only the original payload retries it.
	boom := errors.New("downstream 500")
	failing := c.handler("charge", func(context.Context, *idem.Lease, *idem.Message) error { return boom })
	f1 := &idem.Message{ID: "order-8", Payload: []byte("amount=1")}
	if out, err := p.Process(ctx, failing, f1); out != idem.OutcomeNone || !errors.Is(err, boom) {
		t.Fatalf("failing handler: (%v, %v)", out, err)
	}
	out, err = p.Process(ctx, h, &idem.Message{ID: "order-8", Payload: []byte("amount=2")})
	if out != idem.Conflict || !errors.Is(err, idem.ErrConflict) {
		t.Fatalf("other payload for a failed row: (%v, %v), want conflict", out, err)
	}
	if n := c.count("order-7") + c.count("order-8"); n != 2 {
		t.Fatalf("handler ran %d times, want 2 (conflicts never run)", n)
	}
	wantRow(t, "failed row after a conflict", leaseRow(t, drv, "charge", "order-8"), driver.LeaseFailed, 1, 1, "")
}

func testLeaseRetry(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	var c callCounter
	boom := errors.New("downstream 503")
	fails := 1
	h := c.handler("notify", func(context.Context, *idem.Lease, *idem.Message) error {
		if fails > 0 {
			fails--
			return boom
		}
		return nil
	})

	// A long backoff: the failed row answers InFlight until its time.
	slow := leaseProc(t, drv, &idem.LeaseConfig{BackoffBase: 24 * time.Hour})
	later := &idem.Message{ID: "later", Payload: []byte("x")}
	out, err := slow.Process(ctx, h, later)
	if out != idem.OutcomeNone || !errors.Is(err, boom) || idem.IsPermanent(err) {
		t.Fatalf("failing handler: (%v, %v), want (none, retriable %v)", out, err, boom)
	}
	row := leaseRow(t, drv, "notify", "later")
	wantRow(t, "failed", row, driver.LeaseFailed, 1, 1, "")
	if !strings.Contains(row.LastError, "downstream 503") || !row.NextAttemptAt.After(row.Now) {
		t.Fatalf("failed row: last error %q, next attempt %v (now %v)", row.LastError, row.NextAttemptAt, row.Now)
	}
	out, err = slow.Process(ctx, h, later)
	wantOutcome(t, "redelivery before the next attempt time", out, err, idem.InFlight)
	if n := c.count("later"); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}

	// A short backoff: retried, with the next token.
	fails = 1
	fast := leaseProc(t, drv, &idem.LeaseConfig{BackoffBase: 50 * time.Millisecond, BackoffMax: 50 * time.Millisecond})
	soon := &idem.Message{ID: "soon", Payload: []byte("y")}
	if out, err := fast.Process(ctx, h, soon); !errors.Is(err, boom) || out != idem.OutcomeNone {
		t.Fatalf("failing handler: (%v, %v)", out, err)
	}
	row = leaseRow(t, drv, "notify", "soon")
	if d := row.NextAttemptAt.Sub(row.Now); row.Status != driver.LeaseFailed || d > 50*time.Millisecond {
		t.Fatalf("failed row %s, next attempt in %s; want within the 50ms backoff ceiling", row.Status, d)
	}
	out, _, err = processUntilSettled(ctx, fast, h, soon, 5*time.Second)
	wantOutcome(t, "retry after the backoff", out, err, idem.Applied)
	if l := c.last(); l.Token != 2 || l.Attempt != 2 {
		t.Fatalf("retry ran with %+v, want token 2, attempt 2", l)
	}
	wantRow(t, "done after retry", leaseRow(t, drv, "notify", "soon"), driver.LeaseDone, 2, 2, "")
	if n := c.count("soon"); n != 2 {
		t.Fatalf("handler ran %d times, want 2", n)
	}
}

func testLeasePermanent(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, &idem.LeaseConfig{BackoffBase: time.Millisecond})
	var c callCounter
	bad := errors.New("payload does not decode")
	h := c.handler("importer", func(context.Context, *idem.Lease, *idem.Message) error { return idem.Permanent(bad) })
	msg := &idem.Message{ID: "rec-1", Payload: []byte("garbage")}
	out, err := p.Process(ctx, h, msg)
	if out != idem.OutcomeNone || !errors.Is(err, bad) || !idem.IsPermanent(err) {
		t.Fatalf("permanent failure: (%v, %v)", out, err)
	}
	row := leaseRow(t, drv, "importer", "rec-1")
	if row.Status != driver.LeaseFailed || !row.NextAttemptAt.IsZero() || !strings.Contains(row.LastError, "payload does not decode") {
		t.Fatalf("permanently failed row: %+v", row)
	}
	time.Sleep(5 * time.Millisecond)
	for range 2 {
		out, err = p.Process(ctx, h, msg)
		if out != idem.OutcomeNone || !errors.Is(err, idem.ErrFailedPermanently) || !idem.IsPermanent(err) || !strings.Contains(err.Error(), "payload does not decode") {
			t.Fatalf("redelivery of a permanently failed message: (%v, %v)", out, err)
		}
	}
	if n := c.count("rec-1"); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

func testLeaseMaxAttempts(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, &idem.LeaseConfig{MaxAttempts: 3, BackoffBase: time.Millisecond, BackoffMax: time.Millisecond})
	var c callCounter
	boom := errors.New("timeout")
	h := c.handler("sync", func(context.Context, *idem.Lease, *idem.Message) error { return boom })
	msg := &idem.Message{ID: "acct-9", Payload: []byte("z")}
	for attempt := 1; attempt <= 3; attempt++ {
		out, _, err := processUntilSettled(ctx, p, h, msg, 5*time.Second)
		if out != idem.OutcomeNone || !errors.Is(err, boom) {
			t.Fatalf("attempt %d: (%v, %v)", attempt, out, err)
		}
		if got, want := idem.IsPermanent(err), attempt == 3; got != want {
			t.Fatalf("attempt %d: permanent %v, want %v (%v)", attempt, got, want, err)
		}
	}
	row := leaseRow(t, drv, "sync", "acct-9")
	wantRow(t, "after MaxAttempts", row, driver.LeaseFailed, 3, 3, "")
	if !row.NextAttemptAt.IsZero() {
		t.Fatalf("next attempt %v after MaxAttempts, want none", row.NextAttemptAt)
	}
	time.Sleep(5 * time.Millisecond)
	if out, err := p.Process(ctx, h, msg); out != idem.OutcomeNone || !errors.Is(err, idem.ErrFailedPermanently) {
		t.Fatalf("delivery after MaxAttempts: (%v, %v)", out, err)
	}
	if n := c.count("acct-9"); n != 3 {
		t.Fatalf("handler ran %d times, want 3", n)
	}

	// An attempt that ends without a verdict (its worker crashed) still
	// uses one up: past MaxAttempts the handler is not called again.
	p2 := leaseProc(t, drv, &idem.LeaseConfig{MaxAttempts: 2, BackoffBase: time.Millisecond, BackoffMax: time.Millisecond})
	msg2 := &idem.Message{ID: "acct-10", Payload: []byte("z")}
	if out, err := p2.Process(ctx, h, msg2); out != idem.OutcomeNone || !errors.Is(err, boom) || idem.IsPermanent(err) {
		t.Fatalf("attempt 1: (%v, %v), want a retriable failure", out, err)
	}
	time.Sleep(5 * time.Millisecond)
	if res, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "sync", MessageID: "acct-10", PayloadHash: msg2.PayloadHash(),
		Owner: "crashed", TTL: 20 * time.Millisecond}); err != nil || !res.Claimed || res.Attempt != 2 {
		t.Fatalf("attempt 2 by a worker that crashes: %+v, %v", res, err)
	}
	time.Sleep(50 * time.Millisecond) // its lease expires
	if out, err := p2.Process(ctx, h, msg2); out != idem.OutcomeNone || !idem.IsPermanent(err) {
		t.Fatalf("claim 3 with MaxAttempts 2: (%v, %v), want a permanent failure", out, err)
	}
	if n := c.count("acct-10"); n != 1 {
		t.Fatalf("handler ran %d times for acct-10, want 1 (attempt 2 crashed, 3 is past MaxAttempts)", n)
	}
	row = leaseRow(t, drv, "sync", "acct-10")
	if row.Status != driver.LeaseFailed || !row.NextAttemptAt.IsZero() || row.Attempts != 2 {
		t.Fatalf("acct-10 after MaxAttempts: %+v, want failed for good after the 2 attempts that ran", row)
	}
}

func testLeasePanic(t *testing.T, drv driver.LeaseDriver) {
	ctx := context.Background()
	p := leaseProc(t, drv, &idem.LeaseConfig{BackoffBase: time.Millisecond, BackoffMax: time.Millisecond})
	var c callCounter
	first := true
	h := c.handler("pager", func(context.Context, *idem.Lease, *idem.Message) error {
		if first {
			first = false
			panic("nil map")
		}
		return nil
	})
	msg := &idem.Message{ID: "alert-1"}
	out, err := p.Process(ctx, h, msg)
	var pe *idem.PanicError
	if out != idem.OutcomeNone || !errors.As(err, &pe) || pe.Value != "nil map" || idem.IsPermanent(err) {
		t.Fatalf("panicking handler: (%v, %v), want a retriable *PanicError", out, err)
	}
	wantRow(t, "after the panic", leaseRow(t, drv, "pager", "alert-1"), driver.LeaseFailed, 1, 1, "")
	out, _, err = processUntilSettled(ctx, p, h, msg, 5*time.Second)
	wantOutcome(t, "retry after the panic", out, err, idem.Applied)
}

// testLeaseShutdown: a worker whose context is cancelled (shutting down)
// marks the message failed with no delay, so another worker takes it at
// once instead of waiting for the lease or the backoff.
func testLeaseShutdown(t *testing.T, drv driver.LeaseDriver) {
	a := leaseProc(t, drv, &idem.LeaseConfig{Owner: "a", BackoffBase: time.Hour})
	b := leaseProc(t, drv, &idem.LeaseConfig{Owner: "b"})
	var c callCounter
	started := make(chan struct{})
	h := c.handler("export", func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	})
	msg := &idem.Message{ID: "job-1"}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := a.Process(ctx, h, msg)
		done <- err
	}()
	<-started
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled worker returned %v, want context.Canceled", err)
	}
	row := leaseRow(t, drv, "export", "job-1")
	if row.Status != driver.LeaseFailed || row.NextAttemptAt.After(row.Now) {
		t.Fatalf("after shutdown: %+v, want failed and claimable now", row)
	}
	var other callCounter
	out, err := b.Process(context.Background(), other.handler("export", nil), msg)
	wantOutcome(t, "another worker right after the shutdown", out, err, idem.Applied)
}

// testLeaseHeartbeat runs a handler for several TTLs: heartbeats keep the
// lease, its context stays live and nobody else gets the message.
func testLeaseHeartbeat(t *testing.T, drv driver.LeaseDriver, ttl time.Duration) {
	ctx := context.Background()
	a := leaseProc(t, drv, &idem.LeaseConfig{Owner: "a", TTL: ttl, Heartbeat: ttl / 5})
	b := leaseProc(t, drv, &idem.LeaseConfig{Owner: "b", TTL: ttl})
	var c callCounter
	var ctxErr atomic.Value
	running := make(chan struct{})
	h := c.handler("report", func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		close(running)
		select {
		case <-ctx.Done():
			ctxErr.Store(context.Cause(ctx))
			return ctx.Err()
		case <-time.After(3 * ttl):
			return nil
		}
	})
	msg := &idem.Message{ID: "r-1"}
	done := make(chan error, 1)
	go func() {
		out, err := a.Process(ctx, h, msg)
		if err == nil && out != idem.Applied {
			err = fmt.Errorf("outcome %v", out)
		}
		done <- err
	}()
	<-running
	var other callCounter
	inflight := 0
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("long handler: %v (context cause %v)", err, ctxErr.Load())
			}
			if inflight < 3 {
				t.Fatalf("only %d deliveries saw the lease in flight", inflight)
			}
			if other.count(msg.ID) != 0 {
				t.Fatal("another worker ran the handler while the lease was held")
			}
			wantRow(t, "after a long handler", leaseRow(t, drv, "report", "r-1"), driver.LeaseDone, 1, 1, "a")
			return
		case <-time.After(ttl / 4):
			out, err := b.Process(ctx, other.handler("report", nil), msg)
			if err != nil || (out != idem.InFlight && out != idem.Duplicate) {
				t.Fatalf("delivery during a heartbeated lease: (%v, %v)", out, err)
			}
			if out == idem.InFlight {
				inflight++
			}
		}
	}
}

// testLeaseExpired: a worker that claimed and vanished (no heartbeat, no
// done) holds the message for TTL; then the next claim runs it with the
// next token.
func testLeaseExpired(t *testing.T, drv driver.LeaseDriver, ttl time.Duration) {
	ctx := context.Background()
	msg := &idem.Message{ID: "evt-9", Payload: []byte("v")}
	// Before the claim: the lease runs from a moment inside it, which
	// under load can be well before the claim returns.
	claimed := time.Now()
	r, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "indexer", MessageID: msg.ID, PayloadHash: msg.PayloadHash(), Owner: "vanished", TTL: ttl})
	if err != nil || !r.Claimed {
		t.Fatalf("claim: %+v, %v", r, err)
	}
	p := leaseProc(t, drv, &idem.LeaseConfig{TTL: ttl})
	var c callCounter
	firstTry := time.Since(claimed)
	out, inflight, err := processUntilSettled(ctx, p, c.handler("indexer", nil), msg, 10*ttl)
	wantOutcome(t, "after the lease expired", out, err, idem.Applied)
	// An in-flight answer is owed only if the first try surely came while
	// the lease was live; a stalled test goroutine may come after.
	if waited := time.Since(claimed); waited < ttl*9/10 || inflight == 0 && firstTry < ttl/2 {
		t.Fatalf("applied after %s and %d in-flight answers; the lease of %s was not respected", waited, inflight, ttl)
	}
	if l := c.last(); l.Token != 2 || l.Attempt != 2 {
		t.Fatalf("re-claim ran with %+v, want token 2, attempt 2", l)
	}
}

// lostRecorder is a HookLeaseLost that keeps the events.
type lostRecorder struct {
	mu     sync.Mutex
	events []idem.LeaseLostEvent
	notify chan string
}

func (r *lostRecorder) OnLeaseLost(_ context.Context, ev *idem.LeaseLostEvent) {
	r.mu.Lock()
	r.events = append(r.events, *ev)
	r.mu.Unlock()
	select {
	case r.notify <- ev.Op:
	default:
	}
}

func (r *lostRecorder) ops() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	ops := make([]string, len(r.events))
	for i, e := range r.events {
		ops[i] = e.Op
	}
	return ops
}

// testLeaseZombie: worker A pauses (its heartbeats stall) past its lease;
// B claims and finishes; A's context was cancelled, and A's late heartbeat
// and done (or failed) are refused as fenced and reported.
func testLeaseZombie(t *testing.T, drv driver.LeaseDriver, ttl time.Duration, fails bool) {
	ctx := context.Background()
	unpause := make(chan struct{})
	lostA := &lostRecorder{notify: make(chan string, 8)}
	a := leaseProc(t, drv, &idem.LeaseConfig{Owner: "zombie-a", TTL: ttl, Hooks: []idem.Hook{lostA},
		FaultHook: func(point string) {
			if point == idem.FaultBeforeHeartbeat {
				<-unpause // the pause: no heartbeat goes out
			}
		}})
	b := leaseProc(t, drv, &idem.LeaseConfig{Owner: "worker-b", TTL: ttl})

	msg := &idem.Message{ID: "invoice-3", Payload: []byte("total=12")}
	smtp := errors.New("smtp: connection reset")
	started, bDone := make(chan struct{}), make(chan struct{})
	var aCancelled, aCause error
	var ca callCounter
	zombie := ca.handler("invoice.mail", func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		close(started)
		<-bDone // paused, and deaf to its context: the worst case
		select {
		case <-ctx.Done():
			aCancelled, aCause = ctx.Err(), context.Cause(ctx)
		case <-time.After(5 * time.Second):
		}
		close(unpause)
		// Let the late heartbeat go out and be refused before returning.
		waitOp(t, lostA, "heartbeat")
		if fails {
			return smtp
		}
		return nil
	})
	type result struct {
		out idem.Outcome
		err error
	}
	aRes := make(chan result, 1)
	beforeA := time.Now() // A's lease runs at least TTL from here
	go func() {
		out, err := a.Process(ctx, zombie, msg)
		aRes <- result{out, err}
	}()
	<-started

	var cb callCounter
	firstTry := time.Since(beforeA)
	out, inflight, err := processUntilSettled(ctx, b, cb.handler("invoice.mail", nil), msg, 20*ttl)
	wantOutcome(t, "worker B", out, err, idem.Applied)
	// B is owed InFlight only if its first try surely came while A's lease
	// was live; a stalled test goroutine may come after.
	if inflight == 0 && firstTry < ttl/2 {
		t.Fatal("B was never told InFlight while A's lease was live")
	}
	if l := cb.last(); l.Token != 2 {
		t.Fatalf("B ran with token %d, want 2", l.Token)
	}
	close(bDone)
	r := <-aRes

	if aCancelled == nil || !errors.Is(aCause, idem.ErrLeaseExpired) {
		t.Fatalf("A's context: err %v, cause %v; want cancelled with ErrLeaseExpired", aCancelled, aCause)
	}
	var fe *idem.FencedError
	wantOp := "done"
	if fails {
		wantOp = "failed"
	}
	if r.out != idem.OutcomeNone || !errors.Is(r.err, idem.ErrFenced) || !errors.As(r.err, &fe) {
		t.Fatalf("A's late %s: (%v, %v), want a *FencedError", wantOp, r.out, r.err)
	}
	if fe.Op != wantOp || fe.Token != 1 || fe.CurrentToken != 2 || !claimedBy(fe.CurrentOwner, "worker-b") || fe.CurrentStatus != "done" {
		t.Fatalf("FencedError %+v", fe)
	}
	if fails && !errors.Is(r.err, smtp) {
		t.Fatalf("A's error %v does not carry the handler's error", r.err)
	}
	ops := strings.Join(lostA.ops(), ",")
	if ops != "expired,heartbeat,"+wantOp {
		t.Fatalf("A reported lost leases %q, want expired,heartbeat,%s", ops, wantOp)
	}
	wantRow(t, "after the zombie", leaseRow(t, drv, "invoice.mail", msg.ID), driver.LeaseDone, 2, 2, "worker-b")
	if ca.count(msg.ID) != 1 || cb.count(msg.ID) != 1 {
		t.Fatalf("A ran %d times and B %d, want 1 each", ca.count(msg.ID), cb.count(msg.ID))
	}
}

func waitOp(t *testing.T, r *lostRecorder, op string) {
	timeout := time.After(10 * time.Second)
	for {
		select {
		case got := <-r.notify:
			if got == op {
				return
			}
		case <-timeout:
			t.Errorf("no %q lease loss reported; got %v", op, r.ops())
			return
		}
	}
}

// CheckConcurrentLeaseWorkers has workers (each its own LeaseProcessor and
// owner) process the same ids messages at once, redelivering InFlight
// answers later as a broker would. All workers walk the IDs in the same
// blocks of ten, each block in each worker's own shuffled order, so that
// they keep meeting on the same IDs at the same time. It returns
// an error unless the handler ran exactly once per ID, exactly one delivery
// per ID was Applied and every other ended Duplicate, no delivery failed, no
// write was refused as fenced, and every row ended done with token 1 (no
// lease was ever taken over). It also returns how many deliveries were
// answered InFlight: how often workers really met on one ID.
func CheckConcurrentLeaseWorkers(ctx context.Context, drv driver.LeaseDriver, workers, ids int) (inflightAnswers int64, err error) {
	const name = "concurrent.webhook"
	msgs := make([]*idem.Message, ids)
	index := make(map[string]int, ids)
	for i := range msgs {
		msgs[i] = &idem.Message{ID: fmt.Sprintf("evt-%05d", i), Payload: []byte(fmt.Sprintf("n=%d", i))}
		index[msgs[i].ID] = i
	}
	calls := make([]atomic.Int64, ids)
	var applied, duplicates, inflight, failed atomic.Int64
	var fenced fenceCounter
	var errOnce sync.Once
	var errSample error
	h := &idem.LeaseHandler{Name: name, Call: func(ctx context.Context, l *idem.Lease, m *idem.Message) error {
		calls[index[m.ID]].Add(1)
		time.Sleep(2 * time.Millisecond) // a downstream call: long enough to overlap
		return nil
	}}
	procs := make([]*idem.LeaseProcessor, workers)
	for w := range procs {
		p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{
			Owner: fmt.Sprintf("worker-%02d", w), TTL: time.Minute, Hooks: []idem.Hook{&fenced},
		})
		if err != nil {
			return 0, err
		}
		procs[w] = p
	}
	start := make(chan struct{})
	var wg sync.WaitGroup
	for w, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 11))
			pending := make([]int, 0, ids)
			for lo := 0; lo < ids; lo += 10 {
				for _, k := range r.Perm(min(10, ids-lo)) {
					pending = append(pending, lo+k)
				}
			}
			<-start
			for len(pending) > 0 {
				var later []int
				for _, i := range pending {
					out, err := p.Process(ctx, h, msgs[i])
					switch {
					case err != nil:
						failed.Add(1)
						errOnce.Do(func() { errSample = err })
					case out == idem.Applied:
						applied.Add(1)
					case out == idem.Duplicate:
						duplicates.Add(1)
					case out == idem.InFlight:
						inflight.Add(1)
						later = append(later, i)
					default:
						failed.Add(1)
						errOnce.Do(func() { errSample = fmt.Errorf("unexpected outcome %v", out) })
					}
				}
				pending = later
				if len(later) > 0 {
					time.Sleep(time.Millisecond)
				}
			}
		}()
	}
	close(start)
	wg.Wait()

	var problems []string
	if n := failed.Load(); n > 0 {
		problems = append(problems, fmt.Sprintf("%d deliveries failed, first: %v", n, errSample))
	}
	if got := applied.Load(); got != int64(ids) {
		problems = append(problems, fmt.Sprintf("applied %d, want %d", got, ids))
	}
	if got, want := duplicates.Load(), int64((workers-1)*ids); got != want {
		problems = append(problems, fmt.Sprintf("duplicates %d, want %d", got, want))
	}
	if n := fenced.n.Load(); n > 0 {
		problems = append(problems, fmt.Sprintf("%d writes were refused as fenced", n))
	}
	var wrongCalls []string
	for i := range calls {
		if n := calls[i].Load(); n != 1 {
			wrongCalls = append(wrongCalls, fmt.Sprintf("%s ran %d times", msgs[i].ID, n))
		}
	}
	if len(wrongCalls) > 0 {
		problems = append(problems, fmt.Sprintf("%d IDs did not run exactly once (%s)", len(wrongCalls), strings.Join(wrongCalls[:min(5, len(wrongCalls))], ", ")))
	}
	var badRows int
	for _, m := range msgs {
		row, err := drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: name, MessageID: m.ID})
		if err != nil {
			return inflight.Load(), err
		}
		if row == nil || row.Status != driver.LeaseDone || row.Token != 1 || row.Attempts != 1 {
			badRows++
		}
	}
	if badRows > 0 {
		problems = append(problems, fmt.Sprintf("%d rows are not done with token 1", badRows))
	}
	if len(problems) > 0 {
		return inflight.Load(), fmt.Errorf("concurrent lease workers (%d × %d IDs, %d in-flight answers): %s",
			workers, ids, inflight.Load(), strings.Join(problems, "; "))
	}
	return inflight.Load(), nil
}

// fenceCounter counts fenced writes.
type fenceCounter struct{ n atomic.Int64 }

// OnLeaseLost implements idem.HookLeaseLost.
func (c *fenceCounter) OnLeaseLost(_ context.Context, ev *idem.LeaseLostEvent) {
	if errors.Is(ev.Err, idem.ErrFenced) {
		c.n.Add(1)
	}
}
