package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// testDLQGroupPreview parks 100 dead letters of billing and 20 of mailer
// that share one fingerprint, and 3 more of billing in another group, in
// the store dl, which idem reaches with vars and the store flags in
// flags. A replay or discard of the group without --yes changes nothing
// and says how many dead letters it selects, all of them and not the 100
// it lists, and that they belong to two handlers, naming each; with
// --handler it selects that handler's only, and --yes then moves the
// number the preview announced.
func testDLQGroupPreview(t *testing.T, dl driver.DeadLetterStore, vars map[string]string, flags ...string) {
	t.Helper()
	ctx := context.Background()
	// Pages of 7: the count reads the selection a page after another.
	page := dlqCountPage
	dlqCountPage = 7
	t.Cleanup(func() { dlqCountPage = page })
	put := func(handler, fp string, n int) {
		t.Helper()
		for i := range n {
			if _, err := dl.DeadLetterPut(ctx, &driver.DeadLetter{Handler: handler, MessageID: fmt.Sprintf("%s-%s-%d", handler, fp, i),
				Error: "order not found", Class: idem.DeadLetterPermanent, Fingerprint: fp, Attempts: 1}); err != nil {
				t.Fatal(err)
			}
		}
	}
	put("billing", "order-missing", 100)
	put("mailer", "order-missing", 20)
	put("billing", "other", 3)
	run := func(want int, args ...string) (string, string) {
		t.Helper()
		code, out, errOut := runCLIEnv(t, vars, append(args, flags...)...)
		if code != want {
			t.Fatalf("idem %s: exit %d, want %d\n%s%s", strings.Join(args, " "), code, want, out, errOut)
		}
		return out, errOut
	}
	parked := func() map[string]int {
		t.Helper()
		dls, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{State: driver.DeadLetterParked, Summary: true})
		if err != nil {
			t.Fatal(err)
		}
		n := map[string]int{}
		for _, d := range dls {
			n[d.Handler+"/"+d.Fingerprint]++
		}
		return n
	}

	for _, sub := range []string{"replay", "discard"} {
		out, errOut := run(exitUsage, "dlq", sub, "--group", "order-missing")
		if !strings.Contains(out, "120 parked dead letters to "+sub+", of 2 handlers: billing (100), mailer (20).") ||
			!strings.Contains(out, "The oldest 100 of them are listed above.") ||
			!strings.Contains(errOut, "nothing done: the selection spans 2 handlers") || !strings.Contains(errOut, "the 120 dead letters selected") {
			t.Errorf("dlq %s --group order-missing does not announce the 120 dead letters of both handlers:\n%s%s", sub, out, errOut)
		}
		out, errOut = run(exitUsage, "dlq", sub, "--group", "order-missing", "--handler", "mailer")
		if !strings.Contains(out, "20 parked dead letters to "+sub+", of 1 handler: mailer (20).") || strings.Contains(out, "billing") ||
			!strings.Contains(errOut, "add --yes to "+sub+" the 20 dead letters selected") {
			t.Errorf("dlq %s --group order-missing --handler mailer:\n%s%s", sub, out, errOut)
		}
		out, _ = run(exitUsage, "dlq", sub, "--all", "--limit", "2")
		if !strings.Contains(out, "2 parked dead letters to "+sub+", of 1 handler: billing (2).") {
			t.Errorf("dlq %s --all --limit 2 does not announce the oldest two:\n%s", sub, out)
		}
	}
	if got := parked(); got["billing/order-missing"] != 100 || got["mailer/order-missing"] != 20 || got["billing/other"] != 3 {
		t.Fatalf("previews changed dead letters: parked %v", got)
	}
	if out, _ := run(exitOK, "dlq", "replay", "--group", "order-missing", "--handler", "mailer", "--yes"); !strings.Contains(out, "20 dead letters marked for replay") {
		t.Errorf("replay of mailer's group: %q", out)
	}
	if got := parked(); got["billing/order-missing"] != 100 || got["mailer/order-missing"] != 0 || got["billing/other"] != 3 {
		t.Fatalf("after the replay of mailer's group: parked %v", got)
	}
	if out, _ := run(exitOK, "dlq", "discard", "--group", "order-missing", "--yes"); !strings.Contains(out, "100 dead letters discarded") {
		t.Errorf("discard of the group: %q", out)
	}
	if got := parked(); len(got) != 1 || got["billing/other"] != 3 {
		t.Fatalf("after the discard of the group: parked %v", got)
	}
}

// TestDLQGroupPreviewSQLite: see testDLQGroupPreview.
func TestDLQGroupPreviewSQLite(t *testing.T) {
	path := filepath.Join(t.TempDir(), "dlq.db")
	_, drv := testenv.SQLite(t, path, nil)
	testDLQGroupPreview(t, drv, map[string]string{dsnEnv: path})
}

// TestDLQGroupPreviewPostgres: see testDLQGroupPreview.
func TestDLQGroupPreviewPostgres(t *testing.T) {
	schema, drv := migratedSchema(t)
	testDLQGroupPreview(t, drv, map[string]string{dsnEnv: testenv.PostgresDSN()}, "--schema", schema)
}

// TestDLQGroupPreviewMySQL: see testDLQGroupPreview.
func TestDLQGroupPreviewMySQL(t *testing.T) {
	dsn, drv := mysqlURL(t)
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	testDLQGroupPreview(t, drv, map[string]string{dsnEnv: dsn})
}

// TestDLQGroupPreviewRedis: see testDLQGroupPreview.
func TestDLQGroupPreviewRedis(t *testing.T) {
	client, prefix := testenv.Redis(t)
	drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	testDLQGroupPreview(t, drv, map[string]string{dsnEnv: "redis://" + client.Options().Addr + "/0"}, "--prefix", prefix)
}

// TestDLQRefusesFlagsItWouldIgnore: a dlq subcommand refuses the flags of
// the others instead of ignoring them. replay --json printed text where a
// script expected JSON (and replayed), list --all listed the parked ones
// only.
func TestDLQRefusesFlagsItWouldIgnore(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "dlq.db")
	_, drv := testenv.SQLite(t, path, nil)
	for i := 1; i <= 2; i++ {
		if _, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: fmt.Sprintf("m-%d", i), Error: "boom", Class: idem.DeadLetterPermanent, Attempts: 1}); err != nil {
			t.Fatal(err)
		}
	}
	vars := map[string]string{dsnEnv: path}
	for _, args := range [][]string{
		{"dlq", "replay", "--all", "--yes", "--json"},
		{"dlq", "discard", "1", "--json"},
		{"dlq", "list", "--all"},
		{"dlq", "list", "--yes"},
		{"dlq", "show", "1", "--actor", "bob"},
	} {
		code, out, errOut := runCLIEnv(t, vars, args...)
		if code != exitUsage || !strings.Contains(errOut, "does not apply to dlq "+args[1]) {
			t.Errorf("idem %s: exit %d, want %d naming the flag\n%s%s", strings.Join(args, " "), code, exitUsage, out, errOut)
		}
	}
	dls, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dls {
		if d.State != driver.DeadLetterParked {
			t.Errorf("dead letter %d is %s after refused commands, want parked", d.ID, d.State)
		}
	}
}

// TestDLQShowJSONWithCorruptEnvelope: show --json prints a dead letter
// whose stored envelope is not JSON, the envelope as envelope_bytes; it
// failed with a marshalling error and printed nothing, so the one dead
// letter an operator most needed to read could not be read as JSON.
func TestDLQShowJSONWithCorruptEnvelope(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "dlq.db")
	_, drv := testenv.SQLite(t, path, nil)
	envelope := []byte(`{"ID":"m-1","Payload":`)
	id, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: "m-1", Envelope: envelope, Raw: []byte("raw"),
		Error: "boom", Class: idem.DeadLetterPermanent, Attempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: path}, "dlq", "show", fmt.Sprint(id), "--json")
	var got map[string]any
	if code != exitOK || json.Unmarshal([]byte(out), &got) != nil {
		t.Fatalf("dlq show --json: exit %d, want %d and JSON\n%s%s", code, exitOK, out, errOut)
	}
	if got["envelope_bytes"] != base64.StdEncoding.EncodeToString(envelope) || got["envelope"] != nil || got["message_id"] != "m-1" {
		t.Errorf("dlq show --json: %s", out)
	}
}
