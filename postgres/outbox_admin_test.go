package postgres_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// openOutboxStore returns an outbox on a fresh schema.
func openOutboxStore(t testing.TB) *idemtest.OutboxStore {
	t.Helper()
	pool := testenv.PostgresPool(t, 10)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	log := pgx.Identifier{schema, "idem_outbox_log"}.Sanitize()
	return &idemtest.OutboxStore{Driver: drv, LogEntries: func(ctx context.Context) (n int, err error) {
		err = pool.QueryRow(ctx, `SELECT count(*) FROM `+log).Scan(&n)
		return n, err
	}, Add: func(ctx context.Context, msgs ...*idem.Message) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if err := ob.Add(ctx, tx, msgs...); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}}
}

func TestOutboxAdmin(t *testing.T) {
	idemtest.RunOutboxAdmin(t, &idemtest.OutboxHarness{Open: openOutboxStore})
}
