package sqlite_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/bench/benchtest"
)

// BenchmarkSQLite measures idem's throughput against the same transactions
// without the marker, on a database file with synchronous=FULL.
//
//	go test ./sqlite -run '^$' -bench . -benchtime 1s
func BenchmarkSQLite(b *testing.B) {
	t, err := bench.OpenSQLite(context.Background(), filepath.Join(b.TempDir(), "bench.db"), nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := t.Close(); err != nil {
			b.Error(err)
		}
	})
	benchtest.Run(b, t, nil)
}
