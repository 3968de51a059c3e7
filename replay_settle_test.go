package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/postgres"
	"github.com/idemhq/idem/redisstore"
	"github.com/idemhq/idem/sqlite"
)

// onVerdict is a HookVerdict from a function.
type onVerdict func(ctx context.Context, ev *idem.VerdictEvent)

func (f onVerdict) OnVerdict(ctx context.Context, ev *idem.VerdictEvent) { f(ctx, ev) }

// eachDeadLetterStore runs fn against every store that keeps dead letters:
// SQLite, PostgreSQL, MySQL/MariaDB and Redis, each fresh.
func eachDeadLetterStore(t *testing.T, sqliteFn func(*testing.T, driver.Driver[*sql.Tx], driver.DeadLetterStore),
	pgFn func(*testing.T, driver.Driver[postgres.Tx], driver.DeadLetterStore),
	redisFn func(*testing.T, driver.Driver[*redisstore.Tx], driver.DeadLetterStore)) {
	t.Run("sqlite", func(t *testing.T) {
		drv := freshSQLite(t)
		sqliteFn(t, drv, drv)
	})
	t.Run("postgres", func(t *testing.T) {
		drv := freshPostgres(t, 4)
		pgFn(t, drv, drv)
	})
	t.Run("mysql", func(t *testing.T) {
		drv := freshMySQL(t, 4)
		sqliteFn(t, drv, drv)
	})
	t.Run("redis", func(t *testing.T) {
		client, prefix := testenv.Redis(t)
		drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		if err := drv.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		redisFn(t, drv, drv)
	})
}

// freshSQLite, freshPostgres and freshMySQL return a migrated driver on an
// empty store of their kind (a pool of conns connections).
func freshSQLite(t *testing.T) *sqlite.Driver {
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	return drv
}

func freshPostgres(t *testing.T, conns int32) *postgres.Driver {
	pool := testenv.PostgresPool(t, conns)
	drv, err := postgres.New(pool, &postgres.Config{Schema: testenv.FreshSchema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return drv
}

func freshMySQL(t *testing.T, conns int) *mysql.Driver {
	drv, err := mysql.New(testenv.MySQL(t, testenv.MySQLDatabase(t), conns), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return drv
}

// TestReplayStoppedAfterItAppliedIsRecorded: a consumer stopped (its
// Run's context cancelled, as on a deploy) just after a replayed message
// applied still marks the dead letter replayed, with the outcome applied.
// It used to write that with the cancelled context: the write failed, the
// dead letter stayed claimed (replaying) for ReplayClaimTimeout, and the
// replay that then ran logged the message as a duplicate.
func TestReplayStoppedAfterItAppliedIsRecorded(t *testing.T) {
	eachDeadLetterStore(t, replayStoppedAfterApply[*sql.Tx], replayStoppedAfterApply[postgres.Tx], replayStoppedAfterApply[*redisstore.Tx])
}

func replayStoppedAfterApply[TTx any](t *testing.T, drv driver.Driver[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	p, h, applied, _ := replayRequested(t, drv, dl)

	// The stop comes just as the message has applied.
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	stopping, err := idem.NewConsumer(p, h, dl, &idem.ConsumerConfig{Logger: testenv.Logger(t),
		Hooks: []idem.Hook{onVerdict(func(_ context.Context, ev *idem.VerdictEvent) {
			if ev.Verdict.Outcome == idem.Applied {
				stop()
			}
		})}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := stopping.Replay(runCtx)
	t.Logf("stopped replay: %+v, %v", res, err)
	if applied.Load() != 1 {
		t.Fatalf("applied %d times, want once", applied.Load())
	}
	dls, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "proj"})
	if err != nil || len(dls) != 1 {
		t.Fatalf("list: %d, %v", len(dls), err)
	}
	hist, err := dl.DeadLetterHistory(ctx, dls[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	last := hist[len(hist)-1]
	if dls[0].State != driver.DeadLetterReplayed || last.State != driver.DeadLetterReplayed || last.Outcome != idem.Applied.String() {
		t.Fatalf("after a stop right after it applied: state %s, last entry %+v; want replayed, applied (history %+v)", dls[0].State, last, hist)
	}
	if res.Replayed != 1 || res.Outcomes[idem.Applied] != 1 {
		t.Fatalf("result %+v, want the applied replay counted", res)
	}
}

// TestConcurrentReplaysKeepAggregateOrder: two consumers replay an
// aggregate's dead letters (sequences 1, 2, 3, parked behind the first's
// failure under GapFail) at the same time, as every replica's Run does.
// While one runs sequence 1 (its lease-mode call in flight), the other
// leaves the aggregate alone rather than running sequence 2 into the gap
// the first has not closed yet, which parked it (and 3) again with a gap
// error: an ordered backlog needed a replay request per replica.
func TestConcurrentReplaysKeepAggregateOrder(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) {
		drv := freshSQLite(t)
		replaysKeepOrder(t, drv, drv)
	})
	t.Run("postgres", func(t *testing.T) {
		drv := freshPostgres(t, 8)
		replaysKeepOrder(t, drv, drv)
	})
	t.Run("mysql", func(t *testing.T) {
		drv := freshMySQL(t, 8)
		replaysKeepOrder(t, drv, drv)
	})
}

func replaysKeepOrder(t *testing.T, drv driver.LeaseDriver, dl driver.DeadLetterStore) {
	ctx := context.Background()
	lp, err := idem.NewLeaseProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var (
		broken  atomic.Bool
		mu      sync.Mutex
		called  []int64
		inCall  = make(chan struct{})
		release = make(chan struct{})
		held    atomic.Bool
	)
	broken.Store(true)
	h := &idem.LeaseHandler{Name: "mail", Ordering: &idem.Ordering{Gap: idem.GapFail},
		Call: func(_ context.Context, _ *idem.Lease, m *idem.Message) error {
			if broken.Load() {
				return idem.Permanent(errors.New("bug"))
			}
			if m.Seq == 1 && held.CompareAndSwap(false, true) {
				close(inCall)
				<-release
			}
			mu.Lock()
			called = append(called, m.Seq)
			mu.Unlock()
			return nil
		}}
	newConsumer := func() *idem.LeaseConsumer {
		c, err := idem.NewLeaseConsumer(lp, h, dl, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	a, b := newConsumer(), newConsumer()
	for seq := int64(1); seq <= 3; seq++ {
		m := &idem.Message{ID: fmt.Sprintf("evt-%d", seq), Stream: "acct", Type: "T", AggregateID: "acct-1", Seq: seq, Payload: []byte("x")}
		if v := a.HandleDelivery(ctx, &idem.Delivery{Msg: m, Raw: m.Payload, Source: fmt.Sprintf("acct/0@%d", seq), Attempt: 1}); !v.DeadLettered {
			t.Fatalf("seq %d: verdict %+v, want a dead letter", seq, v)
		}
	}
	broken.Store(false)
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "mail"}, "ops"); err != nil || n != 3 {
		t.Fatalf("RequestReplay: %d, %v", n, err)
	}
	type result struct {
		res idem.ReplayResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := a.Replay(ctx)
		done <- result{r, err}
	}()
	select {
	case <-inCall:
	case <-time.After(30 * time.Second):
		t.Fatal("the first consumer never called sequence 1")
	}
	// Sequence 1 is running on a; b's run meanwhile.
	rb, err := b.Replay(ctx)
	close(release)
	ra := <-done
	if err != nil || ra.err != nil {
		t.Fatalf("replays: %v, %v", err, ra.err)
	}
	if rb.Parked != 0 || ra.res.Parked != 0 {
		t.Errorf("parked again: %d by the second consumer, %d by the first; want none (results %+v, %+v)", rb.Parked, ra.res.Parked, rb, ra.res)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(called) != "[1 2 3]" {
		t.Errorf("calls %v, want [1 2 3]", called)
	}
	dls, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "mail"})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dls {
		if d.State != driver.DeadLetterReplayed {
			t.Errorf("%s: %s (%s), want replayed", d.MessageID, d.State, d.Error)
		}
	}
}

// TestReplayAppliedWhileRequestedAgainIsReplayed: while a replay runs, a
// failed delivery of the same message parks its dead letter and an
// operator requests its replay again; the replay then applies. The dead
// letter is marked replayed (applied), as it is when the operator
// discarded it meanwhile. It used to stay requested, its applied replay
// uncounted, under a warning that said it was marked replayed, and to be
// run once more.
func TestReplayAppliedWhileRequestedAgainIsReplayed(t *testing.T) {
	eachDeadLetterStore(t, replayRequestedMeanwhile[*sql.Tx], replayRequestedMeanwhile[postgres.Tx], replayRequestedMeanwhile[*redisstore.Tx])
}

func replayRequestedMeanwhile[TTx any](t *testing.T, drv driver.Driver[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	p, h, _, parked := replayRequested(t, drv, dl)
	var once atomic.Bool
	r, err := idem.NewConsumer(p, h, dl, &idem.ConsumerConfig{Logger: testenv.Logger(t),
		Hooks: []idem.Hook{onVerdict(func(ctx context.Context, ev *idem.VerdictEvent) {
			if ev.Verdict.Outcome != idem.Applied || !once.CompareAndSwap(false, true) {
				return
			}
			// Meanwhile: a delivery of the message failed (its dead
			// letter is written again, parked) ...
			again := parked
			again.Error, again.Attempts = "timeout", 2
			if _, err := dl.DeadLetterPut(ctx, &again); err != nil {
				t.Error(err)
			}
			// ... and an operator asked for its replay again.
			if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "proj"}, "ops"); err != nil || n != 1 {
				t.Errorf("RequestReplay meanwhile: %d, %v", n, err)
			}
		})}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Replay(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "proj"})
	if err != nil || len(got) != 1 {
		t.Fatalf("list: %d, %v", len(got), err)
	}
	hist, err := dl.DeadLetterHistory(ctx, got[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	last := hist[len(hist)-1]
	if got[0].State != driver.DeadLetterReplayed || last.State != driver.DeadLetterReplayed || !strings.HasPrefix(last.Outcome, idem.Applied.String()) ||
		res.Replayed != 1 || res.Outcomes[idem.Applied] != 1 {
		t.Fatalf("state %s, last entry %+v, result %+v; want replayed, applied, counted (history %+v)", got[0].State, last, res, hist)
	}
}

// replayRequested returns a processor and the handler "proj", which
// failed for good on the message evt-1 (its dead letter, as parked, is
// the last result) and then was mended: the dead letter's replay is
// requested. applied counts the handler's successful calls.
func replayRequested[TTx any](t *testing.T, drv driver.Driver[TTx], dl driver.DeadLetterStore) (*idem.Processor[TTx], *idem.Handler[TTx], *atomic.Int64, driver.DeadLetter) {
	t.Helper()
	ctx := context.Background()
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var broken atomic.Bool
	broken.Store(true)
	applied := &atomic.Int64{}
	h := &idem.Handler[TTx]{Name: "proj", Apply: func(context.Context, TTx, *idem.Message) error {
		if broken.Load() {
			return idem.Permanent(errors.New("bug"))
		}
		applied.Add(1)
		return nil
	}}
	c, err := idem.NewConsumer(p, h, dl, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	msg := &idem.Message{ID: "evt-1", Stream: "orders", Type: "T", Payload: []byte("x")}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Raw: msg.Payload, Source: "orders/0@1", Attempt: 1}); !v.DeadLettered {
		t.Fatalf("verdict %+v, want a dead letter", v)
	}
	stored, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "proj"})
	if err != nil || len(stored) != 1 {
		t.Fatalf("list: %d, %v", len(stored), err)
	}
	broken.Store(false)
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "proj"}, "ops"); err != nil || n != 1 {
		t.Fatalf("RequestReplay: %d, %v", n, err)
	}
	return p, h, applied, stored[0]
}
