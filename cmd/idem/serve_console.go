package main

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem/driver"
)

// The console's pages are server-rendered html/template (contextual
// escaping); its one script draws the live charts from /api/live and is
// served from /static/, so the Content-Security-Policy forbids every inline
// script: an injected <script> would not run even if escaping failed.

//go:embed console
var consoleFiles embed.FS

// consoleOptions configure the console beyond the store's reading.
type consoleOptions struct {
	// Auth checks the credentials of actions; nil is read-only.
	Auth *consoleAuth
	// Live is the sampled history the charts draw; nil draws none.
	Live *liveRing
	// Logger records each action; nil discards.
	Logger *slog.Logger
}

// console serves the operator pages.
type console struct {
	s       *store
	cache   *readingCache
	timeout time.Duration
	auth    *consoleAuth
	live    *liveRing
	log     *slog.Logger
	pages   map[string]*template.Template
}

// consoleTemplateFuncs are the functions the pages use.
var consoleTemplateFuncs = template.FuncMap{
	"clip":  clip,
	"term":  termText,
	"lines": termBlock,
	"when":  func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
	"ago": func(t time.Time) string {
		d := time.Since(t).Round(time.Second)
		if d < 0 {
			d = 0
		}
		return d.String()
	},
	"groupURL": func(handler, fp, state string) string {
		v := url.Values{"handler": {handler}, "fp": {fp}}
		if state != "" && state != driver.DeadLetterParked {
			v.Set("state", state)
		}
		return "/dlq/group?" + v.Encode()
	},
	// groupField is a group's handler and fingerprint as one form field
	// without a line break (see parseActionForm).
	"groupField": func(handler, fp string) string { return url.Values{"handler": {handler}, "fp": {fp}}.Encode() },
	"outboxURL":  outboxURL,
	"action":     func(a string) string { return outboxActions[a] },
	"plural":     func(n any, word string) string { return plural(int(toInt64(n)), word) },
	"len64":      func(v any) int64 { return int64(reflect.ValueOf(v).Len()) },
	"sub":        func(a, b int64) int64 { return a - b },
}

// toInt64 returns the integer n of a page's data as int64.
func toInt64(n any) int64 {
	switch v := n.(type) {
	case int:
		return int64(v)
	case int64:
		return v
	}
	return 0
}

// consolePages are the page templates, each rendered inside layout.html.
var consolePages = []string{"overview", "groups", "group", "letter", "confirm", "result", "outbox", "outbox_confirm", "outbox_result", "login", "error"}

// parseConsolePages parses each page with the layout.
func parseConsolePages() map[string]*template.Template {
	base := template.Must(template.New("layout.html").Funcs(consoleTemplateFuncs).ParseFS(consoleFiles, "console/layout.html"))
	pages := make(map[string]*template.Template, len(consolePages))
	for _, p := range consolePages {
		pages[p] = template.Must(template.Must(base.Clone()).ParseFS(consoleFiles, "console/"+p+".html"))
	}
	return pages
}

// consolePageTemplates are parsed once: the files are embedded.
var consolePageTemplates = parseConsolePages()

// view is what every page's layout shows.
type view struct {
	Title string
	Store string
	Now   time.Time
	// ActionsOn says the console takes actions (a token is set); Actor
	// and CSRF are the logged-in operator's.
	ActionsOn   bool
	Actor, CSRF string
	// Path is the page's path; Here its path and query, where a login
	// returns to.
	Path, Here string
	Page       any
}

// render writes the page name with its data p.
func (c *console) render(w http.ResponseWriter, r *http.Request, code int, name, title string, p any) {
	v := view{Title: title, Store: c.s.String(), Now: time.Now().UTC().Truncate(time.Second), ActionsOn: c.auth != nil, Path: r.URL.Path, Here: r.URL.RequestURI(), Page: p}
	if _, s := c.auth.session(r); s != nil {
		v.Actor, v.CSRF = s.actor, s.csrf
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store") // a page holds its session's CSRF token
	w.WriteHeader(code)
	if err := c.pages[name].ExecuteTemplate(w, "layout.html", v); err != nil {
		// The header is out; all that is left is to stop writing.
		c.log.Warn("idem serve: render a page", "page", name, "error", err)
	}
}

// errorPage is a failed request's page.
type errorPage struct {
	Code int
	Text string
}

// fail answers r with err on the error page.
func (c *console) fail(w http.ResponseWriter, r *http.Request, code int, err error) {
	c.render(w, r, code, "error", http.StatusText(code), errorPage{Code: code, Text: err.Error()})
}

// routes adds the console's pages to mux.
func (c *console) routes(mux *http.ServeMux) {
	mux.HandleFunc("GET /{$}", c.overview)
	mux.HandleFunc("GET /dlq", c.groups)
	mux.HandleFunc("GET /dlq/group", c.group)
	mux.HandleFunc("GET /dlq/{id}", c.letter)
	mux.HandleFunc("POST /dlq/confirm", c.confirm)
	mux.HandleFunc("POST /dlq/apply", c.apply)
	mux.HandleFunc("GET /outbox", c.outboxList)
	mux.HandleFunc("POST /outbox/confirm", c.outboxConfirm)
	mux.HandleFunc("POST /outbox/apply", c.outboxApply)
	mux.HandleFunc("GET /login", c.loginForm)
	mux.HandleFunc("POST /login", c.login)
	mux.HandleFunc("POST /logout", c.logout)
	mux.HandleFunc("GET /api/live", c.liveJSON)
	static, _ := fs.Sub(consoleFiles, "console/static")
	mux.Handle("GET /static/", http.StripPrefix("/static/", staticFiles(static)))
}

// staticFiles serves the console's script and style sheet.
func staticFiles(fsys fs.FS) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name := r.URL.Path
		var typ string
		switch {
		case strings.HasSuffix(name, ".js"):
			typ = "text/javascript; charset=utf-8"
		case strings.HasSuffix(name, ".css"):
			typ = "text/css; charset=utf-8"
		default:
			http.NotFound(w, r)
			return
		}
		f, err := fsys.Open(name)
		if err != nil {
			http.NotFound(w, r)
			return
		}
		defer f.Close()
		w.Header().Set("Content-Type", typ)
		w.Header().Set("Cache-Control", "no-cache")
		_, _ = io.Copy(w, f)
	})
}

// authorizeForm parses an action's form and returns its actor; it answers
// a refusal itself (401 without credentials, 403 for a read-only console,
// a wrong CSRF token or another origin) and returns ok false then.
func (c *console) authorizeForm(w http.ResponseWriter, r *http.Request) (actor string, ok bool) {
	r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
	if err := r.ParseForm(); err != nil {
		c.fail(w, r, http.StatusBadRequest, fmt.Errorf("read the form: %w", err))
		return "", false
	}
	actor, err := c.auth.authorize(r)
	if err != nil {
		code := http.StatusForbidden
		switch {
		case errors.Is(err, errNoCredentials):
			code = http.StatusUnauthorized
		case errors.Is(err, errTokenChecksBusy):
			code = http.StatusTooManyRequests
		}
		c.fail(w, r, code, err)
		return "", false
	}
	return actor, true
}

// checkText refuses a text parameter that a PostgreSQL store cannot hold:
// bytes that are not UTF-8, or a NUL. Such a value names nothing there,
// and passed to a query it fails the query, which the page would answer
// with 503 as if the store were down. params are pairs of a parameter's
// name and its value. SQLite and MySQL hold any bytes.
func (c *console) checkText(params ...string) error {
	if c.s.kind != kindPostgres {
		return nil
	}
	for i := 0; i+1 < len(params); i += 2 {
		if v := params[i+1]; !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
			return fmt.Errorf("%s %q: PostgreSQL holds no such text (not UTF-8, or a NUL)", params[i], termText(v))
		}
	}
	return nil
}

// loginPage is the login form.
type loginPage struct {
	CSRF, Next, Name, Err string
}

// safeNext returns next when it is a path on this server, else "/dlq".
// A browser drops every tab and newline in a Location before it reads it,
// and treats a backslash as a slash, so "/\t/evil.example" would go to
// //evil.example: next may hold no control character at all.
func safeNext(next string) string {
	if strings.HasPrefix(next, "/") && !strings.HasPrefix(next, "//") && !strings.ContainsAny(next, "\\") &&
		!strings.ContainsFunc(next, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return next
	}
	return "/dlq"
}

func (c *console) loginForm(w http.ResponseWriter, r *http.Request) {
	if c.auth == nil {
		c.fail(w, r, http.StatusForbidden, errReadOnly)
		return
	}
	c.render(w, r, http.StatusOK, "login", "Log in", loginPage{CSRF: loginCSRF(w, r), Next: safeNext(r.URL.Query().Get("next"))})
}

// loginFailDelay slows down guessing the token: each wrong one, through
// the form or as a bearer, is answered after it, one at a time.
const loginFailDelay = 300 * time.Millisecond

func (c *console) login(w http.ResponseWriter, r *http.Request) {
	if c.auth == nil {
		c.fail(w, r, http.StatusForbidden, errReadOnly)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if err := r.ParseForm(); err != nil {
		c.fail(w, r, http.StatusBadRequest, err)
		return
	}
	p := loginPage{Next: safeNext(r.PostFormValue("next")), Name: r.PostFormValue("name")}
	actor := cleanActor(p.Name)
	code := http.StatusUnauthorized
	if !sameOrigin(r) || !loginCSRFOK(r) {
		p.Err = errBadCSRF.Error()
	} else {
		switch err := c.auth.tryToken(r.Context(), r.PostFormValue("token")); {
		case errors.Is(err, errTokenChecksBusy):
			p.Err, code = err.Error(), http.StatusTooManyRequests
		case err != nil:
			p.Err = "wrong token"
		case actor == "":
			p.Err = "give your name: it is recorded with each of your actions"
		}
	}
	if p.Err != "" {
		p.CSRF = loginCSRF(w, r)
		c.render(w, r, code, "login", "Log in", p)
		return
	}
	id, _ := c.auth.login(actor)
	setSessionCookie(w, r, id, int(sessionTTL/time.Second))
	c.log.Info("idem serve: console login", "actor", actor, "remote", r.RemoteAddr)
	http.Redirect(w, r, p.Next, http.StatusSeeOther)
}

func (c *console) logout(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		c.fail(w, r, http.StatusBadRequest, err)
		return
	}
	if _, err := c.auth.authorize(r); err != nil {
		c.fail(w, r, http.StatusForbidden, err)
		return
	}
	if id, _ := c.auth.session(r); id != "" {
		c.auth.logout(id)
	}
	setSessionCookie(w, r, "", -1)
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// overviewPage is the console's front page: the per-handler counts, the
// live charts, the outbox and the largest dead-letter groups.
type overviewPage struct {
	Read      time.Time     // when the counts were read
	Refresh   time.Duration // how old they may be
	Estimate  *int64        // the planner's estimate of all markers, if known
	Err       string
	DownSince time.Time     // when the store stopped answering, during an outage
	DownFor   time.Duration // how long it has not answered
	Handlers  []*handlerStats
	Outbox    *outboxReport
	Groups    []dlGroup
	Parked    int64
	More      int
	Live      bool
}

// overviewGroups is how many dead-letter groups the front page lists.
const overviewGroups = 10

// down records an outage that began at since.
func (d *overviewPage) down(since time.Time) {
	d.DownSince, d.DownFor = since.UTC().Truncate(time.Second), time.Since(since).Round(time.Second)
}

func (c *console) overview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	d := overviewPage{Refresh: c.cache.ttl, Live: c.live != nil}
	rd, read := c.cache.get(ctx)
	d.Read = read.UTC().Truncate(time.Second)
	if n, ok, err := c.s.markerEstimate(ctx); err == nil && ok {
		d.Estimate = &n // read on each view: a catalog lookup, not a count
	}
	d.Handlers, d.Outbox = rd.handlers, rd.outbox
	if !rd.downSince.IsZero() {
		d.down(rd.downSince)
	}
	err := rd.err
	if err == nil {
		var dl driver.DeadLetterStore
		if dl, err = c.deadLetters(); err == nil {
			d.Groups, err = c.s.deadLetterGroups(ctx, dl, driver.DeadLetterParked)
		}
		for _, g := range d.Groups {
			d.Parked += g.Count
		}
		n := int64(len(d.Groups))
		if err == nil && n == consoleMaxGroups {
			// Not every group is listed: count them all.
			var parked, all int64
			if parked, all, err = c.s.deadLetterTotals(ctx, driver.DeadLetterParked); err == nil {
				d.Parked, n = parked, all
			}
		}
		if n > overviewGroups {
			d.More = int(n) - overviewGroups
			d.Groups = d.Groups[:overviewGroups]
		}
	}
	code := http.StatusOK
	if err != nil {
		d.Err = err.Error()
		code = http.StatusServiceUnavailable
		if rd.err == nil && ctx.Err() == nil && !errors.Is(err, context.Canceled) {
			// The counts came from the cache; the store failed now.
			d.down(c.cache.failed())
		}
	}
	c.render(w, r, code, "overview", "Overview", d)
}
