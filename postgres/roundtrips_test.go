package postgres_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// roundTrips counts what a pool's connections send and then wait on: a
// statement, or a batch of them, is one round trip.
type roundTrips struct{ n atomic.Int64 }

func (r *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.n.Add(1)
	return ctx
}

func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	r.n.Add(1)
	return ctx
}

func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// TestRoundTripsPerMessage counts the round trips of one message through
// Process, its handler one upsert, against the same transaction without
// idem (BEGIN, the upsert, COMMIT): idem must not add one. The marker's
// INSERT travels with BEGIN.
func TestRoundTripsPerMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresDSN())
	if err != nil {
		t.Fatal(err)
	}
	rt := &roundTrips{}
	cfg.ConnConfig.Tracer = rt
	cfg.MaxConns = 1
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(pctx, cfg)
	if err == nil {
		err = pool.Ping(pctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		testenv.Unavailable(t, "PostgreSQL", cfg.ConnConfig.Host, err)
	}
	t.Cleanup(pool.Close)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	balances := pgx.Identifier{schema, "balances"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+balances+` (account text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	upsert := `INSERT INTO ` + balances + ` (account, amount) VALUES ($1, 1) ON CONFLICT (account) DO UPDATE SET amount = ` + balances + `.amount + 1`
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[postgres.Tx]{Name: "balances", Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
		_, err := tx.Exec(ctx, upsert, m.AggregateID)
		return err
	}}
	plain := func(i int) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, upsert, fmt.Sprint("a-", i%7)); err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		return tx.Commit(ctx)
	}
	through := func(i int) error {
		out, err := proc.Process(ctx, h, &idem.Message{ID: fmt.Sprint("m-", i), AggregateID: fmt.Sprint("a-", i%7)})
		if err == nil && out != idem.Applied {
			err = fmt.Errorf("outcome %v", out)
		}
		return err
	}
	// Per message, after a warm-up that prepares the statements.
	count := func(name string, f func(int) error, from int) float64 {
		for i := range 3 {
			if err := f(from + i); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		const n = 20
		before := rt.n.Load()
		for i := range n {
			if err := f(from + 3 + i); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		return float64(rt.n.Load()-before) / n
	}
	p, i := count("plain", plain, 0), count("idem", through, 100)
	t.Logf("round trips a message: plain %.2f, idem %.2f", p, i)
	if i > p {
		t.Fatalf("idem takes %.2f round trips a message, the plain transaction %.2f", i, p)
	}
	// A redelivery of an applied message, for the breakdown in
	// docs/performance.md: it loses the driver's bet that the message is
	// new (see atomic-mode.md#drivers).
	before := rt.n.Load()
	if out, err := proc.Process(ctx, h, &idem.Message{ID: "m-103", AggregateID: "a-5"}); out != idem.Duplicate || err != nil {
		t.Fatalf("redelivery: (%v, %v)", out, err)
	}
	t.Logf("round trips of a redelivery: %d", rt.n.Load()-before)
}
