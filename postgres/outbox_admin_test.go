package postgres_test

import (
	"context"
	"testing"

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
	drv, err := postgres.New(pool, &postgres.Config{Schema: testenv.FreshSchema(t, pool)})
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
	return &idemtest.OutboxStore{Driver: drv, Add: func(ctx context.Context, msgs ...*idem.Message) error {
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
