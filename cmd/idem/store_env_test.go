package main

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// TestMigrateListsEveryTable: the tables 'idem migrate' names are exactly
// those a migration leaves, on SQLite and PostgreSQL.
func TestMigrateListsEveryTable(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	code, out, errOut := runCLI(t, "migrate", "--dsn", path, "--prefix", "app_")
	if code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	db, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	rows, err := db.Query(`SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'app\_%' ESCAPE '\' ORDER BY name`)
	if err != nil {
		t.Fatal(err)
	}
	var sqliteTables []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		sqliteTables = append(sqliteTables, `"`+n+`"`)
	}
	rows.Close()
	wantTables(t, "SQLite", out, sqliteTables)

	pool := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, pool)
	code, out, errOut = runCLIEnv(t, map[string]string{schemaEnv: schema}, "migrate", "--dsn", testenv.PostgresDSN())
	if code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	r, err := pool.Query(context.Background(), `SELECT format('%I.%I', table_schema, table_name) FROM information_schema.tables WHERE table_schema = $1`, schema)
	if err != nil {
		t.Fatal(err)
	}
	var pgTables []string
	for r.Next() {
		var n string
		if err := r.Scan(&n); err != nil {
			t.Fatal(err)
		}
		pgTables = append(pgTables, n)
	}
	r.Close()
	if len(pgTables) == 0 {
		t.Fatalf("IDEM_SCHEMA=%s: migrate created nothing in the schema\n%s", schema, out)
	}
	wantTables(t, "PostgreSQL", out, pgTables)

	myDSN, myDrv := mysqlURL(t)
	code, out, errOut = runCLI(t, "migrate", "--dsn", myDSN)
	if code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	mr, err := myDrv.DB().Query(`SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE()`)
	if err != nil {
		t.Fatal(err)
	}
	var myTables []string
	for mr.Next() {
		var n string
		if err := mr.Scan(&n); err != nil {
			t.Fatal(err)
		}
		myTables = append(myTables, "`"+n+"`")
	}
	mr.Close()
	wantTables(t, "MySQL", out, myTables)
}

// wantTables checks that out's "tables:" line names exactly tables
// (quoted as the database names them; PostgreSQL's format('%I') leaves
// plain names bare, sqlident quotes them all).
func wantTables(t *testing.T, db, out string, tables []string) {
	t.Helper()
	_, line, ok := strings.Cut(out, "tables: ")
	if !ok {
		t.Fatalf("%s: migrate names no tables:\n%s", db, out)
	}
	line, _, _ = strings.Cut(line, "\n")
	var got []string
	for _, n := range strings.Split(line, ", ") {
		got = append(got, strings.ReplaceAll(n, `"`, ""))
	}
	var want []string
	for _, n := range tables {
		want = append(want, strings.ReplaceAll(n, `"`, ""))
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("%s: migrate names %v; the database has %v", db, got, want)
	}
}

// TestSchemaAndPrefixFromEnvironment: every command reads IDEM_SCHEMA and
// IDEM_PREFIX when the flags are not given, and a store without tables
// names where idem's tables are instead of asking for a migration that
// would make a second, empty set.
func TestSchemaAndPrefixFromEnvironment(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	if code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: path, prefixEnv: "billing_"}, "migrate"); code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	with := map[string]string{dsnEnv: path, prefixEnv: "billing_"}
	without := map[string]string{dsnEnv: path}
	for _, args := range [][]string{{"stats"}, {"dlq", "list"}, {"outbox", "stats"}, {"outbox", "list"}, {"cleanup", "--dry-run", "--retention", "720h"}} {
		if code, out, errOut := runCLIEnv(t, with, args...); code != exitOK {
			t.Errorf("%s with %s: exit %d\n%s%s", strings.Join(args, " "), prefixEnv, code, out, errOut)
		}
		code, _, errOut := runCLIEnv(t, without, args...)
		if code != exitFailed || !strings.Contains(errOut, `no idem tables in prefix "idem_"; found them in prefix "billing_": set --prefix or $IDEM_PREFIX`) {
			t.Errorf("%s without %s: exit %d, want 1 naming the prefix found:\n%s", strings.Join(args, " "), prefixEnv, code, errOut)
		}
	}
	if code, _, errOut := runCLIEnv(t, map[string]string{dsnEnv: path, schemaEnv: "billing"}, "stats"); code != exitUsage || !strings.Contains(errOut, "$IDEM_SCHEMA applies only to PostgreSQL") {
		t.Errorf("IDEM_SCHEMA on SQLite: exit %d, want 2 naming the variable:\n%s", code, errOut)
	}
	empty := filepath.Join(t.TempDir(), "empty.db")
	if code, out, errOut := runCLI(t, "migrate", "--dsn", empty, "--prefix", "x_"); code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	if code, _, errOut := runCLIEnv(t, map[string]string{dsnEnv: empty}, "stats"); code != exitFailed || !strings.Contains(errOut, `found them in prefix "x_"`) {
		t.Errorf("stats on the default prefix: exit %d\n%s", code, errOut)
	}

	pool := testenv.PostgresPool(t, 2)
	billing, bare := testenv.FreshSchema(t, pool), testenv.FreshSchema(t, pool)
	dsn := testenv.PostgresDSN()
	if code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: dsn, schemaEnv: billing}, "migrate"); code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	if code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: dsn, schemaEnv: billing}, "outbox", "list"); code != exitOK {
		t.Fatalf("outbox list with %s: exit %d\n%s%s", schemaEnv, code, out, errOut)
	}
	code, _, errOut := runCLIEnv(t, map[string]string{dsnEnv: dsn, schemaEnv: bare}, "dlq", "list")
	if code != exitFailed || !strings.Contains(errOut, `no idem tables in schema "`+bare+`", prefix "idem_"; found them in `) || !(strings.Contains(errOut, `schema "`+billing+`", prefix "idem_"`) || strings.Contains(errOut, " more: set")) {
		t.Errorf("dlq list in an empty schema: exit %d, want 1 naming where the tables are:\n%s", code, errOut)
	}
	if !strings.Contains(errOut, "set --schema or $IDEM_SCHEMA") {
		t.Errorf("dlq list in an empty schema does not say how to point at the tables:\n%s", errOut)
	}
}

// TestSchemaHelpSaysCreatedOnlyForMigrate: only migrate creates a
// missing schema, and only its help says so.
func TestSchemaHelpSaysCreatedOnlyForMigrate(t *testing.T) {
	t.Parallel()
	for _, c := range commands() {
		_, out, _ := runCLI(t, "help", c.name)
		if !strings.Contains(out, "-schema") || c.name == "bench" {
			continue
		}
		if got := strings.Contains(out, "created if missing"); got != (c.name == "migrate") {
			t.Errorf("idem %s --help: says \"created if missing\" %t, want %t", c.name, got, c.name == "migrate")
		}
		if !strings.Contains(out, "$IDEM_SCHEMA") || !strings.Contains(out, "$IDEM_PREFIX") {
			t.Errorf("idem %s --help does not name $IDEM_SCHEMA and $IDEM_PREFIX", c.name)
		}
	}
}
