package rabbitmq_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/rabbitmq"
)

// TestRetryDuringAlarmSpendsNoAttempt: a handler failure during a memory
// alarm on the broker. The consumer's connection, which publishes the
// retry copy, is blocked until the alarm clears: the copy waits, and so
// do the acks behind it. That is the broker's outage, not the message's:
// with MaxDeliver 2, the failed message must come back as attempt 2 (not
// 3, not a dead letter), the others must not be delivered again as new
// attempts, the queue ends empty, and the balances end exact. The node
// is the test's own.
func TestRetryDuringAlarmSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	srv := testenv.NewRabbitMQServer(t)
	conn, err := amqp.Dial(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	b := &broker{conn: conn, queue: "work", queueType: rabbitmq.QueueQuorum, maxDeliver: 2, logger: true}
	if _, err := b.channel(t).QueueDeclare(b.queue, true, false, false, false, amqp.Table{"x-queue-type": b.queueType}); err != nil {
		t.Fatal(err)
	}
	e := adaptertest.NewEnv(t)
	events := idemtest.Events(20)
	failing := events[3].ID
	b.Publish(t, adaptertest.Messages(events), 0)

	inner := e.Consumer(false)
	var (
		mu       sync.Mutex
		attempts = map[string][]int{}
		retried  time.Time // the failing message's second delivery
		failed   = make(chan struct{})
	)
	h := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		if d.Msg != nil {
			mu.Lock()
			attempts[d.Msg.ID] = append(attempts[d.Msg.ID], d.Attempt)
			first := d.Msg.ID == failing && len(attempts[d.Msg.ID]) == 1
			if d.Msg.ID == failing && len(attempts[d.Msg.ID]) == 2 {
				retried = time.Now()
			}
			mu.Unlock()
			if first {
				close(failed)
				return idem.Verdict{RetryAfter: 100 * time.Millisecond, Err: errors.New("dependency down")}
			}
		}
		return inner.HandleDelivery(ctx, d)
	})

	srv.MemoryAlarm(true)
	cfg := b.config(t, h)
	cfg.URL = srv.URL()
	_, stop := run(t, cfg)
	select {
	case <-failed:
	case <-time.After(20 * time.Second):
		t.Fatal("the failing message was not delivered 20 s into the alarm")
	}
	time.Sleep(2 * time.Second) // the retry copy waits on the blocked connection
	mu.Lock()
	during := len(attempts[failing])
	mu.Unlock()
	if during != 1 {
		t.Fatalf("the failing message was delivered %d times during the alarm, want once", during)
	}
	cleared := time.Now()
	srv.MemoryAlarm(false)

	e.WaitMarkers(len(events))
	e.CheckBalances(events)
	dls, err := e.Drv.DeadLetterList(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 0 {
		t.Fatalf("%d dead letters (first %+v), want none: the alarm is not the message's failure", len(dls), dls[0])
	}
	if err := stop(false); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v; want the context's end", err)
	}
	if n := b.ready(t); n != 0 {
		t.Errorf("%d messages left in the queue after the stop, want none: every ack reached the broker", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if got := attempts[failing]; !slices.Equal(got, []int{1, 2}) {
		t.Errorf("the failing message's attempts: %v, want [1 2]", got)
	} else if retried.Before(cleared) {
		t.Errorf("the retry came %s before the alarm was cleared: the alarm did not hold its copy", cleared.Sub(retried))
	}
	for _, ev := range events {
		if ev.ID != failing && !slices.Equal(attempts[ev.ID], []int{1}) {
			t.Errorf("%s's attempts: %v, want [1]", ev.ID, attempts[ev.ID])
		}
	}
}
