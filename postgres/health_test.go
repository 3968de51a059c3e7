package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

func TestUnavailableAndProbe(t *testing.T) {
	t.Parallel()
	pool := testenv.PostgresPool(t, 2)
	drv, err := postgres.New(pool, &postgres.Config{Schema: testenv.FreshSchema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	for code, want := range map[string]bool{
		"08006": true,  // connection failure
		"57P01": true,  // admin shutdown
		"57P03": true,  // cannot connect now
		"53300": true,  // too many connections
		"25006": true,  // read-only transaction (a standby after failover)
		"23505": false, // unique violation: the message's own
		"40001": false, // serialization failure: retried as the message's
		"42P01": false, // undefined table: not migrated
	} {
		err := fmt.Errorf("insert: %w", &pgconn.PgError{Code: code})
		if got := drv.Unavailable(err); got != want {
			t.Errorf("Unavailable(SQLSTATE %s) = %v, want %v", code, got, want)
		}
	}
	if drv.Unavailable(errors.New("order not found")) || drv.Unavailable(nil) {
		t.Error("a plain error looks like an outage")
	}
	if err := drv.Probe(context.Background()); err != nil {
		t.Fatalf("Probe of a live server: %v", err)
	}
	// A read-only session is what a standby answers after a failover.
	cfg := pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	ro, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	roDrv, err := postgres.New(ro, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := roDrv.Probe(context.Background()); err == nil {
		t.Fatal("Probe of a read-only server succeeded")
	}
}
