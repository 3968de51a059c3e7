package idem_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

func leaseDriver(t testing.TB) *sqlite.Driver {
	t.Helper()
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "lease.db"), nil)
	return drv
}

func TestLeaseConfigDefaults(t *testing.T) {
	t.Parallel()
	p, err := idem.NewLeaseProcessor(leaseDriver(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	c := p.Config()
	host, _ := os.Hostname()
	wantOwner := fmt.Sprintf("%s:%d", host, os.Getpid())
	if c.TTL != 15*time.Minute || c.Heartbeat != 30*time.Second || c.Owner != wantOwner ||
		c.BackoffBase != time.Second || c.BackoffMax != 5*time.Minute || c.MaxAttempts != 0 || c.Logger == nil {
		t.Fatalf("defaults: %+v, want TTL 15m, heartbeat 30s, owner %q, backoff 1s..5m, unlimited attempts", c, wantOwner)
	}

	// Setting only a short TTL keeps the default heartbeat valid.
	for ttl, want := range map[time.Duration]time.Duration{
		90 * time.Second:       30 * time.Second,
		30 * time.Second:       10 * time.Second,
		300 * time.Millisecond: 100 * time.Millisecond,
		time.Hour:              30 * time.Second,
	} {
		p, err := idem.NewLeaseProcessor(leaseDriver(t), &idem.LeaseConfig{TTL: ttl})
		if err != nil {
			t.Fatalf("TTL %s alone: %v", ttl, err)
		}
		if got := p.Config().Heartbeat; got != want {
			t.Errorf("TTL %s: default heartbeat %s, want %s", ttl, got, want)
		}
	}
}

func TestLeaseConfigRejected(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	cases := map[string]idem.LeaseConfig{
		"TTL below 1ms":              {TTL: 500 * time.Microsecond},
		"negative TTL":               {TTL: -time.Second},
		"heartbeat equal to TTL/2":   {TTL: time.Minute, Heartbeat: 30 * time.Second},
		"heartbeat above TTL/2":      {TTL: time.Minute, Heartbeat: 45 * time.Second},
		"default heartbeat vs TTL":   {TTL: 40 * time.Second, Heartbeat: 30 * time.Second},
		"negative heartbeat":         {Heartbeat: -time.Second},
		"owner with NUL":             {Owner: "pod\x007"},
		"owner not UTF-8":            {Owner: "pod-\xff"},
		"owner too long":             {Owner: strings.Repeat("o", idem.MaxIDLen+1)},
		"backoff max below base":     {BackoffBase: time.Minute, BackoffMax: time.Second},
		"negative backoff base":      {BackoffBase: -time.Second, BackoffMax: time.Second},
		"negative max attempts":      {MaxAttempts: -1},
		"hook implementing nothing":  {Hooks: []idem.Hook{42}},
		"heartbeat above a long TTL": {TTL: time.Hour, Heartbeat: time.Hour},
	}
	for name, cfg := range cases {
		if _, err := idem.NewLeaseProcessor(drv, &cfg); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: got %v, want ErrInvalidConfig", name, err)
		}
	}
	if _, err := idem.NewLeaseProcessor(nil, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("nil driver: got %v, want ErrInvalidConfig", err)
	}
	// The message names the setting and its environment variable.
	_, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: time.Minute, Heartbeat: time.Minute})
	if err == nil || !strings.Contains(err.Error(), "Heartbeat (IDEM_LEASE_HEARTBEAT)") || !strings.Contains(err.Error(), "TTL/2 = 30s") {
		t.Errorf("heartbeat error does not explain itself: %v", err)
	}
}

// TestLeaseConfigFromEnv sets process environment variables, so it cannot
// run in parallel.
func TestLeaseConfigFromEnv(t *testing.T) {
	t.Setenv(idem.EnvLeaseTTL, "2m")
	t.Setenv(idem.EnvLeaseHeartbeat, "20s")
	t.Setenv(idem.EnvLeaseOwner, "orders-7f9c")
	cfg := &idem.LeaseConfig{TTL: time.Hour, Heartbeat: time.Minute, Owner: "from-code", MaxAttempts: 4}
	if err := cfg.FromEnv(); err != nil {
		t.Fatal(err)
	}
	if cfg.TTL != 2*time.Minute || cfg.Heartbeat != 20*time.Second || cfg.Owner != "orders-7f9c" || cfg.MaxAttempts != 4 {
		t.Fatalf("after FromEnv: %+v", cfg)
	}
	p, err := idem.NewLeaseProcessor(leaseDriver(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Config(); got.TTL != 2*time.Minute || got.Owner != "orders-7f9c" {
		t.Fatalf("processor config %+v", got)
	}

	// Empty variables leave the fields alone.
	t.Setenv(idem.EnvLeaseTTL, "")
	t.Setenv(idem.EnvLeaseHeartbeat, "")
	t.Setenv(idem.EnvLeaseOwner, "")
	cfg = &idem.LeaseConfig{TTL: time.Hour, Owner: "from-code"}
	if err := cfg.FromEnv(); err != nil || cfg.TTL != time.Hour || cfg.Heartbeat != 0 || cfg.Owner != "from-code" {
		t.Fatalf("empty variables: %+v, %v", cfg, err)
	}

	for name, val := range map[string]string{
		idem.EnvLeaseTTL:       "fifteen minutes",
		idem.EnvLeaseHeartbeat: "-5s",
	} {
		t.Setenv(name, val)
		err := (&idem.LeaseConfig{}).FromEnv()
		if !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), name) {
			t.Errorf("%s=%q: got %v, want ErrInvalidConfig naming the variable", name, val, err)
		}
		t.Setenv(name, "")
	}
	t.Setenv(idem.EnvLeaseTTL, "0s")
	if err := (&idem.LeaseConfig{}).FromEnv(); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("TTL 0s: got %v, want ErrInvalidConfig", err)
	}
}

// TestLeaseConfigFromEnvAllOrNothing checks that a bad variable leaves
// every field as it was, even the ones whose variables were good. It sets
// process environment variables, so it cannot run in parallel.
func TestLeaseConfigFromEnvAllOrNothing(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		ttl, heartbeat, owner string
		wantVar               string
	}{
		{"bad heartbeat after a good TTL", "2m", "soon", "orders-7f9c", idem.EnvLeaseHeartbeat},
		{"negative heartbeat after a good TTL", "2m", "-5s", "", idem.EnvLeaseHeartbeat},
		{"owner too long after good durations", "2m", "20s", strings.Repeat("o", idem.MaxIDLen+1), idem.EnvLeaseOwner},
		{"owner not UTF-8", "", "", "orders-\xff", idem.EnvLeaseOwner},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(idem.EnvLeaseTTL, tc.ttl)
			t.Setenv(idem.EnvLeaseHeartbeat, tc.heartbeat)
			t.Setenv(idem.EnvLeaseOwner, tc.owner)
			want := idem.LeaseConfig{TTL: time.Hour, Heartbeat: time.Minute, Owner: "from-code", MaxAttempts: 4}
			cfg := want
			err := cfg.FromEnv()
			if !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.wantVar) {
				t.Fatalf("got %v, want ErrInvalidConfig naming %s", err, tc.wantVar)
			}
			if cfg.TTL != want.TTL || cfg.Heartbeat != want.Heartbeat || cfg.Owner != want.Owner || cfg.MaxAttempts != want.MaxAttempts {
				t.Fatalf("FromEnv failed but changed the config: got %+v, want %+v", cfg, want)
			}
		})
	}
}

func TestIdempotencyKey(t *testing.T) {
	t.Parallel()
	// printf 'payments.charge\0order-42' | sha256sum
	const want = "2516c16688970d136ea2cbfa2cb3a658b01228d92c7fc7dbde0fabf56dcf0685"
	if got := idem.IdempotencyKey("payments.charge", "order-42"); got != want {
		t.Fatalf("key %s, want %s", got, want)
	}
	if idem.IdempotencyKey("a:b", "c") == idem.IdempotencyKey("a", "b:c") {
		t.Fatal("keys are ambiguous across the handler/ID boundary")
	}
	long := idem.IdempotencyKey("h", strings.Repeat("é", 127))
	if len(long) != 64 || strings.Trim(long, "0123456789abcdef") != "" {
		t.Fatalf("key %q is not 64 lower-case hex characters", long)
	}
}

func TestFencedErrorMatches(t *testing.T) {
	t.Parallel()
	fe := &idem.FencedError{Op: "done", Handler: "h", MessageID: "m", Token: 3, CurrentToken: 4, CurrentOwner: "b", CurrentStatus: "running"}
	err := fmt.Errorf("wrapped: %w", fe)
	var got *idem.FencedError
	if !errors.Is(err, idem.ErrFenced) || !errors.As(err, &got) || got.CurrentToken != 4 {
		t.Fatalf("errors.Is/As on %v", err)
	}
	if errors.Is(err, idem.ErrConflict) || idem.IsPermanent(err) {
		t.Fatal("a fenced error matches what it is not")
	}
	for _, s := range []string{`"h"`, `"m"`, "done with token 3", "running with token 4", `"b"`} {
		if !strings.Contains(fe.Error(), s) {
			t.Errorf("%q lacks %q", fe.Error(), s)
		}
	}
	if idem.InFlight.String() != "in_flight" {
		t.Errorf("InFlight.String() = %q", idem.InFlight.String())
	}
}

// lostHook records lost leases and outcomes.
type lostHook struct {
	mu       sync.Mutex
	lost     []idem.LeaseLostEvent
	outcomes []idem.Outcome
}

func (h *lostHook) OnLeaseLost(_ context.Context, ev *idem.LeaseLostEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lost = append(h.lost, *ev)
}

func (h *lostHook) OnOutcome(_ context.Context, ev *idem.OutcomeEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.outcomes = append(h.outcomes, ev.Outcome)
}

// TestLeaseStoreLostMidHandler closes the database while the handler runs:
// heartbeats fail, the lease runs out locally, the handler's context is
// cancelled with ErrLeaseExpired, the loss is reported, and Process returns
// an error (nothing recorded) instead of claiming success.
func TestLeaseStoreLostMidHandler(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	hook := &lostHook{}
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: 300 * time.Millisecond, Hooks: []idem.Hook{hook}})
	if err != nil {
		t.Fatal(err)
	}
	var cause error
	h := &idem.LeaseHandler{Name: "uploader", Call: func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		drv.DB().Close()
		select {
		case <-ctx.Done():
			cause = context.Cause(ctx)
			return ctx.Err()
		case <-time.After(5 * time.Second):
			return errors.New("context never cancelled")
		}
	}}
	start := time.Now()
	out, err := p.Process(context.Background(), h, &idem.Message{ID: "file-1"})
	if out != idem.OutcomeNone || err == nil {
		t.Fatalf("got (%v, %v), want an error", out, err)
	}
	if !errors.Is(cause, idem.ErrLeaseExpired) {
		t.Fatalf("handler context cause %v, want ErrLeaseExpired", cause)
	}
	if d := time.Since(start); d < 250*time.Millisecond || d > 3*time.Second {
		t.Fatalf("cancelled after %s, want about the 300ms TTL", d)
	}
	hook.mu.Lock()
	defer hook.mu.Unlock()
	if len(hook.lost) != 1 || hook.lost[0].Op != "expired" || !errors.Is(hook.lost[0].Err, idem.ErrLeaseExpired) || hook.lost[0].Token != 1 {
		t.Fatalf("lost-lease reports %+v, want one expiry of token 1", hook.lost)
	}
	if len(hook.outcomes) != 1 || hook.outcomes[0] != idem.OutcomeNone {
		t.Fatalf("outcome hook saw %v", hook.outcomes)
	}
}

// A marker imported from a hand-rolled table (empty payload hash) is a
// done row to lease mode too: any payload is a Duplicate, never a
// conflict, and the handler does not run.
func TestLeaseImportedMarkerIsDuplicate(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	ctx := context.Background()
	if n, err := drv.InsertImportedMarkers(ctx, "uploader", []string{"file-1"}); err != nil || n != 1 {
		t.Fatalf("import: %d, %v", n, err)
	}
	p, err := idem.NewLeaseProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	called := false
	h := &idem.LeaseHandler{Name: "uploader", Call: func(context.Context, *idem.Lease, *idem.Message) error {
		called = true
		return nil
	}}
	out, err := p.Process(ctx, h, &idem.Message{ID: "file-1", Payload: []byte("anything")})
	if err != nil || out != idem.Duplicate || called {
		t.Errorf("imported message in lease mode: %v, %v, handler called %v; want duplicate, not called", out, err, called)
	}
}

// slowGuard is the SQLite driver whose first ordering-guard read stalls
// (a full pool, a slow query) for stall.
type slowGuard struct {
	*sqlite.Driver
	stall time.Duration
	once  sync.Once
}

func (s *slowGuard) SequenceLast(ctx context.Context, h, agg string) (int64, error) {
	s.once.Do(func() { time.Sleep(s.stall) })
	return s.Driver.SequenceLast(ctx, h, agg)
}

// A worker whose lease runs out before its call (its guard read outlasted
// the TTL) does not call: the worker that claimed the message since calls
// alone, never both at once.
func TestLeaseNotCalledAfterItRanOut(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	const ttl = 300 * time.Millisecond
	pa, err := idem.NewLeaseProcessor(&slowGuard{Driver: drv, stall: 2 * ttl}, &idem.LeaseConfig{TTL: ttl, Owner: "A", Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	pb, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: ttl, Owner: "B", Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var calls []string
	h := &idem.LeaseHandler{Name: "mailer", Ordering: &idem.Ordering{Gap: idem.GapAllow},
		Call: func(ctx context.Context, l *idem.Lease, msg *idem.Message) error {
			mu.Lock()
			calls = append(calls, fmt.Sprintf("%s@%d", l.Owner, l.Token))
			mu.Unlock()
			time.Sleep(400 * time.Millisecond) // an external call that ignores ctx
			return nil
		}}
	msg := &idem.Message{ID: "m1", AggregateID: "a", Seq: 1, Payload: []byte("x")}
	var wg sync.WaitGroup
	var errA, errB error
	var outB idem.Outcome
	wg.Go(func() { _, errA = pa.Process(context.Background(), h, msg) })
	wg.Go(func() {
		time.Sleep(ttl + 100*time.Millisecond) // A's lease ran out; its guard read still stalls
		outB, errB = pb.Process(context.Background(), h, msg)
	})
	wg.Wait()
	if outB != idem.Applied || errB != nil {
		t.Fatalf("B: %v, %v; want Applied", outB, errB)
	}
	if !errors.Is(errA, idem.ErrLeaseExpired) {
		t.Fatalf("A: %v; want ErrLeaseExpired", errA)
	}
	if !slices.Equal(calls, []string{"B@2"}) {
		t.Fatalf("calls %v; want B's alone", calls)
	}
}

// Heartbeats fall due from the claim, not from the call: a guard read that
// took most of the TTL does not leave the lease to run out before the
// first heartbeat.
func TestLeaseHeartbeatsCountFromTheClaim(t *testing.T) {
	t.Parallel()
	drv := leaseDriver(t)
	// Long enough that the margin left after the stall (30%) outlasts a
	// loaded machine's scheduling delays, which a 300 ms TTL did not.
	const ttl = 1200 * time.Millisecond
	hook := &lostHook{}
	p, err := idem.NewLeaseProcessor(&slowGuard{Driver: drv, stall: ttl * 7 / 10}, &idem.LeaseConfig{TTL: ttl, Heartbeat: ttl / 3, Owner: "A",
		Logger: testenv.Logger(t), Hooks: []idem.Hook{idem.HookLeaseLost(hook)}})
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.LeaseHandler{Name: "mailer", Ordering: &idem.Ordering{Gap: idem.GapAllow},
		Call: func(ctx context.Context, l *idem.Lease, msg *idem.Message) error {
			select {
			case <-ctx.Done():
				return context.Cause(ctx)
			case <-time.After(ttl):
				return nil
			}
		}}
	out, err := p.Process(context.Background(), h, &idem.Message{ID: "m1", AggregateID: "a", Seq: 1, Payload: []byte("x")})
	if out != idem.Applied || err != nil {
		t.Fatalf("%v, %v; want Applied", out, err)
	}
	hook.mu.Lock()
	defer hook.mu.Unlock()
	if len(hook.lost) != 0 {
		t.Fatalf("lost %+v; want none", hook.lost)
	}
}
