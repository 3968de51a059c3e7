package outage

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// store is a Prober whose answers the test sets.
type store struct {
	down   atomic.Bool
	probes atomic.Int64
}

var errDown = errors.New("store down")

func (s *store) Unavailable(err error) bool { return errors.Is(err, errDown) }

func (s *store) Probe(context.Context) error {
	s.probes.Add(1)
	if s.down.Load() {
		return errDown
	}
	return nil
}

// syncBuffer is a log destination safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func newWatch(s *store, changes *[]Change, mu *sync.Mutex) (*Watch, *syncBuffer) {
	var logs syncBuffer
	w := New(s, Config{Component: "test", Logger: slog.New(slog.NewTextHandler(&logs, nil)), Base: time.Millisecond, Max: 5 * time.Millisecond,
		OnChange: func(c Change) {
			mu.Lock()
			defer mu.Unlock()
			*changes = append(*changes, c)
		}})
	return w, &logs
}

func TestCheckConfirmsWithAProbe(t *testing.T) {
	t.Parallel()
	s := &store{}
	var (
		mu      sync.Mutex
		changes []Change
	)
	w, _ := newWatch(s, &changes, &mu)
	ctx := context.Background()
	if w.Check(ctx, errors.New("handler failed")) {
		t.Fatal("an error that does not look like an outage started one")
	}
	if s.probes.Load() != 0 {
		t.Fatal("a plain handler error cost a probe")
	}
	if w.Check(ctx, errDown) {
		t.Fatal("a suspect error while the store answers started an outage")
	}
	if w.Check(ctx, nil) {
		t.Fatal("nil started an outage")
	}
	s.down.Store(true)
	if !w.Check(ctx, errDown) || !w.Down() {
		t.Fatal("a suspect error confirmed by the probe did not start an outage")
	}
	if !w.Check(ctx, fmt.Errorf("again: %w", errDown)) || w.Outages() != 1 {
		t.Fatalf("a second failure during the outage: outages %d, want 1", w.Outages())
	}
	mu.Lock()
	if len(changes) != 1 || !changes[0].Down || !errors.Is(changes[0].Cause, errDown) {
		t.Fatalf("changes %+v, want one start", changes)
	}
	mu.Unlock()
}

func TestWaitHoldsUntilTheStoreAnswers(t *testing.T) {
	t.Parallel()
	s := &store{}
	var (
		mu      sync.Mutex
		changes []Change
	)
	w, logs := newWatch(s, &changes, &mu)
	ctx := context.Background()
	if err := w.Wait(ctx, nil); err != nil {
		t.Fatalf("Wait with the store up: %v", err)
	}
	s.down.Store(true)
	w.Check(ctx, errDown)
	var released atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if err := w.Wait(ctx, nil); err != nil {
				t.Error(err)
			}
			released.Add(1)
		})
	}
	time.Sleep(30 * time.Millisecond)
	if released.Load() != 0 {
		t.Fatal("a waiter was released while the store was down")
	}
	if s.probes.Load() < 2 {
		t.Fatalf("%d probes in 30 ms, want the store probed while down", s.probes.Load())
	}
	s.down.Store(false)
	wg.Wait()
	if w.Down() {
		t.Fatal("still down after a successful probe")
	}
	mu.Lock()
	if len(changes) != 2 || changes[1].Down || changes[1].Duration <= 0 {
		t.Fatalf("changes %+v, want a start and an end with its duration", changes)
	}
	mu.Unlock()
	out := logs.String()
	if strings.Count(out, "level=WARN") != 1 || strings.Count(out, "level=INFO") != 1 {
		t.Fatalf("want one WARN and one INFO line, got:\n%s", out)
	}
}

func TestWaitEndsWithItsCaller(t *testing.T) {
	t.Parallel()
	s := &store{}
	s.down.Store(true)
	var (
		mu      sync.Mutex
		changes []Change
	)
	w, _ := newWatch(s, &changes, &mu)
	w.Check(context.Background(), errDown)
	stop := make(chan struct{})
	close(stop)
	if err := w.Wait(context.Background(), stop); !errors.Is(err, ErrStopped) {
		t.Fatalf("Wait after stop: %v, want ErrStopped", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := w.Wait(ctx, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait after cancel: %v, want context.Canceled", err)
	}
	// Nobody waits: probing stops, rather than go on for ever.
	time.Sleep(20 * time.Millisecond)
	n := s.probes.Load()
	time.Sleep(30 * time.Millisecond)
	if s.probes.Load() != n {
		t.Fatal("the store is still probed with nobody waiting")
	}
	if !w.Down() {
		t.Fatal("the outage ended without a successful probe")
	}
}

func TestDoRunsAgainAfterTheOutage(t *testing.T) {
	t.Parallel()
	s := &store{}
	var (
		mu      sync.Mutex
		changes []Change
	)
	w, _ := newWatch(s, &changes, &mu)
	s.down.Store(true)
	calls := 0
	err := w.Do(context.Background(), nil, func() error {
		calls++
		if calls == 1 {
			go func() { time.Sleep(20 * time.Millisecond); s.down.Store(false) }()
			return errDown
		}
		return nil
	})
	if err != nil || calls != 2 {
		t.Fatalf("Do: %v after %d calls, want success on the second", err, calls)
	}
}

func TestNetworkErrors(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED},
		fmt.Errorf("read: %w", syscall.ECONNRESET),
		io.ErrUnexpectedEOF,
		fmt.Errorf("write: %w", syscall.EPIPE),
		context.DeadlineExceeded,
	} {
		if !Network(err) {
			t.Errorf("Network(%v) = false", err)
		}
	}
	for _, err := range []error{errors.New("order 7 not found"), context.Canceled, io.EOF} {
		if Network(err) {
			t.Errorf("Network(%v) = true", err)
		}
	}
}

func TestNilWatchNeverReportsAnOutage(t *testing.T) {
	t.Parallel()
	var w *Watch
	if New(nil, Config{}) != nil {
		t.Fatal("New(nil) is not nil")
	}
	if w.Check(context.Background(), errDown) || w.Down() || w.Wait(context.Background(), nil) != nil || w.Suspect(errDown) {
		t.Fatal("a nil Watch reported an outage")
	}
}
