package mysql_test

import (
	"context"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/bench/benchtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// BenchmarkMySQL measures idem's throughput against the same transactions
// without the marker, on a new database of the server testenv finds, on
// a pool from mysql.Open.
//
//	go test ./mysql -run '^$' -bench . -benchtime 1s
func BenchmarkMySQL(b *testing.B) {
	ctx := context.Background()
	cfg, err := gomysql.ParseDSN(testenv.MySQLDatabase(b))
	if err != nil {
		b.Fatal(err)
	}
	db, err := mysql.Open(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)
	b.Cleanup(func() { db.Close() })
	t, err := bench.OpenMySQL(ctx, db)
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
