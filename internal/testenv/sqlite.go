package testenv

import (
	"context"
	"database/sql"
	"sync"
	"testing"

	"github.com/idemhq/idem/sqlite"
)

// SQLite opens the SQLite database at path (":memory:" for one in memory)
// with opts, builds its driver with the default table prefix and migrates
// it. The database is closed when the test ends.
func SQLite(t testing.TB, path string, opts *sqlite.OpenOptions) (*sql.DB, *sqlite.Driver) {
	t.Helper()
	db, err := sqlite.Open(path, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	drv, err := sqlite.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return db, drv
}

// HoldSQLite takes the SQLite file at path down for the drivers on it:
// another connection holds it in BEGIN EXCLUSIVE until the returned
// release is called (at most once; the test's end releases it too), so
// their statements fail with SQLITE_BUSY once their busy timeout passes.
func HoldSQLite(t testing.TB, path string) (release func()) {
	t.Helper()
	ctx := context.Background()
	db, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		db.Close()
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, "BEGIN EXCLUSIVE"); err != nil {
		conn.Close()
		db.Close()
		t.Fatal(err)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			if _, err := conn.ExecContext(ctx, "ROLLBACK"); err != nil {
				t.Errorf("release the SQLite file: %v", err)
			}
			conn.Close()
			db.Close()
		})
	}
	t.Cleanup(release)
	return release
}
