package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// TestGoexitInHandlerRollsBack: a handler that leaves its goroutine with
// runtime.Goexit (t.FailNow or t.Fatal in a test's handler) is not a
// panic, which recover sees; Process still rolls back the transaction it
// opened. It was left open, and on SQLite, whose pool has one connection,
// every later call waited for it for good.
func TestGoexitInHandlerRollsBack(t *testing.T) {
	t.Parallel()
	p := memProcessor(t, nil)
	h := &idem.Handler[*sql.Tx]{Name: "goexit", Apply: func(context.Context, *sql.Tx, *idem.Message) error {
		runtime.Goexit()
		return nil
	}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = p.Process(context.Background(), h, &idem.Message{ID: "m-1"})
	}()
	<-done
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	out, err := p.Process(ctx, noop(), &idem.Message{ID: "m-2"})
	if err != nil {
		t.Fatalf("the next Process, on another handler: (%v, %v): the transaction of the handler that called Goexit was left open and holds the only connection", out, err)
	}
}

// TestStoppedReplayStaysRequested: stopping a replay (the context of
// Consumer.Run or Replay ends while a replayed message runs) is not a
// failure of that message: its dead letter stays replay_requested, with
// its first error, for the next run. It was parked again as exhausted,
// "replay failed: ... context canceled", and the operator's request lost.
func TestStoppedReplayStaysRequested(t *testing.T) {
	t.Parallel()
	l := newLedger(t)
	var broken, stopping atomic.Bool
	broken.Store(true)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := &idem.Handler[*sql.Tx]{Name: "replayed", Apply: func(ctx context.Context, _ *sql.Tx, _ *idem.Message) error {
		if broken.Load() {
			return idem.Permanent(errors.New("account frozen"))
		}
		if stopping.Load() {
			cancel() // the service shuts down while the replayed message runs
			return ctx.Err()
		}
		return nil
	}}
	c, err := idem.NewConsumer(l.proc, h, l.dl, nil)
	if err != nil {
		t.Fatal(err)
	}
	if v := c.HandleDelivery(context.Background(), &idem.Delivery{Msg: &idem.Message{ID: "m-1"}, Attempt: 1}); !v.DeadLettered {
		t.Fatalf("%+v, want a dead letter", v)
	}
	broken.Store(false)
	if n, err := idem.RequestReplay(context.Background(), l.dl, nil, "ops"); err != nil || n != 1 {
		t.Fatalf("RequestReplay: %d, %v", n, err)
	}
	stopping.Store(true)
	if res, err := c.Replay(ctx); !errors.Is(err, context.Canceled) || res.Parked != 0 || res.Replayed != 0 {
		t.Fatalf("stopped replay: %+v, %v; want context.Canceled and nothing counted", res, err)
	}
	dls, err := l.dl.DeadLetterList(context.Background(), &driver.DeadLetterFilter{Handler: "replayed"})
	if err != nil || len(dls) != 1 {
		t.Fatalf("dead letters: %+v, %v", dls, err)
	}
	if dls[0].State != driver.DeadLetterReplayRequested || dls[0].Class != idem.DeadLetterPermanent {
		hist, _ := l.dl.DeadLetterHistory(context.Background(), dls[0].ID)
		t.Fatalf("after a replay stopped by its context: state %s (error %q, class %s; history %+v), want %s: the request should survive the shutdown",
			dls[0].State, dls[0].Error, dls[0].Class, hist, driver.DeadLetterReplayRequested)
	}
}
