package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// attachLeaseStore opens the SQLite file at path (creating and migrating it
// if needed); crash tests open it from two processes.
func attachLeaseStore(t testing.TB, path string) driver.LeaseDriver {
	t.Helper()
	_, drv := testenv.SQLite(t, path, nil)
	return drv
}

func createLeaseStore(t testing.TB) (driver.LeaseDriver, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "lease.db")
	return attachLeaseStore(t, path), path
}

func openLeaseStore(t testing.TB) driver.LeaseDriver {
	t.Helper()
	drv, _ := createLeaseStore(t)
	return drv
}

func TestLease(t *testing.T) {
	t.Parallel()
	// A smaller concurrent-workers run than Postgres's 16 × 500: SQLite
	// has one writer and fsyncs every claim and done.
	idemtest.RunLease(t, &idemtest.LeaseHarness{Open: openLeaseStore, Workers: 8, IDs: 60})
}

func leaseCrashHarness() *idemtest.LeaseCrashHarness {
	return &idemtest.LeaseCrashHarness{Create: createLeaseStore, Attach: attachLeaseStore, ChildTest: "TestLeaseCrashChild"}
}

// TestLeaseCrash kills a worker process at every crash point, on a SQLite
// file both processes open.
func TestLeaseCrash(t *testing.T) {
	t.Parallel()
	idemtest.RunLeaseCrash(t, leaseCrashHarness())
}

// TestLeaseCrashChild is the killed worker of TestLeaseCrash; run on its
// own it does nothing.
func TestLeaseCrashChild(t *testing.T) {
	idemtest.LeaseCrashChild(t, leaseCrashHarness())
}

// TestLeaseReadsAtomicMarkers upgrades a database that has only the atomic
// schema and markers written by it: after the lease migration the markers
// read as done (token 0) and lease mode treats them as duplicates or
// conflicts, while atomic mode keeps working.
func TestLeaseReadsAtomicMarkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "old.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	schema, err := os.ReadFile("migrations/001_markers.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(strings.ReplaceAll(string(schema), "{{processed}}", `"idem_processed"`)); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE idem_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL);
INSERT INTO idem_migrations VALUES (1, '001_markers.sql', 0)`); err != nil {
		t.Fatal(err)
	}
	old := &idem.Message{ID: "evt-1", Payload: []byte("v1")}
	if _, err := db.Exec(`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES ('mailer', ?, ?, 1)`,
		old.ID, old.PayloadHash()); err != nil {
		t.Fatal(err)
	}

	drv, err := sqlite.New(db, nil)
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

	// Atomic mode is unaffected: new markers are done rows with token 0.
	ap, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	ah := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
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

	if _, err := db.Exec(`UPDATE idem_processed SET status = 'bogus' WHERE message_id = 'evt-2'`); err == nil {
		t.Fatal("status constraint accepted 'bogus'")
	}
}
