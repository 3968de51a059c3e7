package idemtest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// LeaseCrashHarness tells RunLeaseCrash how to share a store with a child
// process. The driver's test package provides it to two test functions: one
// calling RunLeaseCrash, one (named ChildTest) calling LeaseCrashChild.
type LeaseCrashHarness struct {
	// Create makes a fresh, migrated store and returns a lease driver on it
	// and where: a string from which Attach opens the same store in
	// another process (a file path, a schema name). Required.
	Create func(t testing.TB) (drv driver.LeaseDriver, where string)
	// Attach opens the store that Create named where. It runs in the child
	// process. Required.
	Attach func(t testing.TB, where string) driver.LeaseDriver
	// ChildTest is the name of the top-level test function that calls
	// LeaseCrashChild with this harness. Required.
	ChildTest string
	// TTL is the lease of the worker that is killed: the restarted workers
	// wait about this long, and the child must finish its attempt up to the
	// crash point within it (or its heartbeats must get through). Default
	// 1s, enough on a loaded machine running the race detector.
	TTL time.Duration
}

// AtomicCrashHarness tells RunAtomicCrash how to share a store with a
// child process, as LeaseCrashHarness does for lease mode: the driver's
// test package provides it to two test functions, one calling
// RunAtomicCrash, one (named ChildTest) calling AtomicCrashChild.
type AtomicCrashHarness[TTx any] struct {
	// Create makes a fresh, migrated store with its balances table and
	// returns it and where: a string from which Attach opens the same
	// store in another process (a file path, a schema name). Required.
	Create func(t testing.TB) (*Store[TTx], string)
	// Attach opens the store that Create named where, in the child
	// process: Driver and Credit are enough. Required.
	Attach func(t testing.TB, where string) *Store[TTx]
	// ChildTest is the name of the top-level test function that calls
	// AtomicCrashChild with this harness. Required.
	ChildTest string
}

const (
	envAtomicCrashPoint = "IDEM_ATOMIC_CRASH_POINT"
	envAtomicCrashStore = "IDEM_ATOMIC_CRASH_STORE"
)

// Crash points of RunLeaseCrash, in the order an attempt reaches them. Two
// are inside the handler; the others are idem.LeaseConfig fault points.
const (
	CrashAfterClaim = idem.FaultAfterClaim // the claim committed, nothing else
	CrashBeforeCall = "before_call"        // in the handler, before the HTTP call
	CrashAfterCall  = "after_call"         // in the handler, after the HTTP call returned
	CrashBeforeDone = idem.FaultBeforeDone // the handler returned nil, done not written
	CrashAfterDone  = idem.FaultAfterDone  // done written, the broker not yet acknowledged
)

// crashPoints lists the crash points in order.
func crashPoints() []string {
	return []string{CrashAfterClaim, CrashBeforeCall, CrashAfterCall, CrashBeforeDone, CrashAfterDone}
}

// Environment of a crash child.
const (
	envCrashPoint   = "IDEM_LEASE_CRASH_POINT"
	envCrashStore   = "IDEM_LEASE_CRASH_STORE"
	envCrashURL     = "IDEM_LEASE_CRASH_URL"
	envCrashMessage = "IDEM_LEASE_CRASH_MESSAGE"
	envCrashTTL     = "IDEM_LEASE_CRASH_TTL"
)

const (
	crashHandlerName = "payments.charge"
	crashChildOwner  = "crash-child"
	tokenHeader      = "Idem-Fencing-Token"
)

// chargeHandler POSTs the message to url with its idempotency key and
// fencing token, calling fault before and after the call.
func chargeHandler(url string, fault func(point string)) *idem.LeaseHandler {
	return &idem.LeaseHandler{Name: crashHandlerName, Call: func(ctx context.Context, l *idem.Lease, m *idem.Message) error {
		fault(CrashBeforeCall)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(m.Payload))
		if err != nil {
			return err
		}
		req.Header.Set("Idempotency-Key", l.IdempotencyKey)
		req.Header.Set(tokenHeader, strconv.FormatInt(l.Token, 10))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("charge: HTTP %d", resp.StatusCode)
		}
		fault(CrashAfterCall)
		return nil
	}}
}

// effectServer is a downstream HTTP API. It records, per Idempotency-Key,
// every request, the tokens they carried, how many ran at the same time,
// and how many times the effect was applied: once per key when it dedupes,
// once per request when it does not. Each request takes delay, widening the
// window in which two attempts could overlap.
type effectServer struct {
	dedupe bool
	delay  time.Duration

	mu   sync.Mutex
	keys map[string]*keyStats
}

type keyStats struct {
	requests, effects, inflight, maxInflight int
	tokens                                   []int64
}

func (s *effectServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	token, err := strconv.ParseInt(r.Header.Get(tokenHeader), 10, 64)
	if key == "" || err != nil {
		http.Error(w, "Idempotency-Key and "+tokenHeader+" are required", http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	if s.keys == nil {
		s.keys = map[string]*keyStats{}
	}
	st := s.keys[key]
	if st == nil {
		st = &keyStats{}
		s.keys[key] = st
	}
	st.requests++
	st.tokens = append(st.tokens, token)
	st.inflight++
	st.maxInflight = max(st.maxInflight, st.inflight)
	s.mu.Unlock()

	time.Sleep(s.delay)

	s.mu.Lock()
	if !s.dedupe || st.effects == 0 {
		st.effects++
	}
	st.inflight--
	s.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

func (s *effectServer) stats(key string) keyStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	if st := s.keys[key]; st != nil {
		c := *st
		c.tokens = append([]int64(nil), st.tokens...)
		return c
	}
	return keyStats{}
}

func (s *effectServer) totalRequests() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, st := range s.keys {
		n += st.requests
	}
	return n
}
