package redisstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// TestWriteOnlyConformance runs the conformance suite on the write-only
// path: Process checks the marker and applies the queued writes in one
// script call. Batches and ProcessTx take the WATCH path, as
// TestConformance checks at full size.
func TestWriteOnlyConformance(t *testing.T) {
	t.Parallel()
	idemtest.Run(t, &idemtest.Harness[*redisstore.Tx]{Goroutines: 8, IDs: 300, Open: func(t testing.TB) *idemtest.Store[*redisstore.Tx] {
		s, _, _ := openStore(t, &redisstore.Config{WriteOnly: true})
		s.ApplyBeforeCheck = true
		return s
	}})
}

// watchPath returns a driver of the WATCH path on the same prefix as a
// write-only one, and its processor.
func watchPath(t *testing.T, c *redis.Client, prefix string, lockTTL time.Duration) (*redisstore.Driver, *idem.Processor[*redisstore.Tx]) {
	drv, err := redisstore.New(c, &redisstore.Config{Prefix: prefix, LockTTL: lockTTL})
	if err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	return drv, proc
}

// A write-only delivery that meets a marker held by a transaction of the
// WATCH path waits for it to end: a Duplicate once it committed, applied
// once it rolled back.
func TestWriteOnlyWaitsForHold(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		s, c, prefix, _, proc := openProc(t, &redisstore.Config{WriteOnly: true})
		drvW, procW := watchPath(t, c, prefix, 0)
		ctx := context.Background()
		e := idemtest.Events(1)[0]
		h := idemtest.CreditHandler(s, "balances", nil)
		tx, err := drvW.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if out, err := procW.ProcessTx(ctx, tx, h, e.Message()); out != idem.Applied || err != nil {
			t.Fatalf("A: (%v, %v)", out, err)
		}
		type res struct {
			out idem.Outcome
			err error
		}
		bDone := make(chan res, 1)
		go func() {
			out, err := proc.Process(ctx, h, e.Message())
			bDone <- res{out, err}
		}()
		select {
		case r := <-bDone:
			t.Fatalf("B returned (%v, %v) while A held the message", r.out, r.err)
		case <-time.After(300 * time.Millisecond):
		}
		want := idem.Duplicate
		if commit {
			err = drvW.Commit(ctx, tx)
		} else {
			err, want = drvW.Rollback(ctx, tx), idem.Applied
		}
		if err != nil {
			t.Fatal(err)
		}
		if r := <-bDone; r.out != want || r.err != nil {
			t.Fatalf("commit %v: B (%v, %v), want %v", commit, r.out, r.err, want)
		}
		got, err := s.Balances(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got[e.Account] != e.Amount {
			t.Fatalf("commit %v: balance %d, want %d", commit, got[e.Account], e.Amount)
		}
	}
}

// A transaction of the WATCH path that outlived its hold cannot commit
// once a write-only delivery applied the message.
func TestWriteOnlyAbortsOutlivedHold(t *testing.T) {
	t.Parallel()
	s, c, prefix, _, proc := openProc(t, &redisstore.Config{WriteOnly: true})
	drvW, procW := watchPath(t, c, prefix, 50*time.Millisecond)
	ctx := context.Background()
	e := idemtest.Events(1)[0]
	h := idemtest.CreditHandler(s, "balances", nil)
	tx, err := drvW.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := procW.ProcessTx(ctx, tx, h, e.Message()); out != idem.Applied || err != nil {
		t.Fatalf("A: (%v, %v)", out, err)
	}
	marker := drvW.MarkerKey("balances", e.ID)
	for c.Exists(ctx, marker).Val() == 1 { // the hold expires
		time.Sleep(10 * time.Millisecond)
	}
	if out, err := proc.Process(ctx, h, e.Message()); out != idem.Applied || err != nil {
		t.Fatalf("B: (%v, %v)", out, err)
	}
	if err := drvW.Commit(ctx, tx); !errors.Is(err, redisstore.ErrAborted) {
		t.Fatalf("A's commit after B applied: %v, want ErrAborted", err)
	}
	got, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got[e.Account] != e.Amount {
		t.Fatalf("balance %d, want %d", got[e.Account], e.Amount)
	}
}

// A handler that reads through its transaction on the write-only path
// applies nothing: no effect, no marker, and an error that says why.
func TestWriteOnlyRefusesReads(t *testing.T) {
	t.Parallel()
	s, c, prefix, drv, proc := openProc(t, &redisstore.Config{WriteOnly: true})
	ctx := context.Background()
	reads := map[string]func(ctx context.Context, tx *redisstore.Tx) error{
		"conn": func(ctx context.Context, tx *redisstore.Tx) error {
			if err := tx.Conn().Get(ctx, prefix+"config").Err(); err != nil && !errors.Is(err, redis.Nil) {
				return err
			}
			return nil
		},
		"watch ignored": func(ctx context.Context, tx *redisstore.Tx) error {
			_ = tx.Watch(ctx, prefix+"config")
			return nil
		},
	}
	for name, read := range reads {
		h := &idem.Handler[*redisstore.Tx]{Name: "reader", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
			if err := read(ctx, tx); err != nil {
				return err
			}
			return s.Credit(ctx, tx, "acct", 1)
		}}
		msg := &idem.Message{ID: "read-" + name}
		out, err := proc.Process(ctx, h, msg)
		if out != idem.OutcomeNone || !errors.Is(err, redisstore.ErrReadInWriteOnly) || !errors.Is(err, idem.ErrInvalidConfig) || !idem.IsPermanent(err) {
			t.Fatalf("%s: (%v, %v), want ErrReadInWriteOnly", name, out, err)
		}
		if n := c.Exists(ctx, drv.MarkerKey("reader", msg.ID)).Val(); n != 0 {
			t.Fatalf("%s: a marker was written", name)
		}
	}
	got, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 0 {
		t.Fatalf("balances %v, want none", got)
	}
}

// A queued command that fails inside the script leaves the others and the
// marker applied, as one that fails inside EXEC does; its own result
// carries the error.
func TestWriteOnlyPartial(t *testing.T) {
	t.Parallel()
	_, c, prefix, drv, proc := openProc(t, &redisstore.Config{WriteOnly: true, MarkerTTL: time.Minute})
	ctx := context.Background()
	if err := c.Set(ctx, prefix+"string", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	var bad *redis.IntCmd
	h := &idem.Handler[*redisstore.Tx]{Name: "partial", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		bad = tx.Queue().HIncrBy(ctx, prefix+"string", "f", 1) // wrong type
		tx.Queue().Set(ctx, prefix+"other", "applied", 0)
		return nil
	}}
	msg := &idem.Message{ID: "p-1"}
	out, err := proc.Process(ctx, h, msg)
	if out != idem.OutcomeNone || !errors.Is(err, redisstore.ErrExecPartial) {
		t.Fatalf("(%v, %v), want ErrExecPartial", out, err)
	}
	if bad.Err() == nil {
		t.Fatal("the failed command's result has no error")
	}
	if v := c.Get(ctx, prefix+"other").Val(); v != "applied" {
		t.Fatalf("the other command: %q", v)
	}
	ttl := c.PTTL(ctx, drv.MarkerKey("partial", msg.ID)).Val()
	if ttl <= 0 || ttl > time.Minute {
		t.Fatalf("marker TTL %v, want MarkerTTL", ttl)
	}
	if out, err := proc.Process(ctx, h, msg); out != idem.Duplicate || err != nil {
		t.Fatalf("redelivery: (%v, %v)", out, err)
	}
}

// The commit's script survives a server that lost its script cache (a
// restart, SCRIPT FLUSH). Not parallel: another test's script call would
// reload the scripts between the flush and this one's.
func TestWriteOnlyScriptCacheLost(t *testing.T) {
	s, c, _, _, proc := openProc(t, &redisstore.Config{WriteOnly: true})
	ctx := context.Background()
	h := idemtest.CreditHandler(s, "balances", nil)
	ev := idemtest.Events(2)
	for _, e := range ev {
		if err := c.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if out, err := proc.Process(ctx, h, e.Message()); out != idem.Applied || err != nil {
			t.Fatalf("(%v, %v)", out, err)
		}
	}
	got, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for acct, want := range idemtest.Expected(ev) {
		if got[acct] != want {
			t.Fatalf("balance of %s %d, want %d", acct, got[acct], want)
		}
	}
}

// writeOnlyCrashHarness kills a child on the WATCH path (holding the
// message until LockTTL) or on the write-only path (holding nothing), and
// redelivers on the write-only path.
func writeOnlyCrashHarness(childWriteOnly bool, childTest string) *idemtest.AtomicCrashHarness[*redisstore.Tx] {
	return &idemtest.AtomicCrashHarness[*redisstore.Tx]{
		Create: func(t testing.TB) (*idemtest.Store[*redisstore.Tx], string) {
			s, _, prefix := openStore(t, &redisstore.Config{LockTTL: crashLockTTL, WriteOnly: true})
			s.ApplyBeforeCheck = true
			return s, prefix
		},
		Attach: func(t testing.TB, prefix string) *idemtest.Store[*redisstore.Tx] {
			opts, err := redis.ParseURL(testenv.RedisURL())
			if err != nil {
				t.Fatal(err)
			}
			opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled} // see testenv.Redis
			drv, err := redisstore.New(redis.NewClient(opts), &redisstore.Config{Prefix: prefix, LockTTL: crashLockTTL, WriteOnly: childWriteOnly})
			if err != nil {
				t.Fatal(err)
			}
			return &idemtest.Store[*redisstore.Tx]{Driver: drv, Credit: func(ctx context.Context, tx *redisstore.Tx, account string, amount int64) error {
				return tx.Queue().HIncrBy(ctx, prefix+"balances", account, amount).Err()
			}}
		},
		ChildTest: childTest,
	}
}

// TestWriteOnlyCrashAfterHold: a process killed inside a transaction of
// the WATCH path leaves its hold, which the write-only redeliveries wait
// out; after its commit they are Duplicates.
func TestWriteOnlyCrashAfterHold(t *testing.T) {
	idemtest.RunAtomicCrash(t, writeOnlyCrashHarness(false, "TestWriteOnlyCrashAfterHoldChild"))
}

// TestWriteOnlyCrashAfterHoldChild is the killed process of
// TestWriteOnlyCrashAfterHold; run on its own it does nothing.
func TestWriteOnlyCrashAfterHoldChild(t *testing.T) {
	idemtest.AtomicCrashChild(t, writeOnlyCrashHarness(false, "TestWriteOnlyCrashAfterHoldChild"))
}

// TestWriteOnlyCrash: a process killed on the write-only path before its
// commit leaves nothing; after it, the marker.
func TestWriteOnlyCrash(t *testing.T) {
	idemtest.RunAtomicCrash(t, writeOnlyCrashHarness(true, "TestWriteOnlyCrashChild"))
}

// TestWriteOnlyCrashChild is the killed process of TestWriteOnlyCrash; run
// on its own it does nothing.
func TestWriteOnlyCrashChild(t *testing.T) {
	idemtest.AtomicCrashChild(t, writeOnlyCrashHarness(true, "TestWriteOnlyCrashChild"))
}

// A queued command that cannot run inside a script (one Redis flags
// noscript, or one it does not know) fails the commit before anything is
// sent: no marker, no effect, where the script would have run the others.
func TestWriteOnlyRefusesUnscriptable(t *testing.T) {
	t.Parallel()
	s, c, _, drv, proc := openProc(t, &redisstore.Config{WriteOnly: true})
	ctx := context.Background()
	queue := map[string]func(ctx context.Context, q redis.Pipeliner){
		"evalsha": func(ctx context.Context, q redis.Pipeliner) {
			q.EvalSha(ctx, "0123456789012345678901234567890123456789", nil)
		},
		"unknown": func(ctx context.Context, q redis.Pipeliner) { q.Do(ctx, "nosuchcommand", "x") },
	}
	for name, add := range queue {
		h := &idem.Handler[*redisstore.Tx]{Name: "unscriptable", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
			if err := s.Credit(ctx, tx, "acct", 1); err != nil {
				return err
			}
			add(ctx, tx.Queue())
			return nil
		}}
		msg := &idem.Message{ID: "u-" + name}
		out, err := proc.Process(ctx, h, msg)
		if out != idem.OutcomeNone || !errors.Is(err, redisstore.ErrNotScriptable) || !errors.Is(err, idem.ErrInvalidConfig) || !idem.IsPermanent(err) {
			t.Fatalf("%s: (%v, %v), want ErrNotScriptable", name, out, err)
		}
		if n := c.Exists(ctx, drv.MarkerKey("unscriptable", msg.ID)).Val(); n != 0 {
			t.Fatalf("%s: a marker was written", name)
		}
	}
	got, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 0 {
		t.Fatalf("balances %v, want none", got)
	}
}
