package testenv

import (
	"context"
	"database/sql"
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
