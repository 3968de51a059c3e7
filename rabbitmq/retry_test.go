package rabbitmq_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/rabbitmq"
)

// A message whose verdict is a retry after one second goes to the retry
// queue: the 30 messages behind it are applied meanwhile, and it comes
// back after at least its delay and within its tier (1,024 ms) plus slack
// for a loaded machine, as attempt 2 and then 3, on quorum and classic
// queues. The balances end exact.
func TestRetryDoesNotStallTheOthers(t *testing.T) {
	for _, qt := range []string{rabbitmq.QueueQuorum, rabbitmq.QueueClassic} {
		t.Run(qt, func(t *testing.T) {
			t.Parallel()
			const delay = time.Second
			b, e := newBroker(t, qt), adaptertest.NewEnv(t)
			events := idemtest.Events(31)
			stuck := events[0].ID
			inner := e.Consumer(false)
			var (
				mu        sync.Mutex
				seen      []time.Time // the stuck message's deliveries
				attempts  []int
				appliedAt []int // healthy messages applied at each of them
				applied   int
			)
			h := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
				mu.Lock()
				if d.Msg != nil && d.Msg.ID == stuck {
					seen = append(seen, time.Now())
					attempts = append(attempts, d.Attempt)
					appliedAt = append(appliedAt, applied)
					n := len(seen)
					mu.Unlock()
					if n < 3 {
						return idem.Verdict{RetryAfter: delay, Err: errors.New("dependency down")}
					}
					return inner.HandleDelivery(ctx, d)
				}
				mu.Unlock()
				v := inner.HandleDelivery(ctx, d)
				mu.Lock()
				applied++
				mu.Unlock()
				return v
			})
			b.Publish(t, adaptertest.Messages(events), 0)
			b.Start(t, h)
			e.WaitMarkers(len(events))
			e.CheckBalances(events)
			mu.Lock()
			defer mu.Unlock()
			if len(seen) != 3 || attempts[0] != 1 || attempts[1] != 2 || attempts[2] != 3 {
				t.Fatalf("the stuck message came %d times with attempts %v, want 3 times: 1, 2, 3", len(seen), attempts)
			}
			if appliedAt[1] != len(events)-1 {
				t.Fatalf("%d of the %d messages behind the stuck one were applied by its second delivery, want all", appliedAt[1], len(events)-1)
			}
			for i := 1; i < 3; i++ {
				gap := seen[i].Sub(seen[i-1])
				t.Logf("retry %d after %s (asked %s)", i, gap, delay)
				if gap < delay-5*time.Millisecond || gap > 1024*time.Millisecond+1500*time.Millisecond {
					t.Fatalf("retry %d came %s after the delivery before, want %s up to its tier 1.024s (+1.5s slack)", i, gap, delay)
				}
			}
		})
	}
}

// With MaxDeliver 3, the third delivery is the last: a failure that does
// not pass is dead-lettered (exhausted, 3 attempts) instead of retried,
// and the queue ends empty.
func TestMaxDeliverEndsInDeadLetter(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, rabbitmq.QueueQuorum), adaptertest.NewEnv(t)
	b.maxDeliver = 3
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		return errors.New("always failing")
	}}
	c, err := idem.NewConsumer(e.Proc, h, e.Drv, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 20 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		last []bool
	)
	b.Start(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		mu.Lock()
		last = append(last, d.LastAttempt)
		mu.Unlock()
		return c.HandleDelivery(ctx, d)
	}))
	b.Publish(t, []*idem.Message{{ID: "doomed", Payload: []byte("x")}}, 0)
	var dls []driver.DeadLetter
	for deadline := time.Now().Add(20 * time.Second); len(dls) == 0; time.Sleep(20 * time.Millisecond) {
		if dls, err = e.Drv.DeadLetterList(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatal("no dead letter after 20 s")
		}
	}
	if dls[0].MessageID != "doomed" || dls[0].Class != idem.DeadLetterExhausted || dls[0].Attempts != 3 {
		t.Fatalf("dead letter %+v, want doomed, exhausted after 3 attempts", dls[0])
	}
	time.Sleep(200 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(last) != "[false false true]" {
		t.Fatalf("LastAttempt of the deliveries %v, want [false false true]", last)
	}
	if n := b.ready(t); n != 0 {
		t.Fatalf("%d messages left in the queue, want none", n)
	}
}
