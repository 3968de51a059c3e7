package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"testing"
)

// PostgresCluster is a throwaway PostgreSQL server a test owns, so that it
// can stop it while messages flow without touching the shared server.
type PostgresCluster struct {
	t          testing.TB
	bin, dir   string
	data, sock string
	port       int
}

// NewPostgresCluster runs initdb in a temporary directory and starts the
// server on a free loopback port; it is stopped and removed when t ends.
// It skips (loudly, or fails under IDEM_REQUIRE_SERVICES=1) when the
// PostgreSQL server binaries are not installed.
func NewPostgresCluster(t testing.TB) *PostgresCluster {
	t.Helper()
	bins, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
	if len(bins) == 0 {
		Unavailable(t, "PostgreSQL server binaries (initdb, pg_ctl)", "/usr/lib/postgresql/*/bin", os.ErrNotExist)
	}
	dir, err := os.MkdirTemp("", "idem-pg-")
	if err != nil {
		t.Fatal(err)
	}
	c := &PostgresCluster{t: t, bin: filepath.Dir(bins[len(bins)-1]), dir: dir, data: filepath.Join(dir, "data"), sock: dir}
	t.Cleanup(func() {
		c.pgctl("stop", "-m", "immediate")
		os.RemoveAll(dir)
	})
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	c.port = freePort(t)
	if out, err := c.run("initdb", "-D", c.data, "-A", "trust", "-U", "postgres", "--no-sync"); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	c.Start()
	return c
}

// run runs a PostgreSQL binary, as the postgres user when the test runs as
// root (the server refuses to run as root).
func (c *PostgresCluster) run(name string, args ...string) ([]byte, error) {
	path := filepath.Join(c.bin, name)
	var cmd *exec.Cmd
	if u, err := user.Current(); err == nil && u.Uid == "0" {
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	} else {
		cmd = exec.Command(path, args...)
	}
	return cmd.CombinedOutput()
}

func (c *PostgresCluster) pgctl(args ...string) ([]byte, error) {
	return c.run("pg_ctl", append([]string{"-D", c.data, "-w"}, args...)...)
}

// Start starts the server and returns once it accepts connections.
func (c *PostgresCluster) Start() {
	c.t.Helper()
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=on -c max_connections=60", c.port, c.sock)
	if out, err := c.pgctl("start", "-l", filepath.Join(c.dir, "log"), "-o", opts); err != nil {
		c.t.Fatalf("pg_ctl start: %v\n%s", err, out)
	}
}

// Crash stops the server as a crash would: no checkpoint, recovery from
// the WAL at the next start.
func (c *PostgresCluster) Crash() {
	c.t.Helper()
	if out, err := c.pgctl("stop", "-m", "immediate"); err != nil {
		c.t.Fatalf("pg_ctl stop: %v\n%s", err, out)
	}
}

// DSN is the server's connection string, with a 2-second connect timeout.
func (c *PostgresCluster) DSN() string {
	return "postgres://postgres@127.0.0.1:" + strconv.Itoa(c.port) + "/postgres?sslmode=disable&connect_timeout=2"
}
