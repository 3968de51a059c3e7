package mysql_test

import (
	"context"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// attachLeaseStore opens a driver on the database at dsn; crash tests open
// it from two processes.
func attachLeaseStore(t testing.TB, dsn string) driver.LeaseDriver {
	t.Helper()
	drv, err := mysql.New(testenv.MySQL(t, dsn, 40), nil)
	if err != nil {
		t.Fatal(err)
	}
	return drv
}

func createLeaseStore(t testing.TB) (driver.LeaseDriver, string) {
	t.Helper()
	dsn := testenv.MySQLDatabase(t)
	drv := attachLeaseStore(t, dsn)
	if err := drv.(*mysql.Driver).Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return drv, dsn
}

func openLeaseStore(t testing.TB) driver.LeaseDriver {
	t.Helper()
	drv, _ := createLeaseStore(t)
	return drv
}

func TestLease(t *testing.T) {
	t.Parallel()
	idemtest.RunLease(t, &idemtest.LeaseHarness{Open: openLeaseStore, Workers: 16, IDs: 500})
}

func leaseCrashHarness() *idemtest.LeaseCrashHarness {
	return &idemtest.LeaseCrashHarness{Create: createLeaseStore, Attach: attachLeaseStore, ChildTest: "TestLeaseCrashChild"}
}

// TestLeaseCrash kills a worker process at every crash point, on a
// database both processes use.
func TestLeaseCrash(t *testing.T) { idemtest.RunLeaseCrash(t, leaseCrashHarness()) }

// TestLeaseCrashChild is the killed worker of TestLeaseCrash; run on its
// own it does nothing.
func TestLeaseCrashChild(t *testing.T) { idemtest.LeaseCrashChild(t, leaseCrashHarness()) }

// TestLeaseReadsImportedAndAtomicMarkers: a marker in the markers table
// (imported from a hand-rolled table, or written by atomic mode under the
// same handler name) is a done row to lease mode, as on SQLite and
// Postgres: a delivery of its message is a Duplicate (any payload for an
// imported one) and the handler does not run.
func TestLeaseReadsImportedAndAtomicMarkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ld, dsn := createLeaseStore(t)
	drv := ld.(*mysql.Driver)
	if n, err := drv.InsertImportedMarkers(ctx, "uploader", []string{"file-1"}); err != nil || n != 1 {
		t.Fatalf("import: %d, %v", n, err)
	}
	p, err := idem.NewLeaseProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	h := &idem.LeaseHandler{Name: "uploader", Call: func(context.Context, *idem.Lease, *idem.Message) error {
		calls++
		return nil
	}}
	for range 2 {
		out, err := p.Process(ctx, h, &idem.Message{ID: "file-1", Payload: []byte("anything")})
		if err != nil || out != idem.Duplicate || calls != 0 {
			t.Fatalf("imported message in lease mode: %v, %v, handler called %d times; want duplicate, not called", out, err, calls)
		}
	}
	row, err := drv.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "uploader", MessageID: "file-1"})
	if err != nil || row == nil || row.Status != driver.LeaseDone || row.Token != 0 {
		t.Fatalf("LeaseGet of an imported marker: %+v, %v; want done with token 0", row, err)
	}
	// A message without a marker is claimed and applied as ever.
	if out, err := p.Process(ctx, h, &idem.Message{ID: "file-2", Payload: []byte("x")}); err != nil || out != idem.Applied || calls != 1 {
		t.Fatalf("new message: %v, %v, %d calls; want applied once", out, err, calls)
	}
	// An atomic marker (the first 16 bytes of the payload's hash): the
	// same payload is a Duplicate, another a Conflict.
	msg := &idem.Message{ID: "file-3", Payload: []byte("atomic")}
	db := testenv.MySQL(t, dsn, 2)
	if _, err := db.ExecContext(ctx, `INSERT INTO idem_markers (handler_id, message_id, payload_hash, processed_at)
SELECT id, ?, ?, 0 FROM idem_handlers WHERE name = 'uploader'`, msg.ID, msg.PayloadHash()[:16]); err != nil {
		t.Fatal(err)
	}
	if out, err := p.Process(ctx, h, msg); err != nil || out != idem.Duplicate || calls != 1 {
		t.Fatalf("atomic marker, same payload: %v, %v, %d calls; want duplicate, not called", out, err, calls)
	}
	if out, err := p.Process(ctx, h, &idem.Message{ID: "file-3", Payload: []byte("other")}); out != idem.Conflict || !idem.IsPermanent(err) || calls != 1 {
		t.Fatalf("atomic marker, other payload: %v, %v, %d calls; want conflict, not called", out, err, calls)
	}
}
