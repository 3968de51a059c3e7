package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// migratedSchema returns a fresh schema with idem migrated into it, and
// its driver.
func migratedSchema(t *testing.T) (string, *postgres.Driver) {
	t.Helper()
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return schema, drv
}

// TestOperatorCommandsPostgres runs stats and dlq against a Postgres
// schema holding one applied message and one dead letter.
func TestOperatorCommandsPostgres(t *testing.T) {
	schema, drv := migratedSchema(t)
	ctx := context.Background()
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[postgres.Tx]{Name: "mailer", Apply: func(_ context.Context, _ postgres.Tx, m *idem.Message) error {
		if string(m.Payload) == "bad" {
			return idem.Permanent(errFake("template 42 missing"))
		}
		return nil
	}}
	c, err := idem.NewConsumer(proc, h, drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: "m1"}, Attempt: 1}); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("m1: %+v", v)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: "m2", Payload: []byte("bad")}, Attempt: 1}); !v.DeadLettered {
		t.Fatalf("m2: %+v", v)
	}
	vars := map[string]string{dsnEnv: testenv.PostgresDSN()}
	code, out, errOut := runCLIEnv(t, vars, "stats", "--schema", schema, "--json")
	var stats []handlerStats
	if code != exitOK || json.Unmarshal([]byte(out), &stats) != nil || len(stats) != 1 || stats[0].Applied != 1 ||
		stats[0].DeadParked != 1 || stats[0].OldestMarker == nil {
		t.Fatalf("stats: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLIEnv(t, vars, "dlq", "list", "--schema", schema, "--json")
	var dls []dlqJSON
	if code != exitOK || json.Unmarshal([]byte(out), &dls) != nil || len(dls) != 1 || dls[0].MessageID != "m2" || dls[0].Class != "permanent" {
		t.Fatalf("dlq list: exit %d\n%s%s", code, out, errOut)
	}
	// serve reads the same schema: the page and the store metrics.
	s, err := openStore(ctx, testenv.PostgresDSN(), storeOptions{Schema: schema, Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(newServeMux(context.Background(), s, 0, 5*time.Second))
	defer srv.Close()
	if code, body := get(t, srv.URL+"/metrics"); code != http.StatusOK ||
		!strings.Contains(body, "idem_store_up 1") ||
		!strings.Contains(body, `idem_store_markers{handler="mailer"} 1`) ||
		!strings.Contains(body, `idem_store_dead_letters{handler="mailer",state="parked"} 1`) ||
		!strings.Contains(body, "idem_outbox_pending 0") {
		t.Fatalf("serve /metrics on Postgres: %d\n%s", code, body)
	}
	if code, body := get(t, srv.URL+"/"); code != http.StatusOK || !strings.Contains(body, "template 42 missing") {
		t.Fatalf("serve / on Postgres: %d", code)
	}
	code, out, errOut = runCLIEnv(t, vars, "dlq", "replay", "--schema", schema, "--group", dls[0].Fingerprint, "--yes")
	if code != exitOK || out != "1 dead letter marked for replay; a running consumer of their handler replays them.\n" {
		t.Fatalf("dlq replay --group: exit %d\n%s%s", code, out, errOut)
	}
}

type errFake string

func (e errFake) Error() string { return string(e) }

// TestImportPostgres imports a hand-rolled table that lives in another
// schema than idem's, and then stats counts the imported markers.
func TestImportPostgres(t *testing.T) {
	pool := testenv.PostgresPool(t, 4)
	idemSchema, appSchema := testenv.FreshSchema(t, pool), testenv.FreshSchema(t, pool)
	ctx := context.Background()
	vars := map[string]string{dsnEnv: testenv.PostgresDSN()}
	if code, _, errOut := runCLIEnv(t, vars, "migrate", "--schema", idemSchema); code != exitOK {
		t.Fatalf("migrate: exit %d: %s", code, errOut)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+appSchema+`.processed_events (event_id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+appSchema+`.processed_events SELECT 'evt-' || g FROM generate_series(1, 2500) AS g`); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLIEnv(t, vars, "import", "--schema", idemSchema, "--handler", "mailer",
		"--from", appSchema+".processed_events.event_id", "--batch", "1000", "--json")
	var rep importReport
	if code != exitOK || json.Unmarshal([]byte(out), &rep) != nil || rep.Read != 2500 || rep.Imported != 2500 || rep.Invalid != 0 {
		t.Fatalf("import: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLIEnv(t, vars, "stats", "--schema", idemSchema, "--json")
	var stats []handlerStats
	if code != exitOK || json.Unmarshal([]byte(out), &stats) != nil || len(stats) != 1 || stats[0].Applied != 2500 {
		t.Fatalf("stats after import: exit %d\n%s%s", code, out, errOut)
	}
}

// TestOutboxNotifyCommand: 'idem outbox notify on|off' installs and removes
// the outbox's NOTIFY trigger on Postgres, and is refused on SQLite.
func TestOutboxNotifyCommand(t *testing.T) {
	schema, drv := migratedSchema(t)
	ctx := context.Background()
	vars := map[string]string{dsnEnv: testenv.PostgresDSN()}
	for _, step := range []struct {
		arg  string
		want bool
	}{{"on", true}, {"off", false}} {
		code, out, errOut := runCLIEnv(t, vars, "outbox", "notify", step.arg, "--schema", schema)
		if code != exitOK || !strings.Contains(out, "outbox notify "+step.arg) {
			t.Fatalf("outbox notify %s: exit %d\n%s%s", step.arg, code, out, errOut)
		}
		if on, err := drv.OutboxNotifyOn(ctx); err != nil || on != step.want {
			t.Fatalf("after notify %s: on %t, %v; want %t", step.arg, on, err, step.want)
		}
		code, out, errOut = runCLIEnv(t, vars, "outbox", "stats", "--schema", schema, "--json")
		var rep outboxReport
		if code != exitOK || json.Unmarshal([]byte(out), &rep) != nil || rep.Notify == nil || *rep.Notify != step.want {
			t.Fatalf("outbox stats after notify %s: exit %d\n%s%s", step.arg, code, out, errOut)
		}
	}
	if code, _, errOut := runCLIEnv(t, vars, "outbox", "notify", "maybe", "--schema", schema); code != exitUsage || !strings.Contains(errOut, "notify takes on or off") {
		t.Fatalf("notify maybe: exit %d\n%s", code, errOut)
	}
	bare := testenv.FreshSchema(t, testenv.PostgresPool(t, 2))
	if code, _, errOut := runCLIEnv(t, vars, "outbox", "notify", "on", "--schema", bare); code == exitOK || !strings.Contains(errOut, "run 'idem migrate' first") {
		t.Fatalf("notify on an unmigrated schema: exit %d\n%s", code, errOut)
	}
	db := t.TempDir() + "/x.db"
	if code, _, errOut := runCLI(t, "migrate", "--dsn", db); code != exitOK {
		t.Fatalf("migrate sqlite: exit %d\n%s", code, errOut)
	}
	if code, _, errOut := runCLI(t, "outbox", "notify", "on", "--dsn", db); code == exitOK || !strings.Contains(errOut, "only PostgreSQL notifies relays") {
		t.Fatalf("notify on SQLite: exit %d\n%s", code, errOut)
	}
}

// TestServeStopsWhileAReadWaits: 'idem serve' interrupted while a scrape
// waits on a store that does not answer (a table locked) stops at once
// and exits 0: shutting down cancels the reads in flight rather than
// waiting out their timeout.
func TestServeStopsWhileAReadWaits(t *testing.T) {
	schema, _ := migratedSchema(t)
	pool := testenv.PostgresPool(t, 2)
	lockCtx := context.Background()
	tx, err := pool.Begin(lockCtx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(lockCtx)
	if _, err := tx.Exec(lockCtx, `LOCK TABLE `+schema+`.idem_processed IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url, errOut, exit := startServe(t, ctx, "--dsn", testenv.PostgresDSN(), "--schema", schema, "--read-timeout", "30s")
	go func() {
		if resp, err := http.Get(url + "/metrics"); err == nil {
			resp.Body.Close()
		}
	}()
	// Wait until the scrape's read is blocked on the lock.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var waiting int
		if err := pool.QueryRow(lockCtx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%idem_processed%'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the scrape never waited on the lock")
		}
	}
	cancel()
	select {
	case code := <-exit:
		if code != exitOK {
			t.Fatalf("serve exited %d, want 0: %s", code, errOut.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop while a read waited")
	}
}

// TestServePageMarkerEstimate: on PostgreSQL the page adds the planner's
// estimate of all markers, read on each view and named an estimate, while
// its per-handler counts stay the cached reading.
func TestServePageMarkerEstimate(t *testing.T) {
	ctx := context.Background()
	schema, _ := migratedSchema(t)
	pool := testenv.PostgresPool(t, 2)
	table := `"` + schema + `"."idem_processed"`
	// Written as an idem from before migration 011 left them, without
	// migration 012's trigger, which would mirror them into idem_markers.
	if _, err := pool.Exec(ctx, `BEGIN; SET LOCAL session_replication_role = replica;
		INSERT INTO `+table+` (handler, message_id, payload_hash, processed_at, status)
		SELECT 'est', 'm-' || g, '\x00', now(), 'done' FROM generate_series(1, 1500) g; COMMIT`); err != nil {
		t.Fatal(err)
	}
	s, err := openStore(ctx, testenv.PostgresDSN(), storeOptions{Schema: schema, Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(newServeMux(context.Background(), s, time.Hour, 5*time.Second))
	defer srv.Close()
	if _, err := pool.Exec(ctx, `ANALYZE `+table); err != nil {
		t.Fatal(err)
	}
	code, body := get(t, srv.URL+"/")
	if code != http.StatusOK || !strings.Contains(body, "about 1500 in all (PostgreSQL") || !strings.Contains(body, "<td class=\"text\">est</td><td class=\"num\">1500</td>") {
		t.Fatalf("/: %d, want the estimate and the exact count\n%s", code, body)
	}
	// More markers: the estimate follows at the next analysis, the cached
	// count does not.
	// Written as an idem from before migration 011 left them, without
	// migration 012's trigger, which would mirror them into idem_markers.
	if _, err := pool.Exec(ctx, `BEGIN; SET LOCAL session_replication_role = replica;
		INSERT INTO `+table+` (handler, message_id, payload_hash, processed_at, status)
		SELECT 'est', 'n-' || g, '\x00', now(), 'done' FROM generate_series(1, 500) g; COMMIT`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE `+table); err != nil {
		t.Fatal(err)
	}
	if code, body = get(t, srv.URL+"/"); code != http.StatusOK || !strings.Contains(body, "about 2000 in all") || !strings.Contains(body, "<td class=\"text\">est</td><td class=\"num\">1500</td>") {
		t.Fatalf("/ after 500 more: %d\n%s", code, body)
	}
	// Atomic markers in their own table (migration 11) count too.
	markers := `"` + schema + `"."idem_markers"`
	if _, err := pool.Exec(ctx, `INSERT INTO `+markers+` (handler_id, message_key, payload_hash)
		SELECT 1, convert_to('a-' || g, 'UTF8'), '\x00' FROM generate_series(1, 300) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE `+markers); err != nil {
		t.Fatal(err)
	}
	if code, body = get(t, srv.URL+"/"); code != http.StatusOK || !strings.Contains(body, "about 2300 in all") {
		t.Fatalf("/ after 300 atomic markers: %d\n%s", code, body)
	}
}
