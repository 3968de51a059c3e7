package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// serveTimeouts bound what one client may hold of 'idem serve': without
// them, a client that opens connections and sends nothing (or idles after
// one request) keeps each open for good.
type serveTimeouts struct {
	// ReadHeader bounds reading a request's header.
	ReadHeader time.Duration
	// Read bounds reading a whole request.
	Read time.Duration
	// Write bounds writing a response, from the end of the request's
	// header: a page or scrape reads the store for at most --read-timeout,
	// so it is that plus a margin.
	Write time.Duration
	// Idle bounds how long a kept-alive connection waits for the next
	// request.
	Idle time.Duration
}

// defaultServeTimeouts returns serve's timeouts for a store read bounded by
// readTimeout.
func defaultServeTimeouts(readTimeout time.Duration) serveTimeouts {
	return serveTimeouts{ReadHeader: 5 * time.Second, Read: 10 * time.Second, Write: readTimeout + 10*time.Second, Idle: 30 * time.Second}
}

// serveMaxHeaderBytes bounds a request's header; serve's requests carry
// nothing but a path.
const serveMaxHeaderBytes = 16 << 10

// newHTTPServer returns serve's HTTP server for h. Requests run in ctx, so
// that the reads of a page still in flight end when serving does, rather
// than hold up the shutdown.
func newHTTPServer(ctx context.Context, h http.Handler, t serveTimeouts) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: t.ReadHeader,
		ReadTimeout:       t.Read,
		WriteTimeout:      t.Write,
		IdleTimeout:       t.Idle,
		MaxHeaderBytes:    serveMaxHeaderBytes,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
}

// hostList is the value of --allow-host: host names, given as a
// comma-separated list, the flag repeated, or both.
type hostList []string

// String implements flag.Value.
func (l *hostList) String() string {
	if l == nil {
		return ""
	}
	return strings.Join(*l, ",")
}

// Set implements flag.Value.
func (l *hostList) Set(v string) error {
	for raw := range strings.SplitSeq(v, ",") {
		h := normalHost(raw)
		if h == "" {
			return fmt.Errorf("empty host name in %q", v)
		}
		if strings.ContainsAny(strings.TrimSpace(raw), "/@?# ") {
			return fmt.Errorf("%q is not a host name (give the name alone, without scheme or path)", raw)
		}
		*l = append(*l, h)
	}
	return nil
}

// normalHost returns the host of a Host header or a listen address without
// its port and brackets, lower-case and without a final dot.
func normalHost(hostport string) string {
	h := strings.TrimSpace(hostport)
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	}
	h = strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")
	return strings.TrimSuffix(strings.ToLower(h), ".")
}

// hostPolicy decides which Host headers serve answers. A page in a browser
// can be made to reach a loopback server under the attacker's own name
// (DNS rebinding): the Host header is then that name. So serve answers
// only the names it is known by: loopback names and addresses, the host of
// its listen address, and those given with --allow-host. When it listens
// on every interface it answers any IP address as well: a rebinding
// attack always carries a name, never an address.
type hostPolicy struct {
	names map[string]bool
	anyIP bool
}

// newHostPolicy returns the policy for a server listening on listen (the
// --addr value) that also answers the names in allow.
func newHostPolicy(listen string, allow []string) *hostPolicy {
	p := &hostPolicy{names: map[string]bool{"localhost": true}}
	switch h := normalHost(listen); {
	case h == "":
		p.anyIP = true // ":9464": every interface
	case net.ParseIP(h) != nil && net.ParseIP(h).IsUnspecified():
		p.anyIP = true
	default:
		p.names[h] = true
	}
	for _, h := range allow {
		p.names[normalHost(h)] = true
	}
	return p
}

// allows reports whether a request with the Host header host is answered.
func (p *hostPolicy) allows(host string) bool {
	h := normalHost(host)
	if h == "" {
		return false
	}
	if p.names[h] || strings.HasSuffix(h, ".localhost") {
		return true
	}
	if ip := net.ParseIP(h); ip != nil {
		return ip.IsLoopback() || p.anyIP
	}
	return false
}

// serveCSP is the console's Content-Security-Policy: its script, style
// sheet and JSON come from the server itself, no inline script or style
// runs (an injected <script> would not, even if escaping failed), forms
// post only to the server, and no other site may frame it.
const serveCSP = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// guard wraps serve's handler: it refuses a request whose Host the policy
// does not allow (421, saying which flag allows it) and sets the security
// headers on every response.
func guard(p *hostPolicy, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Content-Security-Policy", serveCSP)
		// same-origin, not no-referrer: under no-referrer a browser sends
		// "Origin: null" with the console's own forms, and the console
		// refuses a post whose origin is not its own.
		h.Set("Referrer-Policy", "same-origin")
		if !p.allows(r.Host) {
			http.Error(w, fmt.Sprintf("idem serve does not answer host %q: add it with --allow-host if this is how you reach it", termText(r.Host)), http.StatusMisdirectedRequest)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// readingCache shares one read of the store between the scrapes and the
// page views: counting the markers scans their table (about 0.9 s at two
// million on PostgreSQL), and neither a scrape interval nor a reload
// button is the operator's choice of database load. A reading is reused
// for ttl; a read runs at most one at a time, and whoever asks while it
// runs waits for it rather than starting another.
type readingCache struct {
	base    context.Context // reads end with it: serving's context
	ttl     time.Duration
	timeout time.Duration
	read    func(context.Context) storeReading

	mu     sync.Mutex
	at     time.Time // when last was read; zero before the first read
	last   storeReading
	down   time.Time   // when the reads began to fail; zero while they succeed
	flight *readFlight // the read under way, if any
}

// readFlight is one read of the store under way.
type readFlight struct {
	done chan struct{} // closed when r and at are set
	r    storeReading
	at   time.Time
}

// newReadingCache returns a cache of s's readings, each reused for ttl and
// bounded by timeout; reads end with base.
func newReadingCache(base context.Context, s *store, ttl, timeout time.Duration) *readingCache {
	return &readingCache{base: base, ttl: ttl, timeout: timeout, read: func(ctx context.Context) storeReading { return readStore(ctx, s) }}
}

// get returns a reading no older than ttl and when it was taken, reading
// the store if there is none (or joining the read under way). If ctx ends
// first, it returns ctx's error as the reading's; the read goes on for the
// others.
func (c *readingCache) get(ctx context.Context) (storeReading, time.Time) {
	c.mu.Lock()
	if !c.at.IsZero() && time.Since(c.at) < c.ttl {
		r, at := c.last, c.at
		c.mu.Unlock()
		return r, at
	}
	f := c.flight
	if f == nil {
		f = &readFlight{done: make(chan struct{})}
		c.flight = f
		go c.run(f)
	}
	c.mu.Unlock()
	select {
	case <-f.done:
		return f.r, f.at
	case <-ctx.Done():
		return storeReading{err: fmt.Errorf("read the store: %w", ctx.Err())}, time.Now()
	}
}

// failed records that a read of the store outside the cache (the page's
// own) failed: an outage begins now unless one is under way, and the
// cached reading is no longer served. It returns when the outage began.
func (c *readingCache) failed() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.down.IsZero() {
		c.down = time.Now()
	}
	c.at = time.Time{}
	return c.down
}

// run performs the read f, in the cache's own context: the request that
// started it may go away, the others still wait for it.
func (c *readingCache) run(f *readFlight) {
	ctx, cancel := context.WithTimeout(c.base, c.timeout)
	defer cancel()
	r := c.read(ctx)
	c.mu.Lock()
	switch {
	case r.err == nil:
		c.down = time.Time{}
	case c.down.IsZero():
		c.down = time.Now()
	}
	r.downSince = c.down
	c.last, c.at = r, time.Now()
	f.r, f.at = r, c.at
	c.flight = nil
	c.mu.Unlock()
	close(f.done)
}
