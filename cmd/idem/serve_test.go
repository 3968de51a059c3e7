package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
)

// seedServeStore fills a SQLite file with what serve shows: a demo's
// markers and dead letters, a dead letter whose ID and error are HTML, and
// two pending outbox rows. It returns the path and the marker and parked
// dead-letter counts of demo.balances, read with plain SQL.
func seedServeStore(t *testing.T) (path string, markers, parked int) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "serve.db")
	if code, _, errOut := runCLI(t, "demo", "--events", "500", "--accounts", "20", "--conflicts", "2", "--seed", "7", "--workers", "1", "--broker", "none", "--db", path); code != exitOK {
		t.Fatalf("demo: exit %d: %s", code, errOut)
	}
	ctx := context.Background()
	db, drv := testenv.SQLite(t, path, nil)
	if _, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "mailer", MessageID: "<b>id</b>", Error: `<script>alert("x")</script>`, Class: idem.DeadLetterPermanent, Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	addToOutbox(t, db, drv, "o1", "o2")
	if err := db.QueryRow(`SELECT count(*) FROM idem_processed WHERE handler = 'demo.balances'`).Scan(&markers); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(`SELECT count(*) FROM idem_dead_letters WHERE handler = 'demo.balances' AND state = 'parked'`).Scan(&parked); err != nil {
		t.Fatal(err)
	}
	if markers == 0 || parked == 0 {
		t.Fatalf("seed: %d markers, %d parked dead letters; want some of each", markers, parked)
	}
	return path, markers, parked
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}

// TestServeEndpoints checks /metrics, / and /healthz against the seeded
// counts, then with the store gone.
func TestServeEndpoints(t *testing.T) {
	path, markers, parked := seedServeStore(t)
	s, err := openStore(context.Background(), path, storeOptions{Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(newServeMux(context.Background(), s, 0, 5*time.Second))
	defer srv.Close()

	code, body := get(t, srv.URL+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d\n%s", code, body)
	}
	for _, line := range []string{
		"idem_store_up 1",
		fmt.Sprintf(`idem_store_markers{handler="demo.balances"} %d`, markers),
		fmt.Sprintf(`idem_store_dead_letters{handler="demo.balances",state="parked"} %d`, parked),
		`idem_store_dead_letters{handler="mailer",state="parked"} 1`,
		`idem_store_conflicts{handler="demo.balances"} 2`,
		"idem_outbox_pending 2",
		"idem_outbox_published 0",
		"go_goroutines ",
	} {
		if !strings.Contains(body, line) {
			t.Errorf("/metrics lacks %q", line)
		}
	}
	if !regexp.MustCompile(`(?m)^idem_store_oldest_marker_timestamp_seconds\{handler="demo.balances"\} 1\.[0-9.e+]+$`).MatchString(body) {
		t.Errorf("/metrics lacks the oldest marker's timestamp")
	}

	code, body = get(t, srv.URL+"/")
	if code != http.StatusOK {
		t.Fatalf("/: %d\n%s", code, body)
	}
	for _, want := range []string{"demo.balances", "Parked dead letters", "&lt;script&gt;", "Outbox"} {
		if !strings.Contains(body, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	if strings.Contains(body, "<script>") {
		t.Error("page carries stored text unescaped")
	}
	// The mailer's group lists its letter, whose ID is HTML.
	code, body = get(t, srv.URL+"/dlq/group?handler=mailer&fp=")
	if code != http.StatusOK || !strings.Contains(body, "&lt;b&gt;id&lt;/b&gt;") || strings.Contains(body, "<b>id") {
		t.Errorf("/dlq/group: %d, want the letter's ID escaped\n%s", code, body)
	}
	if code, body = get(t, srv.URL+"/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("/healthz: %d %q", code, body)
	}
	if code, _ = get(t, srv.URL+"/nothing"); code != http.StatusNotFound {
		t.Fatalf("/nothing: %d, want 404", code)
	}

	// The store goes away: a scrape still answers, with up 0; health fails.
	s.Close()
	if code, body = get(t, srv.URL+"/metrics"); code != http.StatusOK || !strings.Contains(body, "idem_store_up 0") {
		t.Fatalf("/metrics with the store closed: %d, up 0 missing", code)
	}
	if code, _ = get(t, srv.URL+"/healthz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/healthz with the store closed: %d, want 503", code)
	}
	if code, body = get(t, srv.URL+"/"); code != http.StatusServiceUnavailable || !strings.Contains(body, "could not be read") {
		t.Fatalf("/ with the store closed: %d", code)
	}
	if !strings.Contains(body, "Outage in progress") || !strings.Contains(body, "has not answered since") {
		t.Fatalf("/ with the store closed does not show the outage:\n%s", body)
	}
}

// TestServeHealthNeedsTables: a store that answers but holds no idem
// tables is not healthy, as /metrics says with idem_store_up 0.
func TestServeHealthNeedsTables(t *testing.T) {
	path := filepath.Join(t.TempDir(), "empty.db")
	s, err := openStore(context.Background(), path, storeOptions{Prefix: defaultPrefix, Create: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(newServeMux(context.Background(), s, 0, 5*time.Second))
	defer srv.Close()
	if code, body := get(t, srv.URL+"/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "run 'idem migrate' first") {
		t.Fatalf("/healthz on a store without tables: %d %q, want 503 saying why", code, body)
	}
	if code, body := get(t, srv.URL+"/metrics"); code != http.StatusOK || !strings.Contains(body, "idem_store_up 0") {
		t.Fatalf("/metrics on a store without tables: %d, want idem_store_up 0", code)
	}
}

// startServe runs 'idem serve' with args on a free loopback port until ctx
// ends, and returns its URL once it printed it, its stderr and where its
// exit code will come.
func startServe(t *testing.T, ctx context.Context, args ...string) (string, *testenv.Buffer, <-chan int) {
	t.Helper()
	out, errOut := new(testenv.Buffer), new(testenv.Buffer)
	e := &env{stdout: out, stderr: errOut, getenv: func(string) string { return "" }}
	exit := make(chan int, 1)
	go func() { exit <- runEnv(ctx, e, append([]string{"serve", "--addr", "127.0.0.1:0"}, args...)) }()
	addr := regexp.MustCompile(`http://(127\.0\.0\.1:[0-9]+)`)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if m := addr.FindStringSubmatch(out.String()); m != nil {
			return "http://" + m[1], errOut, exit
		}
	}
	t.Fatalf("serve printed no address: %q %q", out.String(), errOut.String())
	return "", nil, nil
}

// TestServeCommandStopsCleanly runs 'idem serve' on a free port, scrapes
// it, and cancels it as SIGINT would: exit 0.
func TestServeCommandStopsCleanly(t *testing.T) {
	path, _, _ := seedServeStore(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url, errOut, exit := startServe(t, ctx, "--dsn", path)
	if code, body := get(t, url+"/metrics"); code != http.StatusOK || !strings.Contains(body, "idem_store_up 1") {
		t.Fatalf("/metrics: %d", code)
	}
	cancel()
	select {
	case code := <-exit:
		if code != exitOK {
			t.Fatalf("serve exited %d after interruption, want 0: %s", code, errOut.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not stop")
	}
}

// TestServeMetricsRefresh: within --refresh a scrape gets the last reading
// and does not touch the store; after it, the store is read again.
func TestServeMetricsRefresh(t *testing.T) {
	path, _, _ := seedServeStore(t)
	s, err := openStore(context.Background(), path, storeOptions{Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c := newStoreCollector(newReadingCache(context.Background(), s, time.Hour, 5*time.Second))
	scrape := func() string {
		t.Helper()
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(c)
		var b strings.Builder
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				fmt.Fprintln(&b, mf.GetName(), m.String())
			}
		}
		return b.String()
	}
	first := scrape()
	if _, err := s.sqliteDB.Exec(`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES ('late', 'x', x'00', 0)`); err != nil {
		t.Fatal(err)
	}
	if again := scrape(); again != first || strings.Contains(again, `"late"`) {
		t.Fatal("a scrape within the refresh interval read the store again")
	}
	c.cache.ttl = 0
	if !strings.Contains(scrape(), `value:"late"`) {
		t.Fatal("a scrape after the refresh interval did not read the store")
	}
}

// TestServeMetricsBadHandlerName: a marker row whose handler is not UTF-8,
// written with raw SQL as a tool outside idem could, and another whose
// name spells that one's escape, do not fail the scrape: /metrics answers
// 200 with idem_store_up 1 and a distinct, valid label for each.
func TestServeMetricsBadHandlerName(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bad.db")
	db, _ := testenv.SQLite(t, path, nil)
	for _, q := range []string{
		`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES (CAST(x'ff62616c' AS TEXT), 'm1', x'00', 1)`,
		`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES ('\xffbal', 'm1', x'00', 1)`,
		`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES ('ok', 'm1', x'00', 1)`,
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	s, err := openStore(context.Background(), path, storeOptions{Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(newServeMux(context.Background(), s, 0, 5*time.Second))
	defer srv.Close()
	code, body := get(t, srv.URL+"/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics: %d\n%s", code, body)
	}
	for _, line := range []string{
		"idem_store_up 1",
		`idem_store_markers{handler="\\xffbal"} 1`,
		`idem_store_markers{handler="\\xffbal#2"} 1`,
		`idem_store_markers{handler="ok"} 1`,
	} {
		if !strings.Contains(body, line) {
			t.Errorf("/metrics lacks %q:\n%s", line, body)
		}
	}
	if code, body := get(t, srv.URL+"/"); code != http.StatusOK || !strings.Contains(body, `\xffbal`) {
		t.Errorf("/: %d, want 200 showing the escaped name\n%s", code, body)
	}
}

// FuzzMetricLabel: any stored handler name becomes a valid label value,
// itself when it is UTF-8, and handlerLabels never repeats a label.
//
//	go test ./cmd/idem -run '^$' -fuzz FuzzMetricLabel -fuzztime 30s
func FuzzMetricLabel(f *testing.F) {
	f.Add("ok", "\xffbal")
	f.Add(`\xff`, "\xff")
	f.Add("a#2", "a")
	f.Fuzz(func(t *testing.T, a, b string) {
		l := metricLabel(a)
		if !utf8.ValidString(l) || (utf8.ValidString(a) != (l == a)) {
			t.Fatalf("metricLabel(%q) = %q", a, l)
		}
		if _, err := prometheus.NewConstMetric(prometheus.NewDesc("x", "x", []string{"handler"}, nil), prometheus.GaugeValue, 1, l); err != nil {
			t.Fatalf("metricLabel(%q) = %q: %v", a, l, err)
		}
		list := []*handlerStats{{Handler: a}, {Handler: b}, {Handler: a + "#2"}, {Handler: b}}
		labels := handlerLabels(list)
		seen := map[string]bool{}
		for _, l := range labels {
			if seen[l] {
				t.Fatalf("handlerLabels(%q, %q) = %q: %q twice", a, b, labels, l)
			}
			seen[l] = true
		}
	})
}
