package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// tableValue returns the value printed on the demo table row label.
func tableValue(t *testing.T, out, label string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^  ` + regexp.QuoteMeta(label) + ` +(\S+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("output has no %q row:\n%s", label, out)
	}
	return m[1]
}

// TestDemoVerifies checks that a small demo run exits 0 with the OK line and the expected counts.
func TestDemoVerifies(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "demo", "--events", "3000", "--accounts", "50")
	if code != exitOK {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if !strings.Contains(out, "verification: OK — every balance matches the unique intended events") {
		t.Errorf("no OK verification line:\n%s", out)
	}
	for label, want := range map[string]string{
		"events intended":  "3000",
		"applied":          "3000",
		"markers stored":   "3000",
		"conflicts":        "5",
		"accounts checked": "50",
		"mismatches":       "0",
	} {
		if got := tableValue(t, out, label); got != want {
			t.Errorf("%s = %s, want %s", label, got, want)
		}
	}
	if got := tableValue(t, out, "duplicates skipped"); got == "0" {
		t.Errorf("no duplicates were skipped; the stream should redeliver:\n%s", out)
	}
}

// TestDemoReportsInjectedConflicts checks that every injected conflict is reported once and never applied.
func TestDemoReportsInjectedConflicts(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "demo", "--events", "3000", "--accounts", "50", "--conflicts", "3", "--seed", "7")
	if code != exitOK {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if got := tableValue(t, out, "conflicts"); got != "3" {
		t.Errorf("conflicts = %s, want 3\n%s", got, out)
	}
	if got := tableValue(t, out, "applied"); got != "3000" {
		t.Errorf("applied = %s, want 3000", got)
	}
	if !strings.Contains(out, "verification: OK") {
		t.Errorf("no OK verification line:\n%s", out)
	}
}

// TestDemoPlainProgressWhenNotATerminal checks that output to a buffer gets plain progress lines, not a redrawn bar.
func TestDemoPlainProgressWhenNotATerminal(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "demo", "--events", "2000", "--accounts", "20", "--batch", "50")
	if code != exitOK {
		t.Fatalf("exit %d, want 0\nstderr:\n%s", code, errOut)
	}
	if strings.Contains(out, "\r") {
		t.Errorf("output to a non-terminal contains carriage returns:\n%q", out)
	}
	lines := regexp.MustCompile(`(?m)^progress: +\d+%`).FindAllString(out, -1)
	if len(lines) < 5 {
		t.Errorf("got %d plain progress lines, want one per tenth:\n%s", len(lines), out)
	}
	if !regexp.MustCompile(`(?m)^progress: 100%`).MatchString(out) {
		t.Errorf("no 100%% progress line:\n%s", out)
	}
}

// TestDemoEdgeCases runs the demo with extreme sizes: one event, one worker, huge batches, no duplicates.
func TestDemoEdgeCases(t *testing.T) {
	t.Parallel()
	tests := [][]string{
		{"--events", "1", "--accounts", "1", "--conflicts", "1"},
		{"--events", "500", "--accounts", "10", "--workers", "1", "--batch", "7", "--broker", "none"},
		{"--events", "500", "--accounts", "900", "--workers", "6", "--batch", "1000", "--dup-rate", "1", "--broker", "none"},
		{"--events", "500", "--accounts", "10", "--dup-rate", "0", "--conflicts", "0"},
	}
	for _, args := range tests {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			t.Parallel()
			code, out, errOut := runCLI(t, append([]string{"demo"}, args...)...)
			if code != exitOK || !strings.Contains(out, "verification: OK") {
				t.Fatalf("exit %d, want 0 and OK\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
			}
		})
	}
}

// TestDemoKeepsDatabaseAndRefusesToReuseIt checks --db: the file is kept, and a second run on it is refused.
func TestDemoKeepsDatabaseAndRefusesToReuseIt(t *testing.T) {
	t.Parallel()
	db := filepath.Join(t.TempDir(), "kept.db")
	code, out, errOut := runCLI(t, "demo", "--events", "200", "--accounts", "5", "--db", db)
	if code != exitOK {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if _, err := os.Stat(db); err != nil {
		t.Fatalf("--db file not kept: %v", err)
	}
	code, _, errOut = runCLI(t, "demo", "--events", "200", "--db", db)
	if code != exitUsage || !strings.Contains(errOut, "already exists") {
		t.Errorf("second run on the same --db: exit %d, want %d with \"already exists\"; stderr: %s", code, exitUsage, errOut)
	}
}

// TestDemoFlagErrors checks that out-of-range demo flags are usage errors.
func TestDemoFlagErrors(t *testing.T) {
	t.Parallel()
	tests := map[string][]string{
		"--events must be at least 1":    {"--events", "0"},
		"--accounts must be at least 1":  {"--accounts", "0"},
		"--workers must be at least 1":   {"--workers", "0"},
		"--batch must be at least 1":     {"--batch", "-3"},
		"--dup-rate must be between":     {"--dup-rate", "1.5"},
		"--conflicts must be between 0":  {"--events", "10", "--conflicts", "11"},
		"--conflicts must be between 0 ": {"--conflicts", "-1"},
		"--lease runs over a broker":     {"--lease", "--broker", "none"},
		"--shuffle hands the reordered":  {"--shuffle", "--broker", "kafka"},
	}
	for want, args := range tests {
		t.Run(want, func(t *testing.T) {
			t.Parallel()
			code, _, errOut := runCLI(t, append([]string{"demo"}, args...)...)
			if code != exitUsage || !strings.Contains(errOut, strings.TrimSpace(want)) {
				t.Errorf("exit %d, want %d with %q; stderr: %s", code, exitUsage, want, errOut)
			}
		})
	}
}

// TestDemoFlagsOfAnotherMode: a flag the chosen demo does not read is a
// usage error naming it, where the demo ran without it (--workers over a
// broker, whose three consumers it never sized); and --conflicts, which
// --lease and --shuffle do not read, no longer refuses their small
// --events with its default of 5.
func TestDemoFlagsOfAnotherMode(t *testing.T) {
	for _, args := range [][]string{
		{"--workers", "8"},
		{"--broker", "kafka", "--window", "8"},
		{"--broker", "none", "--window", "8"},
		{"--shuffle", "--conflicts", "2"},
		{"--shuffle", "--batch", "10"},
		{"--lease", "--accounts", "10"},
		{"--lease", "--workers", "2"},
	} {
		code, _, errOut := runCLI(t, append([]string{"demo", "--events", "20"}, args...)...)
		if code != exitUsage || !strings.Contains(errOut, "--"+strings.TrimPrefix(args[len(args)-2], "--")+" does not apply") {
			t.Errorf("demo %s: exit %d, want %d naming the flag; stderr: %s", strings.Join(args, " "), code, exitUsage, errOut)
		}
	}
	for _, args := range [][]string{{"--shuffle", "--events", "3"}, {"--lease", "--events", "3"}} {
		code, out, errOut := runCLI(t, append([]string{"demo"}, args...)...)
		if code != exitOK || !strings.Contains(out, "verification: OK") {
			t.Errorf("demo %s: exit %d, want 0 and OK\n%s%s", strings.Join(args, " "), code, out, errOut)
		}
	}
}

// TestDemoInterrupted checks that a cancelled context ends the demo with exit 1.
func TestDemoInterrupted(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var out, errOut bytes.Buffer
	e := &env{stdout: &out, stderr: &errOut, getenv: func(string) string { return "" }}
	code := runEnv(ctx, e, []string{"demo", "--events", "1000"})
	if code != exitFailed {
		t.Errorf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitFailed, out.String(), errOut.String())
	}
}

// TestDemoStreamShape checks the delivered stream: counts, conflict ordering, bursts and determinism.
func TestDemoStreamShape(t *testing.T) {
	t.Parallel()
	cfg := &demoConfig{events: 5000, dupRate: 0.2, conflicts: 20, accounts: 30, workers: 3, batch: 40, seed: 3}
	names := newDemoNames(cfg)
	events := demoEvents(cfg, names)
	s := buildDemoStream(cfg, names, events)

	intended := map[string]string{}
	for _, ev := range events {
		intended[ev.ID] = string(demoMessage(names, ev.ID, ev.Account, ev.Amount).Payload)
	}
	if len(intended) != cfg.events {
		t.Fatalf("%d unique IDs, want %d", len(intended), cfg.events)
	}
	firstBatch := map[string]int{}
	deliveries, conflicts, bursts := 0, 0, 0
	for bi, b := range s.batches {
		if b.copies < 1 || b.copies > 3 || b.copies > cfg.workers {
			t.Errorf("batch %d: %d copies", bi, b.copies)
		}
		if b.copies > 1 {
			bursts++
		}
		deliveries += len(b.msgs) * b.copies
		for _, dep := range b.deps {
			if dep >= bi {
				t.Errorf("batch %d depends on later batch %d", bi, dep)
			}
		}
		for _, m := range b.msgs {
			if _, seen := firstBatch[m.ID]; !seen {
				firstBatch[m.ID] = bi
				if string(m.Payload) != intended[m.ID] {
					t.Errorf("first delivery of %s carries a conflicting payload", m.ID)
				}
			}
			if string(m.Payload) == intended[m.ID] {
				continue
			}
			conflicts++
			if b.copies != 1 {
				t.Errorf("conflicting delivery %s is in a burst", m.ID)
			}
			if fb := firstBatch[m.ID]; fb != bi && !slices.Contains(b.deps, fb) {
				t.Errorf("conflicting delivery %s in batch %d does not wait for batch %d", m.ID, bi, fb)
			}
		}
	}
	if deliveries != s.deliveries {
		t.Errorf("batches hold %d deliveries, stream says %d", deliveries, s.deliveries)
	}
	if want := cfg.events + 1000 + cfg.conflicts + s.burstExtra; deliveries != want {
		t.Errorf("%d deliveries, want %d", deliveries, want)
	}
	if conflicts != cfg.conflicts || len(s.conflictIDs) != cfg.conflicts {
		t.Errorf("%d conflicting deliveries over %d IDs, want %d", conflicts, len(s.conflictIDs), cfg.conflicts)
	}
	if bursts == 0 || bursts != s.burstBatches {
		t.Errorf("%d burst batches, stream says %d; want some", bursts, s.burstBatches)
	}

	// The same seed gives the same stream.
	again := buildDemoStream(cfg, names, demoEvents(cfg, names))
	if len(again.batches) != len(s.batches) {
		t.Fatalf("second build: %d batches, want %d", len(again.batches), len(s.batches))
	}
	for bi := range s.batches {
		a, b := s.batches[bi], again.batches[bi]
		if a.copies != b.copies || len(a.msgs) != len(b.msgs) {
			t.Fatalf("batch %d differs between builds", bi)
		}
		for i := range a.msgs {
			if a.msgs[i].ID != b.msgs[i].ID || !bytes.Equal(a.msgs[i].Payload, b.msgs[i].Payload) {
				t.Fatalf("batch %d message %d differs between builds", bi, i)
			}
		}
	}
}

// TestDemoReportFailsOnMismatch checks that balance mismatches fail verification and at most ten are listed.
func TestDemoReportFailsOnMismatch(t *testing.T) {
	t.Parallel()
	cfg := &demoConfig{events: 10}
	s := &demoStream{deliveries: 12, conflicts: 1, conflictIDs: map[string]bool{"evt-000003": true}}
	c := &demoCounts{conflictIDs: map[string]int{"evt-000003": 1}}
	c.applied.Store(10)
	c.duplicates.Store(1)
	c.conflicts.Store(1)
	v := &demoVerification{accountsChecked: 20, markers: 10}
	for i := range 12 {
		v.mismatches = append(v.mismatches, newDemoNames(&demoConfig{accounts: 20, events: 10}).account(i)+": got 2, want 1")
	}
	var out bytes.Buffer
	if printDemoReport(&out, cfg, s, c, v, time.Second) {
		t.Fatalf("report passed with mismatches:\n%s", out.String())
	}
	line := regexp.MustCompile(`(?m)^verification: FAILED.*$`).FindString(out.String())
	if line == "" {
		t.Fatalf("no FAILED line:\n%s", out.String())
	}
	if n := strings.Count(line, "got 2, want 1"); n != demoShowMismatches {
		t.Errorf("FAILED line lists %d accounts, want %d: %s", n, demoShowMismatches, line)
	}
	if !strings.Contains(line, "2 more") {
		t.Errorf("FAILED line does not say how many more: %s", line)
	}
}

// TestDemoReportFailsOnWrongCounts checks that a double apply or a missing conflict fails verification.
func TestDemoReportFailsOnWrongCounts(t *testing.T) {
	t.Parallel()
	cfg := &demoConfig{events: 10}
	s := &demoStream{deliveries: 12, conflicts: 2, conflictIDs: map[string]bool{"evt-000001": true, "evt-000002": true}}
	c := &demoCounts{conflictIDs: map[string]int{"evt-000001": 1}}
	c.applied.Store(11) // one double apply
	c.duplicates.Store(0)
	c.conflicts.Store(1)
	v := &demoVerification{accountsChecked: 3, markers: 10}
	var out bytes.Buffer
	if printDemoReport(&out, cfg, s, c, v, time.Second) {
		t.Fatalf("report passed with wrong counts:\n%s", out.String())
	}
	for _, want := range []string{"applied 11 deliveries, want 10", "1 conflicts reported, want the 2 injected"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
}

// TestDemoCountsRejectUnknownOutcome checks that an outcome other than applied, duplicate or conflict is an error.
func TestDemoCountsRejectUnknownOutcome(t *testing.T) {
	t.Parallel()
	c := &demoCounts{conflictIDs: map[string]int{}}
	err := c.add([]*idem.Message{{ID: "a"}}, []idem.Outcome{idem.OutcomeNone})
	if err == nil {
		t.Fatal("OutcomeNone was counted without an error")
	}
}

// TestDemoShuffle runs the ordering demo with heavy reordering: the guard
// holds early events and the order-sensitive verification passes.
func TestDemoShuffle(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "demo", "--shuffle", "--events", "2000", "--accounts", "10", "--window", "16", "--workers", "2")
	if code != exitOK {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if !strings.Contains(out, "verification: OK") {
		t.Fatalf("no OK line:\n%s", out)
	}
	m := regexp.MustCompile(`early, held and retried\s+(\d+)`).FindStringSubmatch(out)
	if m == nil || m[1] == "0" {
		t.Fatalf("the guard held nothing; the test does not exercise it:\n%s", out)
	}
}

// TestDemoShuffleDetectsMisorder turns the guard off: the same stream then
// applies events out of order, and the order checksum must catch it.
func TestDemoShuffleDetectsMisorder(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	cfg := &demoConfig{events: 2000, accounts: 10, workers: 2, batch: 1, window: 16, dupRate: 0.1, seed: 1, shuffle: true, noGuard: true}
	err := runShuffleDemo(context.Background(), &env{stdout: &out, stderr: io.Discard, getenv: func(string) string { return "" }}, cfg)
	if err == nil || !strings.Contains(out.String(), "verification: FAILED") {
		t.Fatalf("without the guard the verification must fail; err=%v\n%s", err, out.String())
	}
}

// TestDemoOverNATSKillsConsumers runs the default demo: an embedded
// JetStream server, three consumers, two killed mid-stream; the balances
// must still verify exactly.
func TestDemoOverNATSKillsConsumers(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "demo", "--events", "2000", "--accounts", "20", "--conflicts", "2")
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	for _, want := range []string{"embedded NATS JetStream server", "consumers killed                2", "dead-lettered                   2", "verification: OK"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// TestDemoOverKafkaCrashesMembers runs the demo over the in-process Kafka
// cluster: two group members crash before committing, and the balances
// still verify exactly.
func TestDemoOverKafkaCrashesMembers(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "demo", "--broker", "kafka", "--events", "2000", "--accounts", "20", "--conflicts", "2")
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	for _, want := range []string{"in-process Kafka-protocol cluster", "consumers killed                2", "dead-lettered                   2", "verification: OK"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// TestDemoOverRabbitMQ runs the demo over the RabbitMQ server at
// IDEM_RABBITMQ_URL: two consumers have their TCP connections cut, and the
// balances still verify exactly.
func TestDemoOverRabbitMQ(t *testing.T) {
	t.Parallel()
	testenv.RabbitMQ(t) // skip loudly (or fail in CI) when it is down
	code, out, errOut := runCLI(t, "demo", "--broker", "rabbitmq", "--events", "2000", "--accounts", "20", "--conflicts", "2")
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, out, errOut)
	}
	for _, want := range []string{"RabbitMQ server at", "consumers killed                2", "dead-lettered                   2", "verification: OK"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// TestDemoLease runs the lease-mode demo over the brokers: two consumers
// killed, a tenth of the signups published twice, a mail service refusing
// some calls; every signup must get exactly one email.
func TestDemoLease(t *testing.T) {
	t.Parallel()
	for _, broker := range []string{"nats", "kafka", "rabbitmq"} {
		t.Run(broker, func(t *testing.T) {
			t.Parallel()
			if broker == "rabbitmq" {
				testenv.RabbitMQ(t)
			}
			code, out, errOut := runCLI(t, "demo", "--lease", "--broker", broker, "--events", "600")
			if code != exitOK {
				t.Fatalf("exit %d\n%s%s", code, out, errOut)
			}
			for _, want := range []string{"consumers killed                2", "emails sent                   600", "wrong email counts              0", "verification: OK"} {
				if !strings.Contains(out, want) {
					t.Errorf("output lacks %q:\n%s", want, out)
				}
			}
		})
	}
}

// TestDemoLeaseCheckCatchesWrongCounts: a second email, a missing one and
// one for no signup are each reported.
func TestDemoLeaseCheckCatchesWrongCounts(t *testing.T) {
	sent := map[string]int{"signup-000000": 1, "signup-000001": 2, "signup-000009": 1}
	wrong := checkEmails(sent, 3)
	want := []string{"signup-000001: 2 emails", "signup-000002: 0 emails", "signup-000009: 1 emails, for no signup"}
	if strings.Join(wrong, "|") != strings.Join(want, "|") {
		t.Fatalf("checkEmails = %q, want %q", wrong, want)
	}
	if wrong := checkEmails(map[string]int{"signup-000000": 1}, 1); len(wrong) != 0 {
		t.Fatalf("checkEmails of a correct run = %q, want nothing", wrong)
	}
}
