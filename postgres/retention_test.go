package postgres_test

import (
	"context"
	"errors"
	"fmt"
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

// TestPruneMillionMarkersWhileProcessing fills the marker table with
// 1,000,000 markers 30 days old, then prunes them in batches of 5,000 while
// a processor keeps applying new messages: pruning finishes with no error,
// every old marker is gone and every new one kept, the balances are exact,
// and no message waited longer than the slowest batch (plus scheduling
// slack): batches are short transactions on other rows.
func TestPruneMillionMarkersWhileProcessing(t *testing.T) {
	const old = 1_000_000
	pool := testenv.PostgresPool(t, 8)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx := context.Background()
	markers := pgx.Identifier{schema, "idem_markers"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "idem_handlers"}.Sanitize()+` (name) VALUES ('balances')`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+markers+` (handler_id, message_key, payload_hash, processed_at)
SELECT 1, convert_to('old-' || lpad(i::text, 7, '0'), 'UTF8'), '\x00'::bytea, now() - interval '30 days'
FROM generate_series(1, $1) AS i`, old); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE `+markers); err != nil {
		t.Fatal(err)
	}

	idemtest.CheckPruneWhileProcessing(t, s, old, 5000, func(i int) string { return fmt.Sprintf("new-%06d", i) })
}

// TestPruneDriverKeysetCursor checks the driver's cursor on the old table
// (leases, and atomic markers from before migration 011): batches walk the
// key space without revisiting it, and the short batch that ends it goes
// on into the markers table (empty here), which ends the walk.
func TestPruneDriverKeysetCursor(t *testing.T) {
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx := context.Background()
	markers := pgx.Identifier{schema, "idem_processed"}.Sanitize()
	if err := legacyExec(ctx, pool, `INSERT INTO `+markers+` (handler, message_id, payload_hash, processed_at)
SELECT h, 'm-' || lpad(i::text, 3, '0'), '\x00'::bytea, now() - interval '30 days'
FROM generate_series(1, 25) AS i, (VALUES ('a'), ('b')) AS hs(h)`); err != nil {
		t.Fatal(err)
	}
	drv := s.Driver.(*postgres.Driver)
	p := &driver.PruneParams{Before: time.Now().Add(-24 * time.Hour), Limit: 20}
	var total int
	var lasts []string
	for range 10 {
		res, err := drv.PruneMarkers(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		total += res.Deleted
		if res.Done || res.Last.Position != 0 {
			lasts = append(lasts, fmt.Sprintf("done=%v", res.Done))
			break
		}
		lasts = append(lasts, res.Last.Handler+"/"+res.Last.MessageID)
		p.After = res.Last
	}
	if want := "[a/m-020 b/m-015 done=true]"; total != 50 || fmt.Sprint(lasts) != want {
		t.Fatalf("deleted %d with cursors %v, want 50 with %s", total, lasts, want)
	}
}

// TestPruneDriverPhysicalCursor checks the cursor on the markers table:
// batches walk it in physical order, delete at most Limit rows each, keep
// the young markers found among the old ones, and end with Done.
func TestPruneDriverPhysicalCursor(t *testing.T) {
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx := context.Background()
	markers := pgx.Identifier{schema, "idem_markers"}.Sanitize()
	// 1,000 markers, every fifth young: about 10 pages.
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "idem_handlers"}.Sanitize()+` (name) VALUES ('a')`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+markers+` (handler_id, message_key, payload_hash, processed_at)
SELECT 1, convert_to('m-' || i, 'UTF8'), '\x00'::bytea, now() - CASE WHEN i % 5 = 0 THEN interval '1 hour' ELSE interval '30 days' END
FROM generate_series(1, 1000) AS i`); err != nil {
		t.Fatal(err)
	}
	drv := s.Driver.(*postgres.Driver)
	p := &driver.PruneParams{Before: time.Now().Add(-24 * time.Hour), Limit: 150, After: driver.MarkerKey{Position: 1}}
	var total, batches int
	for ; batches < 100; batches++ {
		res, err := drv.PruneMarkers(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		if res.Deleted > p.Limit {
			t.Fatalf("batch %d deleted %d, more than the limit %d", batches, res.Deleted, p.Limit)
		}
		total += res.Deleted
		if res.Done {
			break
		}
		if res.Last.Position <= p.After.Position {
			t.Fatalf("cursor went from %d to %d", p.After.Position, res.Last.Position)
		}
		p.After = res.Last
	}
	var left, young int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE processed_at > now() - interval '1 day') FROM `+markers).Scan(&left, &young); err != nil {
		t.Fatal(err)
	}
	if total != 800 || left != 200 || young != 200 {
		t.Fatalf("deleted %d in %d batches, %d left (%d young); want 800 deleted and the 200 young left", total, batches+1, left, young)
	}
}

// TestPruneDeletesExpiredOutboxClaims: the outbox pass of retention also
// deletes the relay claims and holds that expired (left by a relay that
// died, or by a failure's hold), so the claims table does not keep a row
// per key that ever failed; live ones stay.
func TestPruneDeletesExpiredOutboxClaims(t *testing.T) {
	pool := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx := context.Background()
	claims := pgx.Identifier{schema, "idem_outbox_claims"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+claims+` (ordering_key, owner, claimed_until) VALUES
('dead-relay', 'relay-1', now() - interval '1 hour'), ('old-hold', '', now() - interval '1 second'),
('live', 'relay-2', now() + interval '1 hour'), ('held', '', now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	drv := s.Driver.(*postgres.Driver)
	if _, _, err := drv.OutboxPrune(ctx, time.Now().Add(-24*time.Hour), 0, 100); err != nil {
		t.Fatal(err)
	}
	var left []string
	rows, err := pool.Query(ctx, `SELECT ordering_key FROM `+claims+` ORDER BY ordering_key`)
	if err != nil {
		t.Fatal(err)
	}
	if left, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(left) != "[held live]" {
		t.Fatalf("claims after prune: %v, want the live claim and hold only", left)
	}
}

// TestPruneOnAPoolOfOne: retention holds its lock on a connection of its
// own, so it runs on a pool of one connection (which it used to wait on
// for ever) and excludes a second run all the same.
func TestPruneOnAPoolOfOne(t *testing.T) {
	pool := testenv.PostgresPool(t, 1)
	s := storeIn(t, pool, testenv.FreshSchema(t, pool))
	pr, err := idem.NewPruner(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := pr.Prune(ctx); err != nil {
		t.Fatalf("Prune on a pool of one: %v", err)
	}
	mp := s.Driver.(driver.MarkerPruner)
	unlock, ok, err := mp.TryMaintenanceLock(ctx)
	if err != nil || !ok {
		t.Fatalf("first lock: %v, %v", ok, err)
	}
	if _, err := pr.Prune(ctx); !errors.Is(err, idem.ErrMaintenanceBusy) {
		t.Fatalf("Prune while another instance holds the lock: %v, want ErrMaintenanceBusy", err)
	}
	unlock()
	if _, err := pr.Prune(ctx); err != nil {
		t.Fatalf("Prune after the other instance let go: %v", err)
	}
}

// aheadClock is the driver with its store's clock moved: what a server
// whose clock differs from the application host's looks like to idem.
type aheadClock struct {
	*postgres.Driver
	by time.Duration
}

func (a aheadClock) Now(ctx context.Context) (time.Time, error) {
	t, err := a.Driver.Now(ctx)
	return t.Add(a.by), err
}

// TestPruneGoesByTheStoresClock: markers are stamped by the server's
// clock, and the retention cutoff is taken from it too, not from the
// application host's, unless RetentionConfig.Now says otherwise.
func TestPruneGoesByTheStoresClock(t *testing.T) {
	pool := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx := context.Background()
	drv := s.Driver.(*postgres.Driver)
	if now, err := drv.Now(ctx); err != nil || time.Since(now).Abs() > time.Minute {
		t.Fatalf("server clock %v (%v), want about now", now, err)
	}
	markers := pgx.Identifier{schema, "idem_processed"}.Sanitize()
	// A marker an hour short of the 7-day retention, by the server's clock.
	if err := legacyExec(ctx, pool, `INSERT INTO `+markers+` (handler, message_id, payload_hash, processed_at)
VALUES ('h', 'young', '\x00', now() - interval '7 days' + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		drv     any
		now     func() time.Time
		deleted int
	}{
		{drv, nil, 0}, // the server's clock: not old yet
		{aheadClock{drv, -2 * time.Hour}, nil, 0},        // a server behind: still not
		{drv, func() time.Time { return time.Now() }, 0}, // the caller's clock, in step
		{aheadClock{drv, 2 * time.Hour}, nil, 1},         // a server two hours ahead: old
	} {
		pr, err := idem.NewPruner(c.drv, &idem.RetentionConfig{Now: c.now})
		if err != nil {
			t.Fatal(err)
		}
		// The dry run and the run count by the same clock, and say which
		// cutoff they used.
		var now time.Time
		if c.now != nil {
			now = c.now()
		} else if now, err = c.drv.(interface {
			Now(context.Context) (time.Time, error)
		}).Now(ctx); err != nil {
			t.Fatal(err)
		}
		wantCut := now.Add(-idem.DefaultRetention)
		est, err := pr.Prunable(ctx)
		if err != nil || est.Markers["h"] != int64(c.deleted) || est.Cutoff.Sub(wantCut).Abs() > time.Minute {
			t.Fatalf("%T: dry run %+v, %v; want %d markers before %v", c.drv, est, err, c.deleted, wantCut)
		}
		st, err := pr.Prune(ctx)
		if err != nil || st.Deleted != c.deleted || st.Cutoff.Sub(wantCut).Abs() > time.Minute {
			t.Fatalf("%T: %+v, %v; want %d deleted before %v", c.drv, st, err, c.deleted, wantCut)
		}
	}
}

// legacyExec runs sql, which writes markers to the old table as an idem
// from before migration 011 left them, without the trigger of migration
// 012 (which mirrors such writes into the new table): data written
// before the upgrade. The tests connect as a superuser, which
// session_replication_role needs.
func legacyExec(ctx context.Context, pool *pgxpool.Pool, sql string, args ...any) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SET LOCAL session_replication_role = replica"); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, sql, args...); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// TestPruneHugeBatchSize: a batch size past what a page range can hold
// (tens of billions of rows) prunes like any other, rather than failing
// on a page number beyond the largest a table can have.
func TestPruneHugeBatchSize(t *testing.T) {
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "idem_handlers"}.Sanitize()+` (name) VALUES ('a')`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "idem_markers"}.Sanitize()+` (handler_id, message_key, payload_hash, processed_at)
SELECT 1, convert_to('m-' || i, 'UTF8'), '\x00'::bytea, now() - CASE WHEN i % 5 = 0 THEN interval '1 hour' ELSE interval '30 days' END
FROM generate_series(1, 100) AS i`); err != nil {
		t.Fatal(err)
	}
	pr, err := idem.NewPruner(s.Driver, &idem.RetentionConfig{Retention: 24 * time.Hour, BatchSize: 1 << 40})
	if err != nil {
		t.Fatal(err)
	}
	st, err := pr.Prune(ctx)
	if err != nil || st.Deleted != 80 {
		t.Fatalf("prune with a batch size of 2^40: %+v, %v; want the 80 old markers deleted", st, err)
	}
}
