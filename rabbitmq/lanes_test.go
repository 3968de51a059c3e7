package rabbitmq_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/rabbitmq"
)

// With Concurrency 8, deliveries of different aggregates are decided at
// once, but one aggregate's never are, and each aggregate's are decided in
// the order they were published; with Batch too, a lane's batch holds its
// aggregates' deliveries in that order.
func TestLanesOverlapAggregatesNotOneAggregate(t *testing.T) {
	for _, batch := range []int{1, 5} {
		t.Run(fmt.Sprintf("batch-%d", batch), func(t *testing.T) {
			t.Parallel()
			b := newBroker(t, rabbitmq.QueueQuorum)
			b.concurrency = 8
			var msgs []*idem.Message
			for s := int64(1); s <= 10; s++ {
				for a := range 8 {
					msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("agg%d-%d", a, s), AggregateID: fmt.Sprintf("agg%d", a), Seq: s})
				}
			}
			b.Publish(t, msgs, 0)
			var (
				mu              sync.Mutex
				inFlight        = map[string]int{}
				total, maxTotal int
				overlapSameAgg  bool
				order           = map[string][]int64{}
				decided         = make(chan struct{}, len(msgs))
			)
			enter := func(ds []*idem.Delivery) {
				mu.Lock()
				defer mu.Unlock()
				for _, d := range ds {
					agg := d.Msg.AggregateID
					if inFlight[agg] > 0 {
						overlapSameAgg = true
					}
					order[agg] = append(order[agg], d.Msg.Seq)
				}
				aggs := map[string]bool{}
				for _, d := range ds {
					aggs[d.Msg.AggregateID] = true
				}
				for agg := range aggs {
					inFlight[agg]++
				}
				total++
				maxTotal = max(maxTotal, total)
			}
			leave := func(ds []*idem.Delivery) {
				time.Sleep(30 * time.Millisecond)
				mu.Lock()
				defer mu.Unlock()
				aggs := map[string]bool{}
				for _, d := range ds {
					aggs[d.Msg.AggregateID] = true
				}
				for agg := range aggs {
					inFlight[agg]--
				}
				total--
				for range ds {
					decided <- struct{}{}
				}
			}
			h := &laneHandler{enter: enter, leave: leave}
			if batch > 1 {
				b.StartBatched(t, h, batch)
			} else {
				b.Start(t, h)
			}
			for range msgs {
				select {
				case <-decided:
				case <-time.After(30 * time.Second):
					t.Fatal("not every delivery decided after 30 s")
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if overlapSameAgg {
				t.Fatal("two deliveries of one aggregate were decided at once")
			}
			if maxTotal < 2 {
				t.Fatalf("at most %d lanes decided at once, want several", maxTotal)
			}
			for agg, seqs := range order {
				for i, s := range seqs {
					if s != int64(i+1) || len(seqs) != 10 {
						t.Fatalf("%s decided %v, want 1..10 in order", agg, seqs)
					}
				}
			}
			t.Logf("up to %d lanes at once", maxTotal)
		})
	}
}

// laneHandler records what it decides, and acks everything.
type laneHandler struct {
	enter, leave func([]*idem.Delivery)
}

func (h *laneHandler) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	return h.HandleDeliveries(ctx, []*idem.Delivery{d})[0]
}

func (h *laneHandler) HandleDeliveries(_ context.Context, ds []*idem.Delivery) []idem.Verdict {
	h.enter(ds)
	h.leave(ds)
	vs := make([]idem.Verdict, len(ds))
	for i := range vs {
		vs[i] = idem.Verdict{Ack: true, Outcome: idem.Applied}
	}
	return vs
}

// A delivery that a batch returns waiting behind an earlier one of its
// aggregate (idem.ErrWaitsForAggregate) was not tried: its retry copy
// keeps its attempt. It used to count one, as a failure's copy does.
func TestWaitingDeliveryKeepsItsAttempt(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	b.Publish(t, []*idem.Message{{ID: "a-1", AggregateID: "a", Seq: 1}, {ID: "a-2", AggregateID: "a", Seq: 2}}, 0)
	var (
		mu       sync.Mutex
		attempts = map[string][]int{}
		acked    = map[string]bool{}
		done     = make(chan struct{})
	)
	h := batchFunc(func(ds []*idem.Delivery) []idem.Verdict {
		mu.Lock()
		defer mu.Unlock()
		vs := make([]idem.Verdict, len(ds))
		for i, d := range ds {
			id := d.Msg.ID
			attempts[id] = append(attempts[id], d.Attempt)
			switch {
			case id == "a-1" && len(attempts[id]) == 1:
				vs[i] = idem.Verdict{RetryAfter: 100 * time.Millisecond, Err: fmt.Errorf("transient")}
			case id == "a-2" && !acked["a-1"]:
				vs[i] = idem.Verdict{RetryAfter: 100 * time.Millisecond, Err: fmt.Errorf("%w: a-2 after a-1", idem.ErrWaitsForAggregate)}
			default:
				vs[i] = idem.Verdict{Ack: true, Outcome: idem.Applied}
				acked[id] = true
				if len(acked) == 2 {
					close(done)
				}
			}
		}
		return vs
	})
	b.StartBatched(t, h, 2)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("not both applied after 30 s")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(attempts["a-2"]) < 2 {
		t.Fatalf("a-2 delivered %v; want it to have waited at least once", attempts["a-2"])
	}
	for _, a := range attempts["a-2"] {
		if a != 1 {
			t.Fatalf("a-2 delivered at attempts %v; want 1 throughout (waiting is no attempt)", attempts["a-2"])
		}
	}
	if got := attempts["a-1"]; len(got) != 2 || got[1] != 2 {
		t.Fatalf("a-1 delivered at attempts %v; want 1 then 2", got)
	}
}

// batchFunc is a BatchDeliveryHandler of a function.
type batchFunc func([]*idem.Delivery) []idem.Verdict

func (f batchFunc) HandleDelivery(_ context.Context, d *idem.Delivery) idem.Verdict {
	return f([]*idem.Delivery{d})[0]
}

func (f batchFunc) HandleDeliveries(_ context.Context, ds []*idem.Delivery) []idem.Verdict {
	return f(ds)
}
