package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemhq/idem/sqlite"
)

// TestImportHandRolledTable imports a SQLite processed-events table: the
// valid IDs become markers, an over-long value is listed and makes the
// exit code 1, a second run finds every marker in place, and bad flags are
// usage errors.
func TestImportHandRolledTable(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "app.db")
	if code, _, errOut := runCLI(t, "migrate", "--dsn", path); code != exitOK {
		t.Fatalf("migrate: exit %d: %s", code, errOut)
	}
	db, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `CREATE TABLE processed_events (event_id TEXT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"evt-1", "evt-2", "evt-3", strings.Repeat("x", 256)} {
		if _, err := db.ExecContext(ctx, `INSERT INTO processed_events VALUES (?)`, id); err != nil {
			t.Fatal(err)
		}
	}
	db.Close()

	args := []string{"import", "--dsn", path, "--handler", "billing.credits", "--from", "processed_events.event_id", "--batch", "2"}
	code, out, errOut := runCLI(t, append(args, "--json")...)
	var rep importReport
	if code != exitFailed || json.Unmarshal([]byte(out), &rep) != nil || rep.Read != 4 || rep.Imported != 3 || rep.Invalid != 1 || len(rep.Skipped) != 1 ||
		!strings.Contains(errOut, "1 value(s) of processed_events.event_id are not valid message IDs") {
		t.Fatalf("import: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLI(t, args...)
	if code != exitFailed || !strings.Contains(out, "Imported 0 markers") || !strings.Contains(out, "3 already there, 1 invalid") || !strings.Contains(errOut, `skipped "xxx`) {
		t.Fatalf("second import: exit %d\n%s%s", code, out, errOut)
	}

	for _, bad := range [][]string{
		{"import", "--dsn", path, "--from", "processed_events.event_id"},
		{"import", "--dsn", path, "--handler", "h", "--from", "event_id"},
		{"import", "--dsn", path, "--handler", "h", "--from", "a.b.c.d"},
		{"import", "--dsn", path, "--handler", "h", "--from", "t.c", "--batch", "0"},
	} {
		if code, _, errOut := runCLI(t, bad...); code != exitUsage {
			t.Errorf("%v: exit %d, want usage (%s)", bad, code, errOut)
		}
	}
	code, _, errOut = runCLI(t, "import", "--dsn", path, "--handler", "h", "--from", `processed_events.event_id";--`)
	if code == exitOK || !strings.Contains(errOut, "import column") {
		t.Errorf("hostile column: exit %d, stderr %q", code, errOut)
	}
}

// TestImportListsHugeValuesBounded: an invalid value of a megabyte is
// listed by a bounded prefix, not printed whole (ten of them would fill
// the terminal, or the --json report, with 10 MB).
func TestImportListsHugeValuesBounded(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "app.db")
	if code, _, errOut := runCLI(t, "migrate", "--dsn", path); code != exitOK {
		t.Fatalf("migrate: exit %d: %s", code, errOut)
	}
	db, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE seen (id TEXT)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO seen VALUES (?), ('evt-1')`, strings.Repeat("y", 1<<20)); err != nil {
		t.Fatal(err)
	}
	db.Close()
	args := []string{"import", "--dsn", path, "--handler", "h", "--from", "seen.id"}
	code, out, errOut := runCLI(t, args...)
	if code != exitFailed || !strings.Contains(errOut, `skipped "yyy`) || len(errOut) > 2000 {
		t.Fatalf("import: exit %d, %d bytes of stderr (want the value listed by a short prefix)\n%.500s", code, len(errOut), errOut)
	}
	code, out, _ = runCLI(t, append(args, "--json")...)
	var rep importReport
	if code != exitFailed || json.Unmarshal([]byte(out), &rep) != nil || len(rep.Skipped) != 1 || len(rep.Skipped[0]) > 1000 || rep.Invalid != 1 {
		t.Fatalf("import --json: exit %d, %d bytes of output (want the value listed by a short prefix)\n%.500s", code, len(out), out)
	}
}
