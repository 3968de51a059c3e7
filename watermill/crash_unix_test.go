//go:build unix

package watermill_test

import (
	"errors"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	idemwm "github.com/idemhq/idem/watermill"
)

// Environment of the subscriber child process (TestSubscriberChild).
const (
	envChildBroker = "IDEM_WM_CHILD_BROKER"
	envChildSchema = "IDEM_WM_CHILD_SCHEMA"
	envChildTopic  = "IDEM_WM_CHILD_TOPIC"
)

// A subscriber process consuming through idem is killed with SIGKILL
// mid-stream, wherever it is (inside a transaction, between a commit and
// its ack, ...), and a new process takes over: the balances come out
// exactly as the unique events say, with every tenth event published
// twice.
func TestSubscriberProcessKilled(t *testing.T) {
	t.Parallel()
	for _, name := range brokers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newPGEnv(t, nil)
			b := brokerFor(t, name, e, unique("idem_wm_crash_"), true)
			events := idemtest.Events(1200)
			publishEvents(t, b.pub, b.topic, events, 10)

			first := startChild(t, name, e.schema, b.topic)
			waitFor(t, 30*time.Second, "the child applied 200 events", func() bool { return e.markers() >= 200 })
			first.kill(t)
			if n := e.markers(); n >= len(events) {
				t.Logf("the child applied all %d events before it was killed: the restart has nothing left to do", n)
			} else {
				t.Logf("killed after %d of %d events", n, len(events))
			}

			second := startChild(t, name, e.schema, b.topic)
			e.waitExact(events, 0)
			second.kill(t)
		})
	}
}

// child is a subscriber process running TestSubscriberChild.
type child struct {
	cmd *exec.Cmd
	out *testenv.Buffer
}

// startChild starts the test binary again, running only
// TestSubscriberChild on the given broker, schema and topic.
func startChild(t *testing.T, broker, schema, topic string) *child {
	t.Helper()
	c := &child{out: &testenv.Buffer{}}
	c.cmd = exec.Command(os.Args[0], "-test.run=^TestSubscriberChild$", "-test.count=1", "-test.v")
	c.cmd.Env = append(os.Environ(), envChildBroker+"="+broker, envChildSchema+"="+schema, envChildTopic+"="+topic)
	c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if c.cmd.ProcessState == nil {
			_ = c.cmd.Process.Kill()
			_ = c.cmd.Wait()
		}
	})
	return c
}

// kill sends SIGKILL and checks that the child died of it.
func (c *child) kill(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := c.cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("child was not killed (wait: %v); output:\n%s", err, c.out.String())
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child ended with %v, want killed by SIGKILL; output:\n%s", ee, c.out.String())
	}
}

// TestSubscriberChild is the subscriber process of
// TestSubscriberProcessKilled: a router consuming through idem until it
// is killed. Run by itself it returns at once.
func TestSubscriberChild(t *testing.T) {
	name := os.Getenv(envChildBroker)
	if name == "" {
		return
	}
	e := attachPGEnv(t, os.Getenv(envChildSchema))
	b := brokerFor(t, name, e, os.Getenv(envChildTopic), false)
	h, err := idemwm.New(e.consumer, nil)
	if err != nil {
		t.Fatal(err)
	}
	runRouter(t, b.newSub(t), b.topic, h.Handle)
	time.Sleep(2 * time.Minute) // until killed
	t.Fatal("not killed within 2 minutes")
}
