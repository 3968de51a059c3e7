package postgres_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestLeaseOutageAfterClaimSpendsNoAttempt crashes a private server right
// after a claim, before the ordering guard reads and before the handler
// runs, and starts it again a moment later. The claim called nothing, and
// its release could not be written: the row stays running under this
// worker's claim. Once the store answers, the held delivery takes that
// lease up and applies the message at once, on its first attempt.
//
// Before, the delivery found its own lease in flight until the TTL ran
// out: on the broker's last delivery that was a dead letter (an outage
// producing one), and otherwise the next claim counted a second attempt
// for a handler never called, which under MaxAttempts 1 failed the
// message for good without a call.
func TestLeaseOutageAfterClaimSpendsNoAttempt(t *testing.T) {
	c := testenv.NewPostgresCluster(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, c.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	drv, err := postgres.New(pool, &postgres.Config{Schema: "app"})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}

	claimed, down := make(chan struct{}), make(chan struct{})
	var faults atomic.Int32
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{
		TTL: time.Minute, MaxAttempts: 1, Logger: testenv.Logger(t),
		FaultHook: func(point string) {
			if point == idem.FaultAfterClaim && faults.Add(1) == 1 {
				close(claimed)
				<-down // the server is gone before the guard reads
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	var attempt atomic.Int32
	h := &idem.LeaseHandler{Name: "mailer", Ordering: &idem.Ordering{Gap: idem.GapFail},
		Call: func(_ context.Context, l *idem.Lease, _ *idem.Message) error {
			calls.Add(1)
			attempt.Store(int32(l.Attempt))
			return nil
		}}
	cons, err := idem.NewLeaseConsumer(lp, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t),
		ProbeBackoff: idem.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}

	verdict := make(chan idem.Verdict, 1)
	go func() {
		verdict <- cons.HandleDelivery(ctx, &idem.Delivery{
			Msg:     &idem.Message{ID: "mail-1", AggregateID: "user-1", Seq: 1, Payload: []byte("hello")},
			Attempt: 1, LastAttempt: true,
		})
	}()
	select {
	case <-claimed:
	case v := <-verdict:
		t.Fatalf("decided before the claim's fault point: %+v", v)
	case <-time.After(30 * time.Second):
		t.Fatal("no claim within 30 s")
	}
	c.Crash()
	close(down)
	time.Sleep(time.Second)
	c.Start()

	var v idem.Verdict
	select {
	case v = <-verdict:
	case <-time.After(30 * time.Second):
		t.Fatal("not decided 30 s after the server came back")
	}
	if !v.Ack || v.DeadLettered || v.Outcome != idem.Applied || v.Err != nil {
		t.Fatalf("verdict after the outage: %+v; want applied (the outage is no failure of the message)", v)
	}
	if calls.Load() != 1 || attempt.Load() != 1 {
		t.Fatalf("handler called %d times, last on attempt %d; want once, on attempt 1", calls.Load(), attempt.Load())
	}
	row, err := drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: "mail-1"})
	if err != nil {
		t.Fatal(err)
	}
	if row == nil || row.Status != driver.LeaseDone || row.Attempts != 1 {
		t.Fatalf("row %+v; want done after 1 attempt", row)
	}
	dls, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{})
	if err != nil || len(dls) != 0 {
		t.Fatalf("%d dead letters (%v); want none", len(dls), err)
	}
}

// TestLeaseHungHeartbeatDoesNotHoldTheDoneWrite: the handler's effect is
// done, but the heartbeat sent just before is stuck on a connection whose
// network path died (a failover, a firewall change: no reset, no answer).
// The worker gives that heartbeat up and marks the message done at once
// on another connection. It used to wait for the heartbeat to time out,
// which takes what is left of the lease (up to the 15-minute TTL by
// default): the lane stalled, a shutdown waited, and the done write came
// only as the lease ran out, when another worker may claim the message
// and repeat the effect.
func TestLeaseHungHeartbeatDoesNotHoldTheDoneWrite(t *testing.T) {
	ctx := context.Background()
	direct := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, direct)
	if d, err := postgres.New(direct, &postgres.Config{Schema: schema}); err != nil {
		t.Fatal(err)
	} else if err := d.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	pool, hole := testenv.PostgresPoolThrough(t, 4)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}

	const ttl = 4 * time.Second
	heartbeat := make(chan struct{})
	var once sync.Once
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: ttl, Logger: testenv.Logger(t),
		FaultHook: func(point string) {
			if point == idem.FaultBeforeHeartbeat {
				once.Do(func() { close(heartbeat) })
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	var returned time.Time
	h := &idem.LeaseHandler{Name: "mailer", Call: func(context.Context, *idem.Lease, *idem.Message) error {
		hole.Cut() // the path to the store dies while the mail goes out
		<-heartbeat
		time.Sleep(200 * time.Millisecond) // the heartbeat is on the dead path
		returned = time.Now()
		return nil
	}}
	out, err := lp.Process(ctx, h, &idem.Message{ID: "mail-1", Payload: []byte("hello")})
	took := time.Since(returned)
	if out != idem.Applied || err != nil {
		t.Fatalf("Process: (%v, %v); want applied", out, err)
	}
	if took > time.Second {
		t.Fatalf("the done write came %s after the handler returned (lease TTL %s): it waited for the hung heartbeat", took.Round(time.Millisecond), ttl)
	}
	row, err := drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: "mail-1"})
	if err != nil || row == nil || row.Status != driver.LeaseDone {
		t.Fatalf("row %+v, %v; want done", row, err)
	}
}
