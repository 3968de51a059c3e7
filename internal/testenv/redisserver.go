package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// RedisServer is a throwaway Redis server a test owns, so that it can kill
// it while messages flow without touching the shared server. It keeps an
// append-only file fsynced at every write, so a kill loses no write the
// server acknowledged.
type RedisServer struct {
	t    testing.TB
	bin  string
	dir  string
	port int
	proc *serverProcess
}

// NewRedisServer starts redis-server on a free loopback port with its files
// in a temporary directory; it is killed and removed when t ends. It skips
// (loudly, or fails under IDEM_REQUIRE_SERVICES=1) when redis-server is not
// installed.
func NewRedisServer(t testing.TB) *RedisServer {
	t.Helper()
	bin := findBinary("redis-server")
	if bin == "" {
		Unavailable(t, "redis-server", "$PATH", os.ErrNotExist)
	}
	s := &RedisServer{t: t, bin: bin, dir: t.TempDir(), port: freePort(t)}
	t.Cleanup(s.Crash)
	s.Start()
	return s
}

// Start starts the server and returns once it answers PING with its data
// loaded.
func (s *RedisServer) Start() {
	s.t.Helper()
	cmd := exec.Command(s.bin, "--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--dir", s.dir,
		"--save", "", "--appendonly", "yes", "--appendfsync", "always", "--logfile", filepath.Join(s.dir, "redis.log"))
	c := s.client(redis.Options{MaxRetries: -1, DialerRetries: 1})
	defer c.Close()
	// PING answers LOADING until the append-only file is read.
	s.proc = startServer(s.t, cmd, filepath.Join(s.dir, "redis.log"), 30*time.Second, func(ctx context.Context) error {
		return c.Ping(ctx).Err()
	})
}

// Crash kills the server (SIGKILL). Killing a stopped server does nothing.
func (s *RedisServer) Crash() {
	s.proc.kill()
	s.proc = nil
}

// Client returns a client of the server with opts (Addr set, maintenance
// notifications off, as Redis before 8 lacks them), closed when the test
// ends.
func (s *RedisServer) Client(opts redis.Options) *redis.Client {
	c := s.client(opts)
	s.t.Cleanup(func() { c.Close() })
	return c
}

func (s *RedisServer) client(opts redis.Options) *redis.Client {
	opts.Addr = s.Addr()
	opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	return redis.NewClient(&opts)
}

// Addr is the server's host:port.
func (s *RedisServer) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }
