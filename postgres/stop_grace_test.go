package postgres_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// hungStore is a store whose connections run through a Blackhole, and a
// handler crediting accounts in it that calls cut, once, before its
// first write.
type hungStore struct {
	s    *idemtest.Store[postgres.Tx]
	hole *testenv.Blackhole
	p    *idem.Processor[postgres.Tx]
	h    *idem.Handler[postgres.Tx]
	// entered is closed when the handler first runs, after cut.
	entered chan struct{}
}

func newHungStore(t *testing.T, cut func(ctx context.Context, hole *testenv.Blackhole)) *hungStore {
	t.Helper()
	pool, hole := testenv.PostgresPoolThrough(t, 4)
	direct := testenv.PostgresPool(t, 1)
	hs := &hungStore{s: storeIn(t, pool, testenv.FreshSchema(t, direct)), hole: hole, entered: make(chan struct{})}
	// First of the cleanups: the schema's drop waits for the locks of
	// sessions left hanging.
	t.Cleanup(hole.Close)
	p, err := idem.NewProcessor(hs.s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	hs.p = p
	credit := idemtest.CreditHandler(hs.s, "balances", nil)
	var once sync.Once
	first := func(ctx context.Context) {
		once.Do(func() {
			cut(ctx, hole)
			close(hs.entered)
		})
	}
	hs.h = &idem.Handler[postgres.Tx]{Name: credit.Name,
		Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
			first(ctx)
			return credit.Apply(ctx, tx, m)
		},
		ApplyBatch: func(ctx context.Context, tx postgres.Tx, msgs []*idem.Message) error {
			first(ctx)
			return credit.ApplyBatch(ctx, tx, msgs)
		},
	}
	return hs
}

func (hs *hungStore) consumer(t *testing.T, grace time.Duration) *idem.Consumer[postgres.Tx] {
	t.Helper()
	c, err := idem.NewConsumer(hs.p, hs.h, hs.s.Driver.(*postgres.Driver), &idem.ConsumerConfig{StopGrace: grace, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// decideAndStop runs decide, closes stop once the handler ran (and a
// moment more, so that its write is under way), and returns decide's
// verdicts and how long after the stop they came; it fails the test if
// they have not come long after the stop.
func (hs *hungStore) decideAndStop(t *testing.T, stop chan struct{}, grace time.Duration, decide func() []idem.Verdict) ([]idem.Verdict, time.Duration) {
	t.Helper()
	res := make(chan []idem.Verdict, 1)
	go func() { res <- decide() }()
	<-hs.entered
	time.Sleep(100 * time.Millisecond)
	close(stop)
	stopped := time.Now()
	select {
	case vs := <-res:
		return vs, time.Since(stopped)
	case <-time.After(grace + 10*time.Second):
		t.Fatalf("still deciding %s after the stop (StopGrace %s): the stop waits for a delivery that does not end", time.Since(stopped).Round(time.Second), grace)
		return nil, 0
	}
}

// checkCut checks that every verdict hands its delivery back as no
// attempt, cut short by the stop, and that it came no sooner than the
// grace: what finishes within it is not cut.
func checkCut(t *testing.T, vs []idem.Verdict, took, grace time.Duration) {
	t.Helper()
	for i, v := range vs {
		if v.Ack || v.DeadLettered || !errors.Is(v.Err, idem.ErrStopped) {
			t.Fatalf("verdict %d: %+v; want a retry matching ErrStopped", i, v)
		}
	}
	if took < grace-50*time.Millisecond {
		t.Fatalf("cut %s after the stop; StopGrace is %s", took, grace)
	}
}

// applyAgain delivers events again once the path to the store is back
// (the connections it left hanging reset, as the server finds out in the
// end): each applied once, the balances those of the events.
func (hs *hungStore) applyAgain(t *testing.T, events []idemtest.Event) {
	t.Helper()
	ctx := context.Background()
	hs.hole.Reset()
	c := hs.consumer(t, time.Second)
	for _, e := range events {
		if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: e.Message(), Attempt: 1}); !v.Ack || v.Outcome != idem.Applied {
			t.Fatalf("%s delivered again: %+v; want applied (nothing of the cut delivery committed)", e.ID, v)
		}
	}
	got, err := hs.s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := idemtest.Expected(events)
	if len(got) != len(want) {
		t.Fatalf("balances %v; want %v", got, want)
	}
	for a, n := range want {
		if got[a] != n {
			t.Fatalf("balances %v; want %v", got, want)
		}
	}
}

// TestStopCutsADeliveryHungOnTheStore: the path to the store dies (no
// reset, no answer: a frozen server, a dropped route) while a delivery
// writes. No error comes for as long as TCP keeps trying, so a stop used
// to wait as long: the adapter's Run did not return. StopGrace after the
// stop the delivery is cancelled, its connection dropped, and it is
// handed back as no attempt; delivered again, it applies once.
func TestStopCutsADeliveryHungOnTheStore(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	hs := newHungStore(t, func(_ context.Context, hole *testenv.Blackhole) { hole.Cut() })
	c := hs.consumer(t, grace)
	events := idemtest.Events(1)
	stop := make(chan struct{})
	vs, took := hs.decideAndStop(t, stop, grace, func() []idem.Verdict {
		d := &idem.Delivery{Msg: events[0].Message(), Attempt: 1, LastAttempt: true, Stopping: stop, Source: "test"}
		return []idem.Verdict{c.HandleDelivery(context.Background(), d)}
	})
	checkCut(t, vs, took, grace)
	hs.applyAgain(t, events)
}

// TestStopCutsAHungBatch is the same for a batch: every delivery of it
// is handed back as no attempt.
func TestStopCutsAHungBatch(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	hs := newHungStore(t, func(_ context.Context, hole *testenv.Blackhole) { hole.Cut() })
	c := hs.consumer(t, grace)
	events := idemtest.Events(20)
	stop := make(chan struct{})
	vs, took := hs.decideAndStop(t, stop, grace, func() []idem.Verdict {
		ds := make([]*idem.Delivery, len(events))
		for i, e := range events {
			ds[i] = &idem.Delivery{Msg: e.Message(), Attempt: 1, Stopping: stop, Source: "test"}
		}
		return c.HandleDeliveries(context.Background(), ds)
	})
	if len(vs) != len(events) {
		t.Fatalf("%d verdicts for %d deliveries", len(vs), len(events))
	}
	checkCut(t, vs, took, grace)
	hs.applyAgain(t, events)
}

// TestStopCutsASlowHandler: a handler still running StopGrace after the
// stop (not the store's fault) is cancelled too, and its transaction,
// which had written, rolled back; one that ends within the grace is not
// cut, and commits.
func TestStopCutsASlowHandler(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		grace time.Duration
		wait  time.Duration // how long the handler runs on after the stop
		cut   bool
	}{
		{"past the grace", time.Second, 20 * time.Second, true},
		{"within the grace", 5 * time.Second, 300 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			stop := make(chan struct{})
			hs := newHungStore(t, func(context.Context, *testenv.Blackhole) {})
			// The handler writes, then, the first time, runs on until the
			// stop and tc.wait after it (or its context's end).
			credit := hs.h.Apply
			var slow atomic.Bool
			slow.Store(true)
			hs.h.Apply = func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
				if err := credit(ctx, tx, m); err != nil || !slow.Swap(false) {
					return err
				}
				<-stop
				select {
				case <-time.After(tc.wait):
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			c := hs.consumer(t, tc.grace)
			events := idemtest.Events(1)
			vs, took := hs.decideAndStop(t, stop, tc.grace, func() []idem.Verdict {
				d := &idem.Delivery{Msg: events[0].Message(), Attempt: 1, Stopping: stop, Source: "test"}
				return []idem.Verdict{c.HandleDelivery(context.Background(), d)}
			})
			if !tc.cut {
				if v := vs[0]; !v.Ack || v.Outcome != idem.Applied {
					t.Fatalf("verdict %+v after %s; want applied: it ended within the grace", v, took)
				}
				return
			}
			checkCut(t, vs, took, tc.grace)
			hs.applyAgain(t, events)
		})
	}
}

// TestStopGraceCountsFromTheStop: deliveries an adapter decides one after
// another once stopped (JetStream puts its unstarted messages back so)
// share one grace, counted from the stop: a second one started after the
// first was cut is cut at once, not a grace later.
func TestStopGraceCountsFromTheStop(t *testing.T) {
	t.Parallel()
	const grace = 2 * time.Second
	hs := newHungStore(t, func(context.Context, *testenv.Blackhole) {})
	credit := hs.h.Apply
	hs.h.Apply = func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
		if err := credit(ctx, tx, m); err != nil {
			return err
		}
		<-ctx.Done() // slower than any grace
		return ctx.Err()
	}
	c := hs.consumer(t, grace)
	events := idemtest.Events(2)
	stop := make(chan struct{})
	close(stop)
	stopped := time.Now()
	for i, e := range events {
		v := c.HandleDelivery(context.Background(), &idem.Delivery{Msg: e.Message(), Attempt: 1, Stopping: stop, Source: "test"})
		if v.Ack || !errors.Is(v.Err, idem.ErrStopped) {
			t.Fatalf("delivery %d: %+v; want a retry matching ErrStopped", i, v)
		}
	}
	if took := time.Since(stopped); took > grace+grace/2 {
		t.Fatalf("two deliveries after the stop took %s; want both cut within one grace (%s) of it", took, grace)
	}
}
