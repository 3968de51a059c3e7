package postgres_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"sync"
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

// TestServerDefaultIsolationWrites races the driver's writes outside a
// transaction on sessions whose default isolation is REPEATABLE READ or
// SERIALIZABLE: 16 workers at once claim one expired lease, record one
// gap sighting, add to one handler's stats and move one dead letter. At
// those levels a statement that meets a row another committed meanwhile
// fails to serialize (each failure an attempt, or an operator's error);
// the driver runs them at READ COMMITTED, so every call succeeds and the
// race has exactly one winner where there is one.
func TestServerDefaultIsolationWrites(t *testing.T) {
	t.Parallel()
	const workers, rounds = 16, 15
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testenv.PostgresPoolWith(t, workers+1, func(c *pgxpool.Config) {
				c.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
			})
			schema := testenv.FreshSchema(t, pool)
			drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			if err := drv.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			// race runs f in every worker at once and fails t on any
			// error; it returns how many answered true.
			race := func(what string, f func(w int) (bool, error)) int {
				var (
					mu   sync.Mutex
					wins int
					errs []error
					wg   sync.WaitGroup
				)
				start := make(chan struct{})
				for w := range workers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						<-start
						won, err := f(w)
						mu.Lock()
						defer mu.Unlock()
						if err != nil {
							errs = append(errs, err)
						} else if won {
							wins++
						}
					}()
				}
				close(start)
				wg.Wait()
				if len(errs) > 0 {
					t.Fatalf("%s: %d of %d workers failed, first: %v", what, len(errs), workers, errs[0])
				}
				return wins
			}
			hash := sha256.Sum256([]byte("x"))
			for r := range rounds {
				id := fmt.Sprintf("m-%d", r)
				// A live lease; a transaction that expires it commits while
				// the workers wait on its row lock to take it over.
				if res, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "h", MessageID: id, PayloadHash: hash[:], Owner: "first", TTL: time.Minute}); err != nil || !res.Claimed {
					t.Fatalf("first claim of %s: %+v, %v", id, res, err)
				}
				expire, err := pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := expire.Exec(ctx, `UPDATE `+schema+`.idem_processed SET lease_until = now() - interval '1 second' WHERE message_id = $1`, id); err != nil {
					t.Fatal(err)
				}
				go func() {
					time.Sleep(50 * time.Millisecond)
					_ = expire.Commit(ctx)
				}()
				if n := race("claim an expired lease", func(w int) (bool, error) {
					res, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "h", MessageID: id, PayloadHash: hash[:], Owner: fmt.Sprint("w", w), TTL: time.Minute})
					return res.Claimed, err
				}); n != 1 {
					t.Fatalf("%s: %d workers took the expired lease over, want 1", id, n)
				}
				race("gap sighting", func(int) (bool, error) {
					_, err := drv.GapSighting(ctx, &driver.GapSightingParams{Handler: "h", AggregateID: "a", Seq: int64(r + 2)})
					return false, err
				})
				race("stats", func(int) (bool, error) {
					return false, drv.StatsAdd(ctx, "h", driver.StatsDelta{Duplicates: 1})
				})
				dl, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "h", MessageID: id, PayloadHash: hash[:], Error: "boom", Class: "permanent", Attempts: 1})
				if err != nil {
					t.Fatal(err)
				}
				if n := race("claim a dead letter for replay", func(int) (bool, error) {
					n, err := drv.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: []int64{dl}, From: []string{driver.DeadLetterParked}, To: driver.DeadLetterReplaying, Actor: "op"})
					return n == 1, err
				}); n != 1 {
					t.Fatalf("dead letter %d: %d workers moved it, want 1", dl, n)
				}
			}
			stats, err := drv.StatsRead(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if got, want := stats["h"].Duplicates, int64(workers*rounds); got != want {
				t.Fatalf("duplicates counted %d, want %d", got, want)
			}
		})
	}
}
