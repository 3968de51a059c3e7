package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
)

// browserLocation resolves a Location header against base as a browser
// does: the WHATWG URL parser drops every ASCII tab and newline first.
func browserLocation(t *testing.T, base, loc string) *url.URL {
	t.Helper()
	loc = strings.NewReplacer("\t", "", "\n", "", "\r", "").Replace(loc)
	b, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	u, err := b.Parse(loc)
	if err != nil {
		t.Fatalf("Location %q: %v", loc, err)
	}
	return u
}

// TestConsoleLoginNextStaysOnServer: the page a login returns to (next)
// is a path of the console, whatever a link to /login put there. A tab or
// newline a browser drops would otherwise turn "/\t/evil.example" into the
// scheme-relative "//evil.example": an open redirect from a genuine login.
func TestConsoleLoginNextStaysOnServer(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	for _, next := range []string{"/\t/evil.example", "/\t\\evil.example", "/\r/evil.example", "/\x00/evil.example", "/\x0b/evil.example", "/dlq\x7f"} {
		c := client(t)
		code, body := do(t, c, "GET", srv.URL+"/login?next="+url.QueryEscape(next), nil, nil)
		m := csrfField.FindStringSubmatch(body)
		if code != http.StatusOK || m == nil {
			t.Fatalf("/login: %d\n%s", code, body)
		}
		req, err := http.NewRequest("POST", srv.URL+"/login", strings.NewReader(url.Values{"csrf": {m[1]}, "name": {"alice"}, "token": {testToken}, "next": {next}}.Encode()))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		srvURL, _ := url.Parse(srv.URL)
		for _, ck := range c.Jar.Cookies(&url.URL{Scheme: "http", Host: srvURL.Host, Path: "/login"}) {
			req.AddCookie(ck)
		}
		// The transport itself: a client would refuse to parse the
		// Location a browser follows.
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusSeeOther {
			t.Fatalf("login with next %q: %d", next, resp.StatusCode)
		}
		loc := resp.Header.Get("Location")
		if u := browserLocation(t, srv.URL, loc); u.Host != srvURL.Host {
			t.Errorf("login with next %q redirects to %q: a browser goes to %s", next, loc, u)
		}
		if strings.ContainsFunc(loc, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			t.Errorf("login with next %q: Location %q holds a control character", next, loc)
		}
	}
}

// TestConsoleLiveEscapesHandlerNames: the charts' handler names in
// /api/live are escaped as every page escapes them: a bidi override or an
// ESC in a stored handler name shows as \u202e, \x1b.
func TestConsoleLiveEscapesHandlerNames(t *testing.T) {
	seed := seedConsoleStore(t)
	hostile := "\u202egnp.exe\x1b[2J"
	addMarkers(t, seed.db, hostile, 0, 3)
	srv, _ := consoleServer(t, seed.path, "", 50*time.Millisecond)
	var names []string
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		code, body := do(t, client(t), "GET", srv.URL+"/api/live", nil, nil)
		if code != http.StatusOK {
			t.Fatalf("/api/live: %d\n%s", code, body)
		}
		var j struct {
			Handlers []struct{ Name string } `json:"handlers"`
		}
		if err := json.Unmarshal([]byte(body), &j); err != nil {
			t.Fatal(err)
		}
		names = names[:0]
		for _, h := range j.Handlers {
			names = append(names, h.Name)
		}
		if len(names) >= 3 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	found := false
	for _, n := range names {
		if strings.ContainsAny(n, "\u202e\x1b") {
			t.Errorf("/api/live names a handler %q: want its control and format characters escaped", n)
		}
		found = found || n == termText(hostile)
	}
	if !found {
		t.Errorf("/api/live's handlers %q: want %q among them", names, termText(hostile))
	}
}

// TestOutboxCheckEscapesStoredIDs: outbox check prints the aggregates it
// finds in a consumer's message IDs, which come from the broker: an ESC
// or a bidi override among them reaches the terminal escaped.
func TestOutboxCheckEscapesStoredIDs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	producer, consumer := filepath.Join(dir, "producer.db"), filepath.Join(dir, "consumer.db")
	db, drv := testenv.SQLite(t, producer, nil)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.AddNext(ctx, tx, "orders", "o-1", "OrderPlaced", []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	cdb, _ := testenv.SQLite(t, consumer, nil)
	hostileAgg := "\x1b]0;pwned\x07\x1b[2J\u202eevil"
	if _, err := cdb.Exec(`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES ('billing', $1, x'00', $2)`,
		outbox.MessageID("orders", hostileAgg, 9), time.Now().UnixMicro()); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLI(t, "outbox", "check", "--dsn", producer, "--consumer", consumer)
	if code != exitFailed || !strings.Contains(out, termText(hostileAgg)) {
		t.Fatalf("outbox check: exit %d, want %d and the aggregate %q escaped\n%s%s", code, exitFailed, termText(hostileAgg), out, errOut)
	}
	if strings.ContainsAny(out+errOut, "\x1b\x07\u202e") {
		t.Errorf("outbox check printed a stored control or format character raw:\n%q", out+errOut)
	}
}

// TestConsoleCookiesSecureBehindTLSProxy: behind the TLS proxy
// docs/console.md recommends, the console itself speaks plain HTTP; the
// proxy's X-Forwarded-Proto (or Forwarded) still marks the login and
// session cookies Secure, so a browser never sends them in clear. Without
// such a header they are not Secure (the loopback console over HTTP must
// keep working).
func TestConsoleCookiesSecureBehindTLSProxy(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	for _, c := range []struct {
		header, value string
		secure        bool
	}{
		{"", "", false},
		{"X-Forwarded-Proto", "https", true},
		{"X-Forwarded-Proto", "http", false},
		{"Forwarded", `for=192.0.2.60;proto=https;by=203.0.113.43`, true},
		{"Forwarded", `for=192.0.2.60;proto=http`, false},
	} {
		header := func(req *http.Request) {
			if c.header != "" {
				req.Header.Set(c.header, c.value)
			}
		}
		req, err := http.NewRequest("GET", srv.URL+"/login", nil)
		if err != nil {
			t.Fatal(err)
		}
		header(req)
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		body := new(strings.Builder)
		_, _ = io.Copy(body, resp.Body)
		resp.Body.Close()
		m := csrfField.FindStringSubmatch(body.String())
		if len(resp.Cookies()) != 1 || m == nil {
			t.Fatalf("%s: %s: GET /login set %d cookies", c.header, c.value, len(resp.Cookies()))
		}
		login := resp.Cookies()[0]
		if login.Secure != c.secure {
			t.Errorf("%s: %s: the login form's cookie Secure=%v, want %v", c.header, c.value, login.Secure, c.secure)
		}
		req, err = http.NewRequest("POST", srv.URL+"/login", strings.NewReader(url.Values{"csrf": {m[1]}, "name": {"alice"}, "token": {testToken}}.Encode()))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Origin", srv.URL)
		header(req)
		req.AddCookie(&http.Cookie{Name: login.Name, Value: login.Value})
		resp, err = http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		var session *http.Cookie
		for _, ck := range resp.Cookies() {
			if ck.Value != "" && ck.MaxAge >= 0 {
				session = ck
			}
		}
		if resp.StatusCode != http.StatusSeeOther || session == nil {
			t.Fatalf("%s: %s: login answered %d with cookies %v", c.header, c.value, resp.StatusCode, resp.Cookies())
		}
		if session.Secure != c.secure {
			t.Errorf("%s: %s: the session cookie Secure=%v, want %v", c.header, c.value, session.Secure, c.secure)
		}
	}
}

// TestConsoleWrongTokensAnsweredOneAtATime: guesses of the token, as a
// bearer or through the login form, sent in parallel, are answered one
// after another, each after loginFailDelay: no more than a few a second,
// however many connections a guesser opens.
func TestConsoleWrongTokensAnsweredOneAtATime(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	one := url.Values{"action": {"replay"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.tmpl[0])}}
	const guesses = 6
	start := time.Now()
	var wg sync.WaitGroup
	for i := range guesses {
		wg.Go(func() {
			hdr := map[string]string{"Authorization": fmt.Sprintf("Bearer %s-%d", testToken, i)}
			if code, _ := do(t, client(t), "POST", srv.URL+"/dlq/apply", one, hdr); code != http.StatusUnauthorized {
				t.Errorf("guess %d: %d, want 401", i, code)
			}
		})
	}
	wg.Wait()
	if took, least := time.Since(start), guesses*loginFailDelay; took < least {
		t.Errorf("%d wrong bearer tokens in parallel answered in %s; one at a time takes at least %s", guesses, took, least)
	}
}

// TestConsoleGroupActionAppliesToWhatWasConfirmed: a group's action
// applies to the dead letters the confirmation counted. One of the group
// that failed after the operator read "Discard 62 dead letters?" (an
// incident going on) stays parked for a look of its own; before, the
// action took every parked letter of the group at apply time, unseen.
func TestConsoleGroupActionAppliesToWhatWasConfirmed(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	c := client(t)
	csrf := login(t, c, srv.URL, "alice", testToken)
	code, body := do(t, c, "POST", srv.URL+"/dlq/confirm", withCSRF(url.Values{"action": {"discard"}, "scope": {"group"}, "handler": {"mailer"}, "fp": {seed.smtpFP}}, csrf), nil)
	if code != 200 || !strings.Contains(body, `<strong id="confirm-count">62</strong>`) {
		t.Fatalf("confirm the group's discard: %d\n%s", code, body)
	}
	form := url.Values{}
	for _, m := range regexp.MustCompile(`<input type="hidden" name="([a-z]+)" value="([^"]*)">`).FindAllStringSubmatch(body, -1) {
		form.Add(m[1], html.UnescapeString(m[2]))
	}
	if g, _ := url.ParseQuery(form.Get("group")); form.Get("until") == "" || g.Get("fp") != seed.smtpFP {
		t.Fatalf("the confirmation's form: %v", form)
	}
	time.Sleep(2 * time.Millisecond)
	e := fmt.Sprintf("idem: handler %q, message %q: permanent: smtp: 550 5.1.1 <u%d@example.com>: mailbox unknown", "mailer", "m-late", 999)
	late := putDeadLetter(t, seed.drv, "mailer", "m-late", e, idem.DeadLetterPermanent, []byte(`{}`), nil)
	if fp := idem.Fingerprint(errors.New(e)); fp != seed.smtpFP {
		t.Fatalf("the late dead letter's group %s, want %s", fp, seed.smtpFP)
	}
	code, body = do(t, c, "POST", srv.URL+"/dlq/apply", form, nil)
	if code != 200 || !strings.Contains(body, `<strong id="moved">62</strong>`) {
		t.Fatalf("apply: %d, want 62 moved\n%s", code, body)
	}
	if n := countState(t, seed.db, driver.DeadLetterDiscarded, seed.smtp); n != 62 {
		t.Errorf("%d of the 62 confirmed discarded", n)
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, []int64{late}); n != 1 {
		t.Error("the dead letter that failed after the confirmation was discarded unseen")
	}
}

// TestConsoleGroupActionNeedsHandlerAndFingerprint: a group action whose
// handler or fingerprint is empty is refused (400) and changes nothing.
// The selection leaves out an empty condition, so before, "fp=" replayed
// or discarded every parked dead letter of the handler, whatever its
// group, after a confirmation that counted none.
func TestConsoleGroupActionNeedsHandlerAndFingerprint(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	bearer := map[string]string{"Authorization": "Bearer " + testToken, "X-Idem-Actor": "script"}
	for _, form := range []url.Values{
		{"action": {"discard"}, "scope": {"group"}, "handler": {"mailer"}, "fp": {""}},
		{"action": {"discard"}, "scope": {"group"}, "handler": {""}, "fp": {seed.tmplFP}},
		{"action": {"replay"}, "scope": {"group"}, "handler": {""}, "fp": {""}},
	} {
		for _, path := range []string{"/dlq/confirm", "/dlq/apply"} {
			if code, body := do(t, client(t), "POST", srv.URL+path, form, bearer); code != http.StatusBadRequest {
				t.Errorf("%s %s: %d, want 400\n%s", path, form.Encode(), code, body)
			}
		}
	}
	all := append(append([]int64{seed.hostile, seed.binary, seed.undecoded}, seed.smtp...), seed.tmpl...)
	if n := countState(t, seed.db, driver.DeadLetterParked, all); n != len(all) {
		t.Fatalf("%d of %d dead letters parked after group actions without a handler or fingerprint", n, len(all))
	}
}

// TestConsoleAbandonedGuessesLeaveTheQueue: a wrong token whose client
// has gone (it closed the connection while its answer waited its turn)
// leaves the queue of wrong tokens at once. Before, each kept its
// connection and its place, and the next wrong token, a mistyped login
// included, waited loginFailDelay for every guess sent and dropped before
// it: a client could hold the server's connections for as long as it
// liked at the cost of a request each.
func TestConsoleAbandonedGuessesLeaveTheQueue(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	one := url.Values{"action": {"replay"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.tmpl[0])}}
	const abandoned = 12
	var wg sync.WaitGroup
	for i := range abandoned {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), loginFailDelay/2)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, "POST", srv.URL+"/dlq/apply", strings.NewReader(one.Encode()))
			if err != nil {
				t.Error(err)
				return
			}
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Header.Set("Authorization", fmt.Sprintf("Bearer %s-%d", testToken, i))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	start := time.Now()
	hdr := map[string]string{"Authorization": "Bearer " + testToken + "-mistyped"}
	if code, _ := do(t, client(t), "POST", srv.URL+"/dlq/apply", one, hdr); code != http.StatusUnauthorized {
		t.Fatalf("a wrong token: %d, want 401", code)
	}
	if took, most := time.Since(start), 4*loginFailDelay; took > most {
		t.Errorf("a wrong token after %d abandoned ones answered in %s, want at most %s", abandoned, took, most)
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, seed.tmpl[:1]); n != 1 {
		t.Fatal("a wrong token changed the store")
	}
}

// TestConsoleRightTokenAnsweredInItsTurn: while a wrong token holds its
// turn, the right one is not answered either. Before, the right token was
// answered at once while the wrong ones waited, so a guesser that gave up
// on every guess not answered within a few milliseconds learned each
// answer at whatever rate it liked, and loginFailDelay limited nothing.
func TestConsoleRightTokenAnsweredInItsTurn(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	one := url.Values{"action": {"replay"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.tmpl[0])}}
	wrong := make(chan int, 1)
	go func() {
		code, _ := do(t, client(t), "POST", srv.URL+"/dlq/apply", one, map[string]string{"Authorization": "Bearer " + testToken + "-wrong"})
		wrong <- code
	}()
	time.Sleep(loginFailDelay / 2) // the wrong token has its turn
	start := time.Now()
	code, body := do(t, client(t), "POST", srv.URL+"/dlq/apply", one, map[string]string{"Authorization": "Bearer " + testToken})
	took := time.Since(start)
	if code != 200 || !strings.Contains(body, `<strong id="moved">1</strong>`) {
		t.Fatalf("the right token: %d\n%s", code, body)
	}
	if code := <-wrong; code != http.StatusUnauthorized {
		t.Fatalf("the wrong token: %d, want 401", code)
	}
	if least := loginFailDelay / 4; took < least {
		t.Errorf("the right token, sent while a wrong one held the turn, answered in %s: before the turn ended (at least %s)", took, least)
	}
}

// TestConsoleTokenQueueIsBounded: wrong tokens sent faster than they are
// answered build no queue without end. With maxTokenWaiting checks
// waiting, a token is refused at once with 429, the right one included,
// which then knows to try again instead of hanging; once the wrong ones
// are answered, it passes.
func TestConsoleTokenQueueIsBounded(t *testing.T) {
	seed := seedConsoleStore(t)
	auth := newConsoleAuth(testToken)
	srv, _ := consoleServerAuth(t, seed.path, auth, time.Hour)
	one := url.Values{"action": {"replay"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.tmpl[0])}}
	const wrong = 1 + maxTokenWaiting // one in its turn, the rest waiting
	codes := make(chan int, wrong)
	var wg sync.WaitGroup
	for i := range wrong {
		wg.Go(func() {
			code, _ := do(t, client(t), "POST", srv.URL+"/dlq/apply", one, map[string]string{"Authorization": fmt.Sprintf("Bearer %s-%d", testToken, i)})
			codes <- code
		})
	}
	for deadline := time.Now().Add(10 * time.Second); auth.waiting.Load() < maxTokenWaiting; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d checks waiting after 10 s, want %d", auth.waiting.Load(), maxTokenWaiting)
		}
	}
	start := time.Now()
	code, body := do(t, client(t), "POST", srv.URL+"/dlq/apply", one, map[string]string{"Authorization": "Bearer " + testToken})
	if took := time.Since(start); code != http.StatusTooManyRequests || took > loginFailDelay {
		t.Errorf("the right token behind %d wrong ones: %d after %s, want 429 at once\n%s", wrong, code, took, body)
	}
	wg.Wait()
	close(codes)
	for c := range codes {
		if c != http.StatusUnauthorized {
			t.Errorf("a wrong token admitted to the queue: %d, want 401", c)
		}
	}
	code, body = do(t, client(t), "POST", srv.URL+"/dlq/apply", one, map[string]string{"Authorization": "Bearer " + testToken})
	if code != 200 || !strings.Contains(body, `<strong id="moved">1</strong>`) {
		t.Fatalf("the right token once the queue is gone: %d\n%s", code, body)
	}
}

// TestConsoleBearerSchemeAnyCase: the Authorization scheme's name is
// case-insensitive (RFC 9110), so "bearer" and "BEARER" carry the token
// as "Bearer" does. Before, such a script was refused with "actions need
// the token", the token it sent never looked at.
func TestConsoleBearerSchemeAnyCase(t *testing.T) {
	seed := seedConsoleStore(t)
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	for i, scheme := range []string{"bearer", "BEARER"} {
		form := url.Values{"action": {"replay"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.tmpl[i])}}
		code, body := do(t, client(t), "POST", srv.URL+"/dlq/apply", form, map[string]string{"Authorization": scheme + " " + testToken, "X-Idem-Actor": "cron"})
		if code != 200 || !strings.Contains(body, `<strong id="moved">1</strong>`) {
			t.Errorf("Authorization: %s <token>: %d\n%s", scheme, code, body)
		}
	}
	if n := countState(t, seed.db, driver.DeadLetterReplayRequested, seed.tmpl[:2]); n != 2 {
		t.Fatalf("%d of 2 replay requests in the store", n)
	}
	// A wrong token in any case is still a wrong token.
	if code, _ := do(t, client(t), "POST", srv.URL+"/dlq/apply", url.Values{"action": {"replay"}, "scope": {"ids"}, "id": {fmt.Sprint(seed.tmpl[2])}},
		map[string]string{"Authorization": "bearer " + testToken + "x"}); code != http.StatusUnauthorized {
		t.Errorf("a wrong lower-case bearer token: %d, want 401", code)
	}
}
