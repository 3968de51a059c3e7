package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

func openStore(t testing.TB) *idemtest.Store[*sql.Tx] {
	t.Helper()
	return openStoreWith(t, nil)
}

// openFastStore is openStore without fsync (synchronous=OFF): for the
// ordering suite's long single-message streams, whose checks are about
// logic, not durability (the conformance and crash tests keep FULL).
func openFastStore(t testing.TB) *idemtest.Store[*sql.Tx] {
	t.Helper()
	return openStoreWith(t, &sqlite.OpenOptions{Synchronous: "OFF"})
}

// openMigrated opens a fresh database file and returns it with its
// migrated driver; the database is closed when the test ends.
func openMigrated(t testing.TB, opts *sqlite.OpenOptions) (*sql.DB, *sqlite.Driver) {
	t.Helper()
	return testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), opts)
}

func openStoreWith(t testing.TB, opts *sqlite.OpenOptions) *idemtest.Store[*sql.Tx] {
	t.Helper()
	db, drv := openMigrated(t, opts)
	return storeOn(t, db, drv)
}

// storeOn returns the suite's store on db, migrated for drv.
func storeOn(t testing.TB, db *sql.DB, drv *sqlite.Driver) *idemtest.Store[*sql.Tx] {
	t.Helper()
	if _, err := db.Exec(`CREATE TABLE balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE states (aggregate TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID`); err != nil {
		t.Fatal(err)
	}
	return &idemtest.Store[*sql.Tx]{
		Driver: drv,
		Credit: func(ctx context.Context, tx *sql.Tx, account string, amount int64) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES (?, ?)
ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, account, amount)
			return err
		},
		Put: func(ctx context.Context, tx *sql.Tx, agg, value string) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO states (aggregate, value) VALUES (?, ?)
ON CONFLICT (aggregate) DO UPDATE SET value = excluded.value`, agg, value)
			return err
		},
		Append: func(ctx context.Context, tx *sql.Tx, agg, value string) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO states (aggregate, value) VALUES (?, ',' || ?)
ON CONFLICT (aggregate) DO UPDATE SET value = value || excluded.value`, agg, value)
			return err
		},
		States: func(ctx context.Context) (map[string]string, error) {
			rows, err := db.QueryContext(ctx, `SELECT aggregate, value FROM states`)
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
		},
		Markers: func(ctx context.Context, handler string) (n int, err error) {
			err = db.QueryRowContext(ctx, `SELECT count(*) FROM idem_processed WHERE handler = ?`, handler).Scan(&n)
			return n, err
		},
		Balances: func(ctx context.Context) (map[string]int64, error) {
			rows, err := db.QueryContext(ctx, `SELECT account, amount FROM balances`)
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			m := map[string]int64{}
			for rows.Next() {
				var a string
				var n int64
				if err := rows.Scan(&a, &n); err != nil {
					return nil, err
				}
				m[a] = n
			}
			return m, rows.Err()
		},
	}
}

func TestImportMarkers(t *testing.T) {
	t.Parallel()
	db, drv := openMigrated(t, &sqlite.OpenOptions{Synchronous: "OFF"})
	s := storeOn(t, db, drv)
	idemtest.CheckImport(t, s, &driver.ImportSource{Table: "processed_events", Column: "event_id"}, func(ctx context.Context, values []string) error {
		if _, err := db.ExecContext(ctx, `CREATE TABLE processed_events (event_id TEXT PRIMARY KEY, processed_at INTEGER)`); err != nil {
			return err
		}
		for _, v := range values {
			if _, err := db.ExecContext(ctx, `INSERT INTO processed_events (event_id) VALUES (?)`, v); err != nil {
				return err
			}
		}
		return nil
	})
	// SQLite orders numbers before texts: an INTEGER key, and a column
	// without a type holding numbers, are read past their first page.
	for _, decl := range []string{"INTEGER PRIMARY KEY", ""} {
		db, drv := openMigrated(t, &sqlite.OpenOptions{Synchronous: "OFF"})
		if _, err := db.Exec(`CREATE TABLE seen (id ` + decl + `)`); err != nil {
			t.Fatal(err)
		}
		for i := 1; i <= 2500; i++ {
			if _, err := db.Exec(`INSERT INTO seen (id) VALUES (?)`, i*7); err != nil {
				t.Fatal(err)
			}
		}
		res, err := idem.ImportMarkers(context.Background(), drv, "balances", &driver.ImportSource{Table: "seen", Column: "id"}, &idem.ImportOptions{Batch: 1000})
		if err != nil || res.Read != 2500 || res.Imported != 2500 {
			t.Fatalf("import of an %q column: %+v, %v; want all 2,500", decl, res, err)
		}
		var has bool
		if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM idem_processed WHERE handler = 'balances' AND message_id = '17500')`).Scan(&has); err != nil || !has {
			t.Fatalf("%q column: marker of the last value 17500: %v, %v", decl, has, err)
		}
	}
	// IDs stored as BLOBs (Go code inserting []byte), some next to text
	// ones, are read past their first page: SQLite orders every BLOB
	// after every text.
	for _, withText := range []bool{false, true} {
		db, drv := openMigrated(t, &sqlite.OpenOptions{Synchronous: "OFF"})
		if _, err := db.Exec(`CREATE TABLE seen (id TEXT PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
		for i := 1; i <= 25; i++ {
			if _, err := db.Exec(`INSERT INTO seen (id) VALUES (?)`, []byte(fmt.Sprintf("id-%02d", i))); err != nil {
				t.Fatal(err)
			}
			// Digits as bytes too: they read as numbers, and are not.
			if _, err := db.Exec(`INSERT INTO seen (id) VALUES (?)`, []byte(fmt.Sprintf("%d", 1000+i))); err != nil {
				t.Fatal(err)
			}
		}
		want := int64(50)
		if withText {
			if _, err := db.Exec(`INSERT INTO seen (id) VALUES ('text-1'), ('text-2')`); err != nil {
				t.Fatal(err)
			}
			want += 2
		}
		res, err := idem.ImportMarkers(context.Background(), drv, "balances", &driver.ImportSource{Table: "seen", Column: "id"}, &idem.ImportOptions{Batch: 10})
		if err != nil || res.Read != want || res.Imported != want {
			t.Fatalf("BLOB IDs (with text ones: %v) in pages of 10: %+v, %v; want all %d", withText, res, err, want)
		}
	}
	// Empty values are left out on every page (after a number, '' sorts
	// greater), and values equal as numbers but not as text (5 and 5.0)
	// are two IDs a page boundary does not merge.
	{
		db, drv := openMigrated(t, &sqlite.OpenOptions{Synchronous: "OFF"})
		if _, err := db.Exec(`CREATE TABLE odd (id BIGINT NOT NULL DEFAULT '')`); err != nil {
			t.Fatal(err)
		}
		for i := 1; i <= 15; i++ {
			if _, err := db.Exec(`INSERT INTO odd (id) VALUES (?)`, i); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := db.Exec(`INSERT INTO odd (id) VALUES (''), (''), (''), (''), (''), ('abc')`); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := idem.ImportMarkers(ctx, drv, "balances", &driver.ImportSource{Table: "odd", Column: "id"}, &idem.ImportOptions{Batch: 10})
		if err != nil || res.Read != 16 || res.Imported != 16 || res.Invalid != 0 {
			t.Fatalf("15 numbers, 5 empty values and abc in pages of 10: %+v, %v; want the 16 non-empty ones", res, err)
		}
		if _, err := db.Exec(`CREATE TABLE mixed (id); INSERT INTO mixed VALUES (5), (5.0), (6), ('x')`); err != nil {
			t.Fatal(err)
		}
		res, err = idem.ImportMarkers(ctx, drv, "mixed", &driver.ImportSource{Table: "mixed", Column: "id"}, &idem.ImportOptions{Batch: 1})
		if err != nil || res.Read != 4 || res.Imported != 4 {
			t.Fatalf("5, 5.0, 6 and x in pages of 1: %+v, %v; want all 4", res, err)
		}
	}
	for _, src := range []*driver.ImportSource{
		{Table: "processed_events; DROP TABLE x", Column: "event_id"},
		{Table: "processed_events", Column: `event_id"`},
		{Schema: "main", Table: "processed_events", Column: "event_id"},
	} {
		if _, err := drv.ImportIDs(context.Background(), src, "", 10); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("source %+v: %v; want ErrInvalidConfig", src, err)
		}
	}
}

// TestImportSpaceOnlyIDs: a value of blanks is a valid message ID, not an
// empty one; in a column declared COLLATE RTRIM it compares equal to the empty string,
// and must be imported all the same, never dropped unread.
func TestImportSpaceOnlyIDs(t *testing.T) {
	t.Parallel()
	db, drv := openMigrated(t, &sqlite.OpenOptions{Synchronous: "OFF"})
	if _, err := db.Exec(`CREATE TABLE seen (id TEXT COLLATE RTRIM); INSERT INTO seen VALUES (' '), ('  '), ('x'), (''), (NULL)`); err != nil {
		t.Fatal(err)
	}
	for _, batch := range []int{1, 10} {
		h := fmt.Sprintf("pad_%d", batch)
		res, err := idem.ImportMarkers(context.Background(), drv, h, &driver.ImportSource{Table: "seen", Column: "id"}, &idem.ImportOptions{Batch: batch})
		if err != nil || res.Read != 3 || res.Imported != 3 {
			t.Fatalf("import of ' ', '  ', 'x' in pages of %d: %+v, %v; want all 3 read and imported", batch, res, err)
		}
	}
}

func TestConformance(t *testing.T) {
	t.Parallel()
	// SQLite has one writer, reached through one connection: concurrent
	// deliveries queue in Go, so 32 goroutines × 1,000 IDs (the default,
	// which Postgres runs with real concurrency) would add 30,000 fsynced
	// transactions here and no coverage. 8 × 500 keeps the races between
	// goroutines without the wait.
	idemtest.Run(t, &idemtest.Harness[*sql.Tx]{Open: openStore, Goroutines: 8, IDs: 500})
}

func TestOrdering(t *testing.T) {
	t.Parallel()
	// 20 aggregates rather than 100: the streams' logic is the same, and
	// SQLite under -race runs them ~30× slower than without.
	idemtest.RunOrdering(t, &idemtest.Harness[*sql.Tx]{Open: openFastStore, Aggregates: 20})
}

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	for range 3 {
		if err := s.Driver.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

func TestHostilePrefixRefused(t *testing.T) {
	t.Parallel()
	db, err := sqlite.Open(":memory:", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	for _, p := range []string{`x"; DROP TABLE t; --`, "Upper_", "1abc", "a b", "ünï", "very_long_prefix_that_exceeds_the_limit_of_forty"} {
		if _, err := sqlite.New(db, &sqlite.Config{TablePrefix: p}); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("prefix %q: got %v, want ErrInvalidConfig", p, err)
		}
	}
	// A reserved word is fine: identifiers are always quoted.
	drv, err := sqlite.New(db, &sqlite.Config{TablePrefix: "order_"})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestProcessBeforeMigrate(t *testing.T) {
	t.Parallel()
	db, err := sqlite.Open(":memory:", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	drv, _ := sqlite.New(db, nil)
	p, _ := idem.NewProcessor(drv, nil)
	h := &idem.Handler[*sql.Tx]{Name: "h", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
	if _, err := p.Process(context.Background(), h, &idem.Message{ID: "1"}); err == nil {
		t.Fatal("Process before Migrate succeeded")
	}
}

func TestOpenRejectsBadSynchronous(t *testing.T) {
	t.Parallel()
	if _, err := sqlite.Open(":memory:", &sqlite.OpenOptions{Synchronous: "sometimes"}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("got %v, want ErrInvalidConfig", err)
	}
}

func TestRetention(t *testing.T) {
	t.Parallel()
	idemtest.RunRetention(t, &idemtest.Harness[*sql.Tx]{Open: openStore})
}

func TestDeadLetters(t *testing.T) {
	t.Parallel()
	idemtest.RunDeadLetters(t, &idemtest.Harness[*sql.Tx]{Open: openStore})
}

// TestDeadLettersByManyIDs: listing or moving dead letters by more IDs
// than SQLite binds parameters (32,766) works, as "idem dlq replay" of a
// large backlog needs.
func TestDeadLettersByManyIDs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, drv := openMigrated(t, nil)
	var ids []int64
	for _, m := range []string{"m-1", "m-2"} {
		id, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "h", MessageID: m, Error: "boom", Class: idem.DeadLetterPermanent,
			Fingerprint: "f", Attempts: 1, FirstFailed: time.Now(), LastFailed: time.Now(), State: driver.DeadLetterParked})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	for id := int64(1_000_000); len(ids) < 40_000; id++ {
		ids = append(ids, id) // no such dead letters
	}
	if got, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: ids}); err != nil || len(got) != 2 {
		t.Fatalf("list by 40,000 IDs: %d, %v; want the 2 that exist", len(got), err)
	}
	n, err := drv.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: ids, From: []string{driver.DeadLetterParked},
		To: driver.DeadLetterReplayRequested, Actor: "ops"})
	if err != nil || n != 2 {
		t.Fatalf("move by 40,000 IDs: %d, %v; want 2 moved", n, err)
	}
}

// TestOpenPathWithURICharacters: a file name holding ?, # or % opens that
// very file, with idem's pragmas in force, rather than a file named by
// the part before it with the rest read as URI parameters.
func TestOpenPathWithURICharacters(t *testing.T) {
	path := filepath.Join(t.TempDir(), "orders?v2#b%41.db")
	db, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE t (x int)`); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		entries, _ := os.ReadDir(filepath.Dir(path))
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Fatalf("%v; the directory holds %v", err, names)
	}
	var busy int
	if err := db.QueryRow(`PRAGMA busy_timeout`).Scan(&busy); err != nil || busy != 10000 {
		t.Fatalf("busy_timeout %d (%v), want 10000", busy, err)
	}
}
