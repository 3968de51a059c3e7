package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/sqlite"
)

// Hostile text the console must render inert: each would set
// window.__pwned if it ran.
const (
	hostileHandler = `<script>window.__pwned=1</script>`
	hostileID      = `"><img src=x onerror="window.__pwned=2">`
	hostilePayload = `{"html":"<script>window.__pwned=3</script>","quote":"\"'"}`
	hostileHeader  = `<img src=x onerror=window.__pwned=5>`
)

// hostileError holds HTML, ANSI escapes, a bidi override and a newline.
var hostileError = "idem: handler " + fmt.Sprintf("%q", hostileHandler) + ": permanent: \x1b[2J\x1b[31mred\x1b[0m \u202egnp.exe\n<script>window.__pwned=4</script>"

// consoleSeed is a SQLite store seeded for the console: dead letters in
// groups, hostile ones, and markers.
type consoleSeed struct {
	path string
	db   *sql.DB
	drv  *sqlite.Driver
	// smtp and tmpl are the IDs of the two mailer groups, smtpFP and
	// tmplFP their fingerprints.
	smtp, tmpl     []int64
	smtpFP, tmplFP string
	// hostile, binary and undecoded are one dead letter each.
	hostile, binary, undecoded int64
}

// putDeadLetter stores the dead letter of a message that failed with
// errText, as a consumer would, and returns its ID.
func putDeadLetter(t *testing.T, drv driver.DeadLetterStore, handler, id, errText, class string, payload []byte, headers map[string]string) int64 {
	t.Helper()
	m := &idem.Message{ID: id, Stream: "orders.placed", Type: "OrderPlaced", AggregateID: "order-" + id, Seq: 1, Payload: payload, Headers: headers,
		Time: time.Date(2026, 11, 26, 9, 30, 0, 0, time.UTC)}
	env, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	n, err := drv.DeadLetterPut(context.Background(), &driver.DeadLetter{Handler: handler, MessageID: id, PayloadHash: m.PayloadHash(), Envelope: env,
		Raw: payload, Source: "orders.placed/0@" + id, Error: errText, Class: class, Fingerprint: idem.Fingerprint(errors.New(errText)), Attempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// seedConsoleStore seeds a SQLite file with 62 mailer dead letters failing
// one way (SMTP 550) and 3 another (a missing template), a hostile one, a
// binary payload, a delivery that did not decode, and markers.
func seedConsoleStore(t *testing.T) *consoleSeed {
	t.Helper()
	s := &consoleSeed{path: filepath.Join(t.TempDir(), "console.db")}
	s.db, s.drv = testenv.SQLite(t, s.path, nil)
	for i := range 62 {
		id := fmt.Sprintf("m-%04d", i+1)
		e := fmt.Sprintf("idem: handler %q, message %q: permanent: smtp: 550 5.1.1 <u%d@example.com>: mailbox unknown", "mailer", id, i+1)
		body := fmt.Sprintf(`{"to":"u%d@example.com","template":"receipt","order":"o-%d"}`, i+1, 1000+i)
		s.smtp = append(s.smtp, putDeadLetter(t, s.drv, "mailer", id, e, idem.DeadLetterPermanent, []byte(body), map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}))
		s.smtpFP = idem.Fingerprint(errors.New(e))
	}
	for i := range 3 {
		id := fmt.Sprintf("t-%d", i+1)
		e := fmt.Sprintf("idem: handler %q, message %q: permanent: render: template %q not found", "mailer", id, "welcome")
		s.tmpl = append(s.tmpl, putDeadLetter(t, s.drv, "mailer", id, e, idem.DeadLetterPermanent, []byte(`{"template":"welcome"}`), nil))
		s.tmplFP = idem.Fingerprint(errors.New(e))
	}
	s.hostile = putDeadLetter(t, s.drv, hostileHandler, hostileID, hostileError, idem.DeadLetterPermanent, []byte(hostilePayload), map[string]string{"X-Evil": hostileHeader})
	s.binary = putDeadLetter(t, s.drv, "billing", "b-1", `idem: handler "billing", message "b-1": permanent: decode invoice: unexpected EOF`, idem.DeadLetterPermanent,
		[]byte{0x0a, 0x04, 0x08, 0x96, 0x01, 0xff, 0xfe, 0x00, 0x12, 0x07, 'i', 'n', 'v', 'o', 'i', 'c', 'e'}, nil)
	var err error
	s.undecoded, err = s.drv.DeadLetterPut(context.Background(), &driver.DeadLetter{Handler: "billing", Raw: []byte("not json\x00\x01"), Source: "billing/2@991",
		Error: `idem: decode: invalid character 'o' in literal null (expecting 'u')`, Class: idem.DeadLetterDecode,
		Fingerprint: idem.Fingerprint(errors.New(`invalid character 'o' in literal null (expecting 'u')`)), Attempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	addToOutbox(t, s.db, s.drv, "receipt-1", "receipt-2")
	addMarkers(t, s.db, "billing", 0, 40)
	addMarkers(t, s.db, "mailer", 0, 25)
	return s
}

// addMarkers writes markers from..to-1 of handler, as applied messages.
func addMarkers(t *testing.T, db *sql.DB, handler string, from, to int) {
	t.Helper()
	for i := from; i < to; i++ {
		if _, err := db.Exec(`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES ($1, $2, x'00', $3)`,
			handler, fmt.Sprintf("%s-%d", handler, i), time.Now().UnixMicro()); err != nil {
			t.Fatal(err)
		}
	}
}

// countState counts the dead letters of ids in state, with plain SQL.
func countState(t *testing.T, db *sql.DB, state string, ids []int64) int {
	t.Helper()
	n := 0
	for _, id := range ids {
		var st string
		if err := db.QueryRow(`SELECT state FROM idem_dead_letters WHERE id = $1`, id).Scan(&st); err != nil {
			t.Fatal(err)
		}
		if st == state {
			n++
		}
	}
	return n
}

// consoleServer serves the console over s with token (empty: read-only)
// and a live view sampling every interval.
func consoleServer(t *testing.T, path, token string, every time.Duration) (*httptest.Server, *store) {
	t.Helper()
	return consoleServerAuth(t, path, newConsoleAuth(token), every)
}

// consoleServerAuth is consoleServer with the token checker given.
func consoleServerAuth(t *testing.T, path string, auth *consoleAuth, every time.Duration) (*httptest.Server, *store) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s, err := openStore(ctx, path, storeOptions{Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	cache := newReadingCache(ctx, s, every, 5*time.Second)
	live := newLiveRing(every)
	go live.run(ctx, cache)
	mux := serveMuxFor(s, cache, 5*time.Second, &consoleOptions{Auth: auth, Live: live, Logger: testenv.Logger(t)})
	srv := httptest.NewServer(guard(newHostPolicy("127.0.0.1:0", nil), mux))
	t.Cleanup(srv.Close)
	return srv, s
}

const testToken = "s3cret-token-for-tests-0123456789"

// client is an HTTP client with a cookie jar that does not follow
// redirects, so a test sees each answer.
func client(t *testing.T) *http.Client {
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func do(t *testing.T, c *http.Client, method, u string, form url.Values, hdr map[string]string) (int, string) {
	t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// login logs c in as name and returns the session's CSRF token.
func login(t *testing.T, c *http.Client, base, name, token string) string {
	t.Helper()
	code, body := do(t, c, "GET", base+"/login", nil, nil)
	m := csrfField.FindStringSubmatch(body)
	if code != 200 || m == nil {
		t.Fatalf("/login: %d, no CSRF field\n%s", code, body)
	}
	code, body = do(t, c, "POST", base+"/login", url.Values{"csrf": {m[1]}, "name": {name}, "token": {token}, "next": {"/dlq"}}, nil)
	if code != http.StatusSeeOther {
		t.Fatalf("login as %s: %d\n%s", name, code, body)
	}
	_, body = do(t, c, "GET", base+"/dlq", nil, nil)
	if m = csrfField.FindStringSubmatch(body); m == nil {
		t.Fatalf("/dlq after login carries no CSRF token\n%s", body)
	}
	return m[1]
}

// TestConsoleActionsNeedCredentials: a replay without a session or token,
// with a wrong token, with a session but a wrong or missing CSRF token, or
// from another origin is refused and changes nothing; the same with the
// session's CSRF token or a bearer token changes exactly the dead letters
// named, and the history names the actor.
func TestConsoleActionsNeedCredentials(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	one := url.Values{"action": {"replay"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.tmpl[0])}}
	anon := client(t)
	for _, tc := range []struct {
		name string
		hdr  map[string]string
		want int
	}{
		{"no credentials", nil, http.StatusUnauthorized},
		{"wrong bearer token", map[string]string{"Authorization": "Bearer " + testToken + "x"}, http.StatusUnauthorized},
	} {
		if code, body := do(t, anon, "POST", srv.URL+"/dlq/apply", one, tc.hdr); code != tc.want {
			t.Errorf("%s: %d, want %d\n%s", tc.name, code, tc.want, body)
		}
	}
	// A GET never acts.
	if code, _ := do(t, anon, "GET", srv.URL+"/dlq/apply?"+one.Encode(), nil, nil); code == http.StatusOK {
		t.Errorf("GET /dlq/apply: %d", code)
	}
	// A wrong token at login opens no session.
	if code, _ := do(t, anon, "GET", srv.URL+"/login", nil, nil); code != 200 {
		t.Fatal("/login")
	}
	u, _ := url.Parse(srv.URL + "/login")
	var loginCSRFValue string
	for _, ck := range anon.Jar.Cookies(u) {
		if ck.Name == loginCookie {
			loginCSRFValue = ck.Value
		}
	}
	if code, body := do(t, anon, "POST", srv.URL+"/login", url.Values{"csrf": {loginCSRFValue}, "name": {"mallory"}, "token": {"guess-guess-guess-guess"}}, nil); code != http.StatusUnauthorized || !strings.Contains(body, "wrong token") {
		t.Errorf("login with a wrong token: %d", code)
	}
	if code, _ := do(t, anon, "POST", srv.URL+"/login", url.Values{"csrf": {"0123456789abcdef0123456789abcdef"}, "name": {"mallory"}, "token": {testToken}}, nil); code != http.StatusUnauthorized {
		t.Errorf("login with the token but a forged CSRF value: %d, want 401", code)
	}

	alice := client(t)
	csrf := login(t, alice, srv.URL, "alice", testToken)
	for _, tc := range []struct {
		name string
		form url.Values
		hdr  map[string]string
		want int
	}{
		{"session without CSRF token", one, nil, http.StatusForbidden},
		{"session with a wrong CSRF token", withCSRF(one, strings.Repeat("0", 32)), nil, http.StatusForbidden},
		{"session from another origin", withCSRF(one, csrf), map[string]string{"Origin": "http://evil.example"}, http.StatusForbidden},
	} {
		if code, body := do(t, alice, "POST", srv.URL+"/dlq/apply", tc.form, tc.hdr); code != tc.want {
			t.Errorf("%s: %d, want %d\n%s", tc.name, code, tc.want, body)
		}
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, seed.tmpl); n != 3 {
		t.Fatalf("after refused actions %d of 3 are parked: a refused action changed the store", n)
	}

	// The confirmation states the count; applying changes that many.
	code, body := do(t, alice, "POST", srv.URL+"/dlq/confirm", withCSRF(url.Values{"action": {"discard"}, "scope": {"group"}, "handler": {"mailer"}, "fp": {seed.tmplFP}}, csrf), nil)
	if code != 200 || !strings.Contains(body, `<strong id="confirm-count">3</strong>`) || !strings.Contains(body, "Discard 3 dead letters?") {
		t.Fatalf("confirm a group's discard: %d, want the count 3\n%s", code, body)
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, seed.tmpl); n != 3 {
		t.Fatalf("a confirmation page changed the store: %d of 3 parked", n)
	}
	code, body = do(t, alice, "POST", srv.URL+"/dlq/apply", withCSRF(one, csrf), nil)
	if code != 200 || !strings.Contains(body, `<strong id="moved">1</strong>`) {
		t.Fatalf("replay one with the session: %d\n%s", code, body)
	}
	if n := countState(t, seed.db, driver.DeadLetterReplayRequested, seed.tmpl[:1]); n != 1 {
		t.Fatal("the replay did not reach the store")
	}
	// A bearer token needs no CSRF token; its actor is the header's.
	two := url.Values{"action": {"discard"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.tmpl[1]), fmt.Sprint(seed.tmpl[2]), fmt.Sprint(seed.tmpl[0])}, "count": {"3"}}
	code, body = do(t, anon, "POST", srv.URL+"/dlq/apply", two, map[string]string{"Authorization": "Bearer " + testToken, "X-Idem-Actor": "deploy-bot"})
	if code != 200 || !strings.Contains(body, `<strong id="moved">2</strong>`) || !strings.Contains(body, "1 was not parked any more") {
		t.Fatalf("discard with a bearer token: %d, want 2 of 3 moved\n%s", code, body)
	}
	if n := countState(t, seed.db, driver.DeadLetterDiscarded, seed.tmpl); n != 2 {
		t.Fatalf("%d discarded, want 2", n)
	}
	for id, actor := range map[int64]string{seed.tmpl[0]: "alice (console)", seed.tmpl[1]: "deploy-bot (console API)"} {
		hist, err := seed.drv.DeadLetterHistory(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		if len(hist) == 0 || hist[len(hist)-1].Actor != actor {
			t.Errorf("dead letter %d's history %+v: want the last entry by %q", id, hist, actor)
		}
	}
	// Logged out, the session acts no more.
	if code, _ := do(t, alice, "POST", srv.URL+"/logout", url.Values{"csrf": {csrf}}, nil); code != http.StatusSeeOther {
		t.Fatalf("logout: %d", code)
	}
	if code, _ := do(t, alice, "POST", srv.URL+"/dlq/apply", withCSRF(url.Values{"action": {"replay"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.smtp[0])}}, csrf), nil); code != http.StatusUnauthorized {
		t.Errorf("an action after logout: %d, want 401", code)
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, seed.smtp[:1]); n != 1 {
		t.Fatal("an action after logout changed the store")
	}
}

func withCSRF(v url.Values, csrf string) url.Values {
	w := url.Values{"csrf": {csrf}}
	for k, vs := range v {
		w[k] = vs
	}
	return w
}

// TestConsoleReadOnly: without a token the console shows the dead letters
// but offers no action, has no login, and refuses every action even with
// a bearer header.
func TestConsoleReadOnly(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, "", time.Hour)
	c := client(t)
	code, body := do(t, c, "GET", srv.URL+fmt.Sprintf("/dlq/%d", seed.smtp[0]), nil, nil)
	if code != 200 || strings.Contains(body, "<form") || !strings.Contains(body, "read-only") {
		t.Fatalf("a letter without a token: %d, want no form\n%s", code, body)
	}
	if code, _ := do(t, c, "GET", srv.URL+"/login", nil, nil); code != http.StatusForbidden {
		t.Errorf("/login on a read-only console: %d, want 403", code)
	}
	code, body = do(t, c, "POST", srv.URL+"/dlq/apply", url.Values{"action": {"discard"}, "scope": {"group"}, "handler": {"mailer"}, "fp": {seed.smtpFP}},
		map[string]string{"Authorization": "Bearer anything-at-all-0123456789"})
	if code != http.StatusForbidden || !strings.Contains(body, "read-only") {
		t.Errorf("an action on a read-only console: %d\n%s", code, body)
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, seed.smtp); n != 62 {
		t.Fatalf("%d of 62 parked after a refused action", n)
	}
}

// TestConsolePages: the groups with their counts and sample reasons, a
// group's pages with the total, a letter's payload as JSON, text or hex,
// and the equivalent commands; hostile text is escaped everywhere.
func TestConsolePages(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	c := client(t)
	code, body := do(t, c, "GET", srv.URL+"/dlq", nil, nil)
	if code != 200 || !strings.Contains(body, `<td class="num">62</td>`) || !strings.Contains(body, "68 dead letters parked in 5 groups") {
		t.Fatalf("/dlq: %d, want 68 dead letters in 5 groups, one of 62\n%s", code, body)
	}
	// The sample reason drops the prefix every error repeats.
	if !strings.Contains(body, "smtp: 550 5.1.1 &lt;u62@example.com&gt;: mailbox unknown") || strings.Contains(body, `message &#34;m-0062&#34;`) {
		t.Errorf("/dlq: the sample reason is not the error's own part")
	}
	group := srv.URL + "/dlq/group?" + url.Values{"handler": {"mailer"}, "fp": {seed.smtpFP}}.Encode()
	code, body = do(t, c, "GET", group, nil, nil)
	if code != 200 || !strings.Contains(body, "Dead letters 1–50 of <strong>62</strong>") || !strings.Contains(body, `id="next-page"`) {
		t.Fatalf("group page 1: %d\n%s", code, body)
	}
	next := regexp.MustCompile(`id="next-page" href="([^"]+)"`).FindStringSubmatch(body)
	code, body = do(t, c, "GET", srv.URL+html.UnescapeString(next[1]), nil, nil)
	if code != 200 || !strings.Contains(body, "Dead letters 51–62 of <strong>62</strong>") || strings.Contains(body, `id="next-page"`) {
		t.Fatalf("group page 2 (%s): %d\n%s", next[1], code, body)
	}
	if !strings.Contains(body, html.EscapeString("idem dlq replay --handler mailer --group '"+seed.smtpFP+"'")) {
		t.Errorf("group page: the equivalent command is missing\n%s", body)
	}

	for _, tc := range []struct {
		id    int64
		wants []string
	}{
		{seed.smtp[0], []string{"(JSON, 61 bytes)", "  &#34;to&#34;: &#34;u1@example.com&#34;,", "idem dlq replay " + fmt.Sprint(seed.smtp[0]), "traceparent"}},
		{seed.binary, []string{"binary (hex)", "0a 04 08 96 01 ff fe 00 12 07 69 6e 76"}},
		{seed.undecoded, []string{"the delivery did not decode", "(binary (hex), 10 bytes)", "6e 6f 74 20 6a 73 6f 6e 00 01"}},
		{seed.hostile, []string{
			"&lt;script&gt;window.__pwned=1&lt;/script&gt;",
			"&#34;&gt;&lt;img src=x onerror=&#34;window.__pwned=2&#34;&gt;",
			`\x1b[2J\x1b[31mred\x1b[0m \u202egnp.exe`,
			"&#34;html&#34;: &#34;&lt;script&gt;window.__pwned=3&lt;/script&gt;&#34;",
			"&lt;img src=x onerror=window.__pwned=5&gt;",
		}},
	} {
		code, body := do(t, c, "GET", srv.URL+fmt.Sprintf("/dlq/%d", tc.id), nil, nil)
		if code != 200 {
			t.Fatalf("/dlq/%d: %d\n%s", tc.id, code, body)
		}
		for _, w := range tc.wants {
			if !strings.Contains(body, w) {
				t.Errorf("/dlq/%d lacks %q\n%s", tc.id, w, body)
			}
		}
		if strings.Contains(body, "<script>window") || strings.Contains(body, "<img") || strings.Contains(body, "\x1b") || strings.Contains(body, "\u202e") {
			t.Errorf("/dlq/%d carries hostile text as it is", tc.id)
		}
	}
	for path, want := range map[string]int{"/dlq/999999": 404, "/dlq/abc": 404, "/dlq?state=nonsense": 400, "/dlq/group?handler=x": 400} {
		if code, _ := do(t, c, "GET", srv.URL+path, nil, nil); code != want {
			t.Errorf("%s: %d, want %d", path, code, want)
		}
	}
	// The live view's JSON carries the hostile handler as a plain string.
	code, body = do(t, c, "GET", srv.URL+"/api/live", nil, nil)
	var live liveJSON
	if code != 200 || json.Unmarshal([]byte(body), &live) != nil || len(live.T) == 0 || live.Parked[len(live.T)-1] == nil || *live.Parked[len(live.T)-1] != 68 {
		t.Fatalf("/api/live: %d, want a sample with 68 parked\n%s", code, body)
	}
}

// TestServeRefusesActionsOffLoopback: --actions without a token is
// refused on an address other machines reach, and a short token anywhere.
func TestServeRefusesActionsOffLoopback(t *testing.T) {
	path, _, _ := seedServeStore(t)
	for _, args := range [][]string{
		{"serve", "--dsn", path, "--addr", "0.0.0.0:0", "--actions"},
		{"serve", "--dsn", path, "--addr", ":0", "--actions"},
		{"serve", "--dsn", path, "--token", "short"},
	} {
		code, _, errOut := runCLI(t, args...)
		if code != exitUsage || !(strings.Contains(errOut, "needs a token of yours") || strings.Contains(errOut, "at least 16 characters")) {
			t.Errorf("%q: exit %d, %s", args, code, errOut)
		}
	}
	// On loopback it generates a token and prints it.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out, errOut := new(testenv.Buffer), new(testenv.Buffer)
	e := &env{stdout: out, stderr: errOut, getenv: func(string) string { return "" }}
	exit := make(chan int, 1)
	go func() { exit <- runEnv(ctx, e, []string{"serve", "--dsn", path, "--addr", "127.0.0.1:0", "--actions"}) }()
	tok := regexp.MustCompile(`token for this run: ([0-9a-f]{32})`)
	for deadline := time.Now().Add(10 * time.Second); tok.FindStringSubmatch(out.String()) == nil && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
	}
	if tok.FindStringSubmatch(out.String()) == nil {
		t.Fatalf("serve --actions printed no token: %q %q", out, errOut)
	}
	cancel()
	if code := <-exit; code != exitOK {
		t.Fatalf("serve exited %d: %s", code, errOut)
	}
}

// FuzzRenderPayload: any payload renders without a panic, as one of the
// kinds, with no control character left but newlines and tabs.
//
//	go test ./cmd/idem -run '^$' -fuzz FuzzRenderPayload -fuzztime 30s
func FuzzRenderPayload(f *testing.F) {
	f.Add([]byte(hostilePayload))
	f.Add([]byte{0xff, 0x00, 0x1b})
	f.Add([]byte("plain\ntext\u202e"))
	f.Fuzz(func(t *testing.T, b []byte) {
		v := renderPayload(b)
		switch v.Kind {
		case "JSON", "text", "binary (hex)", "empty":
		default:
			t.Fatalf("kind %q", v.Kind)
		}
		for _, r := range v.Text {
			if (r < 0x20 && r != '\n' && r != '\t') || r == 0x7f || r == '\u202e' {
				t.Fatalf("renderPayload(%q) kept %U", b, r)
			}
		}
	})
}

// failOutboxRows claims the pending outbox rows as a relay would and
// records a failed publish of each: a subject no stream covers.
func failOutboxRows(t *testing.T, drv *sqlite.Driver) []int64 {
	t.Helper()
	ctx := context.Background()
	rows, _, err := drv.OutboxClaim(ctx, "relay-1", 100, 0, time.Minute)
	if err != nil || len(rows) == 0 {
		t.Fatalf("claim the outbox rows: %d rows, %v", len(rows), err)
	}
	var ids []int64
	for _, r := range rows {
		if err := drv.OutboxFailed(ctx, "relay-1", r.ID, "nats: no response from stream: no stream covers subject \"credits\"", time.Minute); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, r.ID)
	}
	return ids
}

// outboxState returns the state the outbox admin API reports for row id,
// or "" when it is not unpublished (published or discarded).
func outboxState(t *testing.T, drv *sqlite.Driver, id int64) string {
	t.Helper()
	p, err := drv.OutboxList(context.Background(), driver.OutboxFilter{AfterID: id - 1, Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Rows) == 0 || p.Rows[0].ID != id {
		return ""
	}
	return string(p.Rows[0].State)
}

// TestConsoleOutbox: the outbox page lists failing rows with their error;
// parking and discarding them need the token and a confirmation naming
// the rows, and change the store; the actor is recorded.
func TestConsoleOutbox(t *testing.T) {
	seed := seedConsoleStore(t)
	ids := failOutboxRows(t, seed.drv)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	anon := client(t)
	code, body := do(t, anon, "GET", srv.URL+"/outbox", nil, nil)
	if code != 200 || !strings.Contains(body, "2 failing") || !strings.Contains(body, "no stream covers subject &#34;credits&#34;") || strings.Contains(body, `name="id"`) {
		t.Fatalf("/outbox read-only: %d, want 2 failing rows with their error and no checkbox\n%s", code, body)
	}
	park := url.Values{"action": {"park"}, "id": {fmt.Sprint(ids[0])}, "reason": {"no stream covers it"}}
	if code, _ := do(t, anon, "POST", srv.URL+"/outbox/apply", park, nil); code != http.StatusUnauthorized {
		t.Fatalf("park without the token: %d, want 401", code)
	}
	if st := outboxState(t, seed.drv, ids[0]); st != "failing" {
		t.Fatalf("a refused park changed the row: %q", st)
	}
	alice := client(t)
	csrf := login(t, alice, srv.URL, "alice", testToken)
	// The confirmation counts the named rows that are unpublished now.
	code, body = do(t, alice, "POST", srv.URL+"/outbox/confirm", withCSRF(url.Values{"action": {"park"}, "id": {fmt.Sprint(ids[0]), "999999"}}, csrf), nil)
	if code != 200 || !strings.Contains(body, `<strong id="confirm-count">1</strong>`) || outboxState(t, seed.drv, ids[0]) != "failing" {
		t.Fatalf("confirm a park: %d\n%s", code, body)
	}
	if code, body = do(t, alice, "POST", srv.URL+"/outbox/apply", withCSRF(park, csrf), nil); code != 200 || !strings.Contains(body, `<strong id="moved">1</strong>`) {
		t.Fatalf("park: %d\n%s", code, body)
	}
	if st := outboxState(t, seed.drv, ids[0]); st != "parked" {
		t.Fatalf("the parked row is %q", st)
	}
	if _, body = do(t, alice, "GET", srv.URL+"/outbox?state=parked", nil, nil); !strings.Contains(body, "parked by alice (console): no stream covers it") {
		t.Errorf("/outbox?state=parked does not say who parked the row and why\n%s", body)
	}
	discard := url.Values{"action": {"discard"}, "id": {fmt.Sprint(ids[0]), fmt.Sprint(ids[1])}}
	if code, body = do(t, alice, "POST", srv.URL+"/outbox/apply", withCSRF(discard, csrf), nil); code != 200 || !strings.Contains(body, `<strong id="moved">2</strong>`) {
		t.Fatalf("discard: %d\n%s", code, body)
	}
	for _, id := range ids {
		if st := outboxState(t, seed.drv, id); st != "" {
			t.Errorf("discarded row %d is still %q", id, st)
		}
	}
}

// TestConsolePostgres: the groups, a group's total, a letter and a group
// replay on a PostgreSQL schema, whose times and parameters differ from
// SQLite's.
func TestConsolePostgres(t *testing.T) {
	schema, drv := migratedSchema(t)
	var ids []int64
	var fp string
	for i := range 7 {
		e := fmt.Sprintf("idem: handler %q, message %q: permanent: order %d not found", "pg<h>", fmt.Sprint(i), i)
		ids = append(ids, putDeadLetter(t, drv, "pg<h>", fmt.Sprint(i), e, idem.DeadLetterPermanent, []byte(`{"n":1}`), nil))
		fp = idem.Fingerprint(errors.New(e))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A password in the DSN (the local server trusts, and ignores it)
	// appears on no page.
	dsn, err := url.Parse(testenv.PostgresDSN())
	if err != nil {
		t.Fatal(err)
	}
	const password = "pw-hunter2-on-no-page"
	dsn.User = url.UserPassword(dsn.User.Username(), password)
	s, err := openStore(ctx, dsn.String(), storeOptions{Schema: schema, Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(serveMuxFor(s, newReadingCache(ctx, s, time.Hour, 5*time.Second), 5*time.Second, &consoleOptions{Auth: newConsoleAuth(testToken)}))
	defer srv.Close()
	c := client(t)
	code, body := do(t, c, "GET", srv.URL+"/dlq", nil, nil)
	if code != 200 || !strings.Contains(body, "7 dead letters parked in 1 group") || !strings.Contains(body, "pg&lt;h&gt;") || !strings.Contains(body, "order 6 not found") {
		t.Fatalf("/dlq on Postgres: %d\n%s", code, body)
	}
	group := srv.URL + "/dlq/group?" + url.Values{"handler": {"pg<h>"}, "fp": {fp}}.Encode()
	if code, body = do(t, c, "GET", group, nil, nil); code != 200 || !strings.Contains(body, "Dead letters 1–7 of <strong>7</strong>") || !strings.Contains(body, "--schema "+schema) {
		t.Fatalf("group on Postgres: %d\n%s", code, body)
	}
	if code, body = do(t, c, "GET", srv.URL+fmt.Sprintf("/dlq/%d", ids[3]), nil, nil); code != 200 || !strings.Contains(body, "&#34;n&#34;: 1") {
		t.Fatalf("a letter on Postgres: %d\n%s", code, body)
	}
	code, body = do(t, c, "POST", srv.URL+"/dlq/apply", url.Values{"action": {"replay"}, "scope": {"group"}, "handler": {"pg<h>"}, "fp": {fp}},
		map[string]string{"Authorization": "Bearer " + testToken, "X-Idem-Actor": "ops"})
	if code != 200 || !strings.Contains(body, `<strong id="moved">7</strong>`) {
		t.Fatalf("replay a group on Postgres: %d\n%s", code, body)
	}
	for _, p := range []string{"/", "/dlq", "/outbox", "/login", fmt.Sprintf("/dlq/%d", ids[0]), "/dlq/group?" + url.Values{"handler": {"pg<h>"}, "fp": {fp}}.Encode()} {
		if code, body := do(t, c, "GET", srv.URL+p, nil, nil); code != 200 || strings.Contains(body, password) || !strings.Contains(body, "PostgreSQL") {
			t.Errorf("%s: %d; want 200, naming the store without its password", p, code)
		}
	}
	left, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{State: driver.DeadLetterReplayRequested, Summary: true})
	if err != nil || len(left) != 7 {
		t.Fatalf("%d replay requests in the store (%v), want 7", len(left), err)
	}
}

// FuzzActionForm: any posted form parses into a valid action on dead
// letters or outbox rows (positive IDs, each once, a bounded number) or
// into an error, never a panic.
//
//	go test ./cmd/idem -run '^$' -fuzz FuzzActionForm -fuzztime 30s
func FuzzActionForm(f *testing.F) {
	f.Add("action=replay&scope=ids&id=1&id=1&id=2")
	f.Add("action=discard&scope=group&handler=%3Cscript%3E&fp=")
	f.Add("action=park&id=-1&reason=%00")
	f.Add("action=replay&scope=ids&id=99999999999999999999")
	f.Fuzz(func(t *testing.T, body string) {
		for _, parse := range []func(*http.Request) ([]int64, error){
			func(r *http.Request) ([]int64, error) {
				f, err := parseActionForm(r)
				if err != nil {
					return nil, err
				}
				if f.Scope == "group" {
					return nil, nil
				}
				return f.IDs, nil
			},
			func(r *http.Request) ([]int64, error) {
				_, ids, _, err := outboxForm(r)
				return ids, err
			},
		} {
			r := httptest.NewRequest("POST", "/", strings.NewReader(body))
			r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			if r.ParseForm() != nil {
				return
			}
			ids, err := parse(r)
			if err != nil {
				continue
			}
			if len(ids) > consoleMaxSelection {
				t.Fatalf("%q: %d IDs", body, len(ids))
			}
			seen := map[int64]bool{}
			for _, id := range ids {
				if id <= 0 || seen[id] {
					t.Fatalf("%q: IDs %v", body, ids)
				}
				seen[id] = true
			}
		}
	})
}

// TestServeLiveSamplesEveryInterval: the live view keeps one reading per
// interval, as its charts' "per interval" says. Before, the sampler woke
// on a fixed tick and found the cache still holding the reading of the
// tick before (taken a moment after it), so only every other tick added a
// sample and each point of the charts spanned two intervals.
func TestServeLiveSamplesEveryInterval(t *testing.T) {
	seed := seedConsoleStore(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := openStore(ctx, seed.path, storeOptions{Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const every = 400 * time.Millisecond
	cache := newReadingCache(ctx, s, every, 5*time.Second)
	live := newLiveRing(every)
	done := make(chan struct{})
	go func() { defer close(done); live.run(ctx, cache) }()
	time.Sleep(12 * every)
	cancel()
	<-done
	ts := live.snapshot().T
	if len(ts) < 4 {
		t.Fatalf("%d samples in %s, taken every %s", len(ts), 12*every, every)
	}
	var gaps []int64
	for i := 1; i < len(ts); i++ {
		gaps = append(gaps, ts[i]-ts[i-1])
	}
	slices.Sort(gaps)
	if median := time.Duration(gaps[len(gaps)/2]) * time.Millisecond; median > every*3/2 {
		t.Errorf("samples %v ms apart (median %s), want about every %s", gaps, median, every)
	}
}

// TestConsolePostgresBadTextParameters: a handler, fingerprint, stream,
// key or reason that PostgreSQL cannot hold as text (bytes that are not
// UTF-8, a NUL) is a bad request (400), not a failed query answered 503
// as if the store were down.
func TestConsolePostgresBadTextParameters(t *testing.T) {
	schema, drv := migratedSchema(t)
	e := `idem: handler "pg", message "1": permanent: order 1 not found`
	id := putDeadLetter(t, drv, "pg", "1", e, idem.DeadLetterPermanent, []byte(`{}`), nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// An outbox row to park, so that the reason reaches the store.
	pool := testenv.PostgresPool(t, 2)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Add(ctx, tx, &idem.Message{ID: "o-1", Stream: "credits", Payload: []byte("{}")}); err != nil {
		_ = tx.Rollback(ctx)
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var row int64
	if err := pool.QueryRow(ctx, `SELECT id FROM `+schema+`.idem_outbox`).Scan(&row); err != nil {
		t.Fatal(err)
	}
	s, err := openStore(ctx, testenv.PostgresDSN(), storeOptions{Schema: schema, Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(serveMuxFor(s, newReadingCache(ctx, s, time.Hour, 5*time.Second), 5*time.Second, &consoleOptions{Auth: newConsoleAuth(testToken)}))
	defer srv.Close()
	c := client(t)
	rowID := fmt.Sprint(row)
	for _, p := range []string{"/dlq/group?handler=%ff&fp=x", "/dlq/group?handler=pg&fp=a%00b", "/outbox?stream=%fe", "/outbox?key=k%00"} {
		if code, body := do(t, c, "GET", srv.URL+p, nil, nil); code != http.StatusBadRequest {
			t.Errorf("GET %s: %d, want 400\n%s", p, code, body)
		}
	}
	bearer := map[string]string{"Authorization": "Bearer " + testToken}
	for path, form := range map[string]url.Values{
		"/dlq/confirm":    {"action": {"replay"}, "scope": {"group"}, "handler": {"\xff"}, "fp": {"x"}},
		"/dlq/apply":      {"action": {"discard"}, "scope": {"group"}, "handler": {"pg"}, "fp": {"\x00"}},
		"/outbox/confirm": {"action": {"park"}, "id": {rowID}, "reason": {"bad\x00reason"}},
		"/outbox/apply":   {"action": {"park"}, "id": {rowID}, "reason": {"\xff"}},
	} {
		if code, body := do(t, c, "POST", srv.URL+path, form, bearer); code != http.StatusBadRequest {
			t.Errorf("POST %s %q: %d, want 400\n%s", path, form.Encode(), code, body)
		}
	}
	// Good text still works.
	if code, body := do(t, c, "GET", srv.URL+fmt.Sprintf("/dlq/%d", id), nil, nil); code != 200 {
		t.Fatalf("a letter: %d\n%s", code, body)
	}
	if code, body := do(t, c, "POST", srv.URL+"/outbox/apply", url.Values{"action": {"park"}, "id": {rowID}, "reason": {"no stream"}}, bearer); code != 200 || !strings.Contains(body, `<strong id="moved">1</strong>`) {
		t.Fatalf("park the row: %d\n%s", code, body)
	}
}

// TestConsoleCountsEveryGroup: with more groups than the pages list (an
// incident whose errors differ in words, not numbers), the overview and
// the groups page still count every parked dead letter and every group.
// Before, they added up the listed groups alone: 525 parked in 521 groups
// showed as 505 in 500, and the overview's "more groups" as 490.
func TestConsoleCountsEveryGroup(t *testing.T) {
	path := filepath.Join(t.TempDir(), "many.db")
	db, _ := testenv.SQLite(t, path, nil)
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UnixMicro()
	put := func(handler, fp string) {
		if _, err := tx.Exec(`INSERT INTO idem_dead_letters (handler, error, class, fingerprint, attempts, first_failed_at, last_failed_at) VALUES ($1, $2, 'permanent', $3, 1, $4, $4)`,
			handler, "boom: "+fp, fp, now); err != nil {
			_ = tx.Rollback()
			t.Fatal(err)
		}
	}
	for range 5 {
		put("mailer", "fp-big")
	}
	for i := range consoleMaxGroups + 20 {
		put("mailer", fmt.Sprintf("fp-%04d", i))
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	const letters, groups = 5 + consoleMaxGroups + 20, 1 + consoleMaxGroups + 20
	srv, _ := consoleServer(t, path, "", time.Hour)
	c := client(t)
	code, body := do(t, c, "GET", srv.URL+"/dlq", nil, nil)
	if want := fmt.Sprintf("%d dead letters parked in %d groups (the largest %d groups shown)", letters, groups, consoleMaxGroups); code != 200 || !strings.Contains(body, want) {
		t.Errorf("/dlq: %d, want %q\n%s", code, want, regexp.MustCompile(`(?s)<p class="muted" id="groups-total">.*?</p>`).FindString(body))
	}
	code, body = do(t, c, "GET", srv.URL+"/", nil, nil)
	for _, want := range []string{fmt.Sprintf("%d dead letters parked.", letters), fmt.Sprintf("%d more groups", groups-overviewGroups)} {
		if code != 200 || !strings.Contains(body, want) {
			t.Errorf("/: %d, want %q", code, want)
		}
	}
}

// TestConsoleGroupCommandsNameTheGroup: the commands a group's page shows
// name its handler and fingerprint as a shell reads them back, a
// multi-line error's fingerprint (line breaks, a bidi override) included.
// Before, the page showed the escapes inside '…', and the command copied
// from it selected another group: none.
func TestConsoleGroupCommandsNameTheGroup(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash:", err)
	}
	seed := seedConsoleStore(t)
	handler := "mail'er \\ \u202e"
	e := fmt.Sprintf("idem: handler %q, message %q: permanent: render receipt\ntemplate 'x' missing\r\n\tand smtp down \u202egnp.exe", handler, "j-1")
	putDeadLetter(t, seed.drv, handler, "j-1", e, idem.DeadLetterPermanent, []byte(`{}`), nil)
	fp := idem.Fingerprint(errors.New(e))
	srv, _ := consoleServer(t, seed.path, "", time.Hour)
	code, body := do(t, client(t), "GET", srv.URL+"/dlq/group?"+url.Values{"handler": {handler}, "fp": {fp}}.Encode(), nil, nil)
	cmds := regexp.MustCompile(`(?s)<pre class="cmd">(.*?)</pre>`).FindStringSubmatch(body)
	if code != 200 || cmds == nil {
		t.Fatalf("the group's page: %d\n%s", code, body)
	}
	for _, line := range strings.Split(strings.TrimSpace(html.UnescapeString(cmds[1])), "\n") {
		// The shell runs the line with an idem that prints its arguments.
		out, err := exec.Command(bash, "-c", `idem() { printf '%s\0' "$@"; }; `+line).Output()
		if err != nil {
			t.Fatalf("bash -c %q: %v", line, err)
		}
		args := strings.Split(strings.TrimSuffix(string(out), "\x00"), "\x00")
		if i := slices.Index(args, "--group"); i < 0 || i+1 >= len(args) || args[i+1] != fp {
			t.Errorf("%q\nreads back as %q: want --group %q", line, args, fp)
		}
		if i := slices.Index(args, "--handler"); i < 0 || i+1 >= len(args) || args[i+1] != handler {
			t.Errorf("%q\nreads back as %q: want --handler %q", line, args, handler)
		}
	}
}
