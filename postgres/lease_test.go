package postgres_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// attachLeaseStore opens a driver on an existing, migrated schema; crash
// tests use it from a second process.
func attachLeaseStore(t testing.TB, schema string) driver.LeaseDriver {
	t.Helper()
	drv, err := postgres.New(testenv.PostgresPool(t, 4), &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	return drv
}

// createLeaseStore migrates a fresh schema, dropped when t ends. The pool
// has room for the concurrent-workers test's 16 workers.
func createLeaseStore(t testing.TB) (driver.LeaseDriver, string) {
	t.Helper()
	pool := testenv.PostgresPool(t, 20)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return drv, schema
}

func openLeaseStore(t testing.TB) driver.LeaseDriver {
	t.Helper()
	drv, _ := createLeaseStore(t)
	return drv
}

// TestLease runs the lease-mode conformance suite, including 16 workers
// processing the same 500 IDs at once.
func TestLease(t *testing.T) {
	idemtest.RunLease(t, &idemtest.LeaseHarness{Open: openLeaseStore, Workers: 16, IDs: 500})
}

func leaseCrashHarness() *idemtest.LeaseCrashHarness {
	return &idemtest.LeaseCrashHarness{Create: createLeaseStore, Attach: attachLeaseStore, ChildTest: "TestLeaseCrashChild"}
}

// TestLeaseCrash kills a worker process at every crash point, on a fresh
// schema both processes use (its name reaches the child in an environment
// variable).
func TestLeaseCrash(t *testing.T) {
	idemtest.RunLeaseCrash(t, leaseCrashHarness())
}

// TestLeaseCrashChild is the killed worker of TestLeaseCrash; run on its
// own it does nothing.
func TestLeaseCrashChild(t *testing.T) {
	idemtest.LeaseCrashChild(t, leaseCrashHarness())
}

// TestLeaseReadsAtomicMarkers upgrades a schema that has only the atomic
// migration and markers written by it: after the lease migration they read
// as done (token 0), lease mode treats them as duplicates or conflicts, and
// atomic mode keeps working.
func TestLeaseReadsAtomicMarkers(t *testing.T) {
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	processed := pgx.Identifier{schema, "idem_processed"}.Sanitize()
	sql001, err := os.ReadFile("migrations/001_markers.sql")
	if err != nil {
		t.Fatal(err)
	}
	sql001 = []byte(strings.NewReplacer("{{processed}}", processed, "{{processed_at_idx}}", "idem_processed_at_brin").Replace(string(sql001)))
	if _, err := pool.Exec(ctx, string(sql001)); err != nil {
		t.Fatal(err)
	}
	migrationsTable := pgx.Identifier{schema, "idem_migrations"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+migrationsTable+` (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
INSERT INTO `+migrationsTable+` (version, name) VALUES (1, '001_markers.sql')`); err != nil {
		t.Fatal(err)
	}
	old := &idem.Message{ID: "evt-1", Payload: []byte("v1")}
	if _, err := pool.Exec(ctx, `INSERT INTO `+processed+` (handler, message_id, payload_hash) VALUES ('mailer', $1, $2)`, old.ID, old.PayloadHash()); err != nil {
		t.Fatal(err)
	}

	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	row, err := drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: old.ID})
	if err != nil || row == nil {
		t.Fatalf("LeaseGet: %+v, %v", row, err)
	}
	if row.Status != driver.LeaseDone || row.Token != 0 || row.Attempts != 0 || row.Owner != "" || !row.LeaseUntil.IsZero() {
		t.Fatalf("atomic marker after the lease migration: %+v, want done with token 0", row)
	}

	lp, err := idem.NewLeaseProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	lh := &idem.LeaseHandler{Name: "mailer", Call: func(context.Context, *idem.Lease, *idem.Message) error { calls++; return nil }}
	if out, err := lp.Process(ctx, lh, old); out != idem.Duplicate || err != nil {
		t.Fatalf("lease delivery of an atomic marker: (%v, %v), want duplicate", out, err)
	}
	if out, err := lp.Process(ctx, lh, &idem.Message{ID: old.ID, Payload: []byte("v2")}); out != idem.Conflict || !errors.Is(err, idem.ErrConflict) {
		t.Fatalf("other payload for an atomic marker: (%v, %v), want conflict", out, err)
	}
	if calls != 0 {
		t.Fatalf("lease handler ran %d times on an atomic marker", calls)
	}

	ap, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	ah := &idem.Handler[postgres.Tx]{Name: "mailer", Apply: func(context.Context, postgres.Tx, *idem.Message) error { return nil }}
	if out, err := ap.Process(ctx, ah, &idem.Message{ID: "evt-2"}); out != idem.Applied || err != nil {
		t.Fatalf("atomic delivery after the migration: (%v, %v)", out, err)
	}
	if out, err := ap.Process(ctx, ah, old); out != idem.Duplicate || err != nil {
		t.Fatalf("atomic redelivery of an old marker: (%v, %v)", out, err)
	}
	row, err = drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: "evt-2"})
	if err != nil || row == nil || row.Status != driver.LeaseDone || row.Token != 0 {
		t.Fatalf("new atomic marker: %+v, %v", row, err)
	}
}
