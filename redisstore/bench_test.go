package redisstore_test

import (
	"context"
	"testing"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/bench/benchtest"
	"github.com/idemhq/idem/internal/testenv"
)

// BenchmarkRedis measures idem's throughput against the same MULTI/EXEC
// without the marker, on the server testenv finds.
//
//	go test ./redisstore -run '^$' -bench . -benchtime 1s
func BenchmarkRedis(b *testing.B) {
	client, prefix := testenv.Redis(b)
	ctx := context.Background()
	t, err := bench.OpenRedis(ctx, client, prefix)
	if err != nil {
		b.Fatal(err)
	}
	benchtest.Run(b, t, nil)
}
