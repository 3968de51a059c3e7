package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// Probe fails while another connection holds the write lock past the busy
// timeout, and the error it met looks like an outage; both pass once the
// lock goes.
func TestUnavailableAndProbe(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, drv := testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 20 * time.Millisecond})
	ctx := context.Background()
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("Probe of a free database: %v", err)
	}
	other, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	lock, err := other.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "BEGIN EXCLUSIVE"); err != nil {
		t.Fatal(err)
	}
	perr := drv.Probe(ctx)
	if perr == nil || !drv.Unavailable(perr) {
		t.Fatalf("Probe of a locked database: %v, want an error that looks like an outage", perr)
	}
	_, werr := db.ExecContext(ctx, "CREATE TABLE t (x)")
	if werr == nil || !drv.Unavailable(werr) {
		t.Fatalf("a write to a locked database: %v, want an error that looks like an outage", werr)
	}
	if _, err := lock.ExecContext(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("Probe once the lock went: %v", err)
	}
	if _, err := db.ExecContext(ctx, "SELECT * FROM no_such_table"); err == nil || drv.Unavailable(err) {
		t.Fatalf("a missing table looks like an outage: %v", err)
	}
	if drv.Unavailable(errors.New("plain")) || drv.Unavailable(nil) {
		t.Fatal("a plain error looks like an outage")
	}
}

// TestProbeNeedsAWrite: a database the process may only read, and one
// whose pool begins transactions deferred (no lock until the first
// write), both let a BEGIN through; the probe must still find that no
// write can happen, with an error that looks like an outage.
func TestProbeNeedsAWrite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "idem.db")
	_, drv := testenv.SQLite(t, path, nil)
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("Probe of a writable database: %v", err)
	}
	ro, err := sql.Open("sqlite", "file:"+path+"?mode=ro&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	roDrv, err := sqlite.New(ro, nil)
	if err != nil {
		t.Fatal(err)
	}
	if perr := roDrv.Probe(ctx); perr == nil || !roDrv.Unavailable(perr) {
		t.Fatalf("Probe of a read-only database: %v, want an error that looks like an outage", perr)
	}

	deferred, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(20)")
	if err != nil {
		t.Fatal(err)
	}
	defer deferred.Close()
	defDrv, err := sqlite.New(deferred, nil)
	if err != nil {
		t.Fatal(err)
	}
	lock, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	c, err := lock.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	defer c.ExecContext(ctx, "ROLLBACK")
	if perr := defDrv.Probe(ctx); perr == nil || !defDrv.Unavailable(perr) {
		t.Fatalf("Probe on a deferred pool while another holds the write lock: %v, want an error that looks like an outage", perr)
	}
}
