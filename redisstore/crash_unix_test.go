//go:build unix

package redisstore_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// Environment of the crashing child process.
const (
	crashPointEnv  = "IDEM_REDIS_CRASH_POINT"
	crashPrefixEnv = "IDEM_REDIS_CRASH_PREFIX"
	crashLockTTL   = 500 * time.Millisecond
)

// crashHandler credits 7 to acct-1 and, in the child, kills the process at
// point: "handler" as the handler starts (the marker is taken), "queued"
// once the effect is queued (everything but the EXEC done), "committed"
// once Process returned Applied (before any broker ack).
func crashHandler(prefix, point string) *idem.Handler[*redisstore.Tx] {
	return &idem.Handler[*redisstore.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		if point == "handler" {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
		err := tx.Queue().HIncrBy(ctx, prefix+"balances", "acct-1", 7).Err()
		if point == "queued" {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
		return err
	}}
}

var crashMsg = &idem.Message{ID: "credit-1", Payload: []byte("7")}

// TestCrashChild is the child's side of TestCrashKilledProcess; it passes
// at once unless started by it.
func TestCrashChild(t *testing.T) {
	point, prefix := os.Getenv(crashPointEnv), os.Getenv(crashPrefixEnv)
	if point == "" {
		return
	}
	opts, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled} // see testenv.Redis
	drv, err := redisstore.New(redis.NewClient(opts), &redisstore.Config{Prefix: prefix, LockTTL: crashLockTTL})
	if err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	out, err := proc.Process(context.Background(), crashHandler(prefix, point), crashMsg)
	if err == nil && out == idem.Applied && point == "committed" {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
	}
	t.Fatalf("child was not killed at %q: %v, %v", point, out, err)
}

// TestCrashKilledProcess starts this test binary again as a child that
// processes one message and dies of SIGKILL at a point of its transaction,
// then redelivers the message from four goroutines at once. Killed before
// its EXEC, the child applied nothing and left only its pending marker:
// after the lock expires exactly one redelivery applies. Killed after, the
// message is applied and every redelivery is a Duplicate. The balance is 7
// either way.
func TestCrashKilledProcess(t *testing.T) {
	if os.Getenv(crashPointEnv) != "" {
		return // in the child, which runs TestCrashChild only
	}
	for _, point := range []string{"handler", "queued", "committed"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			client, prefix := testenv.Redis(t)
			cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
			cmd.Env = append(os.Environ(), crashPointEnv+"="+point, crashPrefixEnv+"="+prefix)
			out, err := cmd.CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) {
				t.Fatalf("child: %v\n%s", err, out)
			}
			if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
				t.Fatalf("child did not die of SIGKILL at %q: %v\n%s", point, err, out)
			}
			drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix, LockTTL: crashLockTTL})
			if err != nil {
				t.Fatal(err)
			}
			if point != "committed" {
				if n, err := client.HLen(ctx, prefix+"balances").Result(); err != nil || n != 0 {
					t.Fatalf("the child's effect is visible after it died before its EXEC: %d, %v", n, err)
				}
			}
			proc, err := idem.NewProcessor(drv, nil)
			if err != nil {
				t.Fatal(err)
			}
			var (
				mu   sync.Mutex
				outs = map[idem.Outcome]int{}
				wg   sync.WaitGroup
			)
			for range 4 {
				wg.Go(func() {
					out, err := proc.Process(ctx, crashHandler(prefix, ""), crashMsg)
					if err != nil {
						t.Errorf("redelivery: %v", err)
					}
					mu.Lock()
					outs[out]++
					mu.Unlock()
				})
			}
			wg.Wait()
			wantApplied := 1
			if point == "committed" {
				wantApplied = 0
			}
			if outs[idem.Applied] != wantApplied || outs[idem.Duplicate] != 4-wantApplied {
				t.Errorf("redeliveries: %v, want %d applied and the rest duplicate", outs, wantApplied)
			}
			if got, err := client.HGet(ctx, prefix+"balances", "acct-1").Int64(); err != nil || got != 7 {
				t.Fatalf("balance %d, %v; want 7", got, err)
			}
		})
	}
}
