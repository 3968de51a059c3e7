package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// openStore returns a driver under a prefix unique to the test, with
// balances in a hash next to its markers.
func openStore(t testing.TB, cfg *redisstore.Config) (*idemtest.Store[*redisstore.Tx], *redis.Client, string) {
	c, prefix := testenv.Redis(t)
	if cfg == nil {
		cfg = &redisstore.Config{}
	}
	cfg.Prefix = prefix
	drv, err := redisstore.New(c, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	balances := prefix + "balances"
	return &idemtest.Store[*redisstore.Tx]{
		Driver: drv,
		Credit: func(ctx context.Context, tx *redisstore.Tx, account string, amount int64) error {
			return tx.Queue().HIncrBy(ctx, balances, account, amount).Err()
		},
		Balances: func(ctx context.Context) (map[string]int64, error) {
			return testenv.RedisInts(ctx, c, balances)
		},
		Put: func(ctx context.Context, tx *redisstore.Tx, agg, value string) error {
			return tx.Queue().Set(ctx, prefix+"state:"+agg, value, 0).Err()
		},
		Append: func(ctx context.Context, tx *redisstore.Tx, agg, value string) error {
			return tx.Queue().Append(ctx, prefix+"state:"+agg, ","+value).Err()
		},
		States: func(ctx context.Context) (map[string]string, error) {
			keys, err := scan(ctx, c, prefix+"state:*")
			if err != nil {
				return nil, err
			}
			out := make(map[string]string, len(keys))
			for _, k := range keys {
				if out[strings.TrimPrefix(k, prefix+"state:")], err = c.Get(ctx, k).Result(); err != nil {
					return nil, err
				}
			}
			return out, nil
		},
		Markers: func(ctx context.Context, handler string) (int, error) {
			keys, err := scan(ctx, c, prefix+"m:"+handler+"|*")
			return len(keys), err
		},
	}, c, prefix
}

// openProc is openStore with the driver and a processor over it.
func openProc(t testing.TB, cfg *redisstore.Config) (*idemtest.Store[*redisstore.Tx], *redis.Client, string, *redisstore.Driver, *idem.Processor[*redisstore.Tx]) {
	s, c, prefix := openStore(t, cfg)
	drv := s.Driver.(*redisstore.Driver)
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s, c, prefix, drv, proc
}

func scan(ctx context.Context, c *redis.Client, pattern string) ([]string, error) {
	var keys []string
	iter := c.Scan(ctx, 0, pattern, 1000).Iterator()
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	return keys, iter.Err()
}

// The store runs the core, ordering and dead-letter suites. It has no
// lease mode (RunLease, RunLeaseCrash), no SQL-style pruner (RunRetention:
// retention is by MarkerTTL, TestMarkerTTL; gap sightings are forgotten as
// the aggregate passes them, TestGapSightingsStayBounded) and no importer
// (CheckImport); docs/redis.md says so.
func TestConformance(t *testing.T) {
	t.Parallel()
	idemtest.Run(t, &idemtest.Harness[*redisstore.Tx]{Open: func(t testing.TB) *idemtest.Store[*redisstore.Tx] {
		s, _, _ := openStore(t, nil)
		return s
	}})
}

func TestOrdering(t *testing.T) {
	t.Parallel()
	idemtest.RunOrdering(t, &idemtest.Harness[*redisstore.Tx]{Open: func(t testing.TB) *idemtest.Store[*redisstore.Tx] {
		s, _, _ := openStore(t, nil)
		return s
	}})
}

func TestDeadLetters(t *testing.T) {
	t.Parallel()
	idemtest.RunDeadLetters(t, &idemtest.Harness[*redisstore.Tx]{Open: func(t testing.TB) *idemtest.Store[*redisstore.Tx] {
		s, _, _ := openStore(t, nil)
		return s
	}})
}

func TestBadConfigRefused(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer c.Close()
	for _, cfg := range []*redisstore.Config{
		{Prefix: "has space"},
		{Prefix: "tab\t"},
		{Prefix: "ünï"},
		{Prefix: string(make([]byte, 65))},
		{LockTTL: time.Microsecond},
		{MarkerTTL: -time.Second},
		{MarkerTTL: time.Microsecond},
	} {
		if _, err := redisstore.New(c, cfg); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%+v: got %v, want ErrInvalidConfig", cfg, err)
		}
	}
	if _, err := redisstore.New(nil, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("nil client: got %v, want ErrInvalidConfig", err)
	}
}

func TestMarkerKeyIsUnambiguous(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	drv, err := redisstore.New(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Handler names may hold ':' but never '|'.
	a, b := drv.MarkerKey("a:b", "c"), drv.MarkerKey("a", "b:c")
	if a == b {
		t.Fatalf("both keys are %q", a)
	}
	if want := "idem:m:a:b|c"; a != want {
		t.Errorf("MarkerKey = %q, want %q", a, want)
	}
}

// A process that dies between taking a message's lock and committing
// leaves the lock only: no marker, no effect. After LockTTL the redelivery
// applies, exactly once.
func TestCrashedTransactionsLockExpires(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, prefix := openStore(t, &redisstore.Config{LockTTL: 300 * time.Millisecond})
	drv := s.Driver.(*redisstore.Driver)
	msg := idemtest.Event{ID: "evt-1", Account: "acct-1", Amount: 7}.Message()

	// The "crashed" transaction: marker taken, effect queued, never
	// committed, its connection abandoned.
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	locked := time.Now() // the lock expires LockTTL after this, at the earliest
	res, err := drv.MarkerInsert(ctx, tx, &driver.MarkerInsertParams{Handler: "balances", MessageID: msg.ID, PayloadHash: msg.PayloadHash()})
	if err != nil || !res.Inserted {
		t.Fatalf("insert: %+v, %v", res, err)
	}
	if err := s.Credit(ctx, tx, "acct-1", 7); err != nil {
		t.Fatal(err)
	}
	tx.Conn().Close() // the process is gone: no EXEC, no release

	if v, err := c.Get(ctx, drv.MarkerKey("balances", msg.ID)).Result(); err != nil || !strings.HasPrefix(v, "p:") {
		t.Fatalf("marker after the crash: %q, %v; want only the pending value", v, err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := idemtest.CreditHandler(s, "balances", nil)
	out, err := proc.Process(ctx, h, msg)
	if err != nil || out != idem.Applied {
		t.Fatalf("redelivery: %v, %v; want applied", out, err)
	}
	if waited := time.Since(locked); waited < 290*time.Millisecond {
		t.Errorf("redelivery applied %v after the crashed lock was taken, before it expired", waited)
	}
	if out, err := proc.Process(ctx, h, msg); err != nil || out != idem.Duplicate {
		t.Fatalf("second redelivery: %v, %v; want duplicate", out, err)
	}
	got, err := c.HGet(ctx, prefix+"balances", "acct-1").Int64()
	if err != nil || got != 7 {
		t.Fatalf("balance %d, %v; want 7", got, err)
	}
}

// A transaction that outlives its lock while another applies the message
// cannot commit: its EXEC aborts, and the effect is applied once.
func TestSlowTransactionCannotDoubleApply(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, prefix, _, proc := openProc(t, &redisstore.Config{LockTTL: 300 * time.Millisecond})
	msg := idemtest.Event{ID: "evt-1", Account: "acct-1", Amount: 5}.Message()
	inSlow, release := make(chan struct{}), make(chan struct{})
	slow := &idem.Handler[*redisstore.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		close(inSlow)
		<-release
		return s.Credit(ctx, tx, "acct-1", 5)
	}}
	done := make(chan error, 1)
	go func() {
		out, err := proc.Process(ctx, slow, msg)
		if err == nil {
			err = fmt.Errorf("slow delivery: outcome %v, want an error", out)
		}
		done <- err
	}()
	<-inSlow
	// The slow one's lock expires; a redelivery takes over and applies.
	out, err := proc.Process(ctx, idemtest.CreditHandler(s, "balances", nil), msg)
	if err != nil || out != idem.Applied {
		t.Fatalf("redelivery: %v, %v; want applied", out, err)
	}
	close(release)
	if err := <-done; !errors.Is(err, redisstore.ErrAborted) {
		t.Fatalf("slow delivery: %v; want ErrAborted", err)
	}
	got, err := c.HGet(ctx, prefix+"balances", "acct-1").Int64()
	if err != nil || got != 5 {
		t.Fatalf("balance %d, %v; want 5", got, err)
	}
}

// A read-modify-write handler watches what it reads: a concurrent change
// of that key aborts the commit rather than being overwritten, and no
// marker is written, so the retry applies.
func TestWatchedReadAbortsOnConcurrentChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c, prefix, _, proc := openProc(t, nil)
	key := prefix + "max"
	var interfere atomic.Bool
	interfere.Store(true)
	h := &idem.Handler[*redisstore.Tx]{Name: "max", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		if err := tx.Watch(ctx, key); err != nil {
			return err
		}
		cur, err := tx.Conn().Get(ctx, key).Int64()
		if err != nil && !errors.Is(err, redis.Nil) {
			return err
		}
		if interfere.Swap(false) {
			if err := c.Set(ctx, key, 100, 0).Err(); err != nil {
				return err
			}
		}
		return tx.Queue().Set(ctx, key, max(cur, 10), 0).Err()
	}}
	msg := &idem.Message{ID: "m-1", Payload: []byte("10")}
	if _, err := proc.Process(ctx, h, msg); !errors.Is(err, redisstore.ErrAborted) {
		t.Fatalf("first attempt: %v; want ErrAborted", err)
	}
	if out, err := proc.Process(ctx, h, msg); err != nil || out != idem.Applied {
		t.Fatalf("retry: %v, %v; want applied", out, err)
	}
	if got, err := c.Get(ctx, key).Int64(); err != nil || got != 100 {
		t.Fatalf("max = %d, %v; want 100 (the concurrent write kept)", got, err)
	}
}

// Redis does not roll back an EXEC in which one command fails: Commit says
// so with ErrExecPartial, and the marker is there.
func TestFailedQueuedCommandIsReported(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c, prefix, drv, proc := openProc(t, nil)
	if err := c.Set(ctx, prefix+"str", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*redisstore.Tx]{Name: "bad", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		return tx.Queue().HIncrBy(ctx, prefix+"str", "f", 1).Err() // WRONGTYPE at EXEC
	}}
	_, err := proc.Process(ctx, h, &idem.Message{ID: "m-1"})
	if !errors.Is(err, redisstore.ErrExecPartial) {
		t.Fatalf("got %v; want ErrExecPartial", err)
	}
	if n, err := c.Exists(ctx, drv.MarkerKey("bad", "m-1")).Result(); err != nil || n != 1 {
		t.Fatalf("marker: %d, %v; want written", n, err)
	}
}

func TestMarkerTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, _, drv, proc := openProc(t, &redisstore.Config{MarkerTTL: time.Hour})
	msg := idemtest.Event{ID: "evt-1", Account: "a", Amount: 1}.Message()
	if _, err := proc.Process(ctx, idemtest.CreditHandler(s, "balances", nil), msg); err != nil {
		t.Fatal(err)
	}
	ttl, err := c.PTTL(ctx, drv.MarkerKey("balances", msg.ID)).Result()
	if err != nil || ttl <= 59*time.Minute || ttl > time.Hour {
		t.Fatalf("marker TTL %v, %v; want about 1h", ttl, err)
	}
	// The ordering guard's gap sightings expire the same way.
	if _, err := drv.GapSighting(ctx, &driver.GapSightingParams{Handler: "balances", AggregateID: "a", Seq: 5}); err != nil {
		t.Fatal(err)
	}
	prefix := strings.TrimSuffix(drv.MarkerKey("balances", "x"), "m:balances|x")
	ttl, err = c.PTTL(ctx, prefix+"g:balances|a").Result()
	if err != nil || ttl <= 59*time.Minute || ttl > time.Hour {
		t.Fatalf("gap sightings TTL %v, %v; want about 1h", ttl, err)
	}
}

// A transaction holding markers waits for a message another transaction
// has locked, and takes it once that one rolls back. Inside a transaction
// whose caller watched keys it cannot wait (that would drop the caller's
// watches): the insert fails with ErrLockBusy.
func TestWaitForLockedMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, _ := openStore(t, nil)
	drv := s.Driver.(*redisstore.Driver)
	params := func(id string) *driver.MarkerInsertParams {
		return &driver.MarkerInsertParams{Handler: "h", MessageID: id, PayloadHash: []byte("x")}
	}
	holder, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := drv.MarkerInsert(ctx, holder, params("m-2")); err != nil || !res.Inserted {
		t.Fatalf("holder: %+v, %v", res, err)
	}

	watcher, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := watcher.Watch(ctx, "some-read"); err != nil {
		t.Fatal(err)
	}
	if _, err := drv.MarkerInsert(ctx, watcher, params("m-2")); !errors.Is(err, redisstore.ErrLockBusy) {
		t.Fatalf("watching transaction: %v; want ErrLockBusy", err)
	}
	if err := drv.Rollback(ctx, watcher); err != nil {
		t.Fatal(err)
	}

	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := drv.MarkerInsert(ctx, tx, params("m-1")); err != nil || !res.Inserted {
		t.Fatalf("first: %+v, %v", res, err)
	}
	start := time.Now()
	go func() {
		time.Sleep(100 * time.Millisecond)
		drv.Rollback(ctx, holder)
	}()
	if res, err := drv.MarkerInsert(ctx, tx, params("m-2")); err != nil || !res.Inserted {
		t.Fatalf("second: %+v, %v", res, err)
	}
	if waited := time.Since(start); waited < 80*time.Millisecond {
		t.Errorf("second insert returned after %v, before the holder rolled back", waited)
	}
	if err := drv.Commit(ctx, tx); err != nil {
		t.Fatal(err)
	}
	if n, err := c.Exists(ctx, drv.MarkerKey("h", "m-1"), drv.MarkerKey("h", "m-2")).Result(); err != nil || n != 2 {
		t.Fatalf("markers after commit: %d, %v; want 2", n, err)
	}
}

// Many processes' worth of goroutines deliver overlapping batches in
// different orders: locks taken in ID order never deadlock, and every
// credit lands once.
func TestOverlappingBatchesDoNotDeadlock(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, _, _ := openStore(t, nil)
	proc, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := idemtest.CreditHandler(s, "balances", nil)
	events := idemtest.Events(400)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := range 16 {
		wg.Go(func() {
			// Goroutine g delivers windows of 50 starting at offsets that
			// overlap its neighbours', reversed every other goroutine.
			for lo := (g * 25) % 400; lo < 400; lo += 50 {
				var msgs []*idem.Message
				for i := lo; i < min(lo+50, 400); i++ {
					msgs = append(msgs, events[i].Message())
				}
				if g%2 == 1 {
					for i, j := 0, len(msgs)-1; i < j; i, j = i+1, j-1 {
						msgs[i], msgs[j] = msgs[j], msgs[i]
					}
				}
				if _, err := proc.ProcessBatch(ctx, h, msgs); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// Offsets 0, 25, …, 375 with windows of 50 cover every event.
	got, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := idemtest.Expected(events)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("balances %v\nwant %v", got, want)
	}
}

// TestExampleFlow is Example against the test server.
func TestExampleFlow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client, prefix := testenv.Redis(t)
	drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*redisstore.Tx]{
		Name: "balances",
		Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
			return tx.Queue().HIncrBy(ctx, prefix+"balances", m.AggregateID, 25).Err()
		},
	}
	msg := &idem.Message{ID: "credit-1", AggregateID: "acct-7", Payload: []byte("25")}
	var outs []idem.Outcome
	for range 2 {
		out, err := proc.Process(ctx, h, msg)
		if err != nil {
			t.Fatal(err)
		}
		outs = append(outs, out)
	}
	balance, err := client.HGet(ctx, prefix+"balances", "acct-7").Int64()
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(outs, balance) != "[applied duplicate] 25" {
		t.Fatalf("outcomes %v, balance %d; want [applied duplicate] 25", outs, balance)
	}
}

// A queued command Redis refuses when it is queued (wrong arity) discards
// the whole transaction: nothing applied, no marker, and the message can
// be applied later by a handler that gets it right.
func TestRefusedQueuedCommandDiscardsAll(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c, prefix, drv, proc := openProc(t, nil)
	bad := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		tx.Queue().HIncrBy(ctx, prefix+"n", "f", 1)
		return tx.Queue().Do(ctx, "hincrby", prefix+"n").Err() // too few arguments
	}}
	msg := &idem.Message{ID: "m-1"}
	if out, err := proc.Process(ctx, bad, msg); err == nil || errors.Is(err, redisstore.ErrExecPartial) {
		t.Fatalf("bad handler: %v, %v; want an error, not a partial EXEC", out, err)
	}
	if n, err := c.Exists(ctx, prefix+"n", drv.MarkerKey("h", "m-1")).Result(); err != nil || n != 0 {
		t.Fatalf("%d keys written by a discarded transaction (%v)", n, err)
	}
	good := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		return tx.Queue().HIncrBy(ctx, prefix+"n", "f", 1).Err()
	}}
	if out, err := proc.Process(ctx, good, msg); err != nil || out != idem.Applied {
		t.Fatalf("retry: %v, %v; want applied", out, err)
	}
	if got, err := c.HGet(ctx, prefix+"n", "f").Int64(); err != nil || got != 1 {
		t.Fatalf("n.f = %d, %v; want 1", got, err)
	}
}

// A server that lost its script cache (a restart, SCRIPT FLUSH) answers
// the driver's first script call with NOSCRIPT after the same pipeline
// WATCHed the keys that script was to write. Retrying on the same
// connection must not leave those watches behind: writing a key it watches
// would abort the transaction's own commit. The flush is server-wide, so
// concurrent tests meet it too, which every script call must survive.
func TestScriptCacheLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, _ := openStore(t, nil)
	drv := s.Driver.(*redisstore.Driver)
	many := func(ids ...string) *driver.MarkerInsertManyParams {
		p := &driver.MarkerInsertManyParams{Handler: "h", MessageIDs: ids}
		for range ids {
			p.PayloadHashes = append(p.PayloadHashes, []byte("x"))
		}
		return p
	}

	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A claim held before the cache is lost, and a batch inserted after.
	if res, err := drv.MarkerInsert(ctx, tx, &driver.MarkerInsertParams{Handler: "h", MessageID: "m-0", PayloadHash: []byte("x")}); err != nil || !res.Inserted {
		t.Fatalf("first insert: %+v, %v", res, err)
	}
	if err := c.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	res, err := drv.MarkerInsertMany(ctx, tx, many("m-1", "m-2", "m-3"))
	if err != nil {
		t.Fatalf("insert after the flush: %v", err)
	}
	for i, r := range res {
		if !r.Inserted {
			t.Fatalf("marker %d not inserted: %+v", i+1, r)
		}
	}
	if err := drv.Commit(ctx, tx); err != nil {
		t.Fatalf("commit after the flush: %v", err)
	}
	if n, err := c.Exists(ctx, drv.MarkerKey("h", "m-0"), drv.MarkerKey("h", "m-1"), drv.MarkerKey("h", "m-2"), drv.MarkerKey("h", "m-3")).Result(); err != nil || n != 4 {
		t.Fatalf("markers after commit: %d, %v; want 4", n, err)
	}

	// Through the processor: a batch and an ordered batch, each right
	// after a flush, apply once.
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var events []idemtest.Event
	want := map[string]int64{}
	for i := range 20 {
		e := idemtest.Event{ID: fmt.Sprintf("evt-%02d", i), Account: fmt.Sprintf("acct-%d", i%3), Amount: int64(i + 1)}
		events = append(events, e)
		want[e.Account] += e.Amount
	}
	msgs := func(es []idemtest.Event) []*idem.Message {
		out := make([]*idem.Message, len(es))
		for i, e := range es {
			out[i] = e.Message()
			out[i].Seq = int64(i + 1) // increasing per account too
		}
		return out
	}
	plain := idemtest.CreditHandler(s, "credits", nil)
	ordered := idemtest.CreditHandler(s, "ordered", nil)
	ordered.Ordering = &idem.Ordering{Gap: idem.GapAllow}
	for _, h := range []*idem.Handler[*redisstore.Tx]{plain, ordered} {
		if err := c.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		outs, err := proc.ProcessBatch(ctx, h, msgs(events))
		if err != nil {
			t.Fatalf("%s: batch after a flush: %v", h.Name, err)
		}
		for i, o := range outs {
			if o != idem.Applied {
				t.Fatalf("%s: event %d: %v; want Applied", h.Name, i, o)
			}
		}
	}
	got, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for a, w := range want {
		if got[a] != 2*w { // both handlers credit the same balances
			t.Errorf("balance %s = %d; want %d", a, got[a], 2*w)
		}
	}
}

// A batch holding a marker another transaction applied watches only the
// markers it holds: a change to that other marker before the commit (a
// commit landing between the batch's WATCH and its read, under load; an
// expiring or deleted marker) must not abort the batch.
func TestBatchWatchesOnlyItsOwnMarkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, prefix, drv, proc := openProc(t, nil)
	old := idemtest.Event{ID: "evt-old", Account: "acct-1", Amount: 5}.Message()
	if out, err := proc.Process(ctx, idemtest.CreditHandler(s, "balances", nil), old); err != nil || out != idem.Applied {
		t.Fatalf("first delivery: %v, %v", out, err)
	}
	fresh := idemtest.Event{ID: "evt-new", Account: "acct-1", Amount: 7}.Message()
	h := &idem.Handler[*redisstore.Tx]{Name: "balances", ApplyBatch: func(ctx context.Context, tx *redisstore.Tx, msgs []*idem.Message) error {
		// The batch's markers are taken; the old one changes meanwhile.
		if err := c.Del(ctx, drv.MarkerKey("balances", old.ID)).Err(); err != nil {
			return err
		}
		for _, m := range msgs {
			if err := s.Credit(ctx, tx, "acct-1", 7); err != nil || m.ID != fresh.ID {
				return fmt.Errorf("credit %s: %v", m.ID, err)
			}
		}
		return nil
	}}
	outs, err := proc.ProcessBatch(ctx, h, []*idem.Message{old, fresh})
	if err != nil {
		t.Fatalf("batch: %v; want it committed", err)
	}
	if outs[0] != idem.Duplicate || outs[1] != idem.Applied {
		t.Fatalf("outcomes %v; want [Duplicate Applied]", outs)
	}
	got, err := c.HGet(ctx, prefix+"balances", "acct-1").Int64()
	if err != nil || got != 12 {
		t.Fatalf("balance %d, %v; want 12", got, err)
	}
}

// The same in a transaction of the caller's that only met a duplicate:
// its own writes commit although the duplicate's marker changed.
func TestDuplicateInCallersTransactionDoesNotAbortIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, prefix, drv, proc := openProc(t, nil)
	old := idemtest.Event{ID: "evt-old", Account: "acct-1", Amount: 5}.Message()
	h := idemtest.CreditHandler(s, "balances", nil)
	if out, err := proc.Process(ctx, h, old); err != nil || out != idem.Applied {
		t.Fatalf("first delivery: %v, %v", out, err)
	}
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Queue().Set(ctx, prefix+"own", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if out, err := proc.ProcessTx(ctx, tx, h, old); err != nil || out != idem.Duplicate {
		t.Fatalf("redelivery: %v, %v; want Duplicate", out, err)
	}
	if err := c.Del(ctx, drv.MarkerKey("balances", old.ID)).Err(); err != nil {
		t.Fatal(err)
	}
	if err := drv.Commit(ctx, tx); err != nil {
		t.Fatalf("commit: %v; want the caller's write committed", err)
	}
	if v, err := c.Get(ctx, prefix+"own").Result(); err != nil || v != "v" {
		t.Fatalf("caller's write: %q, %v", v, err)
	}
}
