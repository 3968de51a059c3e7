package redisstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// crashLockTTL is the lock a killed child leaves on its message: the
// redeliveries wait it out.
const crashLockTTL = 500 * time.Millisecond

// atomicCrashHarness shares a key prefix with the killed child.
func atomicCrashHarness() *idemtest.AtomicCrashHarness[*redisstore.Tx] {
	return &idemtest.AtomicCrashHarness[*redisstore.Tx]{
		Create: func(t testing.TB) (*idemtest.Store[*redisstore.Tx], string) {
			s, _, prefix := openStore(t, &redisstore.Config{LockTTL: crashLockTTL})
			return s, prefix
		},
		Attach: func(t testing.TB, prefix string) *idemtest.Store[*redisstore.Tx] {
			// A client of its own: testenv.Redis would delete the
			// prefix's keys when the child's test ends.
			opts, err := redis.ParseURL(testenv.RedisURL())
			if err != nil {
				t.Fatal(err)
			}
			opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled} // see testenv.Redis
			drv, err := redisstore.New(redis.NewClient(opts), &redisstore.Config{Prefix: prefix, LockTTL: crashLockTTL})
			if err != nil {
				t.Fatal(err)
			}
			return &idemtest.Store[*redisstore.Tx]{Driver: drv, Credit: func(ctx context.Context, tx *redisstore.Tx, account string, amount int64) error {
				return tx.Queue().HIncrBy(ctx, prefix+"balances", account, amount).Err()
			}}
		},
		ChildTest: "TestAtomicCrashChild",
	}
}

// TestAtomicCrash kills a process inside a transaction, before its EXEC
// (the child's pending marker then holds the message for LockTTL) and
// after it, and redelivers the message concurrently.
func TestAtomicCrash(t *testing.T) { idemtest.RunAtomicCrash(t, atomicCrashHarness()) }

// TestAtomicCrashChild is the killed process of TestAtomicCrash; run on its
// own it does nothing.
func TestAtomicCrashChild(t *testing.T) { idemtest.AtomicCrashChild(t, atomicCrashHarness()) }
