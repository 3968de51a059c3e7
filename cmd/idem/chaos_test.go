package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// TestChaos builds idem (without -race: a dozen instrumented processes
// would measure the race detector) and runs a seeded chaos run on each
// broker: every kind of process is SIGKILLed at random and restarted, and
// the run must verify every effect against the intended events and exit 0.
func TestChaos(t *testing.T) {
	t.Parallel() // so the tests after it run while TestMain's build goes on
	if testing.Short() {
		t.Skip("chaos runs take half a minute; skipped with -short")
	}
	testenv.PostgresPool(t, 1) // skips loudly, or fails under IDEM_REQUIRE_SERVICES=1
	bin := buildIdem(t)
	cases := []struct {
		broker, duration string
		kinds            []string
	}{
		{"nats", "30s", []string{"consumer", "relay", "node"}},
		{"kafka", "15s", []string{"consumer", "relay"}},
	}
	for _, c := range cases {
		t.Run(c.broker, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, "chaos", "--broker", c.broker, "--duration", c.duration, "--seed", "1",
				"--kill-every", "1s", "--rate", "50", "--drain-timeout", "3m", "--dsn", testenv.PostgresDSN())
			// Interrupted, the run stops its processes and drops its schema.
			cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
			cmd.WaitDelay = 30 * time.Second
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			err := cmd.Run()
			t.Logf("idem chaos --broker %s:\n%s", c.broker, out.String())
			if err != nil {
				t.Fatalf("idem chaos: %v", err)
			}
			if !strings.Contains(out.String(), "\nverification: OK") {
				t.Fatal("no 'verification: OK' in the summary")
			}
			kills := chaosKillCounts(t, out.String())
			for _, k := range c.kinds {
				if kills[k] == 0 {
					t.Errorf("no %s was killed (kills %v)", k, kills)
				}
			}
		})
	}
}

// chaosKillCounts reads the kills line of a chaos summary.
func chaosKillCounts(t *testing.T, out string) map[string]int {
	t.Helper()
	line := regexp.MustCompile(`(?m)^  kills +\d+: (.*)$`).FindStringSubmatch(out)
	if line == nil {
		t.Fatal("no kills line in the summary")
	}
	kills := map[string]int{}
	for _, m := range regexp.MustCompile(`(consumer|relay|node) (\d+)`).FindAllStringSubmatch(line[1], -1) {
		kills[m[1]], _ = strconv.Atoi(m[2])
	}
	return kills
}

// TestMain starts building the idem binary TestChaos runs before any test
// does, when TestChaos is to run: without -race, nothing of the test
// binary's build is reused, and on a cold build cache the build takes
// minutes, which the package's other tests now overlap.
func TestMain(m *testing.M) {
	flag.Parse()
	var dir string
	if !testing.Short() && runsTest("TestChaos") {
		var err error
		if dir, err = os.MkdirTemp("", "idem-chaos-bin-"); err == nil {
			go chaosBin.build(filepath.Join(dir, "idem"))
		} else {
			chaosBin.fail(err)
		}
	} else {
		chaosBin.fail(errors.New("idem was not built: -short, or -run does not select TestChaos"))
	}
	code := m.Run()
	<-chaosBin.done // the build writes into dir until it ends
	if dir != "" {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

// runsTest reports whether the -run pattern selects the top-level test
// name.
func runsTest(name string) bool {
	f := flag.Lookup("test.run")
	if f == nil || f.Value.String() == "" {
		return true
	}
	top, _, _ := strings.Cut(f.Value.String(), "/")
	ok, err := regexp.MatchString(top, name)
	return err != nil || ok // a pattern that does not compile fails the run anyway
}

// chaosBin is the idem binary TestMain builds for TestChaos.
var chaosBin = &binBuild{done: make(chan struct{})}

// binBuild is a build of this command that tests wait for.
type binBuild struct {
	done chan struct{} // closed when path or err is set
	path string
	err  error
}

// build runs go build into path.
func (b *binBuild) build(path string) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	}
	out, err := exec.Command(goBin, "build", "-o", path, ".").CombinedOutput()
	if err != nil {
		b.fail(fmt.Errorf("go build: %w\n%s", err, out))
		return
	}
	b.path = path
	close(b.done)
}

func (b *binBuild) fail(err error) {
	b.err = err
	close(b.done)
}

// buildIdem returns the idem binary TestMain is building, once built.
func buildIdem(t *testing.T) string {
	t.Helper()
	select {
	case <-chaosBin.done:
	case <-time.After(15 * time.Minute):
		t.Fatal("go build of idem did not end within 15 minutes")
	}
	if chaosBin.err != nil {
		t.Fatal(chaosBin.err)
	}
	return chaosBin.path
}

// TestChaosVerifyCatches checks that the run's verification fails on what
// it is there to catch: a balance applied twice, an account applied out of
// order, an event the sink never saw, a sink key of no event, a dead letter
// and an unpublished outbox row.
func TestChaosVerifyCatches(t *testing.T) {
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	sink, err := newChaosSink()
	if err != nil {
		t.Fatal(err)
	}
	defer sink.close()
	h := &chaosHarness{cfg: &chaosConfig{}, pool: pool, drv: drv, schema: schema, tables: newChaosTables(schema),
		sink: sink, procs: &chaosProcs{}}
	for _, q := range h.tables.ddl() {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	h.events = []chaosEvent{
		{id: "e1", account: "a", amount: 5, seq: 1},
		{id: "e2", account: "a", amount: 7, seq: 2},
		{id: "e3", account: "b", amount: -3, seq: 1},
	}
	call := func(id string) {
		sink.mu.Lock()
		key := idem.IdempotencyKey(chaosSinkHandler, id)
		sink.keys[key] = &chaosKey{calls: 1, effects: 1, token: 1}
		sink.applied++
		sink.mu.Unlock()
	}
	sqlExec := func(q string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, q, args...); err != nil {
			t.Fatal(err)
		}
	}
	// Right: every event applied once, in order; the sink saw each.
	sqlExec(`INSERT INTO ` + h.tables.balances + ` VALUES ('a', 12, 2), ('b', -3, 1)`)
	sqlExec(`INSERT INTO ` + h.tables.ordered + ` VALUES ('a', 2, 2, 0), ('b', 1, 1, 0)`)
	for _, ev := range h.events {
		call(ev.id)
	}
	res := &chaosResult{events: len(h.events)}
	if err := h.verify(ctx, res); err != nil {
		t.Fatal(err)
	}
	if len(res.problems) != 0 {
		t.Fatalf("a right state fails verification: %v", res.problems)
	}

	// Wrong: e2 applied twice, b out of order, e3 missing at the sink
	// and a stray key there, a dead letter, a pending outbox row.
	sqlExec(`UPDATE ` + h.tables.balances + ` SET amount = 19, n = 3 WHERE account = 'a'`)
	sqlExec(`UPDATE ` + h.tables.ordered + ` SET bad = 1 WHERE account = 'b'`)
	sink.mu.Lock()
	delete(sink.keys, idem.IdempotencyKey(chaosSinkHandler, "e3"))
	sink.mu.Unlock()
	call("e9")
	consumer, err := idem.NewConsumer(mustProcessor(t, drv), &idem.Handler[postgres.Tx]{Name: "x", Apply: func(context.Context, postgres.Tx, *idem.Message) error {
		return idem.Permanent(errors.New("refused"))
	}}, drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	if v := consumer.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: "d1"}, Attempt: 1}); !v.DeadLettered {
		t.Fatalf("setup: no dead letter: %+v", v)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Add(ctx, tx, &idem.Message{ID: "m1", Stream: "chaos.events", Payload: []byte("{}")}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	res = &chaosResult{events: len(h.events)}
	if err := h.verify(ctx, res); err != nil {
		t.Fatal(err)
	}
	got := strings.Join(res.problems, "\n")
	for _, want := range []string{
		"a: balance 19 from 3 events, want 12 from 2",
		"b: ordered handler at sequence 1 after 1 writes, 1 out of order",
		"the sink has no effect for 1 events: e3",
		"the sink was called with 1 keys of no intended event",
		"1 outbox rows unpublished",
		"dead letters: x d1",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("verification does not report %q; it reports:\n%s", want, got)
		}
	}
}

func mustProcessor(t *testing.T, drv *postgres.Driver) *idem.Processor[postgres.Tx] {
	t.Helper()
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestChaosSinkStateReadsTheLeases checks the diagnosis a run that did not
// drain prints: the lease handler's rows by status, from the run's schema.
func TestChaosSinkStateReadsTheLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 4)
	schema := "idem_chaos_state_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`) })
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "w"})
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.LeaseHandler{Name: chaosSinkHandler, Call: func(context.Context, *idem.Lease, *idem.Message) error { return nil }}
	for _, id := range []string{"a", "b"} {
		if _, err := lp.Process(ctx, h, &idem.Message{ID: id, Payload: []byte("x")}); err != nil {
			t.Fatal(err)
		}
	}
	hs := &chaosHarness{pool: pool, schema: schema, sink: &chaosSink{calls: 3, fenced: 1}}
	if got, want := hs.sinkState(ctx), "sink leases 2 done, 0 running, 0 failed (most attempts 1); sink calls 3, fenced 1"; got != want {
		t.Fatalf("sinkState = %q, want %q", got, want)
	}
}
