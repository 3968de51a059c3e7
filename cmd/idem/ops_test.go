package main

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata")

// golden compares got, with times, durations and the database path
// blanked, to testdata/name.golden.
func golden(t *testing.T, name, db, got string) {
	t.Helper()
	got = strings.ReplaceAll(got, db, "<DB>")
	got = regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z`).ReplaceAllString(got, "<TIME>")
	got = regexp.MustCompile(`\d+(\.\d+)?(ms|µs|s)\b`).ReplaceAllString(got, "<DUR>")
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./cmd/idem -run %s -update)", err, t.Name())
	}
	if got != string(want) {
		t.Errorf("%s differs from %s:\n--- got\n%s\n--- want\n%s", name, path, got, want)
	}
}

// TestOperatorCommandsGolden runs stats, dlq and cleanup against a
// database the demo filled (fixed seed, three conflicts) and compares each
// output, human and JSON, with its golden file.
func TestOperatorCommandsGolden(t *testing.T) {
	db := filepath.Join(t.TempDir(), "ops.db")
	if code, _, errOut := runCLI(t, "demo", "--events", "2000", "--accounts", "20", "--conflicts", "3", "--seed", "42", "--workers", "1", "--broker", "none", "--db", db); code != exitOK {
		t.Fatalf("demo: exit %d: %s", code, errOut)
	}
	steps := []struct {
		name string
		args []string
		code int
	}{
		{"stats", []string{"stats"}, exitOK},
		{"stats_json", []string{"stats", "--json"}, exitOK},
		{"dlq_list", []string{"dlq", "list"}, exitOK},
		{"dlq_list_json", []string{"dlq", "list", "--json"}, exitOK},
		{"dlq_list_since_days", []string{"dlq", "list", "--since", "7d"}, exitOK},
		{"dlq_show", []string{"dlq", "show", "2"}, exitOK},
		{"dlq_replay_needs_selection", []string{"dlq", "replay"}, exitUsage},
		{"dlq_replay_one", []string{"dlq", "replay", "1"}, exitOK},
		{"dlq_discard_all_needs_yes", []string{"dlq", "discard", "--all", "--handler", "demo.balances", "--actor", "bob"}, exitUsage},
		{"dlq_discard_handler", []string{"dlq", "discard", "--all", "--handler", "demo.balances", "--actor", "bob", "--yes"}, exitOK},
		{"dlq_show_history", []string{"dlq", "show", "2"}, exitOK},
		{"dlq_list_all_states", []string{"dlq", "list", "--state", "all"}, exitOK},
		{"dlq_list_empty", []string{"dlq", "list"}, exitOK},
		{"cleanup_dry_run", []string{"cleanup", "--dry-run"}, exitOK},
		{"cleanup_dry_run_json", []string{"cleanup", "--dry-run", "--json"}, exitOK},
		{"cleanup", []string{"cleanup", "--retention", "1ns"}, exitOK},
		{"stats_after_cleanup", []string{"stats"}, exitOK},
	}
	for _, st := range steps {
		code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: db}, st.args...)
		if code != st.code {
			t.Fatalf("idem %s: exit %d, want %d\n%s%s", strings.Join(st.args, " "), code, st.code, out, errOut)
		}
		golden(t, st.name, db, out+errOut)
	}
	// Selections that can match nothing, or would be dropped, are usage
	// errors, not an empty answer.
	for _, args := range [][]string{
		{"dlq", "list", "1"},
		{"dlq", "list", "--limit", "-1"},
		{"dlq", "list", "--since", "-24h"},
		{"dlq", "list", "--since", "2030-01-01T00:00:00Z", "--until", "2020-01-01T00:00:00Z"},
	} {
		if code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: db}, args...); code != exitUsage {
			t.Errorf("idem %s: exit %d, want %d\n%s%s", strings.Join(args, " "), code, exitUsage, out, errOut)
		}
	}
	// A replay or discard of named dead letters that changes none of them
	// fails: the operator asked for something that did not happen.
	for _, args := range [][]string{{"dlq", "replay", "999"}, {"dlq", "discard", "999"}} {
		if code, _, errOut := runCLIEnv(t, map[string]string{dsnEnv: db}, args...); code != exitFailed || !strings.Contains(errOut, "1 of the 1 dead letter named was not changed") {
			t.Errorf("idem %s: exit %d, stderr %q; want %d naming the unchanged one", strings.Join(args, " "), code, errOut, exitFailed)
		}
	}
	// Flags may follow the IDs, as the synopsis shows them.
	_, before, _ := runCLIEnv(t, map[string]string{dsnEnv: db}, "dlq", "show", "--json", "2")
	code, after, errOut := runCLIEnv(t, map[string]string{dsnEnv: db}, "dlq", "show", "2", "--json")
	if code != exitOK || after != before || !strings.HasPrefix(after, "{") {
		t.Fatalf("dlq show 2 --json: exit %d, %q%s; want what dlq show --json 2 printed, %q", code, after, errOut, before)
	}
}

func TestParseInterspersed(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		pos       []string
		json      bool
		handler   string
		wantError bool
	}{
		{args: []string{"1", "2"}, pos: []string{"1", "2"}},
		{args: []string{"--json", "1"}, pos: []string{"1"}, json: true},
		{args: []string{"1", "--json", "2", "--handler", "h"}, pos: []string{"1", "2"}, json: true, handler: "h"},
		{args: []string{"1", "--", "--json"}, pos: []string{"1", "--json"}},
		{args: []string{"--", "--json", "3"}, pos: []string{"--json", "3"}},
		{args: []string{"1", "--nope"}, wantError: true},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		json := fs.Bool("json", false, "")
		handler := fs.String("handler", "", "")
		pos, err := parseInterspersed(fs, tc.args)
		if (err != nil) != tc.wantError || !slices.Equal(pos, tc.pos) || *json != tc.json || *handler != tc.handler {
			t.Errorf("%q: %q, %v, json %v, handler %q; want %q, json %v, handler %q, error %v",
				tc.args, pos, err, *json, *handler, tc.pos, tc.json, tc.handler, tc.wantError)
		}
	}
}
