package postgres_test

import (
	"context"
	"testing"

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
	b.Cleanup(func() {
		if err := t.Close(ctx); err != nil {
			b.Error(err)
		}
	})
	benchtest.Run(b, t, nil)
}
