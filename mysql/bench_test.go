package mysql_test

import (
	"context"
	"testing"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/bench/benchtest"
	"github.com/idemhq/idem/internal/testenv"
)

// BenchmarkMySQL measures idem's throughput against the same transactions
// without the marker, on a new database of the server testenv finds, on
// a pool from mysql.Open.
//
//	go test ./mysql -run '^$' -bench . -benchtime 1s
func BenchmarkMySQL(b *testing.B) {
	t, err := bench.OpenMySQL(context.Background(), openFolded(b, testenv.MySQLDatabase(b), 8))
	if err != nil {
		b.Fatal(err)
	}
	benchtest.Run(b, t, nil)
}
