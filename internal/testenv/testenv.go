// Package testenv finds the real services tests run against.
//
// Each service is located through an environment variable with a localhost
// default. When a service is unreachable the test is skipped with a loud
// message, unless IDEM_REQUIRE_SERVICES=1, which turns the skip into a
// failure (CI sets it, so CI can never silently skip).
package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultPostgresDSN is used when IDEM_POSTGRES_DSN is unset.
const DefaultPostgresDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// RequireServices reports whether IDEM_REQUIRE_SERVICES=1.
func RequireServices() bool { return os.Getenv("IDEM_REQUIRE_SERVICES") == "1" }

// PostgresDSN returns IDEM_POSTGRES_DSN or the default.
func PostgresDSN() string {
	if dsn := os.Getenv("IDEM_POSTGRES_DSN"); dsn != "" {
		return dsn
	}
	return DefaultPostgresDSN
}

// Unavailable skips t loudly, or fails it under IDEM_REQUIRE_SERVICES=1.
func Unavailable(t testing.TB, service, where string, err error) {
	t.Helper()
	msg := fmt.Sprintf("\n*** %s UNAVAILABLE at %s: %v\n*** set the address with its IDEM_* variable; IDEM_REQUIRE_SERVICES=1 makes this a failure", service, where, err)
	if RequireServices() {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// PostgresPool connects to Postgres and returns a pool of at most maxConns
// connections, closed when t ends.
func PostgresPool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return PostgresPoolWith(t, maxConns, nil)
}

// PostgresPoolWith is PostgresPool with the pool's configuration passed
// to configure (when not nil) before it connects.
func PostgresPoolWith(t testing.TB, maxConns int32, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(PostgresDSN())
	if err != nil {
		t.Fatalf("IDEM_POSTGRES_DSN: %v", err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	if configure != nil {
		configure(cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		Unavailable(t, "PostgreSQL", cfg.ConnConfig.Host, err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// FreshSchema returns the name of a new, empty schema that is dropped when t
// ends.
func FreshSchema(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "idemtest_" + hex.EncodeToString(b)
	if _, err := pool.Exec(context.Background(), `CREATE SCHEMA `+schema); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	return schema
}

// Logger returns a logger that writes through t.Log, so that an adapter's
// warnings (a consumer killed while it acknowledges, say) show with the
// test that caused them, or after a benchmark's result lines, instead of in
// the middle of them.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tLogWriter{t}, nil))
}

type tLogWriter struct{ t testing.TB }

func (w tLogWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// Buffer is a bytes.Buffer safe for concurrent writes and reads: a
// command's or a logger's output read while it runs.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write implements io.Writer.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String returns what was written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
