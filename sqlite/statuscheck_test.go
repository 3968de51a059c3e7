package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/sqlite"
)

// TestStatusCheckMigratesInPlace: migration 010 rewrites the lease status
// CHECK of migration 002 from an IN list, which SQLite checks by building a
// temporary B-tree for every row written, to comparisons. On a database
// migrated to 009 with a marker in it: the marker's insert then builds no
// temporary B-tree (EXPLAIN has no OpenEphemeral), on the connection that
// migrated and on a pool opened before the migration (as another process
// would have); the constraint still refuses any other status; the old
// marker still makes its message a duplicate; and integrity_check passes.
func TestStatusCheckMigratesInPlace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "old.db")
	db := openFile(t, path)
	migrateTo(t, db, 9)
	const insert = `INSERT INTO "idem_processed" (handler, message_id, payload_hash, processed_at) VALUES (?, ?, ?, ?)`
	if _, err := db.ExecContext(ctx, insert, "h", "m-1", []byte{7}, 1); err != nil {
		t.Fatal(err)
	}
	if def := tableSQL(t, db); !strings.Contains(def, `CHECK (status IN ('running', 'done', 'failed'))`) {
		t.Fatalf("the table as migration 002 leaves it: %s; migration 010 expects its IN list", def)
	}
	other := openFile(t, path)
	if !ephemeral(t, other, insert) {
		t.Fatal("before the migration, the insert should build the IN list's temporary B-tree")
	}

	drv, err := sqlite.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if def := tableSQL(t, db); !strings.Contains(def, `CHECK (status = 'running' OR status = 'done' OR status = 'failed')`) || strings.Contains(def, " IN (") {
		t.Fatalf("after migration 010: %s", def)
	}
	// The write comes first: it reads the schema version, and a pool
	// whose cached schema is older rereads it. (EXPLAIN alone reads
	// nothing from the file.)
	for name, pool := range map[string]*sql.DB{"the migrating pool": db, "a pool opened before": other} {
		_, err := pool.ExecContext(ctx, `INSERT INTO "idem_processed" (handler, message_id, payload_hash, processed_at, status) VALUES ('h', 'bad', x'', 1, 'bogus')`)
		if err == nil || !strings.Contains(err.Error(), "CHECK constraint failed") {
			t.Errorf("%s: status 'bogus' gave %v, want a CHECK constraint failure", name, err)
		}
		if ephemeral(t, pool, insert) {
			t.Errorf("%s: the marker insert still builds a temporary B-tree", name)
		}
	}
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res, err := drv.MarkerInsert(ctx, tx, &driver.MarkerInsertParams{Handler: "h", MessageID: "m-1", PayloadHash: []byte{7}})
	_ = drv.Rollback(ctx, tx)
	if err != nil || res.Inserted || string(res.ExistingHash) != "\x07" {
		t.Fatalf("the marker from before the migration: %+v, %v; want it found with its hash", res, err)
	}
	var check string
	if err := db.QueryRowContext(ctx, `PRAGMA integrity_check`).Scan(&check); err != nil || check != "ok" {
		t.Fatalf("integrity_check: %q, %v", check, err)
	}
}

func openFile(t *testing.T, path string) *sql.DB {
	t.Helper()
	db, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// migrateTo applies the migration files up to version last to db, with the
// default prefix, as the driver of that version did.
func migrateTo(t *testing.T, db *sql.DB, last int) {
	t.Helper()
	files, err := filepath.Glob("migrations/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE "idem_migrations" (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	names := regexp.MustCompile(`\{\{([a-z_]+?)_name\}\}`)
	quoted := regexp.MustCompile(`\{\{([a-z_]+)\}\}`)
	for _, f := range files {
		name := filepath.Base(f)
		v, _ := strconv.Atoi(name[:3])
		if v > last {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		script := quoted.ReplaceAllString(names.ReplaceAllString(string(b), `idem_$1`), `"idem_$1"`)
		if _, err := db.Exec(script); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := db.Exec(`INSERT INTO "idem_migrations" VALUES (?, ?, 0)`, v, name); err != nil {
			t.Fatal(err)
		}
	}
}

// tableSQL returns the marker table's definition.
func tableSQL(t *testing.T, db *sql.DB) string {
	t.Helper()
	var def string
	if err := db.QueryRow(`SELECT sql FROM sqlite_schema WHERE type = 'table' AND name = 'idem_processed'`).Scan(&def); err != nil {
		t.Fatal(err)
	}
	return def
}

// ephemeral reports whether the program SQLite compiles for insert opens a
// temporary B-tree.
func ephemeral(t *testing.T, db *sql.DB, insert string) bool {
	t.Helper()
	rows, err := db.Query(`EXPLAIN `+insert, "h", "x", []byte{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	found := false
	for rows.Next() {
		var (
			addr int
			op   string
			rest [6]any
		)
		if err := rows.Scan(&addr, &op, &rest[0], &rest[1], &rest[2], &rest[3], &rest[4], &rest[5]); err != nil {
			t.Fatal(err)
		}
		found = found || op == "OpenEphemeral"
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return found
}

// TestStatusCheckUnderDefensiveMode: a pool in SQLite's defensive mode
// forbids editing the schema text. Migration 010 then keeps the IN list
// (the same constraint, checked more slowly) rather than failing the
// upgrade, leaves writable_schema off, and the driver works.
func TestStatusCheckUnderDefensiveMode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "defensive.db")+"?_defensive=1&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { db.Close() })
	drv, err := sqlite.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatalf("Migrate in defensive mode: %v", err)
	}
	if def := tableSQL(t, db); !strings.Contains(def, `CHECK (status IN ('running', 'done', 'failed'))`) {
		t.Fatalf("defensive mode should keep the definition: %s", def)
	}
	var on int
	if err := db.QueryRowContext(ctx, `PRAGMA writable_schema`).Scan(&on); err != nil || on != 0 {
		t.Fatalf("writable_schema after Migrate: %d, %v; want 0", on, err)
	}
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Rollback(ctx, tx)
	if res, err := drv.MarkerInsert(ctx, tx, &driver.MarkerInsertParams{Handler: "h", MessageID: "m", PayloadHash: []byte{1}}); err != nil || !res.Inserted {
		t.Fatalf("MarkerInsert: %+v, %v", res, err)
	}
}

// TestStatusCheckCancelledLeavesSchemaLocked: Migrate cancelled once
// migration 010 has turned writable_schema on (database/sql then rolls the
// transaction back by itself) returns the cancellation, leaves the schema
// as it was, and leaves no pooled connection able to write sqlite_schema;
// the next Migrate applies 010.
func TestStatusCheckCancelledLeavesSchemaLocked(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "cancel.db")
	db := openFile(t, path)
	migrateTo(t, db, 9)
	drv, err := sqlite.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	sqlite.SetSchemaWritableHook(drv, func() {
		cancel()
		time.Sleep(50 * time.Millisecond) // database/sql's rollback on ctx's end
	})
	if err := drv.Migrate(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Migrate cancelled in migration 010: %v, want context.Canceled", err)
	}
	var on int
	if err := db.QueryRow(`PRAGMA writable_schema`).Scan(&on); err != nil || on != 0 {
		t.Fatalf("writable_schema after the cancelled Migrate: %d, %v; want 0", on, err)
	}
	if _, err := db.Exec(`UPDATE sqlite_schema SET sql = sql WHERE name = 'idem_processed'`); err == nil {
		t.Fatal("sqlite_schema is writable on the pool after the cancelled Migrate")
	}
	if def := tableSQL(t, db); !strings.Contains(def, `status IN (`) {
		t.Fatalf("the cancelled migration changed the definition: %s", def)
	}
	sqlite.SetSchemaWritableHook(drv, nil)
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if def := tableSQL(t, db); !strings.Contains(def, `status = 'running' OR`) {
		t.Fatalf("after a second Migrate: %s", def)
	}
}
