package testenv

import (
	"context"
	"net"
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
	t      testing.TB
	bin    string
	dir    string
	port   int
	cmd    *exec.Cmd
	exited chan struct{}
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
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &RedisServer{t: t, bin: bin, dir: t.TempDir(), port: l.Addr().(*net.TCPAddr).Port}
	l.Close()
	t.Cleanup(s.Crash)
	s.Start()
	return s
}

// Start starts the server and returns once it answers PING with its data
// loaded.
func (s *RedisServer) Start() {
	s.t.Helper()
	s.cmd = exec.Command(s.bin, "--port", strconv.Itoa(s.port), "--bind", "127.0.0.1", "--dir", s.dir,
		"--save", "", "--appendonly", "yes", "--appendfsync", "always", "--logfile", filepath.Join(s.dir, "redis.log"))
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("start redis-server: %v", err)
	}
	s.exited = make(chan struct{})
	go func(cmd *exec.Cmd, exited chan struct{}) {
		_ = cmd.Wait()
		close(exited)
	}(s.cmd, s.exited)
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialerRetries: 1,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}})
	defer c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err() // LOADING until the append-only file is read
		cancel()
		if err == nil {
			return
		}
		select {
		case <-s.exited:
			log, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			s.t.Fatalf("redis-server exited at start: %s", log)
		default:
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("redis-server did not answer within 30 s: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Crash kills the server (SIGKILL). Killing a stopped server does nothing.
func (s *RedisServer) Crash() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.exited
	s.cmd = nil
}

// Addr is the server's host:port.
func (s *RedisServer) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }
