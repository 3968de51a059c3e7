package postgres_test

import (
	"context"
	"crypto/sha256"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestStandardConformingStringsOff migrates and processes on sessions with
// standard_conforming_strings off, a setting older applications still
// carry, where a backslash in a plain string literal is an escape: the
// schema must not depend on it. An old process's 16-byte ID goes through
// the mirror trigger of migration 012, whose key ends in a NUL byte.
func TestStandardConformingStringsOff(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.PostgresPoolWith(t, 4, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["standard_conforming_strings"] = "off"
	})
	var scs string
	if err := pool.QueryRow(ctx, `SHOW standard_conforming_strings`).Scan(&scs); err != nil || scs != "off" {
		t.Fatalf("standard_conforming_strings = %q, %v; want off", scs, err)
	}
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	// An old process's marker of a 16-byte ID, mirrored by the trigger.
	const old = "0123456789abcdef"
	hash := sha256.Sum256([]byte("x"))
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{schema, "idem_processed"}.Sanitize()+
		` (handler, message_id, payload_hash) VALUES ($1, $2, $3)`, "balances", old, hash[:]); err != nil {
		t.Fatalf("an old process's marker: %v", err)
	}
	if applied := processCounting(t, drv, old, "new-1", "new-1"); applied != 1 {
		t.Fatalf("applied %d times; want 1 (new-1 once; the old process's ID is a duplicate)", applied)
	}
}

// TestMigrateAsServiceRole: a DBA migrates the schema, the service runs
// as a role that may only read and write its tables and calls Migrate at
// start, as the docs show. With nothing to migrate that must need no DDL
// right: it succeeds, and the role processes messages.
func TestMigrateAsServiceRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, admin)
	owner, err := postgres.New(admin, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := owner.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	role := schema + "_svc"
	quoted := pgx.Identifier{role}.Sanitize()
	if _, err := admin.Exec(ctx, `CREATE ROLE `+quoted+` LOGIN PASSWORD 'svc';
GRANT USAGE ON SCHEMA `+pgx.Identifier{schema}.Sanitize()+` TO `+quoted+`;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA `+pgx.Identifier{schema}.Sanitize()+` TO `+quoted); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), `DROP OWNED BY `+quoted+`; DROP ROLE `+quoted); err != nil {
			t.Errorf("drop role: %v", err)
		}
	})
	svc := testenv.PostgresPoolWith(t, 2, func(c *pgxpool.Config) {
		c.ConnConfig.User, c.ConnConfig.Password = role, "svc"
	})
	var create bool
	if err := svc.QueryRow(ctx, `SELECT has_schema_privilege($1, 'CREATE')`, schema).Scan(&create); err != nil || create {
		t.Fatalf("the service role may create in the schema (%v, %v): the test needs one that may not", create, err)
	}
	drv, err := postgres.New(svc, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatalf("migrate a migrated schema as the service role: %v", err)
	}
	if applied := processCounting(t, drv, "a", "b", "a"); applied != 2 {
		t.Fatalf("applied %d; want 2", applied)
	}
}

// TestMaintenanceLockPerSchema: with Config.Schema unset each tenant's
// tables are found through its search_path, and each schema has a
// retention run of its own at a time; the same schema still has one.
func TestMaintenanceLockPerSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := testenv.PostgresPool(t, 2)
	tenant := func(schema string) *postgres.Driver {
		pool := testenv.PostgresPoolWith(t, 2, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["search_path"] = schema
		})
		drv, err := postgres.New(pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := drv.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		return drv
	}
	a, b := testenv.FreshSchema(t, admin), testenv.FreshSchema(t, admin)
	for _, s := range []string{a, b} {
		if _, err := admin.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+pgx.Identifier{s}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	da, da2, db := tenant(a), tenant(a), tenant(b)
	unlock, ok, err := da.TryMaintenanceLock(ctx)
	if err != nil || !ok {
		t.Fatalf("tenant %s: %v, %v; want the lock", a, ok, err)
	}
	defer unlock()
	if u, ok, err := db.TryMaintenanceLock(ctx); err != nil || !ok {
		t.Fatalf("tenant %s while %s holds its lock: %v, %v; want its own", b, a, ok, err)
	} else {
		u()
	}
	if u, ok, err := da2.TryMaintenanceLock(ctx); err != nil || ok {
		if ok {
			u()
		}
		t.Fatalf("a second driver on %s: %v, %v; want the lock held", a, ok, err)
	}
}

// TestServerDefaultIsolation runs the conformance suite on sessions whose
// default isolation is REPEATABLE READ or SERIALIZABLE: the transactions
// idem begins are READ COMMITTED whatever the default, and so is the
// interning of a handler name, which many workers do at once on a new
// handler (there a serialization failure cost each an attempt).
func TestServerDefaultIsolation(t *testing.T) {
	t.Parallel()
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			idemtest.Run(t, &idemtest.Harness[postgres.Tx]{Goroutines: 16, IDs: 300, Open: func(t testing.TB) *idemtest.Store[postgres.Tx] {
				pool := testenv.PostgresPoolWith(t, 40, func(c *pgxpool.Config) {
					c.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
				})
				return storeIn(t, pool, testenv.FreshSchema(t, pool))
			}})
		})
	}
}

// processCounting processes a message of each ID in turn (payload "x")
// with a handler named balances and returns how many it applied.
func processCounting(t *testing.T, drv *postgres.Driver, ids ...string) int {
	t.Helper()
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	applied := 0
	h := &idem.Handler[postgres.Tx]{Name: "balances", Apply: func(context.Context, postgres.Tx, *idem.Message) error {
		applied++
		return nil
	}}
	for _, id := range ids {
		if _, err := proc.Process(context.Background(), h, &idem.Message{ID: id, Payload: []byte("x")}); err != nil {
			t.Fatalf("process %s: %v", id, err)
		}
	}
	return applied
}
