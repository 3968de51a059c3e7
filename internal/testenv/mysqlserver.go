package testenv

import (
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// MySQLServer is a throwaway MariaDB (or MySQL) server a test owns, so that
// it can kill it while messages flow without touching the shared server.
type MySQLServer struct {
	t          testing.TB
	server     string // mariadbd or mysqld
	dir, data  string
	port       int
	asRoot     bool
	proc       *serverProcess
	firstStart bool
}

// NewMySQLServer initializes a data directory in a temporary directory and
// starts the server on a free loopback port, with a database named test;
// it is killed and removed when t ends. It skips (loudly, or fails under
// IDEM_REQUIRE_SERVICES=1) when the server binaries (mariadbd and
// mariadb-install-db, or mysqld and mysql_install_db) are not installed.
// The test binary must register the "mysql" database/sql driver.
func NewMySQLServer(t testing.TB) *MySQLServer {
	t.Helper()
	server, install := findBinary("mariadbd", "mysqld"), findBinary("mariadb-install-db", "mysql_install_db")
	if server == "" || install == "" {
		Unavailable(t, "MariaDB server binaries (mariadbd, mariadb-install-db)", "$PATH and /usr/sbin", os.ErrNotExist)
	}
	dir, err := os.MkdirTemp("", "idem-mysql-")
	if err != nil {
		t.Fatal(err)
	}
	s := &MySQLServer{t: t, server: server, dir: dir, data: filepath.Join(dir, "data"), firstStart: true}
	if u, err := user.Current(); err == nil && u.Uid == "0" {
		s.asRoot = true // the server refuses to run as root unless told whom to run as
	}
	t.Cleanup(func() {
		s.Crash()
		os.RemoveAll(dir)
	})
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	s.port = freePort(t)
	args := []string{"--no-defaults", "--datadir=" + s.data, "--auth-root-authentication-method=normal", "--skip-test-db"}
	if s.asRoot {
		args = append(args, "--user=mysql")
	}
	if out, err := exec.Command(install, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", install, err, out)
	}
	s.Start()
	return s
}

// findBinary returns the path of the first of names found on $PATH or in
// /usr/sbin, or "".
func findBinary(names ...string) string {
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
		if p := filepath.Join("/usr/sbin", n); fileExists(p) {
			return p
		}
	}
	return ""
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// Start starts the server and returns once it answers queries.
func (s *MySQLServer) Start() {
	s.t.Helper()
	args := []string{"--no-defaults", "--datadir=" + s.data, "--port=" + strconv.Itoa(s.port),
		"--bind-address=127.0.0.1", "--socket=" + filepath.Join(s.dir, "sock"),
		"--pid-file=" + filepath.Join(s.dir, "pid"), "--log-error=" + filepath.Join(s.dir, "error.log"),
		"--skip-log-bin", "--innodb-buffer-pool-size=64M", "--max-connections=100"}
	if s.asRoot {
		args = append(args, "--user=mysql")
	}
	db, err := sql.Open("mysql", "root@tcp(127.0.0.1:"+strconv.Itoa(s.port)+")/?timeout=1s")
	if err != nil {
		s.t.Fatal(err)
	}
	defer db.Close()
	s.proc = startServer(s.t, exec.Command(s.server, args...), filepath.Join(s.dir, "error.log"), time.Minute, db.PingContext)
	if s.firstStart {
		s.firstStart = false
		if _, err := db.Exec("CREATE DATABASE test CHARACTER SET utf8mb4"); err != nil {
			s.t.Fatal(fmt.Errorf("create database test: %w", err))
		}
	}
}

// Crash kills the server (SIGKILL), as a crash would: InnoDB recovers from
// its redo log at the next start. Killing a stopped server does nothing.
func (s *MySQLServer) Crash() {
	s.proc.kill()
	s.proc = nil
}

// DSN is the server's database test in go-sql-driver/mysql's form, with a
// 2-second connect timeout.
func (s *MySQLServer) DSN() string {
	return "root@tcp(127.0.0.1:" + strconv.Itoa(s.port) + ")/test?timeout=2s"
}
