package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
)

// The console's security model. Reading needs nothing: the console listens
// on the loopback interface by default, and behind a proxy the proxy
// decides who reads. Every action (replay, discard) needs the token given
// with --token or IDEM_SERVE_TOKEN, presented either by a login form that
// opens a session (a cookie: HttpOnly, SameSite=Strict) or as an
// "Authorization: Bearer" header. A session's forms carry its CSRF token,
// compared in constant time; every action is a POST. Each action is logged
// in the dead-letter history with the actor: the name given at login, or
// the X-Idem-Actor header of a bearer request.

// serveTokenEnv is the environment variable that supplies the token when
// --token is not given.
const serveTokenEnv = "IDEM_SERVE_TOKEN"

// minTokenLen is the shortest token accepted: a short one could be guessed.
const minTokenLen = 16

// sessionTTL is how long a console session lasts after login.
const sessionTTL = 12 * time.Hour

// maxSessions bounds the sessions kept in memory; the oldest goes first.
const maxSessions = 1000

// maxActorLen bounds an actor's name as recorded in the history.
const maxActorLen = 64

// Cookie names.
const (
	sessionCookie = "idem_session"
	loginCookie   = "idem_login" // the login form's CSRF value
)

// errTokenTooShort refuses a token that could be guessed.
var errTokenTooShort = fmt.Errorf("the token must be at least %d characters: generate one with 'openssl rand -hex 32'", minTokenLen)

// checkToken validates a token from --token or the environment.
func checkToken(tok string) error {
	if tok == "" {
		return nil
	}
	if len(tok) < minTokenLen {
		return errTokenTooShort
	}
	if strings.ContainsFunc(tok, func(r rune) bool { return r < 0x21 || r == 0x7f }) || !utf8.ValidString(tok) {
		return errors.New("the token must be printable text without spaces")
	}
	return nil
}

// loopbackAddr reports whether the listen address addr (--addr) accepts
// connections from this machine only.
func loopbackAddr(addr string) bool {
	h := normalHost(addr)
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// newToken returns a random token of 32 hex digits.
func newToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b)
}

// session is an operator logged in to the console.
type session struct {
	actor   string
	csrf    string
	expires time.Time
}

// consoleAuth checks the console's credentials. A nil *consoleAuth is a
// read-only console: no one may act.
type consoleAuth struct {
	// tokenHash is the SHA-256 of the token: comparing hashes of equal
	// length keeps the comparison's time independent of the token's.
	tokenHash [32]byte

	mu       sync.Mutex
	sessions map[string]*session

	// turn is a semaphore of one that every check of a token, through
	// the form or as a bearer, takes in turn (see tryToken): wrong
	// guesses, in parallel or not, are answered one after another, a few
	// a second at most.
	turn chan struct{}
	// waiting counts the checks waiting for their turn (maxTokenWaiting).
	waiting atomic.Int32
}

// maxTokenWaiting bounds the token checks waiting for their turn. Past it
// a check is refused at once (errTokenChecksBusy, 429): wrong tokens sent
// faster than they are answered would otherwise build a queue that a
// right one, a login or a script's, waits behind without end.
const maxTokenWaiting = 8

// errTokenChecksBusy refuses a token check when maxTokenWaiting are
// already waiting.
var errTokenChecksBusy = errors.New("too many tokens are waiting to be checked (is something sending wrong ones?); try again in a few seconds")

// tryToken checks tok in its turn: nil if it is the token,
// errNoCredentials if not, errTokenChecksBusy if too many checks wait
// already. The checks run one at a time, and a wrong token keeps the turn
// for loginFailDelay before it is answered. A right one is answered at
// once, but in its turn too: answered while the wrong ones wait, it would
// tell a guesser which guess was right without waiting for any answer, at
// whatever rate. A request whose client goes away while it waits for its
// turn leaves unchecked: nobody reads its answer, and held, it would keep
// its connection and delay every token after it. Once its turn has come,
// a wrong token takes the whole delay, gone or not.
func (a *consoleAuth) tryToken(ctx context.Context, tok string) error {
	if a.waiting.Add(1) > maxTokenWaiting {
		a.waiting.Add(-1)
		return errTokenChecksBusy
	}
	select {
	case a.turn <- struct{}{}:
		a.waiting.Add(-1)
	case <-ctx.Done():
		a.waiting.Add(-1)
		return errNoCredentials
	}
	defer func() { <-a.turn }()
	if a.tokenOK(tok) {
		return nil
	}
	time.Sleep(loginFailDelay)
	return errNoCredentials
}

// newConsoleAuth returns the checker for token, or nil (read-only) when
// token is empty.
func newConsoleAuth(token string) *consoleAuth {
	if token == "" {
		return nil
	}
	return &consoleAuth{tokenHash: sha256.Sum256([]byte(token)), sessions: map[string]*session{}, turn: make(chan struct{}, 1)}
}

// tokenOK reports, in constant time, whether tok is the token.
func (a *consoleAuth) tokenOK(tok string) bool {
	h := sha256.Sum256([]byte(tok))
	return subtle.ConstantTimeCompare(h[:], a.tokenHash[:]) == 1
}

// login opens a session for actor and returns its ID.
func (a *consoleAuth) login(actor string) (string, *session) {
	id := newToken() + newToken()
	s := &session{actor: actor, csrf: newToken(), expires: time.Now().Add(sessionTTL)}
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	for k, v := range a.sessions {
		if now.After(v.expires) {
			delete(a.sessions, k)
		}
	}
	if len(a.sessions) >= maxSessions {
		var oldest string
		for k, v := range a.sessions {
			if oldest == "" || v.expires.Before(a.sessions[oldest].expires) {
				oldest = k
			}
		}
		delete(a.sessions, oldest)
	}
	a.sessions[id] = s
	return id, s
}

// logout ends the session id.
func (a *consoleAuth) logout(id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.sessions, id)
}

// session returns r's live session, if any.
func (a *consoleAuth) session(r *http.Request) (string, *session) {
	if a == nil {
		return "", nil
	}
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return "", nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.sessions[c.Value]
	if s == nil || time.Now().After(s.expires) {
		return "", nil
	}
	return c.Value, s
}

// Why an action is refused.
var (
	errReadOnly      = errors.New("this console is read-only: start 'idem serve' with --token or IDEM_SERVE_TOKEN to act from it")
	errNoCredentials = errors.New("actions need the token: log in, or send it as 'Authorization: Bearer <token>'")
	errBadCSRF       = errors.New("the form's CSRF token does not match this session: reload the page and try again")
	errCrossOrigin   = errors.New("the request comes from another origin")
)

// authorize returns the actor of an action request r, or why it is
// refused. A bearer request needs no CSRF token (a browser never sends the
// header across sites by itself); a session's form must carry its own.
// r's form must be parsed.
func (a *consoleAuth) authorize(r *http.Request) (string, error) {
	if a == nil {
		return "", errReadOnly
	}
	if tok, ok := bearerToken(r); ok {
		if err := a.tryToken(r.Context(), strings.TrimSpace(tok)); err != nil {
			return "", err
		}
		actor := cleanActor(r.Header.Get("X-Idem-Actor"))
		if actor == "" {
			actor = "bearer"
		}
		return actor + " (console API)", nil
	}
	if !sameOrigin(r) {
		return "", errCrossOrigin
	}
	_, s := a.session(r)
	if s == nil {
		return "", errNoCredentials
	}
	if subtle.ConstantTimeCompare([]byte(r.PostFormValue("csrf")), []byte(s.csrf)) != 1 {
		return "", errBadCSRF
	}
	return s.actor + " (console)", nil
}

// bearerToken returns the token of r's "Authorization: Bearer" header, if
// it has one. The scheme's name is case-insensitive (RFC 9110, 11.1):
// "bearer" is the same scheme, and a script that sends it must not be
// told that it sent no token.
func bearerToken(r *http.Request) (string, bool) {
	scheme, tok, ok := strings.Cut(strings.TrimSpace(r.Header.Get("Authorization")), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	return tok, true
}

// sameOrigin reports whether r, a POST, comes from a page of this server:
// its Origin header, when the browser sent one, names r's own host.
// SameSite=Strict keeps the session cookie off cross-site requests
// already; this refuses them even where a browser did not.
func sameOrigin(r *http.Request) bool {
	o := r.Header.Get("Origin")
	if o == "" {
		return true
	}
	u, err := url.Parse(o)
	if err != nil {
		return false
	}
	return strings.EqualFold(u.Host, r.Host)
}

// cleanActor makes a name given at login fit the history: printable,
// one line, bounded.
func cleanActor(s string) string {
	s = strings.TrimSpace(termText(s))
	if len(s) > maxActorLen {
		s = clip(s, maxActorLen)
	}
	return s
}

// setSessionCookie sets (or with maxAge < 0 clears) the session cookie.
func setSessionCookie(w http.ResponseWriter, r *http.Request, id string, maxAge int) {
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: id, Path: "/", MaxAge: maxAge,
		HttpOnly: true, Secure: overTLS(r), SameSite: http.SameSiteStrictMode})
}

// overTLS reports whether the browser reached the console over TLS: the
// connection itself, or a proxy in front that says so (X-Forwarded-Proto
// or Forwarded's proto), as docs/console.md's deployment has it. The
// header is trusted from anyone, since all it does is mark the cookies
// Secure, which a browser then sends over TLS only: a client that lies
// only keeps its own session from working over plain HTTP.
func overTLS(r *http.Request) bool {
	if r.TLS != nil || strings.EqualFold(strings.TrimSpace(r.Header.Get("X-Forwarded-Proto")), "https") {
		return true
	}
	for _, f := range r.Header.Values("Forwarded") {
		for _, part := range strings.FieldsFunc(f, func(c rune) bool { return c == ';' || c == ',' }) {
			k, v, _ := strings.Cut(strings.TrimSpace(part), "=")
			if strings.EqualFold(k, "proto") && strings.EqualFold(strings.Trim(v, `"`), "https") {
				return true
			}
		}
	}
	return false
}

// loginCSRF returns the login form's CSRF value, setting its cookie when
// r has none: the form must carry the value the cookie holds, which a
// page of another site can neither read nor set.
func loginCSRF(w http.ResponseWriter, r *http.Request) string {
	if c, err := r.Cookie(loginCookie); err == nil && len(c.Value) == 32 {
		return c.Value
	}
	v := newToken()
	http.SetCookie(w, &http.Cookie{Name: loginCookie, Value: v, Path: "/login", HttpOnly: true, Secure: overTLS(r), SameSite: http.SameSiteStrictMode})
	return v
}

// loginCSRFOK reports whether the login form r carries its cookie's value.
func loginCSRFOK(r *http.Request) bool {
	c, err := r.Cookie(loginCookie)
	if err != nil || c.Value == "" {
		return false
	}
	return subtle.ConstantTimeCompare([]byte(r.PostFormValue("csrf")), []byte(c.Value)) == 1
}
