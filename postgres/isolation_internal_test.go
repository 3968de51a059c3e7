package postgres

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// poolWith returns a pool of the test server whose sessions start with
// the given settings (and as user, when not empty).
func poolWith(t *testing.T, user string, params map[string]string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresDSN())
	if err != nil {
		t.Fatal(err)
	}
	if user != "" {
		cfg.ConnConfig.User = user
	}
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

var repeatableRead = map[string]string{"default_transaction_isolation": "repeatable read"}

// TestMigrateInAGrantedSchema: an application role that may create in
// the schema a DBA made for it, but not in the database, migrates: the
// schema exists, so Migrate does not ask to create it.
func TestMigrateInAGrantedSchema(t *testing.T) {
	ctx := context.Background()
	admin := testenv.PostgresPool(t, 2)
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	role := "idemtest_app_" + hex.EncodeToString(b)
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP ROLE `+role) })
	schema := testenv.FreshSchema(t, admin)
	if _, err := admin.Exec(ctx, `GRANT USAGE, CREATE ON SCHEMA `+schema+` TO `+role); err != nil {
		t.Fatal(err)
	}
	d, err := New(poolWith(t, role, nil), &Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := d.Migrate(ctx); err != nil {
			t.Fatalf("Migrate as %s in a schema granted to it: %v", role, err)
		}
	}
}

// TestConcurrentMigrateUnderRepeatableRead: two Migrate calls that wait on
// each other both succeed when the server's default isolation is
// REPEATABLE READ: the second sees what the first applied.
func TestConcurrentMigrateUnderRepeatableRead(t *testing.T) {
	ctx := context.Background()
	admin := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, admin)
	pool := poolWith(t, "", repeatableRead)
	d, err := New(pool, &Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	// Hold the migration lock until both calls wait on it.
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, d.migrateLockKey()); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	for range 2 {
		go func() { errs <- d.Migrate(ctx) }()
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var waiting int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d Migrate calls wait on the lock, want 2", waiting)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
}

// TestConcurrentDuplicateUnderRepeatableRead: with the server's default
// isolation at REPEATABLE READ, a delivery that waits on a concurrent
// one's marker still reports Duplicate without an error, on the
// conflict-aware path too: the transactions the driver opens are READ
// COMMITTED.
func TestConcurrentDuplicateUnderRepeatableRead(t *testing.T) {
	for _, aware := range []bool{false, true} {
		ctx := context.Background()
		admin := testenv.PostgresPool(t, 2)
		d, err := New(poolWith(t, "", repeatableRead), &Config{Schema: testenv.FreshSchema(t, admin), ConflictAwareInserts: aware})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		proc, err := idem.NewProcessor(d, nil)
		if err != nil {
			t.Fatal(err)
		}
		inside, release := make(chan struct{}), make(chan struct{})
		var once sync.Once
		var applied int
		h := &idem.Handler[Tx]{Name: "h", Apply: func(context.Context, Tx, *idem.Message) error {
			applied++
			once.Do(func() { close(inside); <-release })
			return nil
		}}
		msg := &idem.Message{ID: "x", Payload: []byte("p")}
		first := make(chan error, 1)
		go func() { _, err := proc.Process(ctx, h, msg); first <- err }()
		<-inside
		second := make(chan struct {
			out idem.Outcome
			err error
		}, 1)
		go func() {
			out, err := proc.Process(ctx, h, msg)
			second <- struct {
				out idem.Outcome
				err error
			}{out, err}
		}()
		// Let the second reach the marker and wait on it.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			var waiting int
			if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted`).Scan(&waiting); err != nil {
				t.Fatal(err)
			}
			if waiting > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the second delivery never waited on the first's marker")
			}
		}
		close(release)
		if err := <-first; err != nil {
			t.Fatal(err)
		}
		if r := <-second; r.out != idem.Duplicate || r.err != nil {
			t.Fatalf("conflict-aware %v: second delivery (%v, %v), want Duplicate without an error", aware, r.out, r.err)
		}
		if applied != 1 {
			t.Fatalf("applied %d times", applied)
		}
	}
}

// TestProcessBeforeMigrate: processing in a schema without idem's tables
// fails with ErrNotMigrated, which says what to do, rather than only
// Postgres's "relation does not exist".
func TestProcessBeforeMigrate(t *testing.T) {
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 2)
	d, err := New(pool, &Config{Schema: testenv.FreshSchema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(d, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[Tx]{Name: "h", Apply: idem.Ignore[Tx]}
	msg := &idem.Message{ID: "x"}
	if _, err := proc.Process(ctx, h, msg); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("Process before Migrate: %v, want ErrNotMigrated", err)
	}
	if _, err := proc.ProcessBatch(ctx, h, []*idem.Message{msg}); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("ProcessBatch before Migrate: %v, want ErrNotMigrated", err)
	}
	lp, err := idem.NewLeaseProcessor(d, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lp.Process(ctx, &idem.LeaseHandler{Name: "h", Call: func(context.Context, *idem.Lease, *idem.Message) error { return nil }}, msg); !errors.Is(err, ErrNotMigrated) {
		t.Fatalf("lease Process before Migrate: %v, want ErrNotMigrated", err)
	}
}
