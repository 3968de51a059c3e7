package main

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCleanupOnDemoDatabase runs cleanup against a database the demo
// filled: a dry run counts nothing under the default retention, a 1 ns
// retention deletes every marker, and a retention below the horizon is a
// usage error.
func TestCleanupOnDemoDatabase(t *testing.T) {
	t.Parallel()
	db := filepath.Join(t.TempDir(), "demo.db")
	if code, _, errOut := runCLI(t, "demo", "--events", "2000", "--accounts", "20", "--conflicts", "0", "--db", db); code != exitOK {
		t.Fatalf("demo: exit %d: %s", code, errOut)
	}

	code, out, errOut := runCLI(t, "cleanup", "--dsn", db, "--dry-run")
	if code != exitOK || !strings.Contains(out, "total    0") || !strings.Contains(out, "Oldest marker: ") {
		t.Fatalf("dry run: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLI(t, "cleanup", "--dsn", db, "--dry-run", "--retention", "1ns", "--json")
	var dry cleanupReport
	if code != exitOK || json.Unmarshal([]byte(out), &dry) != nil || !dry.DryRun || dry.WouldDelete == nil || dry.Deleted != nil || dry.Prunable["demo.balances"] != int64(*dry.WouldDelete) || *dry.WouldDelete < 2000*9/10 {
		t.Fatalf("dry run, 1ns: exit %d\n%s%s", code, out, errOut)
	}

	code, out, errOut = runCLI(t, "cleanup", "--dsn", db, "--retention", "1ns", "--batch", "500", "--json")
	var rep cleanupReport
	if code != exitOK || json.Unmarshal([]byte(out), &rep) != nil || rep.Deleted == nil || rep.WouldDelete != nil || *rep.Deleted != *dry.WouldDelete || *rep.Batches < *dry.WouldDelete/500+1 {
		// More batches than that when one is slow: the next is smaller.
		t.Fatalf("cleanup: exit %d, want %d deleted in at least %d batches\n%s%s", code, *dry.WouldDelete, *dry.WouldDelete/500+1, out, errOut)
	}
	code, out, _ = runCLI(t, "cleanup", "--dsn", db, "--dry-run")
	if code != exitOK || !strings.Contains(out, "No markers stored.") {
		t.Fatalf("after cleanup: exit %d\n%s", code, out)
	}

	code, _, errOut = runCLI(t, "cleanup", "--dsn", db, "--retention", "1h", "--horizon", "2h")
	if code != exitUsage || !strings.Contains(errOut, "shorter than the redelivery horizon") {
		t.Fatalf("retention below horizon: exit %d, stderr %q", code, errOut)
	}
	empty := filepath.Join(t.TempDir(), "empty.db")
	if err := os.WriteFile(empty, nil, 0o600); err != nil { // an empty file is an empty SQLite database
		t.Fatal(err)
	}
	code, _, errOut = runCLI(t, "cleanup", "--dsn", empty, "--dry-run")
	if code != exitFailed || !strings.Contains(errOut, "run 'idem migrate' first") {
		t.Fatalf("unmigrated database: exit %d, stderr %q", code, errOut)
	}
	// A mistyped path is not created: only migrate creates the file.
	missing := filepath.Join(t.TempDir(), "typo.db")
	for _, args := range [][]string{{"cleanup", "--dry-run"}, {"stats"}, {"dlq", "list"}, {"outbox", "stats"}} {
		code, _, errOut = runCLI(t, append(args, "--dsn", missing)...)
		if code != exitFailed || !strings.Contains(errOut, "does not exist (idem migrate creates it)") {
			t.Fatalf("idem %s on a missing file: exit %d, stderr %q", strings.Join(args, " "), code, errOut)
		}
		if _, err := os.Stat(missing); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("idem %s created %s (%v)", strings.Join(args, " "), missing, err)
		}
	}
}
