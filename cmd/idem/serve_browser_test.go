package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/idemhq/idem"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
)

// The console in a real browser: Debian's Chromium, headless, driven over
// the DevTools protocol. One browser serves the whole test.

// screenshotsEnv makes the browser test write the documentation's
// screenshots to docs/console/ (CI leaves them alone).
const screenshotsEnv = "IDEM_CONSOLE_SCREENSHOTS"

// browser starts a headless Chromium for t and returns a tab's context.
// The flags keep it off the network: on a closed machine Chromium
// otherwise stalls on its background requests.
func browser(t *testing.T) context.Context {
	t.Helper()
	path := testenv.Chromium(t)
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1360, 900),
	)
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancel)
	ctx, cancelTab := chromedp.NewContext(actx, chromedp.WithLogf(t.Logf))
	t.Cleanup(cancelTab)
	// The browser lives as long as the context of the first call, which
	// therefore has no deadline; the steps after it have one each.
	if err := chromedp.Do(ctx, chromedp.Navigate("about:blank")); err != nil {
		t.Fatalf("start Chromium (%s): %v", path, err)
	}
	return ctx
}

// step runs actions in the browser, bounded so that a hung page fails the
// test rather than CI.
func step(t *testing.T, ctx context.Context, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	value(t, ctx, what, chromedp.Steps(actions...))
}

// value runs a in the browser and returns its value, bounded as step.
func value[T any](t *testing.T, ctx context.Context, what string, a chromedp.Action[T]) T {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	v, err := chromedp.Run(sctx, a)
	if err != nil {
		loc, _ := chromedp.Run(ctx, chromedp.Location())
		page, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body ? document.body.innerText : ""`))
		t.Fatalf("%s (at %s): %v\npage:\n%s", what, loc, err, page)
	}
	return v
}

// screenshot saves the page as docs/console/name.png when screenshotsEnv
// is set.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	if os.Getenv(screenshotsEnv) != "1" {
		return
	}
	png := value(t, ctx, "screenshot "+name, chromedp.FullScreenshot(100))
	dir := filepath.Join("..", "..", "docs", "console")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644); err != nil {
		t.Fatal(err)
	}
}

// notPwned fails t if a hostile text ran as script on the page.
func notPwned(t *testing.T, ctx context.Context, where string) {
	t.Helper()
	typ := value(t, ctx, "read window.__pwned", chromedp.Evaluate[string](`typeof window.__pwned`))
	if typ != "undefined" {
		t.Fatalf("%s: a hostile text ran as script (window.__pwned is %s)", where, typ)
	}
}

// TestConsoleInBrowser drives the console in Chromium as an operator: the
// overview's live charts draw themselves; the dead letters' largest group
// is found and replayed after a confirmation that states its count, and
// the store holds the replay requests with the operator's name; a
// selection is discarded the same way; an action without the token (or
// without the form's CSRF token) is refused and changes nothing; hostile
// payloads, IDs, handler names and errors stay text; an outage of the
// store shows as a banner without a reload.
func TestConsoleInBrowser(t *testing.T) {
	seed := seedConsoleStore(t)
	stuck := failOutboxRows(t, seed.drv)
	srv, s := consoleServer(t, seed.path, testToken, 250*time.Millisecond)
	ctx := browser(t)
	css := func(sel string) chromedp.CSS { return chromedp.CSS(sel) }
	// text reads an element's text once it exists; read by a script, it
	// never holds a node of a page the browser has left.
	text := func(sel string) string {
		t.Helper()
		return value(t, ctx, "read "+sel, chromedp.Poll[string](fmt.Sprintf(`(function () { var e = document.querySelector(%q); return e ? e.innerText : null })()`, sel),
			chromedp.WithPollingInterval(50*time.Millisecond)))
	}
	samples := func(n int) chromedp.Action[chromedp.Void] {
		return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			_, err := chromedp.Poll[bool](fmt.Sprintf(`Number(document.body.getAttribute("data-live-samples")) >= %d`, n), chromedp.WithPollingInterval(100*time.Millisecond))(ctx, tg)
			return err
		})
	}

	step(t, ctx, "open the overview", chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible(css(`#live figure svg path.series`)))
	n0 := value(t, ctx, "count the samples", chromedp.Evaluate[int](`Number(document.body.getAttribute("data-live-samples"))`))
	// Activity for the charts: markers and duplicates arrive while the
	// console samples the store, and the charts redraw by themselves (no
	// reload) until they hold a dozen more samples.
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(120 * time.Millisecond):
			}
			// Not addMarkers: t.Fatal belongs to the test's goroutine.
			for j := range 3 + i%5 {
				_, _ = seed.db.Exec(`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES ('billing', $1, x'00', $2)`,
					fmt.Sprintf("live-%d-%d", i, j), time.Now().UnixMicro())
			}
			_, _ = seed.db.Exec(`INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES ('mailer', $1, x'00', $2)`,
				fmt.Sprintf("live-%d", i), time.Now().UnixMicro())
			_ = seed.drv.StatsAdd(context.Background(), "billing", driver.StatsDelta{Duplicates: int64(i % 3)})
		}
	}()
	step(t, ctx, "the charts update", samples(n0+12))
	close(stop)
	<-done
	step(t, ctx, "the charts update", samples(n0+14))
	heads := value(t, ctx, "read the charts", chromedp.Evaluate[[]string](`Array.from(document.querySelectorAll("#live figure h3")).map(h => h.textContent)`))
	if !slices.Contains(heads, "billing") || !slices.Contains(heads, hostileHandler) || !slices.Contains(heads, "Dead letters parked") {
		t.Fatalf("charts %q: want one per handler (the hostile name as text), the dead-letter depth and the outbox", heads)
	}
	notPwned(t, ctx, "overview")
	screenshot(t, ctx, "overview")

	// Find the largest group and open it.
	step(t, ctx, "open the dead letters", chromedp.Click(css(`nav a[href="/dlq"]`)), chromedp.WaitVisible(css(`#groups-total`)))
	notPwned(t, ctx, "groups")
	screenshot(t, ctx, "groups")
	step(t, ctx, "open the largest group", chromedp.Click(css(`table.groups tbody tr:first-child td:first-child a`)), chromedp.WaitVisible(css(`#group-total`)))
	if total := text(`#group-total`); !strings.Contains(total, "1–50 of 62") {
		t.Fatalf("the largest group says %q, want 1–50 of 62", total)
	}
	// Not logged in: the page offers no action, and an action posted
	// without the token is refused; nothing changes.
	if n := value(t, ctx, "count the buttons", chromedp.Evaluate[int](`document.querySelectorAll("button[name=action]").length`)); n != 0 {
		t.Fatalf("%d action buttons offered before login", n)
	}
	refused := fmt.Sprintf(`fetch("/dlq/apply", {method: "POST", body: new URLSearchParams({action: "discard", scope: "group", handler: "mailer", fp: %q})}).then(r => r.status)`, seed.smtpFP)
	if status := value(t, ctx, "post an action without the token", chromedp.Evaluate[int](refused, chromedp.EvalAwaitPromise)); status != http.StatusUnauthorized {
		t.Fatalf("an action without the token: HTTP %d, want 401", status)
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, seed.smtp); n != 62 {
		t.Fatalf("after a refused action %d of 62 are parked", n)
	}

	// Log in from the group's page, and come back to it.
	step(t, ctx, "log in", chromedp.Click(css(`#login`)), chromedp.WaitVisible(css(`#token`)),
		chromedp.SendKeys(css(`#name`), "alice"), chromedp.SendKeys(css(`#token`), testToken), chromedp.Click(css(`#login-submit`)),
		chromedp.WaitVisible(css(`#actor`)), chromedp.WaitVisible(css(`#replay-group`)))
	// Logged in, a post without the form's CSRF token is refused too.
	if status := value(t, ctx, "post an action without the CSRF token", chromedp.Evaluate[int](refused, chromedp.EvalAwaitPromise)); status != http.StatusForbidden {
		t.Fatalf("an action without the CSRF token: HTTP %d, want 403", status)
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, seed.smtp); n != 62 {
		t.Fatalf("after a refused action %d of 62 are parked", n)
	}
	screenshot(t, ctx, "group")

	// Replay the group: the confirmation states the count; the result
	// says how many changed, and so does the store.
	step(t, ctx, "ask to replay the group", chromedp.Click(css(`#replay-group`)), chromedp.WaitVisible(css(`#confirm`)))
	if count := text(`#confirm-count`); count != "62" {
		t.Fatalf("the confirmation counts %q, want 62", count)
	}
	if n := countState(t, seed.db, driver.DeadLetterParked, seed.smtp); n != 62 {
		t.Fatalf("the confirmation page changed the store: %d of 62 parked", n)
	}
	screenshot(t, ctx, "confirm")
	step(t, ctx, "confirm", chromedp.Click(css(`#confirm`)), chromedp.WaitVisible(css(`#moved`)))
	if moved := text(`#moved`); moved != "62" {
		t.Fatalf("the result says %q moved, want 62", moved)
	}
	screenshot(t, ctx, "result")
	if n := countState(t, seed.db, driver.DeadLetterReplayRequested, seed.smtp); n != 62 {
		t.Fatalf("%d of the group's 62 are replay_requested in the store", n)
	}
	var actors int
	if err := seed.db.QueryRow(`SELECT count(*) FROM idem_dead_letter_log WHERE state = 'replay_requested' AND actor = 'alice (console)'`).Scan(&actors); err != nil || actors != 62 {
		t.Fatalf("%d replay requests logged as alice's (%v), want 62", actors, err)
	}

	// Discard a selection of the next group, with its confirmation.
	step(t, ctx, "select two of the next group", chromedp.Navigate(srv.URL+"/dlq"), chromedp.WaitVisible(css(`#groups-total`)),
		chromedp.Click(css(`table.groups tbody tr:first-child td:first-child a`)), chromedp.WaitVisible(css(`#discard-selected`)),
		chromedp.Click(css(`#selection tbody tr:nth-child(1) input[type=checkbox]`)), chromedp.Click(css(`#selection tbody tr:nth-child(3) input[type=checkbox]`)),
		chromedp.Click(css(`#discard-selected`)), chromedp.WaitVisible(css(`#confirm`)))
	if count := text(`#confirm-count`); count != "2" {
		t.Fatalf("discarding a selection of two: the confirmation counts %q", count)
	}
	step(t, ctx, "confirm the discard", chromedp.Click(css(`#confirm`)), chromedp.WaitVisible(css(`#moved`)))
	if moved, d, p := text(`#moved`), countState(t, seed.db, driver.DeadLetterDiscarded, seed.tmpl), countState(t, seed.db, driver.DeadLetterParked, seed.tmpl); moved != "2" || d != 2 || p != 1 {
		t.Fatalf("discard of 2 of the template group: result %q; store: %d discarded, %d parked; want 2 and 1", moved, d, p)
	}

	// The outbox: park a row no stream covers, after a confirmation.
	step(t, ctx, "park an outbox row", chromedp.Click(css(`nav a[href="/outbox"]`)), chromedp.WaitVisible(css(`#outbox-selection`)))
	screenshot(t, ctx, "outbox")
	step(t, ctx, "park an outbox row", chromedp.Click(css(`#outbox-selection tbody tr:first-child input[type=checkbox]`)),
		chromedp.SendKeys(css(`#reason`), "no stream covers credits"), chromedp.Click(css(`#park-selected`)), chromedp.WaitVisible(css(`#confirm`)))
	if count := text(`#confirm-count`); count != "1" || outboxState(t, seed.drv, stuck[0]) != "failing" {
		t.Fatalf("parking one outbox row: the confirmation counts %q; the row is %q", count, outboxState(t, seed.drv, stuck[0]))
	}
	step(t, ctx, "confirm the park", chromedp.Click(css(`#confirm`)), chromedp.WaitVisible(css(`#moved`)))
	if moved, st := text(`#moved`), outboxState(t, seed.drv, stuck[0]); moved != "1" || st != "parked" {
		t.Fatalf("park: result %q, the row is %q; want 1 and parked", moved, st)
	}

	// One letter: its history names the operator.
	step(t, ctx, "open a replayed letter", chromedp.Navigate(fmt.Sprintf("%s/dlq/%d", srv.URL, seed.smtp[0])), chromedp.WaitVisible(css(`table.history`)))
	if hist := text(`table.history`); !strings.Contains(hist, "replay_requested") || !strings.Contains(hist, "alice (console)") {
		t.Fatalf("the letter's history %q does not name alice's replay", hist)
	}
	// The hostile letter renders as text.
	step(t, ctx, "open the hostile letter", chromedp.Navigate(fmt.Sprintf("%s/dlq/%d", srv.URL, seed.hostile)), chromedp.WaitVisible(css(`#payload`)))
	notPwned(t, ctx, "hostile letter")
	payload, errText, fields := text(`#payload`), text(`#error`), text(`table.kv`)
	if !strings.Contains(payload, "<script>window.__pwned=3</script>") || !strings.Contains(errText, "<script>window.__pwned=4</script>") ||
		!strings.Contains(errText, `\x1b[2J`) || !strings.Contains(fields, hostileHandler) || !strings.Contains(fields, hostileID) {
		t.Fatalf("the hostile letter does not show its text as text:\npayload %q\nerror %q\nfields %q", payload, errText, fields)
	}
	screenshot(t, ctx, "letter-hostile")
	step(t, ctx, "open a letter", chromedp.Navigate(fmt.Sprintf("%s/dlq/%d", srv.URL, seed.smtp[1])), chromedp.WaitVisible(css(`#payload`)))
	screenshot(t, ctx, "letter")
	for _, path := range []string{"/dlq?state=all", "/dlq/group?" + url.Values{"handler": {hostileHandler}, "fp": {""}}.Encode()} {
		step(t, ctx, "open "+path, chromedp.Navigate(srv.URL+path), chromedp.WaitReady(css(`main`)))
		notPwned(t, ctx, path)
	}

	// The store goes away: the overview says so without a reload.
	step(t, ctx, "back to the overview", chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible(css(`#live figure svg`)))
	s.Close()
	step(t, ctx, "see the outage", chromedp.WaitVisible(css(`#live-outage`)))
	if banner := text(`#live-outage`); !strings.Contains(banner, "has not answered since") {
		t.Fatalf("the outage banner says %q", banner)
	}
	value(t, ctx, "the charts show the gap", chromedp.Poll[bool](`document.querySelectorAll("#live figure:first-child svg rect.gap").length >= 4`, chromedp.WithPollingInterval(100*time.Millisecond)))
	screenshot(t, ctx, "outage")
}

// TestConsoleInBrowserMultilineGroup: a group whose fingerprint holds a
// line break (an errors.Join, a multi-line error) is replayed whole from
// its page. A browser sends every line break of a form's field as CR LF;
// before, the group's form carried the fingerprint as it is, so the
// confirmation counted none of the group and nothing could be done.
func TestConsoleInBrowserMultilineGroup(t *testing.T) {
	seed := seedConsoleStore(t)
	var ids []int64
	var fp string
	for i := range 3 {
		id := fmt.Sprintf("j-%d", i)
		e := fmt.Sprintf("idem: handler %q, message %q: permanent: render receipt\ntemplate missing\r\nand smtp down", "mailer", id)
		ids = append(ids, putDeadLetter(t, seed.drv, "mailer", id, e, idem.DeadLetterPermanent, []byte(`{}`), nil))
		fp = idem.Fingerprint(errors.New(e))
	}
	if !strings.Contains(fp, "\n") {
		t.Fatalf("fingerprint %q: want a line break in it", fp)
	}
	srv, _ := consoleServer(t, seed.path, testToken, time.Hour)
	ctx := browser(t)
	css := func(sel string) chromedp.CSS { return chromedp.CSS(sel) }
	text := func(sel string) string {
		t.Helper()
		return value(t, ctx, "read "+sel, chromedp.Poll[string](fmt.Sprintf(`(function () { var e = document.querySelector(%q); return e ? e.innerText : null })()`, sel),
			chromedp.WithPollingInterval(50*time.Millisecond)))
	}
	group := "/dlq/group?" + url.Values{"handler": {"mailer"}, "fp": {fp}}.Encode()
	step(t, ctx, "log in", chromedp.Navigate(srv.URL+"/login?"+url.Values{"next": {group}}.Encode()), chromedp.WaitVisible(css(`#token`)),
		chromedp.SendKeys(css(`#name`), "alice"), chromedp.SendKeys(css(`#token`), testToken), chromedp.Click(css(`#login-submit`)),
		chromedp.WaitVisible(css(`#replay-group`)))
	if total := text(`#group-total`); !strings.Contains(total, "1–3 of 3") {
		t.Fatalf("the group says %q, want 1–3 of 3", total)
	}
	step(t, ctx, "ask to replay the group", chromedp.Click(css(`#replay-group`)), chromedp.WaitReady(css(`#confirm-count`)))
	if count := text(`#confirm-count`); count != "3" {
		t.Fatalf("the confirmation counts %q, want 3", count)
	}
	step(t, ctx, "confirm", chromedp.Click(css(`#confirm`)), chromedp.WaitVisible(css(`#moved`)))
	if moved := text(`#moved`); moved != "3" {
		t.Fatalf("the result says %q moved, want 3", moved)
	}
	if n := countState(t, seed.db, driver.DeadLetterReplayRequested, ids); n != 3 {
		t.Fatalf("%d of the group's 3 are replay_requested in the store", n)
	}
}
