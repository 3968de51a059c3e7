package sqlite_test

import (
	"context"
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
