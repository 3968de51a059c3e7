package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// openStore returns a store on a fresh database. The pool allows more
// connections than the suite's goroutines, so their transactions really
// contend on the same rows at once.
func openStore(t testing.TB) *idemtest.Store[*sql.Tx] {
	t.Helper()
	db := testenv.MySQL(t, testenv.MySQLDatabase(t), 70)
	return storeOn(t, db, nil)
}

// storeOn migrates a driver over db and creates the suite's tables.
func storeOn(t testing.TB, db *sql.DB, cfg *mysql.Config) *idemtest.Store[*sql.Tx] {
	t.Helper()
	ctx := context.Background()
	drv, err := mysql.New(db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		"CREATE TABLE balances (account VARBINARY(64) PRIMARY KEY, amount BIGINT NOT NULL)",
		"CREATE TABLE states (aggregate VARBINARY(255) PRIMARY KEY, value LONGBLOB NOT NULL)",
		"CREATE TABLE inrow (aggregate VARBINARY(255) PRIMARY KEY, value LONGBLOB NOT NULL, last_seq BIGINT NOT NULL)",
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	return &idemtest.Store[*sql.Tx]{
		Driver: drv,
		Credit: func(ctx context.Context, tx *sql.Tx, account string, amount int64) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES (?, ?)
ON DUPLICATE KEY UPDATE amount = amount + VALUES(amount)`, account, amount)
			return err
		},
		CreditMany: func(ctx context.Context, tx *sql.Tx, accounts []string, amounts []int64) error {
			args := make([]any, 0, 2*len(accounts))
			for i, a := range accounts {
				args = append(args, a, amounts[i])
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES (?, ?)`+
				strings.Repeat(", (?, ?)", len(accounts)-1)+` ON DUPLICATE KEY UPDATE amount = amount + VALUES(amount)`, args...)
			return err
		},
		Balances: func(ctx context.Context) (map[string]int64, error) {
			rows, err := db.QueryContext(ctx, `SELECT account, amount FROM balances`)
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			m := map[string]int64{}
			for rows.Next() {
				var (
					a string
					n int64
				)
				if err := rows.Scan(&a, &n); err != nil {
					return nil, err
				}
				m[a] = n
			}
			return m, rows.Err()
		},
		Put: func(ctx context.Context, tx *sql.Tx, agg, value string) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO states (aggregate, value) VALUES (?, ?)
ON DUPLICATE KEY UPDATE value = VALUES(value)`, agg, value)
			return err
		},
		Append: func(ctx context.Context, tx *sql.Tx, agg, value string) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO states (aggregate, value) VALUES (?, CONCAT(',', ?))
ON DUPLICATE KEY UPDATE value = CONCAT(value, VALUES(value))`, agg, value)
			return err
		},
		States: func(ctx context.Context) (map[string]string, error) {
			return readPairs(ctx, db, `SELECT aggregate, value FROM states`)
		},
		Markers: func(ctx context.Context, handler string) (n int, err error) {
			err = db.QueryRowContext(ctx, `SELECT
  (SELECT count(*) FROM idem_markers m JOIN idem_handlers h ON h.id = m.handler_id WHERE h.name = ?)
+ (SELECT count(*) FROM idem_leases WHERE handler = ?)`, handler, handler).Scan(&n)
			return n, err
		},
		RowAppend: func(ctx context.Context, tx *sql.Tx, g *idem.RowGuard, value string) (idem.RowWrite, error) {
			return rowAppend(ctx, tx, g, value)
		},
		Rows: func(ctx context.Context) (map[string]idemtest.Row, error) {
			rows, err := db.QueryContext(ctx, `SELECT aggregate, value, last_seq FROM inrow`)
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			m := map[string]idemtest.Row{}
			for rows.Next() {
				var (
					a string
					r idemtest.Row
				)
				if err := rows.Scan(&a, &r.Value, &r.Last); err != nil {
					return nil, err
				}
				m[a] = r
			}
			return m, rows.Err()
		},
	}
}

func readPairs(ctx context.Context, db *sql.DB, q string) (map[string]string, error) {
	rows, err := db.QueryContext(ctx, q)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[string]string{}
	for rows.Next() {
		var a, v string
		if err := rows.Scan(&a, &v); err != nil {
			return nil, err
		}
		m[a] = v
	}
	return m, rows.Err()
}

// openStoreSession is openStore on a pool from mysql.Open, whose
// connections are at READ COMMITTED already (Config.SessionIsolation).
func openStoreSession(t testing.TB) *idemtest.Store[*sql.Tx] {
	t.Helper()
	return storeOn(t, openFolded(t, testenv.MySQLDatabase(t), 70), &mysql.Config{SessionIsolation: true})
}

// TestConformance runs the suite with 64 goroutines delivering the same
// 500 IDs, one message per transaction and in overlapping batches, on
// connections set up by mysql.Open: every ID raced by 64 transactions at
// once. (2,000 IDs made it nearly half of this package's CPU under -race
// for no race the 500 do not have.) The other suites run on a plain pool,
// where the driver sets READ COMMITTED per transaction, and so does this
// one, smaller (TestConformancePlainPool).
func TestConformance(t *testing.T) {
	t.Parallel()
	idemtest.Run(t, &idemtest.Harness[*sql.Tx]{Open: openStoreSession, Goroutines: 64, IDs: 500})
}

// TestConformancePlainPool runs the same suite, smaller, on a plain pool
// (sql.Open, REPEATABLE READ sessions, no folded begin), where the driver
// begins each transaction with START TRANSACTION at READ COMMITTED.
func TestConformancePlainPool(t *testing.T) {
	t.Parallel()
	idemtest.Run(t, &idemtest.Harness[*sql.Tx]{Open: openStore, Goroutines: 16, IDs: 300})
}

func TestHostilePrefixRefused(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t, testenv.MySQLDSN(), 1)
	for _, prefix := range []string{"Idem", "a-b", "x`; DROP TABLE y; --", "9lives", strings.Repeat("a", 41)} {
		if _, err := mysql.New(db, &mysql.Config{TablePrefix: prefix}); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("prefix %q: got %v, want ErrInvalidConfig", prefix, err)
		}
	}
	if _, err := mysql.New(nil, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("nil db: got %v, want ErrInvalidConfig", err)
	}
}

func TestOrdering(t *testing.T) {
	t.Parallel()
	idemtest.RunOrdering(t, &idemtest.Harness[*sql.Tx]{Open: openStore, Aggregates: 30})
}

func TestDeadLetters(t *testing.T) {
	t.Parallel()
	idemtest.RunDeadLetters(t, &idemtest.Harness[*sql.Tx]{Open: openStore})
}

func TestRetention(t *testing.T) {
	t.Parallel()
	idemtest.RunRetention(t, &idemtest.Harness[*sql.Tx]{Open: openStore})
}

// TestImportSpaceOnlyIDs: a value of blanks is a valid message ID, not an
// empty one; under a PAD SPACE collation (MariaDB's default) it compares
// equal to the empty string, and must be imported all the same, never dropped unread.
func TestImportSpaceOnlyIDs(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t, testenv.MySQLDatabase(t), 4)
	s := storeOn(t, db, nil)
	drv := s.Driver.(*mysql.Driver)
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `CREATE TABLE seen_pad (id VARCHAR(20) COLLATE utf8mb4_general_ci)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO seen_pad VALUES (' '), ('  '), ('x'), (''), (NULL)`); err != nil {
		t.Fatal(err)
	}
	for _, batch := range []int{1, 10} {
		h := fmt.Sprintf("pad_%d", batch)
		res, err := idem.ImportMarkers(ctx, drv, h, &driver.ImportSource{Table: "seen_pad", Column: "id"}, &idem.ImportOptions{Batch: batch})
		if err != nil || res.Read != 3 || res.Imported != 3 {
			t.Fatalf("import of ' ', '  ', 'x' in pages of %d: %+v, %v; want all 3 read and imported", batch, res, err)
		}
	}
}

func TestImportMarkers(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t, testenv.MySQLDatabase(t), 4)
	s := storeOn(t, db, nil)
	idemtest.CheckImport(t, s, &driver.ImportSource{Table: "processed_events", Column: "event_id"}, func(ctx context.Context, values []string) error {
		if _, err := db.ExecContext(ctx, `CREATE TABLE processed_events (event_id VARCHAR(400) PRIMARY KEY)`); err != nil {
			return err
		}
		for lo := 0; lo < len(values); lo += 500 {
			chunk := values[lo:min(lo+500, len(values))]
			args := make([]any, len(chunk))
			for i, v := range chunk {
				args[i] = v
			}
			if _, err := db.ExecContext(ctx, `INSERT INTO processed_events VALUES (?)`+strings.Repeat(", (?)", len(chunk)-1), args...); err != nil {
				return err
			}
		}
		return nil
	})
	drv := s.Driver.(*mysql.Driver)
	ctx := context.Background()
	// An integer column pages in numeric order; a case-insensitive one
	// keeps 'A' and 'a' apart across a page boundary.
	if _, err := db.ExecContext(ctx, `CREATE TABLE seen_int (id BIGINT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 2500; i += 500 {
		var b strings.Builder
		for j := i; j < i+500; j++ {
			if j > i {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "(%d)", j*7)
		}
		if _, err := db.ExecContext(ctx, `INSERT INTO seen_int VALUES `+b.String()); err != nil {
			t.Fatal(err)
		}
	}
	res, err := idem.ImportMarkers(ctx, drv, "typed_int", &driver.ImportSource{Table: "seen_int", Column: "id"}, &idem.ImportOptions{Batch: 1000})
	if err != nil || res.Read != 2500 || res.Imported != 2500 {
		t.Fatalf("import of a BIGINT column: %+v, %v; want all 2,500", res, err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE seen_ci (id VARCHAR(20) COLLATE utf8mb4_general_ci);
`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO seen_ci VALUES ('A'), ('a'), ('b'), ('B'), ('c'), (NULL), ('')`); err != nil {
		t.Fatal(err)
	}
	res, err = idem.ImportMarkers(ctx, drv, "typed_ci", &driver.ImportSource{Table: "seen_ci", Column: "id"}, &idem.ImportOptions{Batch: 1})
	if err != nil || res.Read != 5 || res.Imported != 5 {
		t.Fatalf("import of A, a, b, B, c in pages of 1: %+v, %v; want all 5", res, err)
	}
	for _, bad := range []*driver.ImportSource{
		{Table: "processed_events; DROP TABLE x", Column: "event_id"},
		{Schema: "test`", Table: "processed_events", Column: "event_id"},
		{Table: "processed_events", Column: ""},
	} {
		if _, err := drv.ImportIDs(ctx, bad, "", 10); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("source %+v: %v; want ErrInvalidConfig", bad, err)
		}
	}
}
