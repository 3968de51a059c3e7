package adaptertest

import (
	"context"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
)

// BenchEndToEnd runs EndToEnd one message at a time and in batches of 100
// (the handler summing a batch's credits per account, or applying each
// credit with its own upsert), each on SQLite at synchronous=FULL (sqlite.Open's default: every commit
// waits for fsync) and at synchronous=NORMAL (no fsync per commit, so
// CPU-bound: idem's own work shows undiluted).
func BenchEndToEnd(b *testing.B, newBroker func(testing.TB) Broker) {
	for _, synchronous := range []string{"FULL", "NORMAL"} {
		for _, c := range []struct {
			name     string
			batch    int
			perEvent bool
		}{{"per-message", 1, false}, {"batch-100", 100, false}, {"batch-100-per-event", 100, true}} {
			b.Run(strings.ToLower(synchronous)+"/"+c.name, func(b *testing.B) {
				EndToEnd(b, newBroker, synchronous, c.batch, c.perEvent)
			})
		}
	}
}

// endToEndRounds is how many times EndToEnd measures each handler,
// alternating plain and idem, so that a slow spell of the disk or the
// machine falls on both.
const endToEndRounds = 3

// EndToEnd publishes max(b.N, 500) new messages and consumes them into
// SQLite (at the given synchronous setting) on a fresh broker, with a plain
// handler (the balance upserts in a transaction, then the ack) and through
// idem.Consumer, alternating the two for endToEndRounds rounds each. It
// reports the median rate of each and their ratio, idem/plain. batch 1
// decides one message at a time; above 1 the adapter hands over batches of
// up to batch and both handlers commit a batch's upserts in one transaction
// (idem adds its markers to it): one upsert per account, or with perEvent
// one per message.
func EndToEnd(b *testing.B, newBroker func(testing.TB) Broker, synchronous string, batch int, perEvent bool) {
	n := max(b.N, 500)
	rate := func(withIdem bool) float64 {
		br, e := newBroker(b), newEnv(b, synchronous)
		events := idemtest.Events(n)
		br.Publish(b, Messages(events), 0)
		var handled atomic.Int64
		var h idem.BatchDeliveryHandler = &plainBatch{e: e, perEvent: perEvent}
		if withIdem {
			h = e.batchConsumer(perEvent)
		}
		counted := &countedBatch{next: h, n: &handled}
		start := time.Now()
		var kill func()
		if batch > 1 {
			kill = br.StartBatched(b, counted, batch)
		} else {
			kill = br.Start(b, idem.DeliveryHandlerFunc(counted.HandleDelivery))
		}
		for handled.Load() < int64(n) {
			time.Sleep(time.Millisecond)
		}
		r := float64(n) / time.Since(start).Seconds()
		kill()
		return r
	}
	b.ResetTimer()
	var plain, withIdem []float64
	for range endToEndRounds {
		plain = append(plain, rate(false))
		withIdem = append(withIdem, rate(true))
	}
	p, i := median(plain), median(withIdem)
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(p, "plain-msgs/s")
	b.ReportMetric(i, "idem-msgs/s")
	b.ReportMetric(i/p, "ratio")
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// plainBatch is the baseline: the same upserts without idem.
type plainBatch struct {
	e        *Env
	perEvent bool
}

func (p *plainBatch) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	return p.HandleDeliveries(ctx, []*idem.Delivery{d})[0]
}

func (p *plainBatch) HandleDeliveries(ctx context.Context, ds []*idem.Delivery) []idem.Verdict {
	vs := make([]idem.Verdict, len(ds))
	payloads := make([][]byte, 0, len(ds))
	for i, d := range ds {
		vs[i] = idem.Verdict{Ack: true, Outcome: idem.Applied}
		if d.Msg != nil {
			payloads = append(payloads, d.Msg.Payload)
		}
	}
	err := func() error {
		tx, err := p.e.DB.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if err := applyCredits(ctx, tx, payloads, p.perEvent); err != nil {
			return err
		}
		return tx.Commit()
	}()
	if err != nil {
		for i := range vs {
			vs[i] = idem.Verdict{RetryAfter: time.Millisecond, Err: err}
		}
	}
	return vs
}

// countedBatch counts the deliveries its handler settled.
type countedBatch struct {
	next idem.BatchDeliveryHandler
	n    *atomic.Int64
}

func (c *countedBatch) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	v := c.next.HandleDelivery(ctx, d)
	if v.Ack {
		c.n.Add(1)
	}
	return v
}

func (c *countedBatch) HandleDeliveries(ctx context.Context, ds []*idem.Delivery) []idem.Verdict {
	vs := c.next.HandleDeliveries(ctx, ds)
	for _, v := range vs {
		if v.Ack {
			c.n.Add(1)
		}
	}
	return vs
}
