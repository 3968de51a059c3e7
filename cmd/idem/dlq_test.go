package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
)

// TestDLQReplayDiscardSelection: replay and discard apply --limit when it
// is given, refuse a --state other than parked (they move parked ones
// only), and take an ID named twice once; show refuses list's filters.
func TestDLQReplayDiscardSelection(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "dlq.db")
	_, drv := testenv.SQLite(t, path, nil)
	for i := 1; i <= 4; i++ {
		if _, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: fmt.Sprintf("m-%d", i), Error: "boom", Class: idem.DeadLetterPermanent, Attempts: 1}); err != nil {
			t.Fatal(err)
		}
	}
	env := map[string]string{dsnEnv: path}
	run := func(want int, args ...string) string {
		t.Helper()
		code, out, errOut := runCLIEnv(t, env, args...)
		if code != want {
			t.Fatalf("idem %s: exit %d, want %d\n%s%s", strings.Join(args, " "), code, want, out, errOut)
		}
		return out + errOut
	}
	states := func() string {
		t.Helper()
		dls, err := drv.DeadLetterList(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		var s []string
		for _, d := range dls {
			s = append(s, d.State)
		}
		return strings.Join(s, " ")
	}
	for _, args := range [][]string{
		{"dlq", "replay", "--all", "--state", "replayed"},
		{"dlq", "discard", "--all", "--state", "all"},
		{"dlq", "replay", "--all", "--limit", "-1"},
		{"dlq", "show", "1", "--limit", "5"},
		{"dlq", "show", "1", "--state", "all"},
		{"dlq", "replay", "1", "2", "--limit", "1"},
	} {
		if out := run(exitUsage, args...); !strings.Contains(out, "--") {
			t.Errorf("idem %s: %q, want the flag named", strings.Join(args, " "), out)
		}
	}
	if got := states(); got != "parked parked parked parked" {
		t.Fatalf("after refused commands: %s", got)
	}
	if out := run(exitOK, "dlq", "replay", "--all", "--limit", "1", "--yes"); !strings.Contains(out, "1 dead letter marked") {
		t.Errorf("replay --limit 1: %q", out)
	}
	if got := states(); got != "replay_requested parked parked parked" {
		t.Fatalf("after replay --all --limit 1: %s, want the oldest only", got)
	}
	if out := run(exitOK, "dlq", "discard", "2", "2"); !strings.Contains(out, "1 dead letter discarded") {
		t.Errorf("discard 2 2: %q", out)
	}
	run(exitOK, "dlq", "discard", "--all", "--state", "parked", "--limit", "1", "--yes")
	if got := states(); got != "replay_requested discarded discarded parked" {
		t.Fatalf("after the discards: %s", got)
	}
}

// TestStorePrefixDefaultsPerKind: without --prefix, SQL tables take idem_
// and Redis keys redisstore's idem:; a --prefix given is kept as is, on
// Redis too.
func TestStorePrefixDefaultsPerKind(t *testing.T) {
	for _, tc := range []struct {
		dsn, prefix, want string
	}{
		{"redis://127.0.0.1:6379/0", "", ""},
		{"redis://127.0.0.1:6379/0", "idem_", "idem_"},
		{"file:x.db", "", defaultPrefix},
		{"file:x.db", "app_", "app_"},
	} {
		tg, err := parseDSN(tc.dsn)
		if err != nil {
			t.Fatal(err)
		}
		o := storeOptions{Prefix: tc.prefix}
		if err := o.check(tg); err != nil {
			t.Fatal(err)
		}
		if o.Prefix != tc.want {
			t.Errorf("%s with prefix %q: %q, want %q", tc.dsn, tc.prefix, o.Prefix, tc.want)
		}
	}
}

// TestSubcommandHelp: --help after a subcommand prints the command's help
// and succeeds.
func TestSubcommandHelp(t *testing.T) {
	for _, args := range [][]string{{"dlq", "list", "--help"}, {"dlq", "replay", "-h"}, {"outbox", "stats", "--help"}} {
		code, out, errOut := runCLI(t, args...)
		if code != exitOK || !strings.HasPrefix(out, "Usage: idem "+args[0]) {
			t.Errorf("idem %s: exit %d, %q %q; want the help and exit 0", strings.Join(args, " "), code, out, errOut)
		}
	}
}

// TestDLQReadsNoBodies: 'dlq list', 'dlq replay' and the serve page read
// summaries, not the dead letters' envelopes and payloads, whose size has
// no bound: what they allocate stays well below the bodies' total.
func TestDLQReadsNoBodies(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "dlq.db")
	_, drv := testenv.SQLite(t, path, nil)
	const (
		n    = 6
		size = 4 << 20
	)
	body := []byte(strings.Repeat("x", size))
	env := []byte(`{"ID":"m","Payload":"` + strings.Repeat("A", size) + `"}`)
	for i := 1; i <= n; i++ {
		if _, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: fmt.Sprintf("m-%d", i), Envelope: env, Raw: body,
			Error: "boom", Class: idem.DeadLetterPermanent, Attempts: 1}); err != nil {
			t.Fatal(err)
		}
	}
	allocated := func(what string, f func()) {
		t.Helper()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		f()
		runtime.ReadMemStats(&after)
		if got := after.TotalAlloc - before.TotalAlloc; got > 2*size {
			t.Errorf("%s allocated %d MiB for %d dead letters of %d MiB; want less than one's bodies", what, got>>20, n, 2*size>>20)
		}
	}
	envs := map[string]string{dsnEnv: path}
	allocated("dlq list", func() {
		if code, out, errOut := runCLIEnv(t, envs, "dlq", "list"); code != exitOK || !strings.Contains(out, "m-6") {
			t.Fatalf("dlq list: exit %d\n%s%s", code, out, errOut)
		}
	})
	s, err := openStore(ctx, path, storeOptions{Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(newServeMux(ctx, s, 0, 5*time.Second))
	defer srv.Close()
	allocated("the console's groups and a group's page", func() {
		if code, page := get(t, srv.URL+"/"); code != http.StatusOK || !strings.Contains(page, "boom") {
			t.Fatalf("serve page: %d\n%s", code, page)
		}
		if code, page := get(t, srv.URL+"/dlq/group?handler=balances&fp="); code != http.StatusOK || !strings.Contains(page, "m-6") {
			t.Fatalf("serve group page: %d\n%s", code, page)
		}
	})
	allocated("dlq replay --all", func() {
		if code, out, errOut := runCLIEnv(t, envs, "dlq", "replay", "--all", "--yes"); code != exitOK || !strings.Contains(out, "6 dead letters marked") {
			t.Fatalf("dlq replay: exit %d\n%s%s", code, out, errOut)
		}
	})
}
