package main

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestServeHostCheck: serve answers loopback names and addresses, the host
// of its --addr and the --allow-host names, and refuses any other Host
// (a DNS-rebinding page's) with 421; on every interface it answers IP
// addresses too, never a foreign name.
func TestServeHostCheck(t *testing.T) {
	t.Parallel()
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	var allow hostList
	if err := allow.Set("idem.internal,Proxy.Example."); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		listen string
		host   string
		want   int
	}{
		{"127.0.0.1:9464", "127.0.0.1:9464", 200},
		{"127.0.0.1:9464", "localhost:9464", 200},
		{"127.0.0.1:9464", "LOCALHOST.", 200},
		{"127.0.0.1:9464", "app.localhost", 200},
		{"127.0.0.1:9464", "[::1]:9464", 200},
		{"127.0.0.1:9464", "127.0.0.2", 200},
		{"127.0.0.1:9464", "idem.internal:443", 200},
		{"127.0.0.1:9464", "proxy.example", 200},
		{"127.0.0.1:9464", "evil.example:9464", 421},
		{"127.0.0.1:9464", "127.0.0.1.evil.example", 421},
		{"127.0.0.1:9464", "localhost.evil.example", 421},
		{"127.0.0.1:9464", "10.0.0.5:9464", 421},
		{"127.0.0.1:9464", "", 421},
		{"metrics.corp:9464", "metrics.corp:9464", 200},
		{":9464", "10.0.0.5:9464", 200},
		{"0.0.0.0:9464", "[fd00::5]:9464", 200},
		{"[::]:9464", "evil.example", 421},
	} {
		h := guard(newHostPolicy(tc.listen, allow), ok)
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = tc.host
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != tc.want {
			t.Errorf("listening on %s, Host %q: %d, want %d (%s)", tc.listen, tc.host, w.Code, tc.want, w.Body)
		}
	}
	for _, bad := range []string{"", "a,,b", "http://x", "x/y"} {
		var l hostList
		if err := l.Set(bad); err == nil {
			t.Errorf("--allow-host %q accepted", bad)
		}
	}
}

// TestServeCommandRefusesForeignHost: the running command applies the
// check, and names the flag that lifts it.
func TestServeCommandRefusesForeignHost(t *testing.T) {
	path, _, _ := seedServeStore(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url, errOut, exit := startServe(t, ctx, "--dsn", path, "--allow-host", "idem.test")
	for host, want := range map[string]int{"rebind.evil.example": 421, "idem.test": 200, "": 200} {
		req, err := http.NewRequest("GET", url+"/metrics", nil)
		if err != nil {
			t.Fatal(err)
		}
		if host != "" {
			req.Host = host
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want || (want == 421 && !strings.Contains(string(body), "--allow-host")) {
			t.Errorf("Host %q: %d %q, want %d", host, resp.StatusCode, body, want)
		}
	}
	cancel()
	if code := <-exit; code != exitOK {
		t.Fatalf("serve exited %d: %s", code, errOut)
	}
}

// TestServeSecurityHeaders: every answer (page, metrics, health, 404, a
// refused host) forbids sniffing and framing, and the page's policy loads
// nothing but the server's own script and style, never an inline one.
func TestServeSecurityHeaders(t *testing.T) {
	path, _, _ := seedServeStore(t)
	s, err := openStore(context.Background(), path, storeOptions{Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	srv := httptest.NewServer(guard(newHostPolicy("127.0.0.1:0", nil), newServeMux(context.Background(), s, 0, 5*time.Second)))
	defer srv.Close()
	for _, tc := range []struct {
		path, host string
		code       int
	}{{"/", "", 200}, {"/metrics", "", 200}, {"/healthz", "", 200}, {"/nothing", "", 404}, {"/", "evil.example", 421}} {
		req, _ := http.NewRequest("GET", srv.URL+tc.path, nil)
		if tc.host != "" {
			req.Host = tc.host
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		h := resp.Header
		if resp.StatusCode != tc.code || h.Get("X-Content-Type-Options") != "nosniff" || h.Get("X-Frame-Options") != "DENY" ||
			!strings.Contains(h.Get("Content-Security-Policy"), "frame-ancestors 'none'") ||
			!strings.HasPrefix(h.Get("Content-Security-Policy"), "default-src 'none'; script-src 'self'; style-src 'self'") ||
			strings.Contains(h.Get("Content-Security-Policy"), "unsafe") {
			t.Errorf("%s (Host %q): %d, headers %v", tc.path, tc.host, resp.StatusCode, h)
		}
	}
}

// TestServeTimeouts: a connection that sends nothing, one that stops in
// the middle of its header and one kept alive after a request are all
// closed by the server, and the command's own timeouts are all set.
func TestServeTimeouts(t *testing.T) {
	t.Parallel()
	to := defaultServeTimeouts(10 * time.Second)
	if to.ReadHeader <= 0 || to.Read <= 0 || to.Write <= 10*time.Second || to.Idle <= 0 {
		t.Fatalf("serve's timeouts %+v: want each set, writes longer than a store read", to)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	short := serveTimeouts{ReadHeader: 200 * time.Millisecond, Read: 300 * time.Millisecond, Write: time.Second, Idle: 200 * time.Millisecond}
	done := make(chan error, 1)
	go func() { done <- serve(ctx, ln, newHTTPServer(ctx, ok, short)) }()
	closedWithin := func(c net.Conn, what string) {
		t.Helper()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		start := time.Now()
		if _, err := io.Copy(io.Discard, c); err != nil {
			t.Errorf("%s: the server did not close the connection: %v", what, err)
		} else if el := time.Since(start); el > 3*time.Second {
			t.Errorf("%s: closed after %s", what, el)
		}
	}
	dial := func() net.Conn {
		t.Helper()
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	closedWithin(dial(), "silent connection")
	c := dial()
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
	closedWithin(c, "half a header")
	c = dial()
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("request: %v %v", resp, err)
	}
	resp.Body.Close()
	closedWithin(c, "idle kept-alive connection")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestServeReadsOnceAtATime: however many scrapes and page views arrive
// together, the store is read once; within the refresh interval it is not
// read again, after it once more.
func TestServeReadsOnceAtATime(t *testing.T) {
	path, _, _ := seedServeStore(t)
	s, err := openStore(context.Background(), path, storeOptions{Prefix: defaultPrefix})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// Count the reads, and hold the first until every request waits.
	cache := newReadingCache(context.Background(), s, time.Hour, 5*time.Second)
	var reads atomic.Int32
	release := make(chan struct{})
	read := cache.read
	cache.read = func(ctx context.Context) storeReading {
		reads.Add(1)
		<-release
		return read(ctx)
	}
	srv := httptest.NewServer(serveMuxFor(s, cache, 5*time.Second, nil))
	defer srv.Close()
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			p := "/"
			if i%2 == 0 {
				p = "/metrics"
			}
			if code, body := get(t, srv.URL+p); code != 200 {
				t.Errorf("%s: %d %s", p, code, body)
			}
		})
	}
	for deadline := time.Now().Add(5 * time.Second); reads.Load() == 0 && time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
	}
	time.Sleep(100 * time.Millisecond) // the others join the read under way
	close(release)
	wg.Wait()
	if n := reads.Load(); n != 1 {
		t.Fatalf("16 concurrent requests read the store %d times, want 1", n)
	}
	if code, body := get(t, srv.URL+"/"); code != 200 || !strings.Contains(body, "read at most once every 1h0m0s") {
		t.Fatalf("/: %d, want the page to say how old its counts may be\n%s", code, body)
	}
	if n := reads.Load(); n != 1 {
		t.Fatalf("a view within the refresh interval read the store again (%d reads)", n)
	}
	cache.mu.Lock()
	cache.ttl = 0
	cache.mu.Unlock()
	get(t, srv.URL+"/")
	if n := reads.Load(); n != 2 {
		t.Fatalf("after the refresh interval: %d reads, want 2", n)
	}
}
