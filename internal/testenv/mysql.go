package testenv

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"
)

// DefaultMySQLDSN is used when IDEM_MYSQL_DSN is unset: MariaDB or MySQL
// on localhost, in go-sql-driver/mysql's DSN form.
const DefaultMySQLDSN = "root@tcp(127.0.0.1:3306)/test"

// MySQLDSN returns IDEM_MYSQL_DSN or the default.
func MySQLDSN() string {
	if dsn := os.Getenv("IDEM_MYSQL_DSN"); dsn != "" {
		return dsn
	}
	return DefaultMySQLDSN
}

// withDatabase returns dsn, in go-sql-driver/mysql's form
// (user:pass@tcp(host:port)/db?params), naming database name instead, with
// parameters interpolated client-side. A password holding '?' is not
// supported.
func withDatabase(dsn, name string) string {
	base, query, _ := strings.Cut(dsn, "?")
	i := strings.LastIndex(base, "/")
	if i < 0 {
		return dsn
	}
	if query != "" {
		query += "&"
	}
	return base[:i+1] + name + "?" + query + "interpolateParams=true"
}

// MySQLDatabase creates a new, empty database on the server of
// IDEM_MYSQL_DSN, dropped when t ends, and returns its DSN (the server's
// DSN with the new database and interpolated parameters). An unreachable
// server skips t loudly, or fails it under IDEM_REQUIRE_SERVICES=1. The
// test binary must register the "mysql" database/sql driver (importing
// package github.com/idemhq/idem/mysql does): testenv does not import it,
// so that modules testing other stores need not require it.
func MySQLDatabase(t testing.TB) string {
	t.Helper()
	dsn := MySQLDSN()
	if !strings.Contains(dsn, "/") {
		t.Fatalf("IDEM_MYSQL_DSN %q: want user:pass@tcp(host:port)/database", dsn)
	}
	admin, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatalf("IDEM_MYSQL_DSN: %v", err)
	}
	defer admin.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := admin.PingContext(ctx); err != nil {
		Unavailable(t, "MySQL/MariaDB", "IDEM_MYSQL_DSN", err)
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "idemtest_" + hex.EncodeToString(b)
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE `"+name+"` CHARACTER SET utf8mb4"); err != nil {
		t.Fatalf("create database: %v", err)
	}
	t.Cleanup(func() {
		db, err := sql.Open("mysql", dsn)
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer db.Close()
		if _, err := db.Exec("DROP DATABASE IF EXISTS `" + name + "`"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	return withDatabase(dsn, name)
}

// MySQL opens a pool of at most maxConns connections on dsn, closed when
// t ends.
func MySQL(t testing.TB, dsn string, maxConns int) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	if maxConns > 0 {
		db.SetMaxOpenConns(maxConns)
		db.SetMaxIdleConns(maxConns)
	}
	t.Cleanup(func() { db.Close() })
	return db
}
