package main

import (
	"bytes"
	"context"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// sqliteTableExists reports whether the SQLite database at path has table.
// appliedSome matches the report of a first migration run.
var appliedSome = regexp.MustCompile(`applied [1-9][0-9]* migrations?;`)

func sqliteTableExists(t *testing.T, path, table string) bool {
	t.Helper()
	db, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?`, table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// TestMigrateSQLite migrates a SQLite file twice and checks the table and both reports.
func TestMigrateSQLite(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	code, out, errOut := runCLI(t, "migrate", "--dsn", "sqlite:"+path)
	if code != exitOK {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if !appliedSome.MatchString(out) {
		t.Errorf("output does not say what was applied:\n%s", out)
	}
	if !sqliteTableExists(t, path, "idem_processed") {
		t.Fatal("idem_processed does not exist after migrate")
	}

	// Again, as a plain path: nothing to do.
	code, out, errOut = runCLI(t, "migrate", "--dsn", path)
	if code != exitOK {
		t.Fatalf("second migrate: exit %d, want 0; stderr: %s", code, errOut)
	}
	if !strings.Contains(out, "already up to date") {
		t.Errorf("second migrate does not say it was up to date:\n%s", out)
	}
}

// TestMigrateSQLiteFromEnvironmentWithPrefix checks IDEM_DSN and --prefix.
func TestMigrateSQLiteFromEnvironmentWithPrefix(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.sqlite")
	code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: "file:" + path}, "migrate", "--prefix", "orders_")
	if code != exitOK {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if !sqliteTableExists(t, path, "orders_processed") {
		t.Fatal("orders_processed does not exist after migrate --prefix orders_")
	}
	if sqliteTableExists(t, path, "idem_processed") {
		t.Error("idem_processed was created despite --prefix")
	}
}

// TestMigratePostgres migrates a fresh PostgreSQL schema and checks the table exists in it.
func TestMigratePostgres(t *testing.T) {
	t.Parallel()
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	code, out, errOut := runCLI(t, "migrate", "--dsn", testenv.PostgresDSN(), "--schema", schema)
	if code != exitOK {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if !appliedSome.MatchString(out) || !strings.Contains(out, schema) {
		t.Errorf("output does not say what was done where:\n%s", out)
	}
	var exists bool
	if err := pool.QueryRow(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'idem_processed')`,
		schema).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if !exists {
		t.Fatalf("%s.idem_processed does not exist after migrate", schema)
	}

	code, out, errOut = runCLI(t, "migrate", "--dsn", testenv.PostgresDSN(), "--schema", schema)
	if code != exitOK || !strings.Contains(out, "already up to date") {
		t.Errorf("second migrate: exit %d, want 0 and \"already up to date\"\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
}

// TestMigrateUsageErrors checks that a missing DSN and bad options exit 2 before touching a database.
func TestMigrateUsageErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	tests := []struct {
		name string
		env  map[string]string
		args []string
		want string
	}{
		{"missing DSN", nil, []string{"migrate"}, "no database given: pass --dsn or set IDEM_DSN"},
		{"blank DSN in environment", map[string]string{dsnEnv: "  "}, []string{"migrate"}, "no database given"},
		{"bad prefix", nil, []string{"migrate", "--dsn", filepath.Join(dir, "a.db"), "--prefix", "Bad-Prefix"}, "--prefix"},
		{"empty prefix", nil, []string{"migrate", "--dsn", filepath.Join(dir, "b.db"), "--prefix", ""}, "--prefix"},
		{"prefix too long", nil, []string{"migrate", "--dsn", filepath.Join(dir, "c.db"), "--prefix", strings.Repeat("p", 41)}, "maximum is 40"},
		{"bad schema", nil, []string{"migrate", "--dsn", "postgres://u@127.0.0.1:1/x", "--schema", "x;drop"}, "--schema"},
		{"schema with SQLite", nil, []string{"migrate", "--dsn", filepath.Join(dir, "d.db"), "--schema", "s"}, "only to PostgreSQL"},
		{"unrecognised DSN", nil, []string{"migrate", "--dsn", "mongodb://u:hunter2@host/db"}, "unrecognised DSN"},
		{"bad Postgres DSN", nil, []string{"migrate", "--dsn", "postgres://u@host:notaport/db"}, "bad PostgreSQL DSN"},
		{"positional argument", nil, []string{"migrate", "--dsn", filepath.Join(dir, "e.db"), "now"}, "unexpected argument"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, _, errOut := runCLIEnv(t, tc.env, tc.args...)
			if code != exitUsage {
				t.Errorf("exit %d, want %d; stderr: %s", code, exitUsage, errOut)
			}
			if !strings.Contains(errOut, tc.want) {
				t.Errorf("stderr lacks %q:\n%s", tc.want, errOut)
			}
			if strings.Contains(errOut, "hunter2") {
				t.Errorf("stderr shows a password:\n%s", errOut)
			}
		})
	}
	t.Cleanup(func() {
		// Runs after the parallel subtests: a usage error must be found
		// before a database file is created.
		for _, name := range []string{"a.db", "b.db", "c.db", "d.db", "e.db"} {
			if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
				t.Errorf("a usage error created %s", name)
			}
		}
	})
}

// TestMigrateOperationFailure checks that a database that cannot be opened exits 1.
func TestMigrateOperationFailure(t *testing.T) {
	t.Parallel()
	code, _, errOut := runCLI(t, "migrate", "--dsn", filepath.Join(t.TempDir(), "no", "such", "dir", "x.db"))
	if code != exitFailed {
		t.Errorf("exit %d, want %d; stderr: %s", code, exitFailed, errOut)
	}
}

// TestParseDSN checks which DSN forms select which driver.
func TestParseDSN(t *testing.T) {
	t.Parallel()
	tests := []struct {
		dsn  string
		kind storeKind
		path string
	}{
		{"postgres://u@localhost/db", kindPostgres, ""},
		{"POSTGRESQL://u@localhost/db", kindPostgres, ""},
		{"sqlite:idem.db", kindSQLite, "idem.db"},
		{"sqlite:///var/lib/idem.db", kindSQLite, "/var/lib/idem.db"},
		{"file:/tmp/x", kindSQLite, "/tmp/x"},
		{"/tmp/x.sqlite", kindSQLite, "/tmp/x.sqlite"},
		{"rel/x.sqlite3", kindSQLite, "rel/x.sqlite3"},
		{"x.DB", kindSQLite, "x.DB"},
		{"file:photos@2x(a).db", kindSQLite, "photos@2x(a).db"},
		{"sqlite:d@/x.db", kindSQLite, "d@/x.db"},
		{"backups/app@/x.db", kindSQLite, "backups/app@/x.db"},
		{"mysql://u@db/app", kindMySQL, ""},
		{"u:pw@tcp(db:3306)/app", kindMySQL, ""},
		{"u@unix(/run/mysqld/mysqld.sock)/app", kindMySQL, ""},
		{"u:pw@(db:3306)/app", kindMySQL, ""},
		{"u:pw@tcp/app", kindMySQL, ""},
		{"u:pw@/app", kindMySQL, ""},
		{"tcp(db:3306)/app", kindMySQL, ""},
	}
	for _, tc := range tests {
		got, err := parseDSN(tc.dsn)
		if err != nil {
			t.Errorf("parseDSN(%q): %v", tc.dsn, err)
			continue
		}
		if got.kind != tc.kind || got.path != tc.path {
			t.Errorf("parseDSN(%q) = %v %q, want %v %q", tc.dsn, got.kind, got.path, tc.kind, tc.path)
		}
	}
	for _, bad := range []string{"", "idem", "mongodb://x", "sqlite:", "file:x.db?mode=ro", "x.txt"} {
		_, err := parseDSN(bad)
		var ue *usageError
		if !errors.As(err, &ue) {
			t.Errorf("parseDSN(%q) = %v, want a usage error", bad, err)
		}
	}
}

// TestRedactDSN checks that passwords are hidden from messages, whatever
// characters they hold.
func TestRedactDSN(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"postgres://u:secret@h:5432/db":              "postgres://u:xxxxx@h:5432/db",
		"postgres://u@h/db":                          "postgres://u@h/db",
		"sqlite:x.db":                                "sqlite:x.db",
		"postgres://u:p@ss@h/db":                     "postgres://u:xxxxx@h/db",
		"postgres://u:pa/ss@h/db":                    "postgres://u:xxxxx@h/db",
		"postgres://u:pa?ss@h/db":                    "postgres://u:xxxxx@h/db",
		"postgres://u:pa#ss@h/db?sslmode=disable":    "postgres://u:xxxxx@h/db?sslmode=disable",
		"redis://:se?cr#et@h:6379/0":                 "redis://:xxxxx@h:6379/0",
		"rediss://app:a%40b@h:6380":                  "rediss://app:xxxxx@h:6380",
		"sqlite://u:pw@/tmp/x.db":                    "sqlite://u:xxxxx@/tmp/x.db",
		"postgres://h/db?user=u&password=secret&x=1": "postgres://h/db?user=u&password=xxxxx",
		"postgres://h/db?sslpassword=a&b#c":          "postgres://h/db?sslpassword=xxxxx",
		"host=db user=u password=secret dbname=app":  "host=db user=u password=xxxxx dbname=app",
		"host=db PASSWORD = 'se cr\\'et' port=5432":  "host=db PASSWORD = xxxxx port=5432",
		"host=db password=se\\ cr#et&x port=5432":    "host=db password=xxxxx port=5432",
		"host=db sslpassword=k password=p":           "host=db sslpassword=xxxxx password=xxxxx",
		"host=db mypassword=x":                       "host=db mypassword=x",
		"postgres://h:5432/db?application_name=a@b":  "postgres://h:xxxxx@b",
		"app:s3cr3t@tcp(db:3306)/orders?x=1":         "app:xxxxx@tcp(db:3306)/orders?x=1",
		"app:p@ss/w=rd@unix(/run/m.sock)/orders":     "app:xxxxx@unix(/run/m.sock)/orders",
		"app:pw@/orders":                             "app:xxxxx@/orders",
		"app@tcp(db)/orders":                         "app@tcp(db)/orders",
		"host=h user=a@b password=c":                 "host=h user=a@b password=xxxxx",
		"app:s3/cr3t@tcp(h)":                         "app:xxxxx@tcp(h)",
		"app:pw@tcp/orders":                          "app:xxxxx@tcp/orders",
		"app:pw@(h:3306)/orders":                     "app:xxxxx@(h:3306)/orders",
		"app:pw@tcp(h)/db?x=a@b/c":                   "app:xxxxx@b/c", // hides more than it must
		"hostaddr=::1 password=p@/q":                 "hostaddr=::1 password=xxxxx",
		"app:a password=b@tcp(h)/db":                 "app:xxxxx@tcp(h)/db",
	} {
		if got := redactDSN(in); got != want {
			t.Errorf("redactDSN(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzRedactDSN: whatever the password, in whatever shape of DSN (a URL's
// userinfo raw or percent-encoded, a URL's query, a key/value DSN quoted or
// with backslash escapes; postgres, redis, rediss, sqlite and file
// schemes), nothing the command line prints for it (the redacted DSN, the
// errors of dlq list and bench, which parse and connect) holds the
// password or a piece of it. The password is the fuzzer's string twice:
// as it is between two markers, and with a marker after every rune, so
// that a leaked piece of at least 7 bytes carries a marker.
//
//	go test ./cmd/idem -run '^$' -fuzz FuzzRedactDSN -fuzztime 30s
func FuzzRedactDSN(f *testing.F) {
	for i, s := range []string{"secret", "p@ss/w:rd", "", "a?b#c", "%zz", "50%", "x y'z\\", "12/ss", "12?ss", "@", "password=x", "\x1b[2J", "\xff"} {
		for shape := i % 5; shape < dsnShapes; shape += 5 {
			f.Add(uint8(shape), s)
		}
	}
	f.Fuzz(func(t *testing.T, shape uint8, raw string) {
		var pieces []string
		for i := 0; i < len(raw); {
			_, n := utf8.DecodeRuneInString(raw[i:])
			pieces = append(pieces, raw[i:i+n])
			i += n
		}
		for _, pass := range []string{fuzzMarker + raw + fuzzMarker, fuzzMarker + strings.Join(pieces, fuzzMarker) + fuzzMarker} {
			dsn := fuzzDSN(shape, pass)
			outs := []string{redactDSN(dsn)}
			if _, err := parseDSN(dsn); err != nil {
				outs = append(outs, err.Error())
			}
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			for _, args := range [][]string{{"dlq", "list"}, {"bench", "--cases", "per-message", "--rounds", "1", "--round", "1ms"}} {
				var out, errOut bytes.Buffer
				e := &env{stdout: &out, stderr: &errOut, getenv: func(string) string { return "" }}
				if code := runEnv(ctx, e, append(args, "--dsn", dsn)); code == exitOK {
					t.Errorf("idem %s --dsn %q succeeded", args[0], dsn)
				}
				outs = append(outs, out.String()+errOut.String())
			}
			cancel()
			for _, out := range outs {
				if strings.Contains(out, pass) || strings.Contains(out, fuzzMarker) {
					t.Fatalf("DSN %q (shape %d): the output shows the password or a piece of it:\n%s", dsn, shape%dsnShapes, out)
				}
			}
		}
	})
}

// fuzzMarker is a piece of every password FuzzRedactDSN tries, and of no
// other text the command line prints.
const fuzzMarker = "zQ"

// dsnShapes is how many DSN shapes fuzzDSN builds.
const dsnShapes = 20

// fuzzDSN builds a DSN of the given shape carrying pass, for a server that
// refuses connections (127.0.0.1:1) or a SQLite file that does not exist.
func fuzzDSN(shape uint8, pass string) string {
	const host = "127.0.0.1:1"
	schemes := []string{"postgres", "postgresql", "redis", "rediss", "sqlite", "file", "mysql"}
	switch s := int(shape % dsnShapes); {
	case s < 7: // the password raw in the userinfo, as people type it
		return schemes[s] + "://app:" + pass + "@" + host + "/0"
	case s < 14: // percent-encoded, as a URL should be
		return schemes[s-7] + "://" + url.UserPassword("app", pass).String() + "@" + host + "/0"
	case s == 14: // in the query
		return "postgres://app@" + host + "/db?sslmode=disable&password=" + url.QueryEscape(pass) + "&application_name=x"
	case s == 17: // go-sql-driver/mysql's own form
		return "app:" + pass + "@tcp(" + host + ")/db"
	case s == 18: // the same without a database
		return "app:" + pass + "@tcp(" + host + ")"
	case s == 19: // the same on the default address
		return "app:" + pass + "@tcp/db"
	case s == 15: // key/value, quoted, which idem refuses as unrecognised
		q := strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(pass)
		return "host=127.0.0.1 port=1 user=app password='" + q + "' dbname=db"
	default: // key/value, unquoted with backslash escapes
		q := strings.NewReplacer(`\`, `\\`, `'`, `\'`, " ", `\ `, "\t", "\\\t").Replace(pass)
		return "host=127.0.0.1 port=1 user=app password=" + q + " dbname=db"
	}
}
