package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// TestIDsComparedExactly: IDs that a PAD SPACE or case-insensitive
// collation would take for one (a trailing space, another case) are
// distinct messages, and an ID of the maximum length is kept whole.
func TestIDsComparedExactly(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := context.Background()
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := idemtest.CreditHandler(s, "exact", nil)
	long := strings.Repeat("é", idem.MaxIDLen/2) + "x" // 255 bytes
	ids := []string{"order-1", "order-1 ", "Order-1", "ORDER-1", "order-1\t", long, long[:len(long)-1] + "y"}
	for i, id := range ids {
		m := &idem.Message{ID: id, Payload: []byte(fmt.Sprintf("acct-%d:1", i))}
		if out, err := p.Process(ctx, h, m); out != idem.Applied || err != nil {
			t.Fatalf("%q: %v, %v; want applied (a distinct ID)", id, out, err)
		}
	}
	for i, id := range ids {
		m := &idem.Message{ID: id, Payload: []byte(fmt.Sprintf("acct-%d:1", i))}
		if out, err := p.Process(ctx, h, m); out != idem.Duplicate || err != nil {
			t.Fatalf("%q again: %v, %v; want duplicate", id, out, err)
		}
	}
	outs, err := p.ProcessBatch(ctx, h, []*idem.Message{{ID: "order-1  ", Payload: []byte("acct-9:1")}, {ID: "order-1 ", Payload: []byte("acct-1:1")}})
	if err != nil || outs[0] != idem.Applied || outs[1] != idem.Duplicate {
		t.Fatalf("batch of a new ID with two trailing spaces and an old one with one: %v, %v", outs, err)
	}
	if n, err := s.Markers(ctx, "exact"); err != nil || n != len(ids)+1 {
		t.Fatalf("%d markers, %v; want %d", n, err, len(ids)+1)
	}
}

// TestConcurrencyCheckNeedsUniqueConstraint removes the primary key the
// guarantee rests on and shows that the concurrency check then fails: the
// check really tests the guarantee.
func TestConcurrencyCheckNeedsUniqueConstraint(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	db := s.Driver.(*mysql.Driver).DB()
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `ALTER TABLE idem_markers DROP PRIMARY KEY, ADD KEY (handler_id, message_id)`); err != nil {
		t.Fatal(err)
	}
	err := idemtest.CheckConcurrentDuplicates(ctx, s, 8, 200, 0)
	if err == nil {
		t.Fatal("the concurrency check passed without the primary key")
	}
	if !strings.Contains(err.Error(), "applied") || !strings.Contains(err.Error(), "balances differ") {
		t.Fatalf("unexpected failure: %v", err)
	}
	t.Logf("without the primary key, as expected: %v", err)
}

// TestConcurrentDuplicatesUnderRepeatableRead: the driver's transactions
// set READ COMMITTED themselves, and its reads of an existing marker are
// locking reads, so concurrent duplicates end as Duplicate even when the
// server's default is REPEATABLE READ and each transaction took its
// snapshot before the other committed (ProcessTx in the caller's
// transaction).
func TestConcurrentDuplicatesUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := context.Background()
	db := s.Driver.(*mysql.Driver).DB()
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := idemtest.CreditHandler(s, "rr", nil)
	if out, err := p.Process(ctx, h, &idem.Message{ID: "warm-up", Payload: []byte("acct-0:1")}); out != idem.Applied || err != nil {
		t.Fatalf("warm-up: %v, %v", out, err)
	}
	events := idemtest.Events(100)
	var wg sync.WaitGroup
	var mu sync.Mutex
	counts := map[idem.Outcome]int{}
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range events {
				e := events[(i+g*13)%len(events)]
				err := func() error {
					tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
					if err != nil {
						return err
					}
					defer tx.Rollback()
					// Take the snapshot now, before any marker of e.
					var n int
					if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM balances`).Scan(&n); err != nil {
						return err
					}
					out, err := p.ProcessTx(ctx, tx, h, e.Message())
					if err != nil {
						return err
					}
					mu.Lock()
					counts[out]++
					mu.Unlock()
					return tx.Commit()
				}()
				var me *gomysql.MySQLError
				if errors.As(err, &me) && me.Number == 1213 {
					// A deadlock victim under REPEATABLE READ: the caller
					// retries its own transaction, as it must.
					mu.Lock()
					counts[idem.OutcomeNone]++
					mu.Unlock()
					continue
				}
				if err != nil {
					t.Errorf("%s: %v", e.ID, err)
				}
			}
		}()
	}
	wg.Wait()
	bal, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := idemtest.Expected(events)
	want["acct-0"]++
	for a, w := range want {
		if bal[a] != w {
			t.Fatalf("balance of %s: %d, want %d (every event applied once)", a, bal[a], w)
		}
	}
	if counts[idem.Applied] > len(events) {
		t.Fatalf("applied %d times for %d events", counts[idem.Applied], len(events))
	}
	t.Logf("outcomes: %v", counts)
}

func TestMigrateConcurrentlyAndTwice(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t, testenv.MySQLDatabase(t), 10)
	drv, err := mysql.New(db, &mysql.Config{TablePrefix: "order_"})
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 4)
	for range 4 {
		go func() { errs <- drv.Migrate(context.Background()) }()
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	// Each migration file recorded once.
	files, err := filepath.Glob("migrations/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("migration files: %v, %v", files, err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM order_migrations`).Scan(&n); err != nil || n != len(files) {
		t.Fatalf("%d migrations recorded, %v; want %d", n, err, len(files))
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(`SELECT count(*) FROM order_migrations`).Scan(&n); err != nil || n != len(files) {
		t.Fatalf("migrating again: %d migrations recorded, %v; want %d", n, err, len(files))
	}
}

func TestProcessBeforeMigrate(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t, testenv.MySQLDatabase(t), 4)
	drv, err := mysql.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "h", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
	if _, err := p.Process(context.Background(), h, &idem.Message{ID: "m"}); !errors.Is(err, mysql.ErrNotMigrated) {
		t.Fatalf("got %v, want ErrNotMigrated", err)
	}
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	_, err = p.ProcessTx(ctx, tx, h, &idem.Message{ID: "m"})
	if !errors.Is(err, mysql.ErrNotMigrated) || strings.Count(err.Error(), "call Migrate first") != 1 {
		t.Fatalf("ProcessTx: got %v, want ErrNotMigrated, said once", err)
	}
}

func TestUnavailableAndProbe(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	drv := s.Driver.(*mysql.Driver)
	for n, want := range map[uint16]bool{
		1040: true,  // too many connections
		1053: true,  // server shutdown
		1290: true,  // --read-only
		1836: true,  // read-only mode
		2006: true,  // gone away
		1062: false, // duplicate key: the message's own
		1213: false, // deadlock: retried as the message's
		1146: false, // no such table: not migrated
	} {
		err := fmt.Errorf("insert: %w", &gomysql.MySQLError{Number: n})
		if got := drv.Unavailable(err); got != want {
			t.Errorf("Unavailable(%d) = %v, want %v", n, got, want)
		}
	}
	if drv.Unavailable(errors.New("order not found")) || drv.Unavailable(nil) {
		t.Error("a plain error looks like an outage")
	}
	if !drv.Unavailable(fmt.Errorf("begin: %w", gomysql.ErrInvalidConn)) {
		t.Error("a broken connection does not look like an outage")
	}
	if err := drv.Probe(context.Background()); err != nil {
		t.Fatalf("Probe of a live server: %v", err)
	}
	// Nothing listens on port 1: connection refused.
	down, err := mysql.New(testenv.MySQL(t, "root@tcp(127.0.0.1:1)/test", 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	err = down.Probe(context.Background())
	if err == nil || !down.Unavailable(err) {
		t.Fatalf("Probe of a closed port: %v; want an error that Unavailable recognizes", err)
	}
}

// TestOpenSetsReadCommitted: a pool from Open runs its connections at READ
// COMMITTED, so the driver may skip setting the level per transaction.
func TestOpenSetsReadCommitted(t *testing.T) {
	t.Parallel()
	cfg, err := gomysql.ParseDSN(testenv.MySQLDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	db, err := mysql.Open(context.Background(), cfg)
	if err != nil {
		testenv.Unavailable(t, "MySQL/MariaDB", cfg.Addr, err)
	}
	defer db.Close()
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	var level string
	if err := tx.QueryRow(`SELECT @@session.tx_isolation`).Scan(&level); err != nil {
		if err := tx.QueryRow(`SELECT @@session.transaction_isolation`).Scan(&level); err != nil {
			t.Fatal(err)
		}
	}
	if level != "READ-COMMITTED" {
		t.Fatalf("isolation of a connection from Open: %s, want READ-COMMITTED", level)
	}
	s := storeOn(t, db, &mysql.Config{SessionIsolation: true})
	if err := idemtest.CheckConcurrentDuplicates(context.Background(), s, 16, 300, 50); err != nil {
		t.Fatal(err)
	}

	// Open manages autocommit: a DSN that sets it is refused.
	own := cfg.Clone()
	own.Params = map[string]string{"autocommit": "0"}
	if _, err := mysql.Open(context.Background(), own); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("Open with autocommit in the DSN: %v, want ErrInvalidConfig", err)
	}
}

// TestDeadlockVictimsRetried: when the transaction holding a marker rolls
// back, the deliveries that waited on it race to insert it, and InnoDB
// picks deadlock victims among them (1213). The driver runs a victim's
// transaction again (the handler has not run), so every ID is applied
// exactly once, and the only errors surfaced are the handler's own. (With
// Config.MaxRetries -1, no retry, a run here surfaced 286 deadlocks.)
func TestDeadlockVictimsRetried(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := context.Background()
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		calls  = map[string]int{}
		failed = map[string]bool{}
	)
	errFirst := errors.New("first attempt fails")
	h := &idem.Handler[*sql.Tx]{Name: "flaky", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		mu.Lock()
		first := !failed[m.ID]
		failed[m.ID] = true
		mu.Unlock()
		if first {
			time.Sleep(20 * time.Millisecond) // let the others queue on the marker
			return errFirst
		}
		mu.Lock()
		calls[m.ID]++
		mu.Unlock()
		return s.Credit(ctx, tx, "acct", 1)
	}}
	const ids, goroutines = 30, 12
	var applied, handlerErrs, otherErrs atomic.Int64
	var sample atomic.Value
	for i := range ids {
		var wg sync.WaitGroup
		m := &idem.Message{ID: fmt.Sprintf("m-%d", i)}
		for range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				out, err := p.Process(ctx, h, m)
				switch {
				case errors.Is(err, errFirst):
					handlerErrs.Add(1)
				case err != nil:
					otherErrs.Add(1)
					sample.Store(err)
				case out == idem.Applied:
					applied.Add(1)
				}
			}()
		}
		wg.Wait()
	}
	if n := otherErrs.Load(); n > 0 {
		t.Fatalf("%d deliveries failed with an error other than the handler's, e.g. %v", n, sample.Load())
	}
	for i := range ids {
		id := fmt.Sprintf("m-%d", i)
		if calls[id] > 1 {
			t.Fatalf("%s applied %d times", id, calls[id])
		}
	}
	bal, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// An ID whose every delivery came before the failing one ended is
	// applied by none of them: its redelivery applies it. Every applied
	// outcome shows in the balance, once.
	if bal["acct"] != applied.Load() || applied.Load() < ids/2 {
		t.Fatalf("balance %d, applied %d (of %d IDs), handler errors %d", bal["acct"], applied.Load(), ids, handlerErrs.Load())
	}
	t.Logf("applied %d of %d IDs, %d handler errors", applied.Load(), ids, handlerErrs.Load())
}

// TestAllocatorNewAggregateNoDeadlock starts 16 allocations of every one of
// 40 new aggregates at once, a quarter of them rolled back. The first
// allocation of an aggregate creates its row; were that row created in the
// allocating transactions, concurrent upserts of the new key would
// deadlock (InnoDB error 1213, the caller's transaction lost), rolled back
// or not. Every allocation must succeed, and the committed numbers of each
// aggregate run 1…n without a gap or a repeat. On a busy pool (one
// connection more than the transactions) the creating statement mostly
// finds no connection to spare at first, and the UPDATE no row: the row
// must still be created outside the transactions (this failed under load,
// 5 runs in 60).
func TestAllocatorNewAggregateNoDeadlock(t *testing.T) {
	t.Parallel()
	for _, tc := range racePools {
		t.Run(tc.name, func(t *testing.T) {
			s := storeOn(t, testenv.MySQL(t, testenv.MySQLDatabase(t), tc.maxConns), nil)
			v, err := idem.NewVersions(s.Driver)
			if err != nil {
				t.Fatal(err)
			}
			raceNewAggregates(t, s, func(ctx context.Context, tx *sql.Tx, agg string) (int64, bool, error) {
				n, err := v.Next(ctx, tx, "orders", agg)
				return n, err == nil, err
			}, func(agg string, committed []int64) {
				slices.Sort(committed)
				for i, n := range committed {
					if n != int64(i+1) {
						t.Fatalf("%s: committed numbers %v, want 1…%d", agg, committed, len(committed))
					}
				}
				if want := raceGoroutines - raceGoroutines/4; len(committed) != want {
					t.Fatalf("%s: %d numbers committed, want %d", agg, len(committed), want)
				}
			})
		})
	}
}

// TestAdvanceNewAggregateNoDeadlock is TestAllocatorNewAggregateNoDeadlock
// for optimistic concurrency: 16 transactions at once expect a new
// aggregate at version 0, and whoever advances it rolls back one time in
// four. No transaction may fail; at most one advance commits, and the
// version read afterwards is the number that did. Both pools, as there.
func TestAdvanceNewAggregateNoDeadlock(t *testing.T) {
	t.Parallel()
	for _, tc := range racePools {
		t.Run(tc.name, func(t *testing.T) {
			s := storeOn(t, testenv.MySQL(t, testenv.MySQLDatabase(t), tc.maxConns), nil)
			ctx := context.Background()
			v, err := idem.NewVersions(s.Driver)
			if err != nil {
				t.Fatal(err)
			}
			raceNewAggregates(t, s, func(ctx context.Context, tx *sql.Tx, agg string) (int64, bool, error) {
				n, err := v.Advance(ctx, tx, "orders", agg, 0)
				if errors.Is(err, idem.ErrExpectedVersion) {
					return 0, false, nil
				}
				return n, err == nil, err
			}, func(agg string, committed []int64) {
				tx, err := s.Driver.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				cur, err := v.Current(ctx, tx, "orders", agg)
				_ = s.Driver.Rollback(ctx, tx)
				if err != nil {
					t.Fatal(err)
				}
				if len(committed) > 1 || cur != int64(len(committed)) {
					t.Fatalf("%s: %d advances from 0 committed, version %d", agg, len(committed), cur)
				}
			})
		})
	}
}

// racePools are the pools the races run on: one with connections to
// spare, and one a connection larger than the transactions begun at once.
var racePools = []struct {
	name     string
	maxConns int
}{{"spare connections", 70}, {"busy pool", raceGoroutines + 1}}

// raceGoroutines is how many transactions raceNewAggregates starts at once
// on each aggregate.
const raceGoroutines = 16

// raceNewAggregates runs, on each of 40 new aggregates in turn,
// raceGoroutines transactions at once that call step, and rolls back every
// fourth of those whose step succeeded (after a pause, so that the others
// queue behind it) and commits the rest. An error of step fails t; ok
// false rolls the transaction back. check gets the numbers step returned
// in the transactions that committed.
func raceNewAggregates(t *testing.T, s *idemtest.Store[*sql.Tx], step func(ctx context.Context, tx *sql.Tx, agg string) (n int64, ok bool, err error), check func(agg string, committed []int64)) {
	ctx := context.Background()
	for a := range 40 {
		agg := fmt.Sprintf("order-%d", a)
		var (
			mu        sync.Mutex
			committed []int64
			wg        sync.WaitGroup
			start     = make(chan struct{})
		)
		for g := range raceGoroutines {
			// Every transaction holds its connection before any goes on.
			tx, err := s.Driver.Begin(ctx)
			if err != nil {
				close(start) // those begun run and end their transactions
				wg.Wait()
				t.Fatal(err)
			}
			wg.Go(func() {
				<-start
				n, ok, err := step(ctx, tx, agg)
				switch {
				case err != nil:
					_ = s.Driver.Rollback(ctx, tx)
					t.Errorf("%s: %v", agg, err)
				case !ok:
					_ = s.Driver.Rollback(ctx, tx)
				case g%4 == 0:
					time.Sleep(time.Millisecond)
					_ = s.Driver.Rollback(ctx, tx)
				default:
					if err := s.Driver.Commit(ctx, tx); err != nil {
						t.Errorf("%s: commit: %v", agg, err)
						return
					}
					mu.Lock()
					committed = append(committed, n)
					mu.Unlock()
				}
			})
		}
		close(start)
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
		check(agg, committed)
	}
}

// TestVersionRowCreationNeverWaitsOnItself allocates for new aggregates
// where the caller's transaction holds a lock that creating the row beside
// it would need: at REPEATABLE READ, the gap an earlier miss locked; the
// row itself, incremented earlier in the transaction through another
// driver (whose memory of rows seen is empty); and a pool of one
// connection. Any of them would hang on itself if idem waited; the
// context's deadline turns such a hang into a failure.
func TestVersionRowCreationNeverWaitsOnItself(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		maxConns int
		begin    func(ctx context.Context, db *sql.DB, s *idemtest.Store[*sql.Tx]) (*sql.Tx, error)
	}{
		{"RepeatableRead", 8, func(ctx context.Context, db *sql.DB, _ *idemtest.Store[*sql.Tx]) (*sql.Tx, error) {
			return db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		}},
		{"ReadCommitted", 8, func(ctx context.Context, _ *sql.DB, s *idemtest.Store[*sql.Tx]) (*sql.Tx, error) {
			return s.Driver.Begin(ctx)
		}},
		{"PoolOfOne", 1, func(ctx context.Context, _ *sql.DB, s *idemtest.Store[*sql.Tx]) (*sql.Tx, error) {
			return s.Driver.Begin(ctx)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := testenv.MySQL(t, testenv.MySQLDatabase(t), tc.maxConns)
			s := storeOn(t, db, nil)
			v, err := idem.NewVersions(s.Driver)
			if err != nil {
				t.Fatal(err)
			}
			other, err := mysql.New(db, nil) // another driver: nothing seen yet
			if err != nil {
				t.Fatal(err)
			}
			v2, err := idem.NewVersions(other)
			if err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				tx, err := tc.begin(ctx, db, s)
				if err != nil {
					cancel()
					t.Fatal(err)
				}
				step := func() error {
					// A miss locks the gap (REPEATABLE READ) where the
					// next aggregate's row goes.
					if _, err := v.Advance(ctx, tx, "orders", fmt.Sprintf("b-%d", i), 5); !errors.Is(err, idem.ErrExpectedVersion) {
						return fmt.Errorf("advance of a missing aggregate from 5: %v, want ErrExpectedVersion", err)
					}
					agg := fmt.Sprintf("c-%d", i)
					if n, err := v.Next(ctx, tx, "orders", agg); err != nil || n != 1 {
						return fmt.Errorf("first Next of %s: %d, %v; want 1", agg, n, err)
					}
					if n, err := v2.Next(ctx, tx, "orders", agg); err != nil || n != 2 {
						return fmt.Errorf("second Next of %s, the row locked by this transaction: %d, %v; want 2", agg, n, err)
					}
					if n, err := v.Advance(ctx, tx, "orders", fmt.Sprintf("d-%d", i), 0); err != nil || n != 1 {
						return fmt.Errorf("advance of a new aggregate from 0: %d, %v; want 1", n, err)
					}
					return nil
				}
				err = step()
				if err != nil {
					_ = tx.Rollback()
					cancel()
					t.Fatalf("round %d: %v", i, err)
				}
				err = tx.Commit()
				cancel()
				if err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// TestNewHandlerOnAFullPool: a handler's name is interned on first use.
// When the transactions of a new handler hold every connection of the
// pool, none of them may wait for another connection to do it: on a pool
// of one, and with four workers holding a pool of four, every message is
// applied, once. A name interned in a transaction that rolls back leaves
// no id behind that a redelivery could slip past; under REPEATABLE READ, a
// name another process interned after the transaction's snapshot is found,
// not taken for a new one.
func TestNewHandlerOnAFullPool(t *testing.T) {
	t.Parallel()
	inTx := func(ctx context.Context, db *sql.DB, iso sql.IsolationLevel, f func(tx *sql.Tx) error) error {
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: iso})
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if err := f(tx); err != nil {
			return err
		}
		return tx.Commit()
	}
	processTx := func(ctx context.Context, p *idem.Processor[*sql.Tx], tx *sql.Tx, h *idem.Handler[*sql.Tx], id, payload string, batch bool) error {
		m := &idem.Message{ID: id, Payload: []byte(payload)}
		var out idem.Outcome
		var err error
		if batch {
			var outs []idem.Outcome
			if outs, err = p.ProcessBatchTx(ctx, tx, h, []*idem.Message{m}); err == nil {
				out = outs[0]
			}
		} else {
			out, err = p.ProcessTx(ctx, tx, h, m)
		}
		if err == nil && out != idem.Applied {
			err = fmt.Errorf("%s: %v, want applied", id, out)
		}
		return err
	}
	t.Run("PoolOfOne", func(t *testing.T) {
		t.Parallel()
		_, db, s, p, ctx := fullPool(t, 1, 20*time.Second)
		// In the caller's transaction, which holds the only connection.
		h := idemtest.CreditHandler(s, "one-conn-tx", nil)
		for i, batch := range []bool{false, true} {
			err := inTx(ctx, db, sql.LevelDefault, func(tx *sql.Tx) error {
				return processTx(ctx, p, tx, h, fmt.Sprintf("t-%d", i), "acct-1:1", batch)
			})
			if err != nil {
				t.Fatalf("in the caller's transaction on a pool of one: %v", err)
			}
		}
		// In transactions the processor begins.
		hp := idemtest.CreditHandler(s, "one-conn", nil)
		for _, want := range []idem.Outcome{idem.Applied, idem.Duplicate} {
			if out, err := p.Process(ctx, hp, &idem.Message{ID: "m-1", Payload: []byte("acct-2:1")}); out != want || err != nil {
				t.Fatalf("process on a pool of one: %v, %v; want %v", out, err, want)
			}
		}
		hb := idemtest.CreditHandler(s, "one-conn-batch", nil)
		outs, err := p.ProcessBatch(ctx, hb, []*idem.Message{{ID: "b-1", Payload: []byte("acct-2:1")}, {ID: "b-2", Payload: []byte("acct-2:1")}})
		if err != nil || outs[0] != idem.Applied || outs[1] != idem.Applied {
			t.Fatalf("batch on a pool of one: %v, %v", outs, err)
		}
		if bal, err := s.Balances(ctx); err != nil || bal["acct-1"] != 2 || bal["acct-2"] != 3 {
			t.Fatalf("balances %v, %v; want acct-1 2, acct-2 3", bal, err)
		}
		// Pruning holds a connection for its lock and needs another: on a
		// pool of one it is refused at once, and processing goes on.
		pr, err := idem.NewPruner(s.Driver, &idem.RetentionConfig{Retention: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pr.Prune(ctx); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Fatalf("prune on a pool of one: %v, want ErrInvalidConfig", err)
		}
		if out, err := p.Process(ctx, hp, &idem.Message{ID: "m-2", Payload: []byte("acct-2:1")}); out != idem.Applied || err != nil {
			t.Fatalf("process after the refused prune: %v, %v", out, err)
		}
	})
	for _, v := range []struct {
		name       string
		twoDrivers bool // the second message goes through another driver on the pool
		ru         bool // the pool's sessions default to READ UNCOMMITTED
	}{{"OneDriver", false, false}, {"TwoDriversOneTx", true, false}, {"ReadUncommittedPool", false, true}} {
		t.Run("RolledBackName/"+v.name, func(t *testing.T) {
			t.Parallel()
			dsn := testenv.MySQLDatabase(t)
			conns, params := 1, ""
			if v.ru {
				conns, params = 2, "&tx_isolation=%27READ-UNCOMMITTED%27"
			}
			db := testenv.MySQL(t, dsn+params, conns)
			s := storeOn(t, db, nil)
			p, err := idem.NewProcessor(s.Driver, nil)
			if err != nil {
				t.Fatal(err)
			}
			p2 := p
			if v.twoDrivers {
				b, err := mysql.New(db, nil)
				if err != nil {
					t.Fatal(err)
				}
				if p2, err = idem.NewProcessor(b, nil); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			var spare *sql.Conn
			if v.ru {
				// Busy while the first message interns the name in the
				// transaction, free for the second.
				if spare, err = db.Conn(ctx); err != nil {
					t.Fatal(err)
				}
				if err := spare.PingContext(ctx); err != nil {
					t.Fatal(err)
				}
			}
			h := idemtest.CreditHandler(s, "ghost", nil)
			// Two messages in one transaction, which interns the name (no
			// connection is spare), reads it back, and rolls back.
			errRollback := errors.New("roll back")
			err = inTx(ctx, db, sql.LevelDefault, func(tx *sql.Tx) error {
				if err := processTx(ctx, p, tx, h, "m-1", "acct-1:1", false); err != nil {
					return err
				}
				if spare != nil {
					spare.Close()
				}
				if err := processTx(ctx, p2, tx, h, "m-2", "acct-1:1", false); err != nil {
					return err
				}
				return errRollback
			})
			if !errors.Is(err, errRollback) {
				t.Fatalf("the rolled back transaction: %v", err)
			}
			// Another process interns the name anew and applies m-1.
			po := otherProcess(t, dsn)
			if out, err := po.Process(ctx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")}); out != idem.Applied || err != nil {
				t.Fatalf("m-1 in the other process: %v, %v; want applied", out, err)
			}
			// Its redelivery to the first process is a duplicate, in either
			// way of processing, through either driver.
			for _, proc := range []*idem.Processor[*sql.Tx]{p, p2} {
				if out, err := proc.Process(ctx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")}); out != idem.Duplicate || err != nil {
					t.Fatalf("m-1 redelivered to the first process: %v, %v; want duplicate", out, err)
				}
				err = inTx(ctx, db, sql.LevelDefault, func(tx *sql.Tx) error {
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
			dsn, db, s, p, ctx := fullPool(t, 4, 20*time.Second)
			holder, err := testenv.MySQL(t, dsn, 1).BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer holder.Rollback()
			if _, err := holder.ExecContext(ctx, "INSERT INTO `idem_handlers` (name) VALUES ('held')"); err != nil {
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
					if err := db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.PROCESSLIST
WHERE DB = DATABASE() AND ID <> CONNECTION_ID() AND INFO LIKE '%idem_handlers%'`).Scan(&waitingDuring); err != nil {
						ended <- err
						return
					}
					if waitingDuring >= 1 && time.Since(start) >= 800*time.Millisecond || time.Since(start) > 10*time.Second {
						break
					}
				}
				if holderCommits {
					ended <- holder.Commit()
				} else {
					ended <- holder.Rollback()
				}
			}()
			h := idemtest.CreditHandler(s, "held", nil)
			err = inTx(ctx, db, sql.LevelDefault, func(tx *sql.Tx) error {
				return processTx(ctx, p, tx, h, "m-1", "acct-1:1", false)
			})
			if err != nil {
				t.Fatalf("ProcessTx while another transaction holds the new name: %v", err)
			}
			if err := <-ended; err != nil {
				t.Fatal(err)
			}
			if out, err := p.Process(ctx, h, &idem.Message{ID: "m-1", Payload: []byte("acct-1:1")}); out != idem.Duplicate || err != nil {
				t.Fatalf("m-1 again: %v, %v; want duplicate", out, err)
			}
			if bal, err := s.Balances(ctx); err != nil || bal["acct-1"] != 1 {
				t.Fatalf("balances %v, %v; want acct-1 1", bal, err)
			}
			if waitingDuring != 1 {
				t.Fatalf("%d statements waited on the held name; want 1, the transaction's own (a pooled insert given up on keeps waiting on the server)", waitingDuring)
			}
		})
	}
	t.Run("RepeatableReadSnapshot", func(t *testing.T) {
		t.Parallel()
		dsn := testenv.MySQLDatabase(t)
		db := testenv.MySQL(t, dsn, 1)
		s := storeOn(t, db, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		var n int
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM balances`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		// Another process, on its own pool, interns the name now.
		po := otherProcess(t, dsn)
		h := idemtest.CreditHandler(s, "snapshot", nil)
		if out, err := po.Process(ctx, h, &idem.Message{ID: "x", Payload: []byte("acct-1:1")}); out != idem.Applied || err != nil {
			t.Fatalf("the other process: %v, %v", out, err)
		}
		p, err := idem.NewProcessor(s.Driver, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			id   string
			want idem.Outcome
		}{{"x", idem.Duplicate}, {"y", idem.Applied}} {
			if out, err := p.ProcessTx(ctx, tx, h, &idem.Message{ID: c.id, Payload: []byte("acct-1:1")}); out != c.want || err != nil {
				t.Fatalf("%s in a REPEATABLE READ transaction older than the name: %v, %v; want %v", c.id, out, err, c.want)
			}
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
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
		_, db, s, p, ctx := fullPool(t, workers, 30*time.Second)
		for r := range rounds {
			h := idemtest.CreditHandler(s, fmt.Sprintf("full-pool-%d", r), nil)
			begun := make(chan struct{}, workers)
			start := make(chan struct{})
			errs := make(chan error, workers)
			for w := range workers {
				go func() {
					errs <- inTx(ctx, db, sql.LevelDefault, func(tx *sql.Tx) error {
						// The first statement takes the transaction's
						// connection.
						var one int
						if err := tx.QueryRowContext(ctx, `SELECT 1`).Scan(&one); err != nil {
							return err
						}
						begun <- struct{}{}
						<-start // every worker holds its connection now
						return processTx(ctx, p, tx, h, fmt.Sprintf("m-%d", w), fmt.Sprintf("acct-%d:1", w), r%2 == 1)
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
// database of its own (dsn), its processor, and a context that bounds its
// waits.
func fullPool(t *testing.T, conns int, wait time.Duration) (string, *sql.DB, *idemtest.Store[*sql.Tx], *idem.Processor[*sql.Tx], context.Context) {
	t.Helper()
	dsn := testenv.MySQLDatabase(t)
	db := testenv.MySQL(t, dsn, conns)
	s := storeOn(t, db, nil)
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	t.Cleanup(cancel)
	return dsn, db, s, p, ctx
}

// otherProcess is another process's processor on the database at dsn: a
// driver of its own, on a pool of its own.
func otherProcess(t *testing.T, dsn string) *idem.Processor[*sql.Tx] {
	t.Helper()
	other, err := mysql.New(testenv.MySQL(t, dsn, 2), nil)
	if err != nil {
		t.Fatal(err)
	}
	po, err := idem.NewProcessor(other, nil)
	if err != nil {
		t.Fatal(err)
	}
	return po
}

// TestAllocatorOnASaturatedPool: four transactions hold every connection
// of a pool of four, and each allocates for a new aggregate of its own.
// No connection can come for the row's creation outside the transaction
// before one of them ends, so the driver must not wait for one (it waited
// versionRowWait, 500 ms, on every new aggregate): each allocation
// creates its row inside its transaction at once, and every number is 1.
func TestAllocatorOnASaturatedPool(t *testing.T) {
	t.Parallel()
	const conns = 4
	s := storeOn(t, testenv.MySQL(t, testenv.MySQLDatabase(t), conns), nil)
	ctx := context.Background()
	v, err := idem.NewVersions(s.Driver)
	if err != nil {
		t.Fatal(err)
	}
	for round := range 5 {
		txs := make([]*sql.Tx, conns)
		for i := range txs {
			if txs[i], err = s.Driver.Begin(ctx); err != nil {
				t.Fatal(err)
			}
		}
		var wg sync.WaitGroup
		took := make([]time.Duration, conns)
		nums := make([]int64, conns)
		errs := make([]error, conns)
		for i, tx := range txs {
			wg.Go(func() {
				start := time.Now()
				nums[i], errs[i] = v.Next(ctx, tx, "orders", fmt.Sprintf("order-%d-%d", round, i))
				took[i] = time.Since(start)
			})
		}
		wg.Wait()
		// Every transaction ends before any check: one left open would
		// hold the database its test drops.
		for i, tx := range txs {
			if err := s.Driver.Commit(ctx, tx); err != nil && errs[i] == nil {
				errs[i] = err
			}
		}
		for i := range txs {
			if errs[i] != nil || nums[i] != 1 {
				t.Fatalf("round %d, transaction %d: number %d, %v; want 1", round, i, nums[i], errs[i])
			}
			// A stall is versionRowWait (500 ms) or more; an allocation
			// takes milliseconds even on a loaded machine.
			if took[i] >= 450*time.Millisecond {
				t.Fatalf("round %d, transaction %d: the allocation took %s: it waited for a connection no one could give back", round, i, took[i])
			}
		}
	}
}
