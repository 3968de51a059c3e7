package bench_test

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/sqlite"
)

// runCases runs every standard case, both variants, for a fixed number of
// events against t. A variant fails if any message is not Applied, so this
// checks that each case's handlers and transaction shapes work at all.
// The cases named in lacking may be refused with bench.ErrUnsupported.
func runCases(t *testing.T, target bench.Target, lacking ...string) {
	ctx := context.Background()
	for _, c := range bench.Cases() {
		if !c.RunsOn(target.Name()) {
			if _, err := c.Target(target); err == nil {
				t.Errorf("%s: runs on %s, though made for %s only", c.Name, target.Name(), c.Store)
			}
			continue
		}
		ct, err := c.Target(target)
		if errors.Is(err, bench.ErrUnsupported) && slices.Contains(lacking, c.Name) {
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", c.Name, err)
		}
		// A full batch at least; 200 messages for a case of one per
		// transaction, which checks it as well as more would.
		events := max(200, c.BatchSize)
		for _, v := range []bench.Variant{bench.Plain, bench.Idem} {
			res, err := bench.Run(ctx, ct, v, bench.Workload{Workers: 2, BatchSize: c.BatchSize, Events: events})
			if err != nil {
				t.Fatalf("%s/%s: %v", c.Name, v, err)
			}
			if res.Events != events {
				t.Errorf("%s/%s: %d events applied, want %d", c.Name, v, res.Events, events)
			}
		}
	}
}

func TestEveryCaseRunsOnSQLite(t *testing.T) {
	t.Parallel()
	target, err := bench.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "bench.db"),
		&bench.SQLiteOptions{Open: &sqlite.OpenOptions{Synchronous: "NORMAL"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { target.Close() })
	runCases(t, target)
}

func TestEveryCaseRunsOnRedis(t *testing.T) {
	t.Parallel()
	client, prefix := testenv.Redis(t)
	target, err := bench.OpenRedis(context.Background(), client, prefix)
	if err != nil {
		t.Fatal(err)
	}
	runCases(t, target)
}

func TestEveryCaseRunsOnPostgres(t *testing.T) {
	t.Parallel()
	pool := testenv.PostgresPool(t, 4)
	ctx := context.Background()
	target, err := bench.OpenPostgres(ctx, pool, &bench.PostgresOptions{Schema: testenv.FreshSchema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := target.Close(ctx); err != nil {
			t.Error(err)
		}
	})
	runCases(t, target)
}

func TestEveryCaseRunsOnMySQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := gomysql.ParseDSN(testenv.MySQLDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	db, err := mysql.Open(ctx, cfg)
	if err != nil {
		testenv.Unavailable(t, "MySQL/MariaDB", cfg.Addr, err)
	}
	db.SetMaxOpenConns(4)
	t.Cleanup(func() { db.Close() })
	target, err := bench.OpenMySQL(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := target.Close(ctx); err != nil {
			t.Error(err)
		}
	})
	runCases(t, target, "version-in-row", "batch-1000-version-in-row")
}
