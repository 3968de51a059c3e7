package redisstore_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/redisstore"
)

// A handler on a WriteOnly driver that takes a write-side version gets
// ErrReadInWriteOnly, as for any read; the rollback must not panic on the
// transaction's missing connection.
func TestWriteOnlyVersionReadRollsBack(t *testing.T) {
	t.Parallel()
	s, c, _, drv, proc := openProc(t, &redisstore.Config{WriteOnly: true})
	ctx := context.Background()
	vs, err := idem.NewVersions(drv)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*redisstore.Tx]{Name: "versioned", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		if _, err := vs.Next(ctx, tx, "orders", "o1"); err != nil {
			return err
		}
		return s.Credit(ctx, tx, "acct", 1)
	}}
	msg := &idem.Message{ID: "v-1"}
	out, err := proc.Process(ctx, h, msg)
	if out != idem.OutcomeNone || !errors.Is(err, redisstore.ErrReadInWriteOnly) {
		t.Fatalf("(%v, %v), want ErrReadInWriteOnly", out, err)
	}
	if n := c.Exists(ctx, drv.MarkerKey("versioned", msg.ID)).Val(); n != 0 {
		t.Fatal("a marker was written")
	}
}

// A queued command with as many arguments as the write-only path takes
// applies with its marker; one more is refused before anything is sent.
// Lua's unpack cannot take two more than the limit: the script then
// failed after it had written the marker and the commands before it, so
// the message counted as applied without its last writes.
func TestWriteOnlyArgumentLimit(t *testing.T) {
	t.Parallel()
	for _, n := range []int{7997, 7998, 7999} {
		_, c, prefix, drv, proc := openProc(t, &redisstore.Config{WriteOnly: true})
		ctx := context.Background()
		h := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
			tx.Queue().Incr(ctx, prefix+"before")
			vals := make([]any, n-2) // RPUSH and the key are two
			for i := range vals {
				vals[i] = i
			}
			return tx.Queue().RPush(ctx, prefix+"list", vals...).Err()
		}}
		out, err := proc.Process(ctx, h, &idem.Message{ID: "x"})
		marker := c.Exists(ctx, drv.MarkerKey("h", "x")).Val()
		before, _ := c.Get(ctx, prefix+"before").Result()
		list := c.LLen(ctx, prefix+"list").Val()
		if n <= 7997 {
			if out != idem.Applied || err != nil || marker != 1 || before != "1" || list != int64(n-2) {
				t.Fatalf("%d arguments: (%v, %v), marker %d, before %q, list %d; want all applied", n, out, err, marker, before, list)
			}
			continue
		}
		if !errors.Is(err, idem.ErrInvalidConfig) || marker != 0 || before != "" || list != 0 {
			t.Fatalf("%d arguments: (%v, %v), marker %d, before %q, list %d; want ErrInvalidConfig and nothing written", n, out, err, marker, before, list)
		}
	}
}

// A LockTTL near the largest Duration ("never expire") still lets a
// transaction that holds a lock wait for another's: its wait bound,
// LockTTL and up to half as much again, overflowed to a negative
// duration, and the waiter failed with ErrLockWait at its second look.
func TestHugeLockTTLStillWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, _, drv, _ := openProc(t, &redisstore.Config{LockTTL: time.Duration(math.MaxInt64)})
	vs, err := idem.NewVersions(drv)
	if err != nil {
		t.Fatal(err)
	}
	holder, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vs.Next(ctx, holder, "s", "A"); err != nil {
		t.Fatal(err)
	}
	waiter, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Rollback(ctx, waiter)
	if _, err := vs.Next(ctx, waiter, "s", "B"); err != nil { // a lock of its own
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := vs.Next(ctx, waiter, "s", "A")
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("the waiter returned %v while the holder was still working", err)
	case <-time.After(300 * time.Millisecond):
	}
	if err := drv.Commit(ctx, holder); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("after the holder committed: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not go on after the holder committed")
	}
}
