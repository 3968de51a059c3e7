package postgres_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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

// TestSessionTimeoutsSpareMarkerWaits runs on sessions with a lock_timeout
// and a statement_timeout shorter than a handler. A redelivery that comes
// while the first delivery's handler runs waits on its marker (per
// message, in a batch) or on its aggregate's sequence row (ordering), and
// must then report Duplicate (or apply the next event), not a timeout that
// costs the message an attempt; the handler's own statements keep the
// timeout.
func TestSessionTimeoutsSpareMarkerWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.PostgresPoolWith(t, 8, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["lock_timeout"] = "100ms"
		c.ConnConfig.RuntimeParams["statement_timeout"] = "300ms"
	})
	// Made and dropped on a session without the timeouts: a DROP SCHEMA
	// slower than them on a loaded machine is not what this tests.
	drv, err := postgres.New(pool, &postgres.Config{Schema: testenv.FreshSchema(t, testenv.PostgresPool(t, 1))})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil { // not cut by the timeouts (TestMigrateUnderSessionTimeouts)
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	const hold = 700 * time.Millisecond // the first delivery's handler
	var applied sync.Map                // message ID → times applied
	count := func(msgs ...*idem.Message) {
		for _, m := range msgs {
			n, _ := applied.LoadOrStore(m.ID, new(int64))
			*(n.(*int64))++
		}
	}
	// timeouts reads the timeouts in force in tx.
	timeouts := func(ctx context.Context, tx postgres.Tx) (string, error) {
		var lock, stmt string
		err := tx.QueryRow(ctx, `SELECT current_setting('lock_timeout'), current_setting('statement_timeout')`).Scan(&lock, &stmt)
		return lock + "/" + stmt, err
	}
	const sessions = "100ms/300ms"
	slow := func(name string, ordering *idem.Ordering) *idem.Handler[postgres.Tx] {
		var mu sync.Mutex
		return &idem.Handler[postgres.Tx]{Name: name, Ordering: ordering, ApplyBatch: func(ctx context.Context, tx postgres.Tx, msgs []*idem.Message) error {
			if got, err := timeouts(ctx, tx); err != nil || got != sessions {
				return fmt.Errorf("the handler runs with timeouts %s (%v), want the sessions' %s", got, err, sessions)
			}
			mu.Lock()
			count(msgs...)
			mu.Unlock()
			time.Sleep(hold)
			return nil
		}}
	}
	// first runs the first delivery; once it holds its markers, second
	// runs the redelivery, whose outcomes are returned.
	redeliver := func(first, second func() ([]idem.Outcome, error)) []idem.Outcome {
		t.Helper()
		done := make(chan error, 1)
		go func() {
			_, err := first()
			done <- err
		}()
		time.Sleep(hold / 4)
		outs, err := second()
		if err != nil {
			t.Fatalf("the redelivery while the first delivery's handler ran: %v", err)
		}
		if err := <-done; err != nil {
			t.Fatalf("the first delivery: %v", err)
		}
		return outs
	}
	one := func(h *idem.Handler[postgres.Tx], m *idem.Message) func() ([]idem.Outcome, error) {
		return func() ([]idem.Outcome, error) {
			out, err := proc.Process(ctx, h, m)
			return []idem.Outcome{out}, err
		}
	}
	batch := func(h *idem.Handler[postgres.Tx], msgs ...*idem.Message) func() ([]idem.Outcome, error) {
		return func() ([]idem.Outcome, error) { return proc.ProcessBatch(ctx, h, msgs) }
	}
	msg := func(id string) *idem.Message { return &idem.Message{ID: id, Payload: []byte("x")} }

	// First of all (the driver has not read the sessions' settings yet), a
	// transaction of the caller's from Driver.Begin with timeouts of its
	// own: an ordered handler's guard runs in it, and the caller's values
	// are still in force after, not the sessions'.
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = drv.Rollback(ctx, tx) }() // after a failure: the pool's Close would wait for it
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'; SET LOCAL statement_timeout = '6s'`); err != nil {
		t.Fatal(err)
	}
	caller := &idem.Handler[postgres.Tx]{Name: "caller", Ordering: &idem.Ordering{}, Apply: func(context.Context, postgres.Tx, *idem.Message) error { return nil }}
	if out, err := proc.ProcessTx(ctx, tx, caller, &idem.Message{ID: "c1", AggregateID: "acc", Seq: 1, Payload: []byte("x")}); err != nil || out != idem.Applied {
		t.Fatalf("ProcessTx: %v, %v", out, err)
	}
	if got, err := timeouts(ctx, tx); err != nil || got != "5s/6s" {
		t.Fatalf("after ProcessTx the caller's transaction runs with timeouts %s (%v), want its own 5s/6s", got, err)
	}
	if err := drv.Commit(ctx, tx); err != nil {
		t.Fatal(err)
	}

	// The batch first: the driver bets on new markers (plain INSERT),
	// loses, and inserts again aware of conflicts. The per-message case
	// then runs in the second after a lost bet, on the conflict-aware
	// insert.
	hb := slow("batch", nil)
	outs := redeliver(batch(hb, msg("b1"), msg("b2")), batch(hb, msg("b2"), msg("b3")))
	if want := []idem.Outcome{idem.Duplicate, idem.Applied}; !slices.Equal(outs, want) {
		t.Fatalf("batch: the redelivery reported %v, want %v", outs, want)
	}
	h := slow("per-message", nil)
	if outs := redeliver(one(h, msg("a")), one(h, msg("a"))); outs[0] != idem.Duplicate {
		t.Fatalf("per message: the redelivery reported %v, want Duplicate", outs[0])
	}
	hv := slow("version-only", &idem.Ordering{VersionOnly: true})
	ev := func(seq int64) *idem.Message {
		return &idem.Message{ID: fmt.Sprint("v", seq), AggregateID: "acc", Seq: seq, Payload: []byte("x")}
	}
	if out, err := proc.Process(ctx, hv, ev(1)); err != nil || out != idem.Applied {
		t.Fatalf("version-only seq 1: %v, %v", out, err)
	}
	if outs := redeliver(one(hv, ev(2)), one(hv, ev(2))); outs[0] != idem.Duplicate && outs[0] != idem.Stale {
		t.Fatalf("version-only: the redelivery reported %v, want Duplicate or Stale", outs[0])
	}
	// Ordered handlers: the next event of an aggregate waits on the
	// sequence row the one before holds, in the marker's transaction.
	for _, b := range []bool{false, true} {
		name := fmt.Sprint("ordered-batch-", b)
		ho := slow(name, &idem.Ordering{})
		ev := func(seq int64) *idem.Message {
			return &idem.Message{ID: fmt.Sprint(name, seq), AggregateID: "acc", Seq: seq, Payload: []byte("x")}
		}
		run := func(m *idem.Message) func() ([]idem.Outcome, error) { return one(ho, m) }
		if b {
			run = func(m *idem.Message) func() ([]idem.Outcome, error) { return batch(ho, m) }
		}
		if outs, err := run(ev(1))(); err != nil || outs[0] != idem.Applied {
			t.Fatalf("%s seq 1: %v, %v", name, outs, err)
		}
		if outs := redeliver(run(ev(2)), run(ev(3))); outs[0] != idem.Applied {
			t.Fatalf("%s: seq 3 while seq 2's handler ran reported %v, want Applied", name, outs[0])
		}
	}
	for _, id := range []string{"a", "b1", "b2", "b3", "v1", "v2", "ordered-batch-false1", "ordered-batch-false2", "ordered-batch-false3", "ordered-batch-true1", "ordered-batch-true2", "ordered-batch-true3"} {
		if n, ok := applied.Load(id); !ok || *(n.(*int64)) != 1 {
			t.Errorf("%s applied %v times, want once", id, n)
		}
	}

	// The handler's statements keep the sessions' statement_timeout.
	sleepy := &idem.Handler[postgres.Tx]{Name: "sleepy", Apply: func(ctx context.Context, tx postgres.Tx, _ *idem.Message) error {
		_, err := tx.Exec(ctx, "SELECT pg_sleep(1)")
		return err
	}}
	_, err = proc.Process(ctx, sleepy, msg("s"))
	if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "57014" {
		t.Fatalf("a handler statement longer than statement_timeout: %v, want SQLSTATE 57014", err)
	}
}

// TestSessionTimeoutsSpareImportWaits runs an import of markers on
// sessions with a lock_timeout or a statement_timeout (under either
// default isolation) while a delivery holds the uncommitted marker of
// one of the IDs. The import waits on that marker, as a redelivery does,
// longer than either timeout; it must not fail with SQLSTATE 55P03 or
// 57014 but, once the delivery ends, count the ID as existing (the
// delivery committed) or import it (the delivery rolled back). The
// sessions keep their timeouts after it.
func TestSessionTimeoutsSpareImportWaits(t *testing.T) {
	t.Parallel()
	sessions := []struct {
		name   string
		params map[string]string
	}{
		{"lock_timeout", map[string]string{"lock_timeout": "100ms", "statement_timeout": "300ms"}},
		{"statement_timeout/repeatable read", map[string]string{"statement_timeout": "150ms", "default_transaction_isolation": "repeatable read"}},
	}
	for _, s := range sessions {
		for _, commit := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/commit=%v", s.name, commit), func(t *testing.T) {
				t.Parallel()
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				pool := testenv.PostgresPoolWith(t, 4, func(c *pgxpool.Config) {
					for k, v := range s.params {
						c.ConnConfig.RuntimeParams[k] = v
					}
				})
				drv, err := postgres.New(pool, &postgres.Config{Schema: testenv.FreshSchema(t, testenv.PostgresPool(t, 1))})
				if err != nil {
					t.Fatal(err)
				}
				if err := drv.Migrate(ctx); err != nil { // not cut by the timeouts (TestMigrateUnderSessionTimeouts)
					t.Fatal(err)
				}
				// An ID imported before: the handler is interned and the
				// sessions' settings read, as in a second import run.
				if n, err := drv.InsertImportedMarkers(ctx, "h", []string{"old"}); err != nil || n != 1 {
					t.Fatalf("first import: %d, %v; want 1", n, err)
				}
				hash := sha256.Sum256([]byte("x"))
				tx, res, err := drv.BeginMarkerInsert(ctx, &driver.MarkerInsertParams{Handler: "h", MessageID: "held", PayloadHash: hash[:]})
				if err != nil || !res.Inserted {
					t.Fatalf("the delivery's marker: %+v, %v", res, err)
				}
				ended := false
				end := func() error {
					ended = true
					if commit {
						return drv.Commit(ctx, tx)
					}
					return drv.Rollback(ctx, tx)
				}
				defer func() {
					if !ended {
						_ = drv.Rollback(context.Background(), tx)
					}
				}()
				type result struct {
					n   int64
					err error
				}
				done := make(chan result, 1)
				go func() {
					n, err := drv.InsertImportedMarkers(ctx, "h", []string{"held", "new", "old"})
					done <- result{n, err}
				}()
				const hold = 600 * time.Millisecond // longer than either timeout
				select {
				case r := <-done:
					t.Fatalf("the import ended while the delivery held its marker: %d, %v; want it to wait", r.n, r.err)
				case <-time.After(hold):
				}
				if err := end(); err != nil {
					t.Fatal(err)
				}
				r := <-done
				want := int64(1) // new
				if !commit {
					want = 2 // held and new
				}
				if r.err != nil || r.n != want {
					t.Fatalf("the import after the delivery ended (commit %v): %d, %v; want %d", commit, r.n, r.err, want)
				}
				// Either way held has its marker now: a redelivery is a
				// duplicate.
				proc, err := idem.NewProcessor(drv, nil)
				if err != nil {
					t.Fatal(err)
				}
				h := &idem.Handler[postgres.Tx]{Name: "h", Apply: func(context.Context, postgres.Tx, *idem.Message) error { return nil }}
				if out, err := proc.Process(ctx, h, &idem.Message{ID: "held", Payload: []byte("x")}); err != nil || out != idem.Duplicate {
					t.Fatalf("a redelivery of held: %v, %v; want Duplicate", out, err)
				}
				// Every session keeps its timeouts.
				conns := make([]*pgxpool.Conn, 0, pool.Config().MaxConns)
				defer func() {
					for _, c := range conns {
						c.Release()
					}
				}()
				for range pool.Config().MaxConns {
					c, err := pool.Acquire(ctx)
					if err != nil {
						t.Fatal(err)
					}
					conns = append(conns, c)
					var lock, stmt string
					if err := c.QueryRow(ctx, `SELECT current_setting('lock_timeout'), current_setting('statement_timeout')`).Scan(&lock, &stmt); err != nil {
						t.Fatal(err)
					}
					if want := s.params["lock_timeout"]; want != "" && lock != want {
						t.Errorf("a session's lock_timeout is %s after the import, want %s", lock, want)
					}
					if want := s.params["statement_timeout"]; stmt != want {
						t.Errorf("a session's statement_timeout is %s after the import, want %s", stmt, want)
					}
				}
			})
		}
	}
}

// TestMigrateUnderSessionTimeouts: instances starting together each call
// Migrate on sessions with a short lock_timeout and statement_timeout, as
// an application's pool may set, while another instance's Migrate holds
// the migration lock for longer than both. The waiting ones used to fail
// with SQLSTATE 55P03 or 57014: a deploy failing at random. All must
// succeed, and the sessions keep their timeouts.
func TestMigrateUnderSessionTimeouts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	plain := testenv.PostgresPool(t, 1)
	schema := testenv.FreshSchema(t, plain)
	const instances = 4
	pool := testenv.PostgresPoolWith(t, instances, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["lock_timeout"] = "100ms"
		c.ConnConfig.RuntimeParams["statement_timeout"] = "100ms"
	})
	// Another instance's Migrate, as the others see it: the lock held
	// until all four wait for it, and then for five times the timeouts.
	// The key is migrateLockKey's, with the default table prefix.
	key := "idem-migrate:" + schema + ".idem_"
	holder, err := plain.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, key); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, instances)
	for range instances {
		go func() {
			drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
			if err == nil {
				err = drv.Migrate(ctx)
			}
			errs <- err
		}()
	}
	// An int8 advisory lock's key is split into classid (high half) and
	// objid (low half) in pg_locks.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var waiting int
		if err := holder.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
  AND objid = (hashtext($1)::bigint & 4294967295)::oid AND objsubid = 1`, key).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting == instances {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d instances wait for the migration lock after 30 s, want %d", waiting, instances)
		}
	}
	time.Sleep(500 * time.Millisecond)
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	for range instances {
		if err := <-errs; err != nil {
			t.Errorf("Migrate: %v", err)
		}
	}
	var lock, stmt string
	if err := pool.QueryRow(ctx, `SELECT current_setting('lock_timeout'), current_setting('statement_timeout')`).Scan(&lock, &stmt); err != nil {
		t.Fatal(err)
	}
	if lock != "100ms" || stmt != "100ms" {
		t.Errorf("after Migrate a session's lock_timeout is %s and statement_timeout %s; want 100ms each", lock, stmt)
	}
}
