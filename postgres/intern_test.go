package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestNewHandlerOnAFullPool: a handler's name is interned on first use.
// When the callers' transactions of a new handler hold every connection of
// the pool, none of them may wait for another connection to do it: on a
// pool of one, and with four workers beginning at once on a pool of four,
// every message is applied, once. A name interned in a transaction that
// rolls back leaves no id behind that a redelivery could slip past. Under
// REPEATABLE READ, a name another process interned after the
// transaction's snapshot is a serialization failure the caller retries,
// never a second name.
func TestNewHandlerOnAFullPool(t *testing.T) {
	t.Parallel()
	inTx := func(ctx context.Context, pool interface {
		BeginTx(context.Context, pgx.TxOptions) (pgx.Tx, error)
	}, iso pgx.TxIsoLevel, f func(tx pgx.Tx) error) error {
		tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
		if err != nil {
			return err
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		if err := f(tx); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	t.Run("PoolOfOne", func(t *testing.T) {
		t.Parallel()
		pool, _, s, p, ctx := fullPool(t, 1, 20*time.Second)
		h := idemtest.CreditHandler(s, "one-conn", nil)
		for _, want := range []idem.Outcome{idem.Applied, idem.Duplicate} {
			err := inTx(ctx, pool, pgx.ReadCommitted, func(tx pgx.Tx) error {
				out, err := p.ProcessTx(ctx, tx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")})
				if err == nil && out != want {
					err = fmt.Errorf("%v, want %v", out, want)
				}
				return err
			})
			if err != nil {
				t.Fatalf("ProcessTx on a pool of one: %v", err)
			}
		}
		hb := idemtest.CreditHandler(s, "one-conn-batch", nil)
		err := inTx(ctx, pool, pgx.ReadCommitted, func(tx pgx.Tx) error {
			outs, err := p.ProcessBatchTx(ctx, tx, hb, []*idem.Message{{ID: "b-1", Payload: []byte("acct-2:1")}, {ID: "b-2", Payload: []byte("acct-2:1")}})
			if err == nil && (outs[0] != idem.Applied || outs[1] != idem.Applied) {
				err = fmt.Errorf("%v, want both applied", outs)
			}
			return err
		})
		if err != nil {
			t.Fatalf("ProcessBatchTx on a pool of one: %v", err)
		}
		if bal, err := s.Balances(ctx); err != nil || bal["acct-1"] != 1 || bal["acct-2"] != 2 {
			t.Fatalf("balances %v, %v; want acct-1 1, acct-2 2", bal, err)
		}
	})
	for _, twoDrivers := range []bool{false, true} {
		name := map[bool]string{false: "OneDriver", true: "TwoDriversOneTx"}[twoDrivers]
		t.Run("RolledBackName/"+name, func(t *testing.T) {
			t.Parallel()
			pool, schema, s, p, ctx := fullPool(t, 1, 20*time.Second)
			p2 := p // the second message's processor: another driver on the pool
			if twoDrivers {
				b, err := postgres.New(pool, &postgres.Config{Schema: schema})
				if err != nil {
					t.Fatal(err)
				}
				if p2, err = idem.NewProcessor(b, nil); err != nil {
					t.Fatal(err)
				}
			}
			h := idemtest.CreditHandler(s, "ghost", nil)
			// Two messages in one transaction, which interns the name (the
			// pool has no other connection), reads it back, and rolls back.
			errRollback := errors.New("roll back")
			err := inTx(ctx, pool, pgx.ReadCommitted, func(tx pgx.Tx) error {
				for i, id := range []string{"m-1", "m-2"} {
					out, err := []*idem.Processor[postgres.Tx]{p, p2}[i].ProcessTx(ctx, tx, h, &idem.Message{ID: id, Payload: []byte("acct-1:1")})
					if err != nil {
						return err
					}
					if out != idem.Applied {
						return fmt.Errorf("%s: %v, want applied", id, out)
					}
				}
				return errRollback
			})
			if !errors.Is(err, errRollback) {
				t.Fatalf("the rolled back transaction: %v", err)
			}
			// Another process interns the name anew and applies m-1.
			po := otherProcess(t, schema)
			if out, err := po.Process(ctx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")}); out != idem.Applied || err != nil {
				t.Fatalf("m-1 in the other process: %v, %v; want applied", out, err)
			}
			// Its redelivery to the first process is a duplicate, in either way
			// of processing.
			for _, proc := range []*idem.Processor[postgres.Tx]{p, p2} {
				if out, err := proc.Process(ctx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")}); out != idem.Duplicate || err != nil {
					t.Fatalf("m-1 redelivered to the first process: %v, %v; want duplicate", out, err)
				}
				err = inTx(ctx, pool, pgx.ReadCommitted, func(tx pgx.Tx) error {
					out, err := proc.ProcessTx(ctx, tx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")})
					if err == nil && out != idem.Duplicate {
						err = fmt.Errorf("%v, want duplicate", out)
					}
					return err
				})
				if err != nil {
					t.Fatalf("m-1 redelivered to the first process's ProcessTx: %v", err)
				}
			}
			if bal, err := s.Balances(ctx); err != nil || bal["acct-1"] != 1 {
				t.Fatalf("balances %v, %v; want acct-1 1 (m-1 once)", bal, err)
			}
		})
	}
	for _, holderCommits := range []bool{true, false} {
		// Another transaction has inserted the name and not ended: the
		// pooled insert must not wait on it (and leave a statement
		// behind when it gives up); the transaction's own insert waits,
		// then finds the holder's row or inserts its own.
		name := map[bool]string{true: "HolderCommits", false: "HolderRollsBack"}[holderCommits]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, schema, s, p, ctx := fullPool(t, 4, 20*time.Second)
			handlers := pgx.Identifier{schema, "idem_handlers"}.Sanitize()
			holder, err := testenv.PostgresPool(t, 1).Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer holder.Rollback(context.WithoutCancel(ctx))
			if _, err := holder.Exec(ctx, `INSERT INTO `+handlers+` (name) VALUES ('held')`); err != nil {
				t.Fatal(err)
			}
			ended := make(chan error, 1)
			waitingDuring := -1
			go func() {
				// Longer than the pooled insert's wait for a connection:
				// by now only the transaction's own insert waits.
				// Until the transaction's insert waits, and at least
				// 800 ms.
				start := time.Now()
				for {
					time.Sleep(50 * time.Millisecond)
					if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE pid <> pg_backend_pid() AND wait_event_type = 'Lock' AND strpos(query, $1) > 0`, handlers).Scan(&waitingDuring); err != nil {
						ended <- err
						return
					}
					if waitingDuring >= 1 && time.Since(start) >= 800*time.Millisecond || time.Since(start) > 10*time.Second {
						break
					}
				}
				if holderCommits {
					ended <- holder.Commit(ctx)
				} else {
					ended <- holder.Rollback(ctx)
				}
			}()
			h := idemtest.CreditHandler(s, "held", nil)
			err = inTx(ctx, pool, pgx.ReadCommitted, func(tx pgx.Tx) error {
				out, err := p.ProcessTx(ctx, tx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")})
				if err == nil && out != idem.Applied {
					err = fmt.Errorf("%v, want applied", out)
				}
				return err
			})
			if err != nil {
				t.Fatalf("ProcessTx while another transaction holds the new name: %v", err)
			}
			if err := <-ended; err != nil {
				t.Fatal(err)
			}
			if waitingDuring != 1 {
				t.Fatalf("%d statements waited on the held name; want 1, the transaction's own (a pooled insert given up on keeps waiting on the server)", waitingDuring)
			}
			if out, err := p.Process(ctx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")}); out != idem.Duplicate || err != nil {
				t.Fatalf("m-1 again: %v, %v; want duplicate", out, err)
			}
			if bal, err := s.Balances(ctx); err != nil || bal["acct-1"] != 1 {
				t.Fatalf("balances %v, %v; want acct-1 1", bal, err)
			}
		})
	}
	t.Run("RepeatableReadSnapshot", func(t *testing.T) {
		t.Parallel()
		pool, schema, s, p, ctx := fullPool(t, 1, 20*time.Second)
		h := idemtest.CreditHandler(s, "snapshot", nil)
		first := true
		for attempt := 0; ; attempt++ {
			err := inTx(ctx, pool, pgx.RepeatableRead, func(tx pgx.Tx) error {
				var n int
				if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "balances"}.Sanitize()).Scan(&n); err != nil {
					return err
				}
				if first {
					first = false
					// Another process, on its own pool, interns the name
					// after this transaction's snapshot.
					po := otherProcess(t, schema)
					if out, err := po.Process(ctx, h, &idem.Message{ID: "x", Payload: []byte("acct-1:1")}); out != idem.Applied || err != nil {
						return fmt.Errorf("the other process: %v, %v", out, err)
					}
				}
				for _, c := range []struct {
					id   string
					want idem.Outcome
				}{{"x", idem.Duplicate}, {"y", idem.Applied}} {
					out, err := p.ProcessTx(ctx, tx, h, &idem.Message{ID: c.id, Payload: []byte("acct-1:1")})
					if err != nil {
						return err
					}
					if out != c.want {
						return fmt.Errorf("%s: %v, want %v", c.id, out, c.want)
					}
				}
				return nil
			})
			var pgErr *pgconn.PgError
			if attempt == 0 && errors.As(err, &pgErr) && pgErr.Code == "40001" {
				t.Logf("first attempt: %v; retried, as the caller of a REPEATABLE READ transaction does", err)
				continue
			}
			if err != nil {
				t.Fatalf("attempt %d: %v", attempt+1, err)
			}
			break
		}
		if m, err := s.Markers(ctx, "snapshot"); err != nil || m != 2 {
			t.Fatalf("%d markers, %v; want 2 (x and y)", m, err)
		}
		if bal, err := s.Balances(ctx); err != nil || bal["acct-1"] != 2 {
			t.Fatalf("balances %v, %v; want acct-1 2", bal, err)
		}
	})
	t.Run("WorkersHoldEveryConnection", func(t *testing.T) {
		t.Parallel()
		const workers, rounds = 4, 12
		pool, _, s, p, ctx := fullPool(t, workers, 30*time.Second)
		for r := range rounds {
			h := idemtest.CreditHandler(s, fmt.Sprintf("full-pool-%d", r), nil)
			begun := make(chan struct{}, workers)
			start := make(chan struct{})
			errs := make(chan error, workers)
			for w := range workers {
				go func() {
					m := &idem.Message{ID: fmt.Sprintf("m-%d", w), Payload: []byte(fmt.Sprintf("acct-%d:1", w))}
					errs <- inTx(ctx, pool, pgx.ReadCommitted, func(tx pgx.Tx) error {
						begun <- struct{}{}
						<-start // every worker holds its connection now
						var out idem.Outcome
						var err error
						if r%2 == 0 {
							out, err = p.ProcessTx(ctx, tx, h, m)
						} else {
							var outs []idem.Outcome
							if outs, err = p.ProcessBatchTx(ctx, tx, h, []*idem.Message{m}); err == nil {
								out = outs[0]
							}
						}
						if err == nil && out != idem.Applied {
							err = fmt.Errorf("%s: %v, want applied", m.ID, out)
						}
						return err
					})
				}()
			}
			for range workers {
				<-begun
			}
			close(start)
			for range workers {
				if err := <-errs; err != nil {
					t.Fatalf("round %d: %v (a worker waiting for a connection its peers hold?)", r, err)
				}
			}
		}
		bal, err := s.Balances(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for w := range workers {
			if a := fmt.Sprintf("acct-%d", w); bal[a] != rounds {
				t.Fatalf("balance of %s: %d, want %d", a, bal[a], rounds)
			}
		}
	})
}

// fullPool is a subtest's store on a pool of conns connections, in a
// schema of its own, its processor, and a context that bounds its waits.
func fullPool(t *testing.T, conns int32, wait time.Duration) (*pgxpool.Pool, string, *idemtest.Store[postgres.Tx], *idem.Processor[postgres.Tx], context.Context) {
	t.Helper()
	pool := testenv.PostgresPool(t, conns)
	schema := testenv.FreshSchema(t, pool)
	s := storeIn(t, pool, schema)
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	t.Cleanup(cancel)
	return pool, schema, s, p, ctx
}

// otherProcess is another process's processor on schema: a driver of its
// own, on a pool of its own.
func otherProcess(t *testing.T, schema string) *idem.Processor[postgres.Tx] {
	t.Helper()
	other, err := postgres.New(testenv.PostgresPool(t, 2), &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	po, err := idem.NewProcessor(other, nil)
	if err != nil {
		t.Fatal(err)
	}
	return po
}
