package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// TestClientFoundRows runs the ordering guard's suite, the conformance
// suite and the dead letters on a pool with clientFoundRows=true, where
// an UPDATE (or the update of an upsert) reports the rows it matched
// rather than the rows it changed: a guard that read "one row" as "it
// advanced" would apply a stale event.
func TestClientFoundRows(t *testing.T) {
	t.Parallel()
	open := func(t testing.TB) *idemtest.Store[*sql.Tx] {
		cfg, err := gomysql.ParseDSN(testenv.MySQLDatabase(t))
		if err != nil {
			t.Fatal(err)
		}
		cfg.ClientFoundRows = true
		return storeOn(t, testenv.MySQL(t, cfg.FormatDSN(), 40), nil)
	}
	h := &idemtest.Harness[*sql.Tx]{Open: open, Goroutines: 16, IDs: 300, Aggregates: 10}
	t.Run("Ordering", func(t *testing.T) { idemtest.RunOrdering(t, h) })
	t.Run("Conformance", func(t *testing.T) { idemtest.Run(t, h) })
	t.Run("DeadLetters", func(t *testing.T) { idemtest.RunDeadLetters(t, h) })
}

// TestMigrateRefusesAutocommitOff: on a pool whose sessions run with
// autocommit=0 (or a completion_type that chains or disconnects) the
// driver's statements outside a transaction would never commit, holding
// their locks; Migrate says so instead, naming the setting.
func TestMigrateRefusesAutocommitOff(t *testing.T) {
	t.Parallel()
	base := testenv.MySQLDatabase(t)
	for _, param := range []string{"autocommit=0", "completion_type=CHAIN"} {
		cfg, err := gomysql.ParseDSN(base + "&" + param)
		if err != nil {
			t.Fatal(err)
		}
		drv, err := mysql.New(testenv.MySQL(t, cfg.FormatDSN(), 2), nil)
		if err != nil {
			t.Fatal(err)
		}
		name := strings.SplitN(param, "=", 2)[0]
		if err := drv.Migrate(context.Background()); !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), name) {
			t.Errorf("Migrate on sessions with %s: %v; want ErrInvalidConfig naming %s", param, err, name)
		}
	}
}

// TestOpenRefusesUnsafeSettings: Open interpolates parameters on the
// client, which is unsafe in character sets where a backslash can end a
// character (a quote in a message ID would end the string), and it needs
// the server's default completion_type and manages autocommit itself
// (Migrate's refusal of those on any pool: TestMigrateRefusesAutocommitOff).
func TestOpenRefusesUnsafeSettings(t *testing.T) {
	t.Parallel()
	base := testenv.MySQLDatabase(t)
	for _, param := range []string{"charset=gbk", "charset=sjis", "completion_type=CHAIN", "autocommit=0"} {
		cfg, err := gomysql.ParseDSN(base + "&" + param)
		if err != nil {
			t.Fatal(err)
		}
		db, err := mysql.Open(context.Background(), cfg)
		if err == nil {
			db.Close()
		}
		if !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("Open with %s: %v; want ErrInvalidConfig", param, err)
		}
	}
}

// TestFirstUseRefusesAutocommitOff: a service that migrates elsewhere
// (with the CLI) and only calls mysql.New on a pool whose sessions run
// with autocommit=0, or a completion_type that chains or disconnects,
// never meets Migrate's check. The driver's first operation makes it:
// processing (in the driver's transaction or the caller's), a write of a
// version row, lease and relay writes, the counters and a read all fail
// with ErrInvalidConfig naming the setting, rather than leave statements
// uncommitted and their locks held. A check that could not run (a
// cancelled context) is no verdict: the next call checks again.
func TestFirstUseRefusesAutocommitOff(t *testing.T) {
	t.Parallel()
	base := testenv.MySQLDatabase(t)
	ctx := context.Background()
	// Migrated on a plain pool, as the CLI would.
	mig, err := mysql.New(testenv.MySQL(t, base, 2), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := mig.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "h", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
	msg := &idem.Message{ID: "m-1", Payload: []byte("x")}
	inTx := func(ctx context.Context, db *sql.DB, f func(tx *sql.Tx) error) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		return f(tx)
	}
	ops := []struct {
		name string
		run  func(ctx context.Context, db *sql.DB, drv *mysql.Driver) error
	}{
		{"Process", func(ctx context.Context, _ *sql.DB, drv *mysql.Driver) error {
			p, err := idem.NewProcessor(drv, nil)
			if err != nil {
				return err
			}
			_, err = p.Process(ctx, h, msg)
			return err
		}},
		{"ProcessTx", func(ctx context.Context, db *sql.DB, drv *mysql.Driver) error {
			p, err := idem.NewProcessor(drv, nil)
			if err != nil {
				return err
			}
			return inTx(ctx, db, func(tx *sql.Tx) error {
				_, err := p.ProcessTx(ctx, tx, h, msg)
				return err
			})
		}},
		{"VersionNext", func(ctx context.Context, db *sql.DB, drv *mysql.Driver) error {
			return inTx(ctx, db, func(tx *sql.Tx) error {
				_, err := drv.VersionNext(ctx, tx, &driver.VersionParams{Stream: "s", AggregateID: "a"})
				return err
			})
		}},
		{"Begin", func(ctx context.Context, _ *sql.DB, drv *mysql.Driver) error {
			tx, err := drv.Begin(ctx)
			if err == nil {
				tx.Rollback()
			}
			return err
		}},
		{"LeaseHeartbeat", func(ctx context.Context, _ *sql.DB, drv *mysql.Driver) error {
			_, err := drv.LeaseHeartbeat(ctx, &driver.LeaseHeartbeatParams{Handler: "h", MessageID: "m", Token: 1, TTL: time.Minute})
			return err
		}},
		{"OutboxMarkPublished", func(ctx context.Context, _ *sql.DB, drv *mysql.Driver) error {
			return drv.OutboxMarkPublished(ctx, []int64{1})
		}},
		{"StatsAdd", func(ctx context.Context, _ *sql.DB, drv *mysql.Driver) error {
			return drv.StatsAdd(ctx, "h", driver.StatsDelta{Duplicates: 1})
		}},
		{"SequenceLast", func(ctx context.Context, _ *sql.DB, drv *mysql.Driver) error {
			_, err := drv.SequenceLast(ctx, "h", "a")
			return err
		}},
	}
	for _, param := range []string{"autocommit=0", "completion_type=CHAIN", "completion_type=%27RELEASE%27"} {
		name := strings.SplitN(param, "=", 2)[0]
		for _, op := range ops {
			// A pool each: under RELEASE, a COMMIT or ROLLBACK (such as
			// the caller's) disconnects, and the next use of that
			// connection fails, as no verdict (see below).
			db := testenv.MySQL(t, base+"&"+param, 4)
			drv, err := mysql.New(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			// Bounded: without the check, a statement may wait on a lock
			// an uncommitted one holds.
			octx, cancel := context.WithTimeout(ctx, 3*time.Second)
			err = op.run(octx, db, drv)
			cancel()
			if !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), name) {
				t.Errorf("%s as the first use of a driver on sessions with %s: %v; want ErrInvalidConfig naming %s", op.name, param, err, name)
			}
		}
		// A cancelled check is no verdict, and is made again.
		drv, err := mysql.New(testenv.MySQL(t, base+"&"+param, 2), nil)
		if err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if _, err := drv.Begin(cctx); err == nil || errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("Begin with a cancelled context on sessions with %s: %v; want the context's error", param, err)
		}
		if _, err := drv.Begin(ctx); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("Begin after a cancelled check on sessions with %s: %v; want ErrInvalidConfig", param, err)
		}
	}
	// On a fit pool a cancelled first check does not stick either.
	drv, err := mysql.New(testenv.MySQL(t, base, 2), nil)
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := drv.StatsAdd(cctx, "fit", driver.StatsDelta{Stale: 1}); err == nil {
		t.Error("StatsAdd with a cancelled context succeeded")
	}
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := drv.StatsAdd(octx, "fit", driver.StatsDelta{Stale: 1}); err != nil {
		t.Errorf("StatsAdd after a cancelled check: %v", err)
	}
}

// TestSessionCheckedOnce: the check of the sessions' settings is one
// query per driver, however many workers start at once, and none after
// it: the per-message path pays nothing for it.
func TestSessionCheckedOnce(t *testing.T) {
	t.Parallel()
	db, _, _, sent, _ := openRecorded(t, 8)
	_, before := sent.since(0)
	drv, err := mysql.New(db, &mysql.Config{SessionIsolation: true})
	if err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "h", Apply: func(ctx context.Context, tx *sql.Tx, _ *idem.Message) error {
		_, err := tx.ExecContext(ctx, upsertBalance, "a")
		return err
	}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10 {
				if _, err := p.Process(ctx, h, &idem.Message{ID: fmt.Sprintf("m-%d-%d", w, i), Payload: []byte("x")}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	qs, _ := sent.since(before)
	checks := 0
	for _, q := range qs {
		if strings.Contains(q, "@@autocommit") {
			checks++
		}
	}
	if checks != 1 {
		t.Fatalf("80 messages from 8 workers on a new driver sent %d checks of the session, want 1", checks)
	}
}

// TestOpenRefusesIsolationInDSN: Open sets the isolation variable itself.
// go-sql-driver sends a DSN's variables in one SET, in map order, so a
// second spelling of it in the DSN (the other name, another case) would
// win on some connections and lose on others (seen: 8 of 40 SERIALIZABLE).
// Open refuses it, whichever name and case.
func TestOpenRefusesIsolationInDSN(t *testing.T) {
	t.Parallel()
	base := testenv.MySQLDatabase(t)
	for _, param := range []string{
		"tx_isolation=%27SERIALIZABLE%27",
		"TX_ISOLATION=%27SERIALIZABLE%27",
		"Tx_Isolation=%27READ-COMMITTED%27",
		"transaction_isolation=%27SERIALIZABLE%27",
		"TRANSACTION_ISOLATION=%27SERIALIZABLE%27",
	} {
		cfg, err := gomysql.ParseDSN(base + "&" + param)
		if err != nil {
			t.Fatal(err)
		}
		db, err := mysql.Open(context.Background(), cfg)
		if err == nil {
			db.Close()
		}
		if !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("Open with %s: %v; want ErrInvalidConfig", param, err)
		}
	}
}

// TestConformanceServerPrepared runs the atomic suite, small, on a plain
// pool with go-sql-driver's default of server-side prepared statements
// (no interpolateParams), which testenv's DSNs otherwise always set.
func TestConformanceServerPrepared(t *testing.T) {
	t.Parallel()
	open := func(t testing.TB) *idemtest.Store[*sql.Tx] {
		cfg, err := gomysql.ParseDSN(testenv.MySQLDatabase(t))
		if err != nil {
			t.Fatal(err)
		}
		cfg.InterpolateParams = false
		db := testenv.MySQL(t, cfg.FormatDSN(), 24)
		if n := prepares(t, db); n == 0 {
			t.Fatal("a statement with a parameter prepared nothing on the server: parameters are interpolated")
		}
		return storeOn(t, db, nil)
	}
	idemtest.Run(t, &idemtest.Harness[*sql.Tx]{Open: open, Goroutines: 8, IDs: 200})
}

// prepares returns how many statements one with a parameter prepared on
// the server, on one connection of db.
func prepares(t testing.TB, db *sql.DB) int {
	t.Helper()
	ctx := context.Background()
	c, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	count := func() int {
		var (
			name string
			n    int
		)
		if err := c.QueryRowContext(ctx, `SHOW SESSION STATUS LIKE 'Com_stmt_prepare'`).Scan(&name, &n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := count()
	var one int
	if err := c.QueryRowContext(ctx, `SELECT ?`, 1).Scan(&one); err != nil {
		t.Fatal(err)
	}
	return count() - before
}

// TestMigrateAsServiceRole: a service whose account may only read and
// write the tables calls Migrate at start on a database an owner already
// migrated. That must pass without asking for CREATE.
func TestMigrateAsServiceRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testenv.MySQLDatabase(t)
	owner := testenv.MySQL(t, dsn, 2)
	drv, err := mysql.New(owner, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	cfg, err := gomysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	user := strings.TrimPrefix(cfg.DBName, "idemtest_") + "_svc"
	if _, err := owner.ExecContext(ctx, "CREATE USER '"+user+"'@'%' IDENTIFIED BY 'svc'"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := owner.ExecContext(context.Background(), "DROP USER '"+user+"'@'%'"); err != nil {
			t.Errorf("drop user: %v", err)
		}
	})
	if _, err := owner.ExecContext(ctx, "GRANT SELECT, INSERT, UPDATE, DELETE ON `"+cfg.DBName+"`.* TO '"+user+"'@'%'"); err != nil {
		t.Fatal(err)
	}
	cfg.User, cfg.Passwd = user, "svc"
	svc := testenv.MySQL(t, cfg.FormatDSN(), 2)
	if _, err := svc.ExecContext(ctx, "CREATE TABLE probe_create (x INT)"); err == nil {
		t.Fatal("the service account may create tables: the test needs one that may not")
	}
	drv, err = mysql.New(svc, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatalf("migrate a migrated database as the service account: %v", err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	applied := 0
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(context.Context, *sql.Tx, *idem.Message) error {
		applied++
		return nil
	}}
	for _, id := range []string{"a", "b", "a"} {
		if _, err := proc.Process(ctx, h, &idem.Message{ID: id, Payload: []byte("x")}); err != nil {
			t.Fatalf("process %s: %v", id, err)
		}
	}
	if applied != 2 {
		t.Fatalf("applied %d; want 2", applied)
	}
}
