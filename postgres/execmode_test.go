package postgres_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// TestQueryExecModes runs the conformance suite, an import and the outbox
// (and, on the simple protocol, the ordering guard and retention, whose
// batches pass a tid) on pools in the exec modes where pgx sends
// parameters as text of no known type: QueryExecModeExec, and the simple
// protocol that pools behind PgBouncer in transaction mode often use. The
// driver's arrays must encode there as well as in the default mode.
func TestQueryExecModes(t *testing.T) {
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			open := func(t testing.TB) (*pgxpool.Pool, string) {
				pool := testenv.PostgresPoolWith(t, 40, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
				return pool, testenv.FreshSchema(t, pool)
			}
			h := &idemtest.Harness[postgres.Tx]{Goroutines: 16, IDs: 300, Aggregates: 10, Open: func(t testing.TB) *idemtest.Store[postgres.Tx] {
				pool, schema := open(t)
				return storeIn(t, pool, schema)
			}}
			idemtest.Run(t, h)
			if mode == pgx.QueryExecModeSimpleProtocol {
				// The slowest suite, once: no parameter carries a type here.
				t.Run("Ordering", func(t *testing.T) { idemtest.RunOrdering(t, h) })
				t.Run("Retention", func(t *testing.T) { idemtest.RunRetention(t, h) })
			}
			t.Run("ImportAndOutbox", func(t *testing.T) {
				ctx := context.Background()
				pool, schema := open(t)
				s := storeIn(t, pool, schema)
				drv := s.Driver.(*postgres.Driver)
				if _, err := pool.Exec(ctx, `CREATE TABLE `+pgx.Identifier{schema, "seen"}.Sanitize()+` AS
SELECT 'imported-' || i AS id FROM generate_series(1, 50) i`); err != nil {
					t.Fatal(err)
				}
				res, err := idem.ImportMarkers(ctx, drv, "h", &driver.ImportSource{Schema: schema, Table: "seen", Column: "id"}, nil)
				if err != nil || res.Imported != 50 {
					t.Fatalf("import: %+v, %v; want 50 imported", res, err)
				}
				if n, err := s.Markers(ctx, "h"); err != nil || n != 50 {
					t.Fatalf("markers after the import: %d, %v; want 50", n, err)
				}
				ob, err := outbox.New(drv)
				if err != nil {
					t.Fatal(err)
				}
				tx, err := pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx)
				if err := ob.Add(ctx, tx,
					&idem.Message{ID: "out-1", Stream: "orders", Payload: []byte("one")},
					&idem.Message{ID: "out-2", Stream: "orders", Payload: []byte{}, AggregateID: "a", Seq: 1}); err != nil {
					t.Fatalf("outbox add: %v", err)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				var n int
				var empty bool
				if err := pool.QueryRow(ctx, `SELECT count(*), bool_or(payload = ''::bytea) FROM `+pgx.Identifier{schema, "idem_outbox"}.Sanitize()).Scan(&n, &empty); err != nil || n != 2 || !empty {
					t.Fatalf("outbox rows: %d (an empty payload: %v), %v; want 2, one empty", n, empty, err)
				}
			})
		})
	}
}
