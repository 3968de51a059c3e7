package postgres_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// footprintMarkers is how many markers the footprint and migration tests
// write: IDEM_FOOTPRINT_MARKERS, default 100,000. The figures in
// docs/performance.md were taken with 1,000,000:
//
//	IDEM_FOOTPRINT_MARKERS=1000000 go test ./postgres -run 'TestMarkerFootprint|TestMigrateOldMarkers' -v
func footprintMarkers(t *testing.T) int {
	n := 100_000
	if v := os.Getenv("IDEM_FOOTPRINT_MARKERS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1000 {
			t.Fatalf("IDEM_FOOTPRINT_MARKERS=%q: want a count of at least 1000", v)
		}
	}
	return n
}

// relBytes returns the size of a table's heap and of its indexes.
func relBytes(t *testing.T, pool *pgxpool.Pool, table string) (heap, index int64) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT pg_relation_size($1::regclass), pg_indexes_size($1::regclass)`, table).Scan(&heap, &index); err != nil {
		t.Fatal(err)
	}
	return heap, index
}

// TestMarkerFootprint measures the bytes a marker takes on Postgres (heap
// and primary key) and the rate at which retention deletes them. The
// markers are those of the measurement: one 20-byte handler name,
// random UUID message IDs in random order, SHA-256 payload hashes. They are
// written through the driver's batch insert, so the layout measured is
// the one processors write. Sizes do not depend on the machine's load;
// the rate does.
func TestMarkerFootprint(t *testing.T) {
	n := footprintMarkers(t)
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	drv := s.Driver.(*postgres.Driver)
	ctx := context.Background()
	const handler = "billing.ledger-sync1" // 20 bytes
	ids, err := pgx.CollectRows(mustQuery(t, pool, `SELECT gen_random_uuid()::text FROM generate_series(1, $1)`, n), pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i += 1000 {
		chunk := ids[i:min(i+1000, n)]
		msgs := make([]*idem.Message, len(chunk))
		for j, id := range chunk {
			msgs[j] = &idem.Message{ID: id, Payload: []byte(id)}
		}
		if err := insertMarkers(ctx, drv, handler, msgs); err != nil {
			t.Fatal(err)
		}
	}
	markers := pgx.Identifier{schema, "idem_markers"}.Sanitize()
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+markers); err != nil {
		t.Fatal(err)
	}
	heap, index := relBytes(t, pool, markers)
	per := float64(heap+index) / float64(n)
	t.Logf("%d markers: heap %.1f MB, index %.1f MB, %.1f bytes a marker (heap %.1f, index %.1f)",
		n, float64(heap)/1e6, float64(index)/1e6, per, float64(heap)/float64(n), float64(index)/float64(n))
	if per > 140 {
		t.Errorf("%.1f bytes a marker, want at most 140", per)
	}

	// Prune them all with the default batch, as seen from eight days on
	// (updating their times instead would leave every page half dead).
	later := func() time.Time { return time.Now().Add(8 * 24 * time.Hour) }
	pr, err := idem.NewPruner(drv, &idem.RetentionConfig{Now: later})
	if err != nil {
		t.Fatal(err)
	}
	st, err := pr.Prune(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pruned %d markers in %s: %.0f rows/s, %d batches, longest %s",
		st.Deleted, st.Duration.Round(time.Millisecond), float64(st.Deleted)/st.Duration.Seconds(), st.Batches, st.LongestBatch.Round(time.Millisecond))
	if st.Deleted != n {
		t.Fatalf("pruned %d markers, want %d", st.Deleted, n)
	}
}

// insertMarkers writes msgs' markers for handler in one transaction.
func insertMarkers(ctx context.Context, drv *postgres.Driver, handler string, msgs []*idem.Message) error {
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		return err
	}
	h := &idem.Handler[postgres.Tx]{Name: handler, Apply: func(context.Context, postgres.Tx, *idem.Message) error { return nil }}
	outs, err := p.ProcessBatch(ctx, h, msgs)
	if err != nil {
		return err
	}
	for i, o := range outs {
		if o != idem.Applied {
			return fmt.Errorf("%s: %v", msgs[i].ID, o)
		}
	}
	return nil
}

func mustQuery(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) pgx.Rows {
	t.Helper()
	rows, err := pool.Query(context.Background(), sql, args...)
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

// TestMigrateOldMarkers upgrades a schema of migration 010 holding atomic
// markers in the old table to the narrow layout, while a writer keeps
// using the old table: the migration holds no lock that blocks it (only
// ACCESS SHARE on the old table) and takes a short time whatever the old
// table's size; the old markers stay visible to dedup (duplicates and
// conflicts are found in either table, alone or in a batch); retention
// deletes them by age and then retires the old layout.
func TestMigrateOldMarkers(t *testing.T) {
	n := footprintMarkers(t)
	pool := testenv.PostgresPool(t, 6)
	schema := testenv.FreshSchema(t, pool)
	storeIn(t, pool, schema)
	ctx := context.Background()
	q := func(name string) string { return pgx.Identifier{schema, name}.Sanitize() }
	// Back to the version before migrations 011 and 012.
	if _, err := pool.Exec(ctx, `DROP TRIGGER `+pgx.Identifier{"idem_processed_mirror"}.Sanitize()+` ON `+q("idem_processed")+`;
DROP FUNCTION `+q("idem_processed_mirror")+`();
DROP TABLE `+q("idem_markers")+`, `+q("idem_handlers")+`, `+q("idem_marker_layout")+`;
DELETE FROM `+q("idem_migrations")+` WHERE version IN (11, 12)`); err != nil {
		t.Fatal(err)
	}
	// Old atomic markers as the driver before migration 011 wrote them; the first
	// half older than the retention.
	const handler = "billing.ledger-sync1"
	if _, err := pool.Exec(ctx, `INSERT INTO `+q("idem_processed")+` (handler, message_id, payload_hash, processed_at)
SELECT $1, id, sha256(convert_to(id, 'UTF8')), now() - CASE WHEN i <= $2 / 2 THEN interval '8 days' ELSE interval '1 day' END
FROM (SELECT i, gen_random_uuid()::text AS id FROM generate_series(1, $2) AS i) AS g`, handler, n); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+q("idem_processed")); err != nil {
		t.Fatal(err)
	}
	heap, index := relBytes(t, pool, q("idem_processed"))
	t.Logf("old layout, %d markers: heap %.1f MB, indexes %.1f MB, %.1f bytes a marker",
		n, float64(heap)/1e6, float64(index)/1e6, float64(heap+index)/float64(n))
	var young, old string
	if err := pool.QueryRow(ctx, `SELECT (SELECT message_id FROM `+q("idem_processed")+` WHERE processed_at > now() - interval '2 days' LIMIT 1),
  (SELECT message_id FROM `+q("idem_processed")+` WHERE processed_at < now() - interval '7 days' LIMIT 1)`).Scan(&young, &old); err != nil {
		t.Fatal(err)
	}

	// The locks the migration takes, seen from inside its transaction.
	sql011, err := os.ReadFile("migrations/011_narrow_markers.sql")
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, strings.NewReplacer("{{processed}}", q("idem_processed"), "{{markers}}", q("idem_markers"),
		"{{handlers}}", q("idem_handlers"), "{{marker_layout}}", q("idem_marker_layout")).Replace(string(sql011))); err != nil {
		t.Fatal(err)
	}
	locks, err := pgx.CollectRows(mustQueryTx(t, tx, `SELECT c.relname || ' ' || l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
WHERE l.pid = pg_backend_pid() AND c.relname LIKE 'idem_processed%' ORDER BY 1`), pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	_ = tx.Rollback(ctx)
	t.Logf("locks on the old table: %v", locks)
	for _, l := range locks {
		if !strings.HasSuffix(l, " AccessShareLock") {
			t.Errorf("migration 011 takes %s; want ACCESS SHARE only", l)
		}
	}

	// Migrate while a writer adds lease rows to the old table, as the
	// previous version's lease claims do.
	var (
		stop    atomic.Bool
		maxWait time.Duration
		writes  int
		wErr    error
		wg      sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			t0 := time.Now()
			if _, err := pool.Exec(ctx, `INSERT INTO `+q("idem_processed")+` (handler, message_id, payload_hash, status, token, attempts)
VALUES ('mailer', $1, '\x00', 'done', 1, 1)`, fmt.Sprintf("mail-%d", i)); err != nil {
				wErr = fmt.Errorf("lease row during the migration: %w", err)
				return
			}
			maxWait = max(maxWait, time.Since(t0))
			writes++
		}
	}()
	time.Sleep(100 * time.Millisecond)
	fresh, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	err = fresh.Migrate(ctx)
	took := time.Since(t0)
	time.Sleep(100 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if wErr != nil {
		t.Fatal(wErr)
	}
	t.Logf("migration 011 over %d old markers took %s; %d lease writes meanwhile, the slowest %s", n, took.Round(time.Millisecond), writes, maxWait.Round(time.Millisecond))

	// The old markers still count.
	p, err := idem.NewProcessor(fresh, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[postgres.Tx]{Name: handler, Apply: func(context.Context, postgres.Tx, *idem.Message) error { return nil }}
	if out, err := p.Process(ctx, h, &idem.Message{ID: young, Payload: []byte(young)}); out != idem.Duplicate || err != nil {
		t.Fatalf("redelivery of an old marker: %v, %v; want duplicate", out, err)
	}
	if out, err := p.Process(ctx, h, &idem.Message{ID: young, Payload: []byte("other")}); out != idem.Conflict {
		t.Fatalf("old marker, other payload: %v, %v; want conflict", out, err)
	}
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{{ID: old, Payload: []byte(old)}, {ID: "new-1", Payload: []byte("x")}, {ID: young, Payload: []byte("other")}})
	if err != nil && outs == nil {
		t.Fatal(err)
	}
	if fmt.Sprint(outs) != fmt.Sprint([]idem.Outcome{idem.Duplicate, idem.Applied, idem.Conflict}) {
		t.Fatalf("batch over old and new markers: %v (%v)", outs, err)
	}
	if out, err := p.Process(ctx, h, &idem.Message{ID: "new-1", Payload: []byte("x")}); out != idem.Duplicate || err != nil {
		t.Fatalf("redelivery of a new marker: %v, %v", out, err)
	}

	// Retention deletes the old markers by age; the old layout is retired
	// once none is left.
	pr, err := idem.NewPruner(fresh, nil)
	if err != nil {
		t.Fatal(err)
	}
	st, err := pr.Prune(ctx)
	if err != nil || st.Deleted != n/2 {
		t.Fatalf("prune: %+v, %v; want the %d older than the retention", st, err, n/2)
	}
	legacy := func() (l bool) {
		if err := pool.QueryRow(ctx, `SELECT legacy_atomic FROM `+q("idem_marker_layout")).Scan(&l); err != nil {
			t.Fatal(err)
		}
		return l
	}
	if !legacy() {
		t.Fatal("old layout retired while old markers are left")
	}
	if out, err := p.Process(ctx, h, &idem.Message{ID: young, Payload: []byte(young)}); out != idem.Duplicate || err != nil {
		t.Fatalf("redelivery of a young old marker after pruning: %v, %v", out, err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+q("idem_processed")+` SET processed_at = now() - interval '30 days' WHERE token = 0`); err != nil {
		t.Fatal(err)
	}
	if st, err = pr.Prune(ctx); err != nil || st.Deleted != n-n/2 {
		t.Fatalf("second prune: %+v, %v; want %d", st, err, n-n/2)
	}
	if legacy() {
		t.Fatal("old layout not retired once the old markers are gone")
	}
}

func mustQueryTx(t *testing.T, tx pgx.Tx, sql string, args ...any) pgx.Rows {
	t.Helper()
	rows, err := tx.Query(context.Background(), sql, args...)
	if err != nil {
		t.Fatal(err)
	}
	return rows
}
