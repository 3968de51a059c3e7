package testenv

import (
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Blackhole is a TCP proxy to a server whose connections can be made to
// swallow everything from some moment on, in both directions, as a dead
// network path or a frozen server does (no reset, no answer): the
// connections open at that moment hang; new ones go through.
type Blackhole struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	links  []*link
}

type link struct {
	client, server net.Conn
	dead           atomic.Bool
}

// NewBlackhole returns a Blackhole to target (host:port), closed when t
// ends.
func NewBlackhole(t testing.TB, target string) *Blackhole {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &Blackhole{ln: ln, target: target}
	t.Cleanup(b.Close)
	go b.accept()
	return b
}

// Port is the port the Blackhole listens on, on 127.0.0.1.
func (b *Blackhole) Port() int { return b.ln.Addr().(*net.TCPAddr).Port }

func (b *Blackhole) accept() {
	for {
		c, err := b.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", b.target)
		if err != nil {
			c.Close()
			continue
		}
		l := &link{client: c, server: s}
		b.mu.Lock()
		b.links = append(b.links, l)
		b.mu.Unlock()
		go l.pipe(c, s)
		go l.pipe(s, c)
	}
}

// pipe copies from src to dst until the link dies; then it reads on and
// drops what it reads.
func (l *link) pipe(src, dst net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !l.dead.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if !l.dead.Load() {
				dst.Close()
			}
			return
		}
	}
}

// Cut makes every connection open now a dead path.
func (b *Blackhole) Cut() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, l := range b.links {
		l.dead.Store(true)
	}
}

// Reset closes the connections Cut made dead, at both ends, as a path
// that comes back resets them: the server ends their sessions (rolling
// back what they had open) and the client's next use fails at once.
func (b *Blackhole) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	live := b.links[:0]
	for _, l := range b.links {
		if !l.dead.Load() {
			live = append(live, l)
			continue
		}
		l.client.Close()
		l.server.Close()
	}
	b.links = live
}

// Close stops the proxy and closes every connection, dead ones included:
// a client waiting on one then fails at once.
func (b *Blackhole) Close() {
	_ = b.ln.Close()
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, l := range b.links {
		l.client.Close()
		l.server.Close()
	}
}

// PostgresPoolThrough returns a pool of at most maxConns connections to
// IDEM_POSTGRES_DSN's server through a new Blackhole, and the Blackhole.
// The Blackhole closes before the pool does, so that closing the pool
// does not wait on dead connections.
func PostgresPoolThrough(t testing.TB, maxConns int32) (*pgxpool.Pool, *Blackhole) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(PostgresDSN())
	if err != nil {
		t.Fatalf("IDEM_POSTGRES_DSN: %v", err)
	}
	hole := NewBlackhole(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	pool := PostgresPoolWith(t, maxConns, func(c *pgxpool.Config) {
		c.ConnConfig.Host = "127.0.0.1"
		c.ConnConfig.Port = uint16(hole.Port())
	})
	t.Cleanup(hole.Close) // runs before the pool's Close (cleanups run last first)
	return pool, hole
}
