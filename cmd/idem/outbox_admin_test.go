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

// TestOutboxAdminCommands: list, park, discard and retry on a SQLite
// outbox holding a failing row with a hostile error, a healthy row and a
// row of a key a relay holds.
func TestOutboxAdminCommands(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "outbox.db")
	db, drv := testenv.SQLite(t, path, nil)
	addToOutbox(t, db, drv, "a", "b", "c")
	if err := drv.OutboxFailed(ctx, "relay-1", 1, "no stream covers \x1b[2Jcredits", time.Hour); err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{dsnEnv: path, "USER": "alice"}
	cli := func(want int, args ...string) string {
		t.Helper()
		code, out, errOut := runCLIEnv(t, vars, args...)
		if code != want {
			t.Fatalf("idem %s: exit %d, want %d\n%s%s", strings.Join(args, " "), code, want, out, errOut)
		}
		return out + errOut
	}

	out := cli(exitOK, "outbox", "list")
	for _, want := range []string{"1   failing  credits  msg:a  1", `no stream covers \x1b[2Jcredits`, "3 rows unpublished (2 pending, 1 failing, 0 parked)."} {
		if !strings.Contains(out, want) {
			t.Fatalf("outbox list lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "\x1b") {
		t.Fatalf("outbox list printed a raw escape:\n%q", out)
	}
	var page outboxListJSON
	if err := json.Unmarshal([]byte(cli(exitOK, "outbox", "list", "--state", "failing", "--json")), &page); err != nil {
		t.Fatal(err)
	}
	if len(page.Rows) != 1 || page.Rows[0].ID != 1 || page.Rows[0].LastError != "no stream covers \x1b[2Jcredits" || page.Rows[0].HeldUntil == nil || page.Counts.Failing != 1 {
		t.Fatalf("list --state failing --json: %+v", page)
	}
	if out := cli(exitOK, "outbox", "list", "--limit", "2"); !strings.Contains(out, "more match; the next page: --after 2") {
		t.Fatalf("a cut list does not say how to go on:\n%s", out)
	}

	if out := cli(exitOK, "outbox", "park", "1", "--reason", "typo in the subject"); !strings.Contains(out, "parked 1 row: 1.") {
		t.Fatalf("park:\n%s", out)
	}
	out = cli(exitOK, "outbox", "list", "--state", "parked")
	if !strings.Contains(out, "parked by alice: typo in the subject") {
		t.Fatalf("list --state parked:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "stats"); !strings.Contains(out, "parked          1") || !strings.Contains(out, "failing         0") {
		t.Fatalf("stats after a park:\n%s", out)
	}

	// Discard lists what it would delete and does nothing without --yes.
	out = cli(exitUsage, "outbox", "discard", "1", "3")
	if !strings.Contains(out, "add --yes to discard these 2 rows") || !strings.Contains(out, "msg:c") {
		t.Fatalf("discard without --yes:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "list", "--json"); !strings.Contains(out, `"id": 1`) {
		t.Fatalf("discard without --yes deleted row 1:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "discard", "1", "--yes", "--actor", "bob", "--reason", "sent twice"); !strings.Contains(out, "discarded 1 row: 1.") {
		t.Fatalf("discard --yes:\n%s", out)
	}
	if out := cli(exitFailed, "outbox", "discard", "1", "--yes"); !strings.Contains(out, "not found or published: 1") {
		t.Fatalf("second discard:\n%s", out)
	}
	var log []string
	rows, err := db.Query(`SELECT outbox_id || ' ' || action || ' ' || actor || ' ' || reason FROM idem_outbox_log ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		log = append(log, s)
	}
	rows.Close()
	if strings.Join(log, "|") != "1 park alice typo in the subject|1 discard bob sent twice" {
		t.Fatalf("outbox log: %q", log)
	}

	// A key a relay holds is busy; a failing row is retried with --all-failing.
	claimed, _, err := drv.OutboxClaim(ctx, "relay-2", 1, 0, time.Hour)
	if err != nil || len(claimed) != 1 || claimed[0].ID != 2 {
		t.Fatalf("claim: %+v, %v", claimed, err)
	}
	if out := cli(exitFailed, "outbox", "park", "2", "3"); !strings.Contains(out, "parked 1 row: 3.") || !strings.Contains(out, "busy, a relay is publishing their key: 2") {
		t.Fatalf("park of a claimed row:\n%s", out)
	}
	if err := drv.OutboxFailed(ctx, "relay-2", 2, "refused", time.Hour); err != nil {
		t.Fatal(err)
	}
	if out := cli(exitUsage, "outbox", "retry", "--all-failing"); !strings.Contains(out, "add --yes to retry these 1 row") && !strings.Contains(out, "add --yes to retry these 1 rows") {
		t.Fatalf("retry --all-failing without --yes:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "retry", "--all-failing", "--yes"); !strings.Contains(out, "retried 1 row: 2.") {
		t.Fatalf("retry --all-failing --yes:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "list", "--key", "msg:b", "--json"); strings.Contains(out, "held_until") {
		t.Fatalf("a retried row is still held:\n%s", out)
	}
	if out := cli(exitFailed, "outbox", "retry", "99"); !strings.Contains(out, "not found or published: 99") {
		t.Fatalf("retry of an unknown row:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "retry", "3"); !strings.Contains(out, "retried 1 row: 3.") {
		t.Fatalf("retry of a parked row:\n%s", out)
	}
}

// TestOutboxAdminUsage: misplaced flags and missing arguments are usage
// errors, before any database is opened.
func TestOutboxAdminUsage(t *testing.T) {
	t.Parallel()
	vars := map[string]string{dsnEnv: filepath.Join(t.TempDir(), "missing.db")}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"outbox", "list", "5"}, "list takes no IDs"},
		{[]string{"outbox", "list", "--state", "stuck"}, `--state "stuck"`},
		{[]string{"outbox", "list", "--limit", "0"}, "--limit 0"},
		{[]string{"outbox", "park"}, "park needs row IDs"},
		{[]string{"outbox", "park", "x"}, `row ID "x"`},
		{[]string{"outbox", "park", "1", "--yes"}, "--yes does not apply to outbox park"},
		{[]string{"outbox", "retry"}, "row IDs or --all-failing"},
		{[]string{"outbox", "retry", "1", "--all-failing"}, "row IDs or --all-failing"},
		{[]string{"outbox", "retry", "1", "--stream", "s"}, "go with --all-failing"},
		{[]string{"outbox", "discard"}, "discard needs row IDs"},
		{[]string{"outbox", "stats", "--state", "failing"}, "--state belongs to outbox list"},
	} {
		code, _, errOut := runCLIEnv(t, vars, tc.args...)
		if code != exitUsage || !strings.Contains(errOut, tc.want) {
			t.Errorf("idem %s: exit %d, want %d with %q:\n%s", strings.Join(tc.args, " "), code, exitUsage, tc.want, errOut)
		}
	}
}
