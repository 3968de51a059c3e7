package jetstream_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
)

// BenchmarkEndToEnd publishes messages to an embedded JetStream server and
// consumes them into SQLite (synchronous=NORMAL) once with a plain handler
// (a transaction with the balance upsert, then Ack) and once through
// idem.Consumer, and reports both rates and idem/plain as the ratio.
//
//	go test ./jetstream -run '^$' -bench EndToEnd -benchtime 3000x
func BenchmarkEndToEnd(b *testing.B) {
	n := max(b.N, 500)
	url := embedded(b)
	rate := func(withIdem bool) float64 {
		br, e := newBroker(b, url), adaptertest.NewEnv(b)
		events := idemtest.Events(n)
		br.Publish(b, adaptertest.Messages(events), 0)
		var handled atomic.Int64
		h := e.Consumer(false)
		if !withIdem {
			h = idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
				acct, amt, err := idemtest.DecodeCredit(d.Msg.Payload)
				if err != nil {
					return idem.Verdict{Ack: true}
				}
				if _, err := e.DB.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?) ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, acct, amt); err != nil {
					return idem.Verdict{RetryAfter: time.Millisecond, Err: err}
				}
				return idem.Verdict{Ack: true, Outcome: idem.Applied}
			})
		}
		counted := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
			defer handled.Add(1)
			return h.HandleDelivery(ctx, d)
		})
		start := time.Now()
		br.Start(b, counted)
		for handled.Load() < int64(n) {
			time.Sleep(time.Millisecond)
		}
		return float64(n) / time.Since(start).Seconds()
	}
	b.ResetTimer()
	plain := rate(false)
	withIdem := rate(true)
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(plain, "plain-msgs/s")
	b.ReportMetric(withIdem, "idem-msgs/s")
	b.ReportMetric(withIdem/plain, "ratio")
}
