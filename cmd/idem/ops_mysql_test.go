package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/outbox"
)

// mysqlURL returns a fresh database as a mysql:// URL, the form the
// command line takes, and a driver on it.
func mysqlURL(t *testing.T) (string, *mysql.Driver) {
	t.Helper()
	dsn := testenv.MySQLDatabase(t)
	cfg, err := gomysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u := "mysql://" + cfg.User
	if cfg.Passwd != "" {
		u += ":" + cfg.Passwd
	}
	u += "@" + cfg.Addr + "/" + cfg.DBName
	drv, err := mysql.New(testenv.MySQL(t, dsn, 4), nil)
	if err != nil {
		t.Fatal(err)
	}
	return u, drv
}

// TestOperatorCommandsMySQL runs migrate, stats, dlq, cleanup and serve
// against a MySQL database holding one applied message and one dead
// letter.
func TestOperatorCommandsMySQL(t *testing.T) {
	dsn, drv := mysqlURL(t)
	ctx := context.Background()
	if code, out, errOut := runCLI(t, "migrate", "--dsn", dsn); code != exitOK || !strings.Contains(out, "applied 2 migrations") ||
		!strings.Contains(out, "`idem_markers`") || !strings.Contains(out, "`idem_outbox_log`") {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, errOut)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
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
	vars := map[string]string{dsnEnv: dsn}
	code, out, errOut := runCLIEnv(t, vars, "stats", "--json")
	var stats []handlerStats
	if code != exitOK || json.Unmarshal([]byte(out), &stats) != nil || len(stats) != 1 || stats[0].Applied != 1 ||
		stats[0].DeadParked != 1 || stats[0].OldestMarker == nil {
		t.Fatalf("stats: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLIEnv(t, vars, "dlq", "list", "--json")
	var dls []dlqJSON
	if code != exitOK || json.Unmarshal([]byte(out), &dls) != nil || len(dls) != 1 || dls[0].MessageID != "m2" || dls[0].Class != "permanent" {
		t.Fatalf("dlq list: exit %d\n%s%s", code, out, errOut)
	}
	s, err := openStore(ctx, dsn, storeOptions{Prefix: defaultPrefix})
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
		t.Fatalf("serve /metrics on MySQL: %d\n%s", code, body)
	}
	if code, body := get(t, srv.URL+"/"); code != http.StatusOK || !strings.Contains(body, "template 42 missing") {
		t.Fatalf("serve / on MySQL: %d", code)
	}
	// The console's groups and a group's page read the dead letters with
	// SQL of their own.
	if code, body := get(t, srv.URL+"/dlq"); code != http.StatusOK || !strings.Contains(body, "template 42 missing") {
		t.Fatalf("serve /dlq on MySQL: %d\n%s", code, body)
	}
	groupURL := srv.URL + "/dlq/group?handler=mailer&fp=" + url.QueryEscape(dls[0].Fingerprint)
	if code, body := get(t, groupURL); code != http.StatusOK || !strings.Contains(body, "m2") || !strings.Contains(body, "of <strong>1</strong> parked") {
		t.Fatalf("serve /dlq/group on MySQL: %d\n%s", code, body)
	}
	code, out, errOut = runCLIEnv(t, vars, "dlq", "replay", "--group", dls[0].Fingerprint, "--yes")
	if code != exitOK || out != "1 dead letter marked for replay; a running consumer of their handler replays them.\n" {
		t.Fatalf("dlq replay --group: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLIEnv(t, vars, "cleanup", "--dry-run", "--retention", "1ns", "--json")
	var dry cleanupReport
	if code != exitOK || json.Unmarshal([]byte(out), &dry) != nil || dry.WouldDelete == nil || *dry.WouldDelete != 1 {
		t.Fatalf("cleanup --dry-run: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut = runCLIEnv(t, vars, "cleanup", "--retention", "1ns", "--json")
	var rep cleanupReport
	if code != exitOK || json.Unmarshal([]byte(out), &rep) != nil || rep.Deleted == nil || *rep.Deleted != 1 {
		t.Fatalf("cleanup: exit %d\n%s%s", code, out, errOut)
	}
	testOutboxAdminMySQL(t, vars, drv)
	// The console's outbox page reads the same administration.
	if code, body := get(t, srv.URL+"/outbox"); code != http.StatusOK || !strings.Contains(body, "msg:c") || !strings.Contains(body, "relay-2") {
		t.Fatalf("serve /outbox on MySQL: %d\n%s", code, body)
	}
	if code, _, errOut := runCLIEnv(t, vars, "stats", "--schema", "app"); code != exitUsage || !strings.Contains(errOut, "--schema applies only to PostgreSQL") {
		t.Fatalf("stats --schema on MySQL: exit %d, stderr %q", code, errOut)
	}
}

// TestMySQLDSNErrorsHidePasswords: a bad or unreachable mysql:// DSN is
// reported without its password.
func TestMySQLDSNErrorsHidePasswords(t *testing.T) {
	for _, dsn := range []string{
		"mysql://app:s3cr3t@127.0.0.1:1/app",            // nothing listens
		"mysql://app:s3cr3t@127.0.0.1:3306/app?tls=foo", // an unknown TLS config
		"mysql://app:s3/cr3t@db/app",                    // a raw '/' in the password
		"mysql://app:s3cr3t@/app",                       // no host
		"app:s3cr3t@tcp(127.0.0.1:1)/app",               // the driver's form, nothing listens
		"app:s3/cr3t@tcp(127.0.0.1:1)/app?tls=foo",      // the same, a '/' in the password, an unknown TLS config
		"app:s3cr3t@tcp(127.0.0.1:1)/app?x=%zz",         // a parameter that does not decode
		"app:s3cr3t@tcp(127.0.0.1:1",                    // unterminated address
	} {
		code, out, errOut := runCLI(t, "stats", "--dsn", dsn)
		if code == exitOK || strings.Contains(out+errOut, "s3cr3t") || strings.Contains(out+errOut, "cr3t") {
			t.Errorf("%s: exit %d, output shows the password:\n%s%s", dsn, code, out, errOut)
		}
	}
}

// TestDriverFormDSNMySQL: the command line takes go-sql-driver/mysql's
// own DSN form as well as a mysql:// URL.
func TestDriverFormDSNMySQL(t *testing.T) {
	dsn := testenv.MySQLDatabase(t)
	cfg, err := gomysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	native := cfg.FormatDSN()
	if code, out, errOut := runCLI(t, "migrate", "--dsn", native); code != exitOK || !strings.Contains(out, "applied 2 migrations") {
		t.Fatalf("migrate --dsn %s: exit %d\n%s%s", native, code, out, errOut)
	}
	if code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: native}, "stats", "--json"); code != exitOK || strings.TrimSpace(out) != "[]" {
		t.Fatalf("stats: exit %d\n%s%s", code, out, errOut)
	}
}

// TestBenchMySQL: bench runs on a mysql:// DSN, and a case the MySQL
// target has no variant for is skipped with a note, not a failure.
func TestBenchMySQL(t *testing.T) {
	dsn, _ := mysqlURL(t)
	code, out, errOut := runCLI(t, "bench", "--dsn", dsn, "--cases", "version-in-row,per-message", "--rounds", "1", "--round", "100ms", "--json")
	var res []benchResult
	if code != exitOK || json.Unmarshal([]byte(out), &res) != nil || len(res) != 1 || res[0].Case != "per-message" || res[0].Store != "mysql" || res[0].Idem <= 0 {
		t.Fatalf("bench: exit %d\n%s%s", code, out, errOut)
	}
	if !strings.Contains(errOut, "version-in-row: mysql has no such variant; skipped") {
		t.Fatalf("bench stderr does not note the skipped case:\n%s", errOut)
	}
}

// testOutboxAdminMySQL runs outbox list, park, discard and retry on a
// MySQL outbox holding a failing row, a healthy row and a row of a key a
// relay holds, and checks the log of the actions.
func testOutboxAdminMySQL(t *testing.T, vars map[string]string, drv *mysql.Driver) {
	t.Helper()
	ctx := context.Background()
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := drv.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b", "c"} {
		if err := ob.Add(ctx, tx, &idem.Message{ID: id, Stream: "credits", Payload: []byte(id)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	page, err := drv.OutboxList(ctx, driver.OutboxFilter{})
	if err != nil || len(page.Rows) != 3 {
		t.Fatalf("outbox list: %+v, %v", page, err)
	}
	a, b, c := page.Rows[0].ID, page.Rows[1].ID, page.Rows[2].ID
	if err := drv.OutboxFailed(ctx, "relay-1", a, "no stream covers credits", time.Hour); err != nil {
		t.Fatal(err)
	}
	vars = maps.Clone(vars)
	vars["USER"] = "alice"
	cli := func(want int, args ...string) string {
		t.Helper()
		code, out, errOut := runCLIEnv(t, vars, args...)
		if code != want {
			t.Fatalf("idem %s: exit %d, want %d\n%s%s", strings.Join(args, " "), code, want, out, errOut)
		}
		return out + errOut
	}
	id := func(n int64) string { return strconv.FormatInt(n, 10) }

	if out := cli(exitOK, "outbox", "list"); !strings.Contains(out, "no stream covers credits") ||
		!strings.Contains(out, "3 rows unpublished (2 pending, 1 failing, 0 parked).") {
		t.Fatalf("outbox list:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "park", id(a), "--reason", "typo in the subject"); !strings.Contains(out, "parked 1 row: "+id(a)+".") {
		t.Fatalf("park:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "list", "--state", "parked"); !strings.Contains(out, "parked by alice: typo in the subject") {
		t.Fatalf("list --state parked:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "stats"); !strings.Contains(out, "parked          1") || !strings.Contains(out, "failing         0") {
		t.Fatalf("stats after a park:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "discard", id(a), "--yes", "--actor", "bob", "--reason", "sent twice"); !strings.Contains(out, "discarded 1 row: "+id(a)+".") {
		t.Fatalf("discard --yes:\n%s", out)
	}
	if out := cli(exitFailed, "outbox", "discard", id(a), "--yes"); !strings.Contains(out, "not found or published: "+id(a)) {
		t.Fatalf("second discard:\n%s", out)
	}
	claimed, _, err := drv.OutboxClaim(ctx, "relay-2", 1, 0, time.Hour)
	if err != nil || len(claimed) != 1 || claimed[0].ID != b {
		t.Fatalf("claim: %+v, %v", claimed, err)
	}
	if out := cli(exitFailed, "outbox", "park", id(b), id(c)); !strings.Contains(out, "parked 1 row: "+id(c)+".") ||
		!strings.Contains(out, "busy, a relay is publishing their key: "+id(b)) {
		t.Fatalf("park of a claimed row:\n%s", out)
	}
	if out := cli(exitOK, "outbox", "retry", id(c)); !strings.Contains(out, "retried 1 row: "+id(c)+".") {
		t.Fatalf("retry of a parked row:\n%s", out)
	}
	var log []string
	rows, err := drv.DB().QueryContext(ctx, `SELECT CONCAT(outbox_id, ' ', action, ' ', actor, ' ', reason) FROM idem_outbox_log ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		log = append(log, strings.TrimSpace(s))
	}
	rows.Close()
	want := []string{id(a) + " park alice typo in the subject", id(a) + " discard bob sent twice", id(c) + " park alice", id(c) + " retry alice"}
	if strings.Join(log, "|") != strings.Join(want, "|") {
		t.Fatalf("outbox log: %q, want %q", log, want)
	}
}

// TestMySQLDSNQuietsTheDriversLog checks what parseMySQLDSN makes of a
// mysql:// DSN: the credentials, parameters interpolated client-side, a
// bounded lock wait, and go-sql-driver's own log lines dropped (the
// command reports a failure itself, once).
func TestMySQLDSNQuietsTheDriversLog(t *testing.T) {
	cfg, err := parseMySQLDSN("mysql://app:s3cret@db.example:3307/orders?parseTime=true")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.User != "app" || cfg.Passwd != "s3cret" || cfg.Addr != "db.example:3307" || cfg.DBName != "orders" || !cfg.ParseTime {
		t.Fatalf("parsed %+v", cfg)
	}
	if !cfg.InterpolateParams || cfg.Params["innodb_lock_wait_timeout"] != cliLockWaitSeconds {
		t.Fatalf("interpolate %t, lock wait %q", cfg.InterpolateParams, cfg.Params["innodb_lock_wait_timeout"])
	}
	if _, ok := cfg.Logger.(quietMySQL); !ok {
		t.Fatalf("logger %T, want quietMySQL", cfg.Logger)
	}
}
