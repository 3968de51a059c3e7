package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// openStore returns a store on a fresh schema. The pool allows more
// connections than the suite's 32 goroutines, so their transactions really
// contend on the same rows at once.
func openStore(t testing.TB) *idemtest.Store[postgres.Tx] {
	t.Helper()
	pool := testenv.PostgresPool(t, 40)
	schema := testenv.FreshSchema(t, pool)
	return storeIn(t, pool, schema)
}

func storeIn(t testing.TB, pool *pgxpool.Pool, schema string) *idemtest.Store[postgres.Tx] {
	t.Helper()
	return storeWith(t, pool, &postgres.Config{Schema: schema})
}

// storeWith is storeIn with the driver's whole configuration.
func storeWith(t testing.TB, pool *pgxpool.Pool, cfg *postgres.Config) *idemtest.Store[postgres.Tx] {
	t.Helper()
	ctx := context.Background()
	schema := cfg.Schema
	drv, err := postgres.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	balances := pgx.Identifier{schema, "balances"}.Sanitize()
	states := pgx.Identifier{schema, "states"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+balances+` (account text PRIMARY KEY, amount bigint NOT NULL);
CREATE TABLE `+states+` (aggregate text PRIMARY KEY, value text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return &idemtest.Store[postgres.Tx]{
		Driver: drv,
		Credit: func(ctx context.Context, tx postgres.Tx, account string, amount int64) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+balances+` (account, amount) VALUES ($1, $2)
ON CONFLICT (account) DO UPDATE SET amount = `+balances+`.amount + excluded.amount`, account, amount)
			return err
		},
		CreditMany: func(ctx context.Context, tx postgres.Tx, accounts []string, amounts []int64) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+balances+` (account, amount)
SELECT a, n FROM unnest($1::text[], $2::bigint[]) AS u(a, n)
ON CONFLICT (account) DO UPDATE SET amount = `+balances+`.amount + excluded.amount`, accounts, amounts)
			return err
		},
		Put: func(ctx context.Context, tx postgres.Tx, agg, value string) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+states+` (aggregate, value) VALUES ($1, $2)
ON CONFLICT (aggregate) DO UPDATE SET value = excluded.value`, agg, value)
			return err
		},
		Append: func(ctx context.Context, tx postgres.Tx, agg, value string) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+states+` (aggregate, value) VALUES ($1, ',' || $2)
ON CONFLICT (aggregate) DO UPDATE SET value = `+states+`.value || excluded.value`, agg, value)
			return err
		},
		States: func(ctx context.Context) (map[string]string, error) {
			rows, err := pool.Query(ctx, `SELECT aggregate, value FROM `+states)
			if err != nil {
				return nil, err
			}
			m := map[string]string{}
			var a, v string
			_, err = pgx.ForEachRow(rows, []any{&a, &v}, func() error { m[a] = v; return nil })
			return m, err
		},
		Markers: func(ctx context.Context, handler string) (n int, err error) {
			err = pool.QueryRow(ctx, markerCountSQL(schema), handler).Scan(&n)
			return n, err
		},
		Balances: func(ctx context.Context) (map[string]int64, error) {
			rows, err := pool.Query(ctx, `SELECT account, amount FROM `+balances)
			if err != nil {
				return nil, err
			}
			m := map[string]int64{}
			var a string
			var n int64
			_, err = pgx.ForEachRow(rows, []any{&a, &n}, func() error { m[a] = n; return nil })
			return m, err
		},
	}
}

// markerCountSQL counts a handler's markers ($1) in both tables: the
// atomic markers table and the old one (leases, and atomic markers from
// before migration 011).
func markerCountSQL(schema string) string {
	return `SELECT (SELECT count(*) FROM ` + pgx.Identifier{schema, "idem_markers"}.Sanitize() + ` m
  JOIN ` + pgx.Identifier{schema, "idem_handlers"}.Sanitize() + ` h ON h.id = m.handler_id WHERE h.name = $1)
+ (SELECT count(*) FROM ` + pgx.Identifier{schema, "idem_processed"}.Sanitize() + ` WHERE handler = $1)`
}

func TestConformance(t *testing.T) {
	idemtest.Run(t, &idemtest.Harness[postgres.Tx]{Open: openStore})
}

// The same suite with every marker insert conflict-aware, as
// Config.ConflictAwareInserts sets it, at the sizes of the other modes'
// runs (TestQueryExecModes): TestConformance and TestOrdering run the
// full sizes once.
func TestConformanceConflictAware(t *testing.T) {
	h := &idemtest.Harness[postgres.Tx]{Goroutines: 16, IDs: 300, Aggregates: 10, Open: func(t testing.TB) *idemtest.Store[postgres.Tx] {
		pool := testenv.PostgresPool(t, 40)
		return storeWith(t, pool, &postgres.Config{Schema: testenv.FreshSchema(t, pool), ConflictAwareInserts: true})
	}}
	idemtest.Run(t, h)
	// The guard and the dead letters insert markers too.
	t.Run("Ordering", func(t *testing.T) { idemtest.RunOrdering(t, h) })
	t.Run("DeadLetters", func(t *testing.T) { idemtest.RunDeadLetters(t, h) })
}

// TestImportBlankIDsUnderANondeterministicCollation: a value of blanks or
// punctuation is a valid message ID, not an empty one; under a
// nondeterministic collation that ignores them it compares equal to the
// empty string, and must be imported all the same, never dropped unread.
func TestImportBlankIDsUnderANondeterministicCollation(t *testing.T) {
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx := context.Background()
	coll := pgx.Identifier{schema, "ignoring"}.Sanitize()
	table := pgx.Identifier{schema, "seen"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE COLLATION `+coll+` (provider = icu, locale = 'und-u-ka-shifted', deterministic = false)`); err != nil {
		t.Skipf("no ICU collation on this server: %v", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (id text COLLATE `+coll+`); INSERT INTO `+table+` VALUES (' '), ('  '), ('-'), ('x'), (''), (NULL)`); err != nil {
		t.Fatal(err)
	}
	for _, batch := range []int{1, 10} {
		res, err := idem.ImportMarkers(ctx, s.Driver.(*postgres.Driver), fmt.Sprintf("blank_%d", batch),
			&driver.ImportSource{Schema: schema, Table: "seen", Column: "id"}, &idem.ImportOptions{Batch: batch})
		if err != nil || res.Read != 4 || res.Imported != 4 {
			t.Fatalf("import of ' ', '  ', '-', 'x' in pages of %d: %+v, %v; want all 4 read and imported", batch, res, err)
		}
	}
}

func TestImportMarkers(t *testing.T) {
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	src := &driver.ImportSource{Schema: schema, Table: "processed_events", Column: "event_id"}
	table := pgx.Identifier{schema, "processed_events"}.Sanitize()
	idemtest.CheckImport(t, s, src, func(ctx context.Context, values []string) error {
		if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (event_id text PRIMARY KEY, processed_at timestamptz DEFAULT now())`); err != nil {
			return err
		}
		_, err := pool.Exec(ctx, `INSERT INTO `+table+` (event_id) SELECT unnest($1::text[])`, values)
		return err
	})
	drv := s.Driver.(*postgres.Driver)
	// Columns of other types: their text forms are the IDs, and pages
	// follow each other in the column's own order.
	ctx := context.Background()
	for _, typ := range []string{"uuid", "bigint", "varchar(64)"} {
		typed := pgx.Identifier{schema, "seen_" + strings.Fields(strings.ReplaceAll(typ, "(", " "))[0]}.Sanitize()
		if _, err := pool.Exec(ctx, `CREATE TABLE `+typed+` (id `+typ+` PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
		val := `(i * 7)::text`
		if typ == "uuid" {
			val = `md5(i::text)::uuid`
		}
		if _, err := pool.Exec(ctx, `INSERT INTO `+typed+` (id) SELECT (`+val+`)::`+typ+` FROM generate_series(1, 2500) i`); err != nil {
			t.Fatal(err)
		}
		src := &driver.ImportSource{Schema: schema, Table: strings.Trim(strings.SplitN(typed, ".", 2)[1], `"`), Column: "id"}
		res, err := idem.ImportMarkers(ctx, drv, "typed_"+strings.Fields(strings.ReplaceAll(typ, "(", " "))[0], src, &idem.ImportOptions{Batch: 1000})
		if err != nil || res.Read != 2500 || res.Imported != 2500 {
			t.Fatalf("import of a %s column: %+v, %v; want all 2,500", typ, res, err)
		}
	}
	// Values equal as values but not as text (numeric 1.5 and 1.50) are
	// two IDs, and a page boundary between them skips neither.
	nums := pgx.Identifier{schema, "seen_numeric"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+nums+` (id numeric); INSERT INTO `+nums+` VALUES (1), (1.5), (1.50), (2), (3), (NULL)`); err != nil {
		t.Fatal(err)
	}
	res, err := idem.ImportMarkers(ctx, drv, "typed_numeric", &driver.ImportSource{Schema: schema, Table: "seen_numeric", Column: "id"}, &idem.ImportOptions{Batch: 2})
	if err != nil || res.Read != 5 || res.Imported != 5 {
		t.Fatalf("import of 1, 1.5, 1.50, 2, 3 in pages of 2: %+v, %v; want all 5", res, err)
	}
	var markers int
	// A canonical UUID is stored as its 16 bytes.
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "idem_markers"}.Sanitize()+
		` WHERE message_key = decode(replace(md5('2500')::uuid::text, '-', ''), 'hex')`).Scan(&markers); err != nil || markers != 1 {
		t.Fatalf("marker of the last UUID in its canonical text: %d, %v", markers, err)
	}
	for _, bad := range []*driver.ImportSource{
		{Table: "processed_events; DROP TABLE x", Column: "event_id"},
		{Schema: `public"`, Table: "processed_events", Column: "event_id"},
		{Table: "processed_events", Column: ""},
	} {
		if _, err := drv.ImportIDs(context.Background(), bad, "", 10); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("source %+v: %v; want ErrInvalidConfig", bad, err)
		}
	}
}

func TestOrdering(t *testing.T) {
	idemtest.RunOrdering(t, &idemtest.Harness[postgres.Tx]{Open: openStore})
}

// TestConcurrencyCheckNeedsUniqueConstraint removes the primary key the
// guarantee rests on and shows that the conformance suite's concurrency
// check then fails: the check really tests the guarantee.
func TestConcurrencyCheckNeedsUniqueConstraint(t *testing.T) {
	pool := testenv.PostgresPool(t, 40)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `ALTER TABLE `+pgx.Identifier{schema, "idem_markers"}.Sanitize()+` DROP CONSTRAINT idem_markers_pkey`); err != nil {
		t.Fatal(err)
	}
	err := idemtest.CheckConcurrentDuplicates(ctx, s, 8, 200, 0)
	if err == nil {
		t.Fatal("the concurrency check passed without the unique constraint")
	}
	if !strings.Contains(err.Error(), "applied") || !strings.Contains(err.Error(), "balances differ") {
		t.Fatalf("unexpected failure: %v", err)
	}
	t.Logf("without the primary key, as expected: %v", err)
}

func TestMigrateConcurrentlyAndTwice(t *testing.T) {
	pool := testenv.PostgresPool(t, 10)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema, TablePrefix: "order_"})
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 4)
	for range 4 {
		go func() { errs <- drv.Migrate(context.Background()) }()
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	count := func() (n, maxVersion int) {
		t.Helper()
		if err := pool.QueryRow(context.Background(), `SELECT count(*), max(version) FROM `+pgx.Identifier{schema, "order_migrations"}.Sanitize()).Scan(&n, &maxVersion); err != nil {
			t.Fatal(err)
		}
		return n, maxVersion
	}
	n, maxVersion := count()
	if n < 2 || maxVersion < 3 {
		t.Fatalf("%d migrations recorded up to version %d, want every embedded one", n, maxVersion)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if again, _ := count(); again != n {
		t.Fatalf("migrating again recorded %d migrations, had %d", again, n)
	}
}

func TestHostileIdentifiersRefused(t *testing.T) {
	pool := testenv.PostgresPool(t, 2)
	for _, cfg := range []postgres.Config{
		{Schema: `public"; DROP SCHEMA public; --`},
		{TablePrefix: "Idem"},
		{TablePrefix: "a-b"},
		{Schema: "9lives"},
	} {
		if _, err := postgres.New(pool, &cfg); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%+v: got %v, want ErrInvalidConfig", cfg, err)
		}
	}
}

// TestCommitAfterFailedStatement checks that a handler which swallowed a
// statement error cannot get its transaction reported as committed.
func TestCommitAfterFailedStatement(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[postgres.Tx]{Name: "sloppy", Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
		_, _ = tx.Exec(ctx, `SELECT 1/0`) // error ignored: the transaction is now aborted
		return nil
	}}
	out, err := p.Process(ctx, h, &idem.Message{ID: "m1"})
	if out != idem.OutcomeNone || !errors.Is(err, postgres.ErrCommitRolledBack) {
		t.Fatalf("got (%v, %v), want ErrCommitRolledBack", out, err)
	}
	good := &idem.Handler[postgres.Tx]{Name: "sloppy", Apply: func(context.Context, postgres.Tx, *idem.Message) error { return nil }}
	out, err = p.Process(ctx, good, &idem.Message{ID: "m1"})
	if out != idem.Applied || err != nil {
		t.Fatalf("redelivery after a rolled-back commit: (%v, %v), want applied", out, err)
	}
}

// TestProcessTxWithPgxTx runs ProcessTx inside a transaction the caller
// began with pgx directly.
func TestProcessTxWithPgxTx(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	pool := s.Driver.(*postgres.Driver).Pool()
	p, _ := idem.NewProcessor(s.Driver, nil)
	h := idemtest.CreditHandler(s, "balances", nil)
	e := idemtest.Events(1)[0]
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		out, err := p.ProcessTx(ctx, tx, h, e.Message())
		if out != idem.Applied {
			t.Errorf("outcome %v", out)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	out, err := p.Process(ctx, h, e.Message())
	if out != idem.Duplicate || err != nil {
		t.Fatalf("redelivery: (%v, %v)", out, err)
	}
	bal, _ := s.Balances(ctx)
	if bal[e.Account] != e.Amount {
		t.Fatalf("balance %d, want %d", bal[e.Account], e.Amount)
	}
}

func TestRetention(t *testing.T) {
	idemtest.RunRetention(t, &idemtest.Harness[postgres.Tx]{Open: openStore})
}

func TestDeadLetters(t *testing.T) {
	idemtest.RunDeadLetters(t, &idemtest.Harness[postgres.Tx]{Open: openStore})
}

// TestProcessTxOnAPoolOfOne: a driver that has not seen a handler name
// yet reads its id, and the marker layout, through the caller's
// transaction, so ProcessTx works while that transaction holds the
// pool's only connection (once the name exists in the database).
func TestProcessTxOnAPoolOfOne(t *testing.T) {
	pool := testenv.PostgresPool(t, 1)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	h := &idem.Handler[postgres.Tx]{Name: "balances", Apply: func(context.Context, postgres.Tx, *idem.Message) error { return nil }}
	first, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := first.Process(ctx, h, &idem.Message{ID: "m-1"}); out != idem.Applied || err != nil {
		t.Fatalf("first delivery: %v, %v", out, err)
	}
	fresh, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(fresh, nil)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	for id, want := range map[string]idem.Outcome{"m-1": idem.Duplicate, "m-2": idem.Applied} {
		if out, err := p.ProcessTx(ctx, tx, h, &idem.Message{ID: id}); out != want || err != nil {
			t.Fatalf("%s in the caller's transaction: %v, %v; want %v", id, out, err, want)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}
