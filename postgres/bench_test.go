package postgres_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/bench/benchtest"
	"github.com/idemhq/idem/internal/testenv"
)

// BenchmarkPostgres measures idem's throughput against the same
// transactions without the marker, on the server testenv finds.
//
//	go test ./postgres -run '^$' -bench . -benchtime 1s
func BenchmarkPostgres(b *testing.B) {
	pool := testenv.PostgresPool(b, 8)
	schema := testenv.FreshSchema(b, pool)
	ctx := context.Background()
	t, err := bench.OpenPostgres(ctx, pool, &bench.PostgresOptions{Schema: schema})
	if err != nil {
		b.Fatal(err)
	}
	benchtest.Run(b, t, nil)
}

// BenchmarkInsertBet measures the plain-INSERT bet (the default) against
// Config.ConflictAwareInserts: idem's transactions on two fresh schemas,
// one of each, alternated in rounds by bench.Compare; the ratio is
// betting / conflict-aware.
//
//	go test ./postgres -run '^$' -bench InsertBet -benchtime 1x
func BenchmarkInsertBet(b *testing.B) {
	pool := testenv.PostgresPool(b, 8)
	ctx := context.Background()
	open := func(aware bool) bench.Target {
		t, err := bench.OpenPostgres(ctx, pool, &bench.PostgresOptions{Schema: testenv.FreshSchema(b, pool), ConflictAwareInserts: aware})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() {
			if err := t.Close(ctx); err != nil {
				b.Error(err)
			}
		})
		return t
	}
	t := bench.Versus(open(false), open(true))
	for _, batch := range []int{0, 100} {
		name := "per-message"
		if batch > 0 {
			name = fmt.Sprintf("batch-%d", batch)
		}
		b.Run(name, func(b *testing.B) {
			w := bench.Workload{Workers: 4, BatchSize: batch, Duration: 500 * time.Millisecond}
			var cmp bench.Comparison
			for b.Loop() {
				var err error
				if cmp, err = bench.Compare(ctx, t, bench.CompareOptions{Workload: w, Rounds: 9, Warmup: 250 * time.Millisecond}); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(cmp.Plain, "conflict-aware-events/s")
			b.ReportMetric(cmp.Idem, "bet-events/s")
			b.ReportMetric(cmp.Ratio, "ratio")
		})
	}
}
