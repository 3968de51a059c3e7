package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemhq/idem/internal/testenv"
)

// TestMisplacedDSNPasswordIsHidden: a DSN typed where another argument
// belongs (without --dsn, as a dead-letter ID, as a flag's value) is
// quoted back in the usage error with its password hidden, as every DSN
// the commands print is.
func TestMisplacedDSNPasswordIsHidden(t *testing.T) {
	const secret = "Pw9secret"
	for _, dsn := range []string{
		"postgres://app:" + secret + "@db.internal:5432/app",
		"mysql://root:" + secret + "@db.internal:3306/app",
		"root:" + secret + "@tcp(db.internal:3306)/app",
		"redis://:" + secret + "@cache.internal:6379/0",
	} {
		for _, args := range [][]string{
			{dsn},
			{"help", dsn},
			{"stats", dsn},
			{"migrate", dsn},
			{"cleanup", "--retention", dsn},
			{"dlq", dsn},
			{"dlq", "show", dsn},
			{"dlq", "list", dsn},
			{"dlq", "list", "--limit", dsn},
			{"dlq", "list", "--since", dsn},
			{"outbox", dsn},
			{"outbox", "park", dsn},
			{"outbox", "list", dsn},
			{"outbox", "stats", "--limit", dsn},
			{"import", "--handler", "h", "--from", dsn},
		} {
			code, out, errOut := runCLI(t, args...)
			if code != exitUsage || strings.Contains(out+errOut, secret) {
				t.Errorf("idem %s: exit %d (want %d), and the password printed:\n%s%s", strings.Join(args, " "), code, exitUsage, out, errOut)
			}
		}
	}
}

// TestOutboxNotifyRefusesJSON: 'outbox notify --json' is a usage error,
// as 'outbox check --json' is, and changes nothing; it switched the
// trigger and printed text where a script expected JSON.
func TestOutboxNotifyRefusesJSON(t *testing.T) {
	schema, drv := migratedSchema(t)
	vars := map[string]string{dsnEnv: testenv.PostgresDSN()}
	code, out, errOut := runCLIEnv(t, vars, "outbox", "notify", "on", "--schema", schema, "--json")
	if code != exitUsage || !strings.Contains(errOut, "prints text only") {
		t.Errorf("outbox notify on --json: exit %d, want %d\n%s%s", code, exitUsage, out, errOut)
	}
	if on, err := drv.OutboxNotifyOn(context.Background()); err != nil || on {
		t.Errorf("after a refused notify on: on %t, %v", on, err)
	}
}

// TestImportBadFromIsUsageError: a --from naming what cannot be a table
// or column, or a schema on SQLite, is a usage error (exit 2) before
// anything is read; it exited 1, as a failed import does.
func TestImportBadFromIsUsageError(t *testing.T) {
	path := filepath.Join(t.TempDir(), "app.db")
	db, _ := testenv.SQLite(t, path, nil)
	if _, err := db.Exec(`CREATE TABLE processed_events (event_id TEXT); INSERT INTO processed_events VALUES ('a1')`); err != nil {
		t.Fatal(err)
	}
	for _, from := range []string{`processed_events.event_id";--`, "Processed_Events.event_id", "processed_events.1id", "main.processed_events.event_id"} {
		code, out, errOut := runCLI(t, "import", "--dsn", path, "--handler", "billing", "--from", from)
		if code != exitUsage || !strings.Contains(errOut, "--from") {
			t.Errorf("import --from %s: exit %d, want %d naming --from\n%s%s", from, code, exitUsage, out, errOut)
		}
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM idem_processed`).Scan(&n); err != nil || n != 0 {
		t.Errorf("markers after refused imports: %d, %v", n, err)
	}
	if code, out, errOut := runCLI(t, "import", "--dsn", path, "--handler", "billing", "--from", "processed_events.event_id"); code != exitOK {
		t.Errorf("import: exit %d\n%s%s", code, out, errOut)
	}
}

// TestBenchSchemaFlag: bench refuses a --schema that is not a plain
// identifier as a usage error, and one given for another store than
// PostgreSQL, which ignored it and ran the benchmark elsewhere.
func TestBenchSchemaFlag(t *testing.T) {
	quick := []string{"--cases", "per-message", "--rounds", "1", "--round", "10ms"}
	for _, args := range [][]string{
		{"bench", "--schema", "idem_bench2"},
		{"bench", "--schema", "idem_bench2", "--dsn", filepath.Join(t.TempDir(), "bench.db")},
		{"bench", "--schema", "idem_bench2", "--dsn", testenv.RedisURL()},
		{"bench", "--schema", "Bad-Schema", "--dsn", testenv.PostgresDSN()},
	} {
		code, out, errOut := runCLI(t, append(args, quick...)...)
		if code != exitUsage || !strings.Contains(errOut, "--schema") {
			t.Errorf("idem %s: exit %d, want %d naming --schema\n%s%s", strings.Join(args, " "), code, exitUsage, out, errOut)
		}
	}
}

// TestBenchWorkersBound: a --workers past what a connection pool takes is
// a usage error; on Redis it panicked in go-redis's NewClient, on
// PostgreSQL it wrapped around the pool's int32 size.
func TestBenchWorkersBound(t *testing.T) {
	for _, dsn := range []string{testenv.RedisURL(), testenv.PostgresDSN()} {
		args := []string{"bench", "--dsn", dsn, "--workers", "2147483646", "--cases", "per-message", "--rounds", "1", "--round", "10ms"}
		code, out, errOut := runCLI(t, args...)
		if code != exitUsage || !strings.Contains(errOut, "--workers") {
			t.Errorf("idem %s: exit %d, want %d naming --workers\n%s%s", strings.Join(args, " "), code, exitUsage, out, errOut)
		}
	}
}

// TestBenchSQLiteLeavesTheFileAsFound: bench on a SQLite DSN removes a
// file it created and drops the tables it added to one that was there,
// as it does on the other stores; it left fourteen idem_bench_ tables
// full of benchmark markers in the operator's database, and a new file
// behind a mistyped path.
func TestBenchSQLiteLeavesTheFileAsFound(t *testing.T) {
	dir := t.TempDir()
	quick := []string{"--cases", "per-message", "--rounds", "1", "--round", "10ms"}
	fresh := filepath.Join(dir, "fresh.db")
	if code, out, errOut := runCLI(t, append([]string{"bench", "--dsn", fresh}, quick...)...); code != exitOK {
		t.Fatalf("bench on a new file: exit %d\n%s%s", code, out, errOut)
	}
	if matches, _ := filepath.Glob(fresh + "*"); len(matches) > 0 {
		t.Errorf("bench left %v behind", matches)
	}
	app := filepath.Join(dir, "app.db")
	db, _ := testenv.SQLite(t, app, nil)
	if _, err := db.Exec(`CREATE TABLE accounts (id TEXT); CREATE TABLE idem_bench_mine (id TEXT)`); err != nil {
		t.Fatal(err)
	}
	before, err := sqliteTables(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := runCLI(t, append([]string{"bench", "--dsn", app}, quick...)...); code != exitOK {
		t.Fatalf("bench on an existing file: exit %d\n%s%s", code, out, errOut)
	}
	after, err := sqliteTables(context.Background(), app)
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) || !after["accounts"] || !after["idem_bench_mine"] {
		t.Errorf("tables before the bench %v, after %v", before, after)
	}
}
