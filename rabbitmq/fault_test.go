package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/rabbitmq"
)

// closeConnection closes, with rabbitmqctl, the one connection whose
// client properties carry name: the adapter's own, never another's. It
// may run outside the test's goroutine: failures are returned.
func closeConnection(name string) error {
	rabbitmqctl, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		return err
	}
	out, err := exec.Command(rabbitmqctl, "-q", "list_connections", "pid", "client_properties").CombinedOutput()
	if err != nil {
		return fmt.Errorf("rabbitmqctl list_connections: %w\n%s", err, out)
	}
	var pids []string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, `"`+name+`"`) {
			pids = append(pids, strings.SplitN(line, "\t", 2)[0])
		}
	}
	if len(pids) != 1 {
		return fmt.Errorf("%d connections named %q, want 1:\n%s", len(pids), name, out)
	}
	if out, err := exec.Command(rabbitmqctl, "-q", "close_connection", pids[0], "idem test: connection closed mid-stream").CombinedOutput(); err != nil {
		return fmt.Errorf("rabbitmqctl close_connection %s: %w\n%s", pids[0], err, out)
	}
	return nil
}

// The server closes the consumer's connection (rabbitmqctl
// close_connection) right after the 300th delivery committed, before its
// ack: the consumer connects again, what it had not acknowledged comes
// back, the decided ones as Duplicates, and the balances end exact.
func TestConnectionClosedMidStream(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Skip("rabbitmqctl not installed: cannot close a connection from the server's side")
	}
	b, e := newBroker(t, rabbitmq.QueueQuorum), adaptertest.NewEnv(t)
	events := idemtest.Events(1200)
	b.Publish(t, adaptertest.Messages(events), 10)
	inner := e.Consumer(false)
	var (
		seen   atomic.Int64
		closed = make(chan struct{})
	)
	cfg := b.config(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		v := inner.HandleDelivery(ctx, d)
		if seen.Add(1) == 300 {
			if err := closeConnection("idem test consumer " + b.queue); err != nil {
				t.Error(err)
			}
			close(closed)
		}
		return v
	}))
	c, stop := run(t, cfg)
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("300 deliveries not decided after 30 s")
	}
	e.WaitMarkers(len(events))
	e.WaitDups(len(events)/10+1, "the closed connection's decided delivery and the republished copies come back as duplicates")
	e.CheckBalances(events)
	if n := c.Sessions(); n < 2 {
		t.Fatalf("%d sessions, want a reconnection", n)
	}
	if err := stop(false); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
}

// Deleting the queue under a running consumer ends Run with
// ErrConsumerCancelled, at once: no reconnecting in a loop.
func TestQueueDeletedEndsRun(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	e := adaptertest.NewEnv(t)
	c, err := rabbitmq.New(b.config(t, e.Consumer(false)))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	for deadline := time.Now().Add(10 * time.Second); c.Sessions() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the consumer did not start consuming")
		}
	}
	ch := b.channel(t)
	if _, err := ch.QueueDelete(b.queue, false, false, false); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, rabbitmq.ErrConsumerCancelled) || !strings.Contains(err.Error(), b.queue) {
			t.Fatalf("Run returned %v, want ErrConsumerCancelled naming the queue", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its queue was deleted")
	}
}

// A passive consumer of a queue that does not exist ends at once with
// ErrTopology, and so does one declaring a queue that exists with another
// type.
func TestTopologyRefusedEndsRun(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	for name, mod := range map[string]func(*rabbitmq.Config){
		"missing":    func(c *rabbitmq.Config) { c.Queue, c.Passive = b.queue+".missing", true },
		"other type": func(c *rabbitmq.Config) { c.QueueType = rabbitmq.QueueClassic },
	} {
		cfg := b.config(t, h)
		mod(cfg)
		c, err := rabbitmq.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = c.Run(ctx)
		cancel()
		if !errors.Is(err, rabbitmq.ErrTopology) {
			t.Fatalf("%s: Run returned %v, want ErrTopology", name, err)
		}
	}
}

// Wrong credentials end Run with ErrRefused; they would not get better by
// connecting again.
func TestWrongCredentialsEndRun(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	cfg := b.config(t, idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} }))
	u, err := amqp.ParseURI(cfg.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.Password = "not-the-password"
	cfg.URL = u.String()
	c, err := rabbitmq.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c.Run(ctx); !errors.Is(err, rabbitmq.ErrRefused) {
		t.Fatalf("Run with a wrong password returned %v, want ErrRefused", err)
	}
}

// Environment of TestKilledBetweenCommitAndAckChild.
const (
	envChildQueue = "IDEM_RABBITMQ_CHILD_QUEUE"
	envChildStore = "IDEM_RABBITMQ_CHILD_STORE"
	childKillAt   = 150
)

// A consumer process SIGKILLed between the commit of a delivery and its
// ack: the child test process consumes into a SQLite file and kills
// itself with SIGKILL once the 150th delivery's outcome is committed,
// before the adapter acks it. A consumer in this process then takes the
// queue over: the killed delivery comes back as a Duplicate, and the
// balances equal those of the unique events.
func TestKilledBetweenCommitAndAck(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	path := filepath.Join(t.TempDir(), "idem.db")
	events := idemtest.Events(400)
	b.Publish(t, adaptertest.Messages(events), 0)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestKilledBetweenCommitAndAckChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), envChildQueue+"="+b.queue, envChildStore+"="+path)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("child was not killed (run error %v); output:\n%s", err, out.String())
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child ended with %v, want killed by SIGKILL; output:\n%s", ee, out.String())
	}
	if !strings.Contains(out.String(), "committed "+strconv.Itoa(childKillAt)+", killing\n") {
		t.Fatalf("child did not die after its commit; output:\n%s", out.String())
	}

	e := adaptertest.OpenEnv(t, path)
	var before int
	if err := e.DB.QueryRow(`SELECT count(*) FROM idem_processed`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if before < childKillAt {
		t.Fatalf("%d markers after the kill, want at least the %d committed", before, childKillAt)
	}
	b.Start(t, e.Consumer(false))
	e.WaitMarkers(len(events))
	e.WaitDups(1, "the delivery committed but not acked before the kill")
	e.CheckBalances(events)
	t.Logf("%d markers at the kill; %d duplicates after the restart", before, e.Dups.Load())
}

// TestKilledBetweenCommitAndAckChild is the child of
// TestKilledBetweenCommitAndAck; it runs only in that child.
func TestKilledBetweenCommitAndAckChild(t *testing.T) {
	queue, path := os.Getenv(envChildQueue), os.Getenv(envChildStore)
	if queue == "" {
		return // runs only as TestKilledBetweenCommitAndAck's child (CI fails on any skip)
	}
	e := adaptertest.OpenEnv(t, path)
	inner := e.Consumer(false)
	var seen atomic.Int64
	b := &broker{queue: queue, queueType: rabbitmq.QueueQuorum}
	cfg := b.config(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		v := inner.HandleDelivery(ctx, d)
		if v.Ack && seen.Add(1) == childKillAt {
			os.Stdout.WriteString("committed " + strconv.Itoa(childKillAt) + ", killing\n")
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
		return v
	}))
	_, _ = run(t, cfg)
	time.Sleep(30 * time.Second)
	t.Fatal("not killed after 30 s")
}

// When Run's context ends, the delivery being decided is finished and
// acked, and every delivery received but not started (the prefetch, the
// lanes' queues) goes back to the queue at once: the ready count equals
// the published messages less the decided ones, and a new consumer
// finishes the balances exactly.
func TestStopReturnsUnstartedDeliveries(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, rabbitmq.QueueQuorum), adaptertest.NewEnv(t)
	b.concurrency = 2
	events := idemtest.Events(200)
	b.Publish(t, adaptertest.Messages(events), 0)
	inner := e.Consumer(false)
	var decided atomic.Int64
	_, stop := run(t, b.config(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		time.Sleep(20 * time.Millisecond) // a slow handler: the prefetch fills
		v := inner.HandleDelivery(ctx, d)
		decided.Add(1)
		return v
	})))
	for deadline := time.Now().Add(30 * time.Second); decided.Load() < 10; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("10 deliveries not decided after 30 s")
		}
	}
	if err := stop(false); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
	n := decided.Load()
	// The queue's count settles a moment after the nacks (a quorum
	// queue applies them through its log).
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		got := b.ready(t)
		if got == len(events)-int(n) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d messages ready 2 s after the stop, want %d (published) - %d (decided)", got, len(events), n)
		}
	}
	b.Start(t, e.Consumer(false))
	e.WaitMarkers(len(events))
	e.CheckBalances(events)
	if d := e.Dups.Load(); d != 0 {
		t.Fatalf("%d duplicates: a decided delivery was not acked before the stop", d)
	}
}

// A broker that cannot be reached is waited for: Run keeps connecting,
// backing off, logs one warning for the whole streak, and returns its
// context's error when that ends.
func TestUnreachableBrokerIsWaitedFor(t *testing.T) {
	t.Parallel()
	var logs testenv.Buffer
	c, err := rabbitmq.New(&rabbitmq.Config{URL: "amqp://guest:guest@127.0.0.1:1/", Queue: "q",
		Handler:   idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} }),
		Reconnect: idem.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Logger:    slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	if err := c.Run(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run returned %v, want the context's deadline", err)
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 {
		t.Fatalf("%d warnings, want 1 for the whole streak:\n%s", n, logs.String())
	}
}
