package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// BenchmarkAddInTransaction measures what the outbox adds to a business
// transaction: the same ledger credit committed with and without one
// outbox row (its sequence allocated by AddNext), alternating in rounds in
// this process. ratio is plain/with-outbox throughput: 1.0 means free.
//
//	go test ./outbox -run '^$' -bench AddInTransaction -benchtime 2000x
func BenchmarkAddInTransaction(b *testing.B) {
	for _, name := range []string{"sqlite", "postgres"} {
		b.Run(name, func(b *testing.B) {
			p := producers()[name](b)
			ctx := context.Background()
			var plain, withOutbox time.Duration
			const rounds = 4
			per := max(b.N/rounds, 1)
			b.ResetTimer()
			for r := range rounds {
				t0 := time.Now()
				for i := range per {
					if err := p.plainCredit(ctx, fmt.Sprintf("acct-%d", i%100), 1); err != nil {
						b.Fatal(err)
					}
				}
				t1 := time.Now()
				for i := range per {
					if _, err := p.credit(ctx, "credits.ledger", fmt.Sprintf("acct-%d", i%100), 1, false); err != nil {
						b.Fatal(err)
					}
				}
				plain += t1.Sub(t0)
				withOutbox += time.Since(t1)
				_ = r
			}
			n := float64(per * rounds)
			b.ReportMetric(float64(plain.Nanoseconds())/n, "plain-ns/tx")
			b.ReportMetric(float64(withOutbox.Nanoseconds())/n, "outbox-ns/tx")
			b.ReportMetric(plain.Seconds()/withOutbox.Seconds(), "ratio")
		})
	}
}

// BenchmarkRelay measures relay throughput: b.N rows over 100 aggregates
// are written first, then one relay publishes them all to an in-process
// broker (embedded JetStream, kfake), reported as rows/s.
//
//	go test ./outbox -run '^$' -bench Relay -benchtime 20000x
func BenchmarkRelay(b *testing.B) {
	brokers := map[string]func(testing.TB) broker{
		"jetstream": func(t testing.TB) broker { return newNATSBroker(t) },
		"kafka":     func(t testing.TB) broker { return newKafkaBroker(t) },
	}
	for _, store := range []string{"sqlite", "postgres"} {
		for _, bname := range []string{"jetstream", "kafka"} {
			b.Run(store+"/"+bname, func(b *testing.B) {
				p := producers()[store](b)
				br := brokers[bname](b)
				ctx := context.Background()
				if err := p.fill(ctx, br.stream(), b.N, 100); err != nil {
					b.Fatal(err)
				}
				r, err := outbox.NewRelay(p.drv, br.publisher(b), &outbox.RelayConfig{Owner: "bench", BatchSize: 500, Concurrency: 16})
				if err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				start := time.Now()
				published := 0
				for published < b.N {
					res, err := r.RunOnce(ctx)
					if err != nil {
						b.Fatal(err)
					}
					published += res.Published
				}
				b.ReportMetric(float64(published)/time.Since(start).Seconds(), "rows/s")
			})
		}
	}
}

// BenchmarkAddConcurrently is BenchmarkAddInTransaction with 4 writers at
// once, each on its own accounts, and on Postgres also with the NOTIFY
// trigger on (Driver.SetOutboxNotify): notifying commits take a
// database-wide lock, so that ratio shows what the trigger costs
// concurrent writers.
//
//	go test ./outbox -run '^$' -bench AddConcurrently -benchtime 8000x
func BenchmarkAddConcurrently(b *testing.B) {
	const writers = 4
	for _, name := range []string{"sqlite", "postgres", "postgres-notify"} {
		b.Run(name, func(b *testing.B) {
			store, notify := strings.CutSuffix(name, "-notify")
			p := producers()[store](b)
			ctx := context.Background()
			if notify {
				if err := p.drv.(*postgres.Driver).SetOutboxNotify(ctx, true); err != nil {
					b.Fatal(err)
				}
			}
			run := func(per int, fn func(w, i int) error) time.Duration {
				start := time.Now()
				var wg sync.WaitGroup
				for w := range writers {
					wg.Go(func() {
						for i := range per {
							if err := fn(w, i); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
				return time.Since(start)
			}
			var plain, withOutbox time.Duration
			const rounds = 4
			per := max(b.N/rounds/writers, 1)
			b.ResetTimer()
			for range rounds {
				plain += run(per, func(w, i int) error {
					return p.plainCredit(ctx, fmt.Sprintf("acct-%d-%d", w, i%25), 1)
				})
				withOutbox += run(per, func(w, i int) error {
					_, err := p.credit(ctx, "credits.ledger", fmt.Sprintf("acct-%d-%d", w, i%25), 1, false)
					return err
				})
			}
			n := float64(per * rounds * writers)
			b.ReportMetric(n/plain.Seconds(), "plain-tx/s")
			b.ReportMetric(n/withOutbox.Seconds(), "outbox-tx/s")
			b.ReportMetric(plain.Seconds()/withOutbox.Seconds(), "ratio")
		})
	}
}
