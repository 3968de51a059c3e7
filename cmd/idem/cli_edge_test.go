package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/testenv"
)

// TestImportSQLiteMissingColumn: an import whose --from names a column
// the SQLite table does not have fails. SQLite reads an unknown
// double-quoted identifier as a string literal, and the import stored the
// column's name as a marker and exited 0: the operator believed the
// hand-rolled IDs were markers, and their redeliveries applied again.
func TestImportSQLiteMissingColumn(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db, _ := testenv.SQLite(t, path, nil)
	if _, err := db.Exec(`CREATE TABLE processed_events (event_id TEXT); INSERT INTO processed_events VALUES ('a1'), ('a2'), ('a3')`); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI(t, "import", "--dsn", path, "--handler", "billing", "--from", "processed_events.evnt_id")
	var bogus int
	if err := db.QueryRow(`SELECT count(*) FROM idem_processed WHERE handler = 'billing' AND message_id = 'evnt_id'`).Scan(&bogus); err != nil {
		t.Fatal(err)
	}
	if code != exitFailed || bogus != 0 {
		t.Errorf("import from a missing column: exit %d (want %d), %d marker(s) named after the column\n%s%s", code, exitFailed, bogus, out, errOut)
	}
}

// TestPostgresPasswordWithAtIsRefused: a PostgreSQL password holding a
// raw '@' never reaches an error message, not even its tail (pgx takes
// the tail for the host, and the connect error printed it): the DSN is a
// usage error asking for %40.
func TestPostgresPasswordWithAtIsRefused(t *testing.T) {
	const tail = "Xy7tail"
	code, out, errOut := runCLI(t, "stats", "--dsn", "postgres://postgres:pa55@"+tail+"@127.0.0.1:1/test")
	if code != exitUsage || strings.Contains(out+errOut, tail) || !strings.Contains(errOut, "%40") {
		t.Errorf("exit %d; the output shows the password's tail %q:\n%s%s", code, tail, out, errOut)
	}
}

// TestDLQListSaysItWasCutShort: dlq list stops at --limit (100 by
// default) and says that more match; it reported "2 dead letters in 1
// group" while three were parked.
func TestDLQListSaysItWasCutShort(t *testing.T) {
	db := filepath.Join(t.TempDir(), "demo.db")
	if code, _, errOut := runCLI(t, "demo", "--events", "300", "--accounts", "10", "--conflicts", "3", "--workers", "1", "--broker", "none", "--db", db); code != exitOK {
		t.Fatalf("demo: exit %d: %s", code, errOut)
	}
	code, out, errOut := runCLI(t, "dlq", "list", "--dsn", db, "--limit", "2")
	if code != exitOK {
		t.Fatalf("dlq list: exit %d\n%s%s", code, out, errOut)
	}
	if !strings.Contains(out, "of 3") && !strings.Contains(out, "more") {
		t.Errorf("3 dead letters are parked; the list of 2 does not say it was cut short:\n%s", out)
	}
}

// TestCleanupDryRunCountsTheOutbox: cleanup --dry-run counts what the
// same cleanup then deletes, published outbox rows included (it reported
// "outbox_deleted": 0 before a cleanup that deleted one).
func TestCleanupDryRunCountsTheOutbox(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db, drv := testenv.SQLite(t, path, nil)
	addToOutbox(t, db, drv, "o1")
	old := time.Now().Add(-30 * 24 * time.Hour).UnixMicro()
	if _, err := db.Exec(`UPDATE idem_outbox SET published_at = ?, created_at = ?`, old, old); err != nil {
		t.Fatal(err)
	}
	var dry, real cleanupReport
	code, out, errOut := runCLI(t, "cleanup", "--dsn", path, "--dry-run", "--json")
	if code != exitOK || json.Unmarshal([]byte(out), &dry) != nil {
		t.Fatalf("dry run: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "cleanup", "--dsn", path, "--json")
	if code != exitOK || json.Unmarshal([]byte(out), &real) != nil {
		t.Fatalf("cleanup: exit %d\n%s%s", code, out, errOut)
	}
	if dry.OutboxWouldDelete == nil || real.OutboxDeleted == nil || *real.OutboxDeleted != 1 || *dry.OutboxWouldDelete != *real.OutboxDeleted {
		t.Fatalf("dry run says %v outbox row(s) would go; the cleanup then deleted %v", dry.OutboxWouldDelete, real.OutboxDeleted)
	}
}

// TestPostgresLockedTableFails: a one-shot command on PostgreSQL waiting
// for a locked table fails after the CLI's lock_timeout, naming the lock,
// as SQLite's busy timeout does; it waited silently for as long as the
// lock was held.
func TestPostgresLockedTableFails(t *testing.T) {
	t.Parallel()
	schema, drv := migratedSchema(t)
	ctx := context.Background()
	tx, err := drv.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE "`+schema+`".idem_processed IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	done := make(chan int, 1)
	var errOut string
	go func() {
		code, _, e := runCLIEnv(t, map[string]string{dsnEnv: testenv.PostgresDSN()}, "stats", "--schema", schema)
		errOut = e
		done <- code
	}()
	select {
	case code := <-done:
		if code != exitFailed || !strings.Contains(errOut, "lock") {
			t.Errorf("stats on a locked table: exit %d, stderr %q; want %d naming the lock", code, errOut, exitFailed)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("stats on a locked table is still waiting after 30 s, with no message")
		tx.Rollback(ctx)
		<-done
	}
}

// TestMigrateNamesSchemaOnce: migrate named the PostgreSQL schema twice:
// "… (schema s), schema "s"".
func TestMigrateNamesSchemaOnce(t *testing.T) {
	pool := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, pool)
	code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: testenv.PostgresDSN()}, "migrate", "--schema", schema)
	if code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	if n := strings.Count(strings.SplitN(out, "\n", 2)[0], schema); n != 1 {
		t.Errorf("the database line names schema %s %d times:\n%s", schema, n, out)
	}
}

// TestUsageErrorDropsTheLibraryPrefix: a usage error drops the library's
// "idem: " prefix, as an operation failure's message does ("idem cleanup:
// idem: retention …").
func TestUsageErrorDropsTheLibraryPrefix(t *testing.T) {
	code, _, errOut := runCLI(t, "cleanup", "--dsn", "x.db", "--retention", "1h", "--horizon", "2h")
	if code != exitUsage || strings.Contains(errOut, "idem cleanup: idem: ") {
		t.Errorf("exit %d, stderr %q", code, errOut)
	}
}
