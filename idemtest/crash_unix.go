//go:build unix

package idemtest

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// RunLeaseCrash kills a lease-mode worker at every crash point
// (CrashAfterClaim, CrashBeforeCall, CrashAfterCall, CrashBeforeDone,
// CrashAfterDone) and checks what the restarted workers make of it.
//
// For each point and for a downstream that dedupes by Idempotency-Key and
// one that does not, it starts the test binary again as a child process
// (running only h.ChildTest) on a store shared with this process. The child
// claims a message with a TTL of h.TTL and sends SIGKILL to itself at the
// point. Then four restarted workers in this process redeliver the message
// until it settles, and the test checks, against numbers computed from the
// point alone:
//
//   - the child really died of SIGKILL at that point, leaving a running row
//     with token 1 (done, after CrashAfterDone);
//   - the row ends done, with token and attempts 2 (1 after CrashAfterDone);
//   - one restarted worker applied it (none after CrashAfterDone) and the
//     others saw Duplicate, never an error;
//   - downstream requests: the child's (if it got past the call) with token
//     1, then at most one more, with token 2, all with the same key;
//   - the deduping downstream applied the effect exactly once; the other
//     applied it once per request: at most one repeat, only after a crash
//     that follows the call;
//   - never two requests for the key at the same time.
func RunLeaseCrash(t *testing.T, h *LeaseCrashHarness) {
	for _, point := range crashPoints() {
		for _, dedupe := range []bool{true, false} {
			mode := "dedupe"
			if !dedupe {
				mode = "no-dedupe"
			}
			t.Run(point+"/"+mode, func(t *testing.T) {
				t.Parallel()
				runCrashCase(t, h, point, dedupe)
			})
		}
	}
}

func runCrashCase(t *testing.T, h *LeaseCrashHarness, point string, dedupe bool) {
	ttl := h.TTL
	if ttl <= 0 {
		ttl = time.Second
	}
	drv, where := h.Create(t)
	srv := &effectServer{dedupe: dedupe, delay: 30 * time.Millisecond}
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	msg := &idem.Message{ID: "order-" + point, Payload: []byte(`{"amount":100,"currency":"EUR"}`)}
	key := idem.IdempotencyKey(crashHandlerName, msg.ID)

	// The child: the same test binary, running only ChildTest.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+h.ChildTest+"$", "-test.count=1")
	cmd.Env = append(os.Environ(),
		envCrashPoint+"="+point,
		envCrashStore+"="+where,
		envCrashURL+"="+ts.URL,
		envCrashMessage+"="+msg.ID,
		envCrashTTL+"="+ttl.String(),
	)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("child was not killed (run error %v); output:\n%s", err, out.String())
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child ended with %v, want killed by SIGKILL; output:\n%s", ee, out.String())
	}
	if !strings.Contains(out.String(), "idemtest: crash at "+point+"\n") {
		t.Fatalf("child did not die at %s; output:\n%s", point, out.String())
	}

	// What the crash left behind.
	childCalled := point == CrashAfterCall || point == CrashBeforeDone || point == CrashAfterDone
	finished := point == CrashAfterDone
	row, err := drv.LeaseGet(context.Background(), &driver.LeaseGetParams{Handler: crashHandlerName, MessageID: msg.ID})
	if err != nil {
		t.Fatal(err)
	}
	wantStatus := driver.LeaseRunning
	if finished {
		wantStatus = driver.LeaseDone
	}
	if row == nil || row.Status != wantStatus || row.Token != 1 || !claimedBy(row.Owner, crashChildOwner) {
		t.Fatalf("after the crash the row is %+v, want %s with token 1 owned by %s", row, wantStatus, crashChildOwner)
	}
	liveFor := row.LeaseUntil.Sub(row.Now)
	if got, want := srv.stats(key).requests, b2i(childCalled); got != want {
		t.Fatalf("the child sent %d requests before dying at %s, want %d", got, point, want)
	}

	// Restart: four workers redeliver until the message settles.
	outs, inflight, errs := restartWorkers(drv, ts.URL, msg, 4, 30*time.Second)
	if len(errs) > 0 {
		t.Fatalf("restarted workers failed: %v", errors.Join(errs...))
	}
	wantApplied := b2i(!finished)
	if got := outs[idem.Applied]; got != wantApplied {
		t.Fatalf("restarted workers applied %d times, want %d (outcomes %v)", got, wantApplied, outs)
	}
	if got := outs[idem.Duplicate]; got != 4-wantApplied {
		t.Fatalf("restarted workers saw %d duplicates, want %d (outcomes %v)", got, 4-wantApplied, outs)
	}
	if !finished && liveFor > 500*time.Millisecond && inflight == 0 {
		t.Fatalf("the dead worker's lease was live for %s more, yet no restarted worker was told InFlight", liveFor)
	}

	// Final state, against numbers computed from the crash point alone.
	wantToken := int64(2)
	if finished {
		wantToken = 1
	}
	row, err = drv.LeaseGet(context.Background(), &driver.LeaseGetParams{Handler: crashHandlerName, MessageID: msg.ID})
	if err != nil {
		t.Fatal(err)
	}
	if row == nil || row.Status != driver.LeaseDone || row.Token != wantToken || row.Attempts != int(wantToken) {
		t.Fatalf("final row %+v, want done with token and attempts %d", row, wantToken)
	}
	var wantTokens []int64
	if childCalled {
		wantTokens = append(wantTokens, 1)
	}
	if !finished {
		wantTokens = append(wantTokens, 2)
	}
	st := srv.stats(key)
	if !slices.Equal(st.tokens, wantTokens) {
		t.Fatalf("downstream saw requests with tokens %v, want %v", st.tokens, wantTokens)
	}
	if total := srv.totalRequests(); total != st.requests {
		t.Fatalf("downstream saw %d requests in all but %d with the message's key", total, st.requests)
	}
	wantEffects := len(wantTokens)
	if dedupe {
		wantEffects = 1
	}
	if st.effects != wantEffects {
		t.Fatalf("downstream applied the effect %d times, want %d", st.effects, wantEffects)
	}
	if st.maxInflight != 1 {
		t.Fatalf("downstream saw %d requests for the key at the same time, want 1", st.maxInflight)
	}
	mode := "dedupe"
	if !dedupe {
		mode = "no-dedupe"
	}
	t.Logf("crash %-11s %-9s: requests %d (tokens %v), effects %d, max concurrent 1, restart outcomes %v after %d in-flight answers",
		point, mode, st.requests, st.tokens, st.effects, outs, inflight)
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// restartWorkers has n workers, each its own LeaseProcessor, redeliver msg
// until it is no longer InFlight.
func restartWorkers(drv driver.LeaseDriver, url string, msg *idem.Message, n int, timeout time.Duration) (map[idem.Outcome]int, int, []error) {
	var (
		mu       sync.Mutex
		outs     = map[idem.Outcome]int{}
		inflight int
		errs     []error
		wg       sync.WaitGroup
	)
	h := chargeHandler(url, func(string) {})
	for w := range n {
		p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: fmt.Sprintf("restart-%d", w), TTL: 5 * time.Second})
		if err != nil {
			return nil, 0, []error{err}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, k, err := processUntilSettled(context.Background(), p, h, msg, timeout)
			mu.Lock()
			defer mu.Unlock()
			inflight += k
			if err != nil {
				errs = append(errs, fmt.Errorf("worker %d: %w", w, err))
				return
			}
			outs[out]++
		}()
	}
	wg.Wait()
	return outs, inflight, errs
}

// LeaseCrashChild is the child side of RunLeaseCrash. Call it from the test
// function named by h.ChildTest. Outside a crash test it returns at once (so
// the test passes, never skips); inside one it opens the shared store,
// processes the message and kills its own process with SIGKILL at the crash
// point, so that no further code of the attempt runs.
func LeaseCrashChild(t *testing.T, h *LeaseCrashHarness) {
	point := os.Getenv(envCrashPoint)
	if point == "" {
		return
	}
	ttl, err := time.ParseDuration(os.Getenv(envCrashTTL))
	if err != nil {
		t.Fatalf("%s: %v", envCrashTTL, err)
	}
	drv := h.Attach(t, os.Getenv(envCrashStore))
	crash := func(at string) {
		if at != point {
			return
		}
		fmt.Printf("idemtest: crash at %s\n", at)
		_ = os.Stdout.Sync()
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		time.Sleep(time.Minute) // SIGKILL cannot be caught: never reached
	}
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: crashChildOwner, TTL: ttl, FaultHook: crash})
	if err != nil {
		t.Fatal(err)
	}
	msg := &idem.Message{ID: os.Getenv(envCrashMessage), Payload: []byte(`{"amount":100,"currency":"EUR"}`)}
	out, err := p.Process(context.Background(), chargeHandler(os.Getenv(envCrashURL), crash), msg)
	t.Fatalf("the child reached the end of the attempt alive at crash point %q: (%v, %v)", point, out, err)
}

// RunAtomicCrash kills (SIGKILL) a child process processing one message
// in atomic mode: as the handler starts (before its write), after the
// write and before the commit, and after the commit (Process returned
// Applied; the broker was not acknowledged). Then four redeliveries run at
// once in this process. Before the commit: nothing is visible, and
// exactly one redelivery applies. After it: all four are Duplicates. The
// balance is the event's amount either way.
func RunAtomicCrash[TTx any](t *testing.T, h *AtomicCrashHarness[TTx]) {
	if os.Getenv(envAtomicCrashPoint) != "" {
		return
	}
	for _, point := range []string{"before_write", "after_write", "after_commit"} {
		t.Run(point, func(t *testing.T) {
			s, where := h.Create(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+h.ChildTest+"$", "-test.count=1")
			cmd.Env = append(os.Environ(), envAtomicCrashPoint+"="+point, envAtomicCrashStore+"="+where)
			out, err := cmd.CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) {
				t.Fatalf("child not killed: %v\n%s", err, out)
			}
			ws, ok := ee.Sys().(syscall.WaitStatus)
			if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL || !strings.Contains(string(out), "atomic crash at "+point) {
				t.Fatalf("child did not die of SIGKILL at %s: %v\n%s", point, err, out)
			}
			e := atomicCrashEvent()
			committed := point == "after_commit"
			want := map[string]int64{}
			if committed {
				want = Expected([]Event{e})
			}
			wantBalances(t, s, want)
			p := newProc(t, s)
			var calls sync.Map
			hd := CreditHandler(s, "balances", &calls)
			var (
				mu   sync.Mutex
				outs = map[idem.Outcome]int{}
				wg   sync.WaitGroup
			)
			for range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					out, err := p.Process(context.Background(), hd, e.Message())
					if err != nil {
						t.Errorf("redelivery: %v", err)
					}
					mu.Lock()
					outs[out]++
					mu.Unlock()
				}()
			}
			wg.Wait()
			wantApplied := 1
			if committed {
				wantApplied = 0
			}
			if outs[idem.Applied] != wantApplied || outs[idem.Duplicate] != 4-wantApplied {
				t.Fatalf("redeliveries %v, want %d applied, the rest duplicate", outs, wantApplied)
			}
			if n := callsOf(&calls, e.ID); n != int64(wantApplied) && !s.ApplyBeforeCheck {
				t.Fatalf("redeliveries reached the handler %d times, want %d", n, wantApplied)
			}
			wantBalances(t, s, Expected([]Event{e}))
		})
	}
}

func atomicCrashEvent() Event { return Event{ID: "crash-1", Account: "acct-1", Amount: 7} }

// AtomicCrashChild is the child side of RunAtomicCrash: it does nothing
// unless RunAtomicCrash started this process.
func AtomicCrashChild[TTx any](t *testing.T, h *AtomicCrashHarness[TTx]) {
	point := os.Getenv(envAtomicCrashPoint)
	if point == "" {
		return
	}
	s := h.Attach(t, os.Getenv(envAtomicCrashStore))
	kill := func(at string) {
		if at == point {
			fmt.Printf("atomic crash at %s\n", at)
			_ = os.Stdout.Sync()
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			time.Sleep(time.Minute)
		}
	}
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	hd := &idem.Handler[TTx]{Name: "balances", Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
		kill("before_write")
		acct, amt, err := DecodeCredit(m.Payload)
		if err != nil {
			return err
		}
		if err := s.Credit(ctx, tx, acct, amt); err != nil {
			return err
		}
		kill("after_write")
		return nil
	}}
	out, err := p.Process(context.Background(), hd, atomicCrashEvent().Message())
	if err == nil && out == idem.Applied {
		kill("after_commit")
	}
	t.Fatalf("child alive after %q: (%v, %v)", point, out, err)
}
