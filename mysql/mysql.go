// Package mysql is idem's store driver for MySQL and MariaDB (InnoDB), on
// database/sql and github.com/go-sql-driver/mysql.
//
//	db, err := sql.Open("mysql", "app:secret@tcp(db:3306)/app")
//	drv, err := mysql.New(db, nil)
//	err = drv.Migrate(ctx)
//	proc, err := idem.NewProcessor(drv, nil)
//
// Handlers receive the *sql.Tx that holds the marker, so ProcessTx accepts
// a transaction the caller began with db.BeginTx.
//
// Isolation: the transactions the driver opens run at READ COMMITTED,
// whatever the server's default (REPEATABLE READ on InnoDB). Two reasons.
// InnoDB takes gap and next-key locks for searches under REPEATABLE READ,
// which makes concurrent batches deadlock far more often for nothing idem
// needs; and a REPEATABLE READ snapshot taken before a concurrent marker
// committed would not show it. The driver does not rely on the second
// point: it reads an existing marker's hash with a locking read, which
// sees the latest committed row at any level, so ProcessTx in a
// transaction of yours at REPEATABLE READ works too. Setting the level
// costs a statement per transaction; Config.SessionIsolation skips it
// when the connections are at READ COMMITTED already (Open sets that up).
//
// Concurrency: a delivery inserts its marker first. A concurrent delivery
// of the same ID blocks on the primary key until the first transaction
// ends, then finds the committed marker (error 1062) and reports
// Duplicate; if the first rolled back, it inserts. InnoDB may pick one of
// several waiters as a deadlock victim (error 1213), or give up after
// innodb_lock_wait_timeout (1205). Where the driver owns the transaction
// and the handler has not run yet (Process and ProcessBatch begin with the
// marker insert) it retries the whole transaction, a bounded number of
// times; nothing was applied, so nothing can apply twice. An error after
// the handler ran is returned: the delivery is retried by its consumer.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/mysql.md
package mysql

import (
	"context"
	"crypto/sha256"
	"database/sql"
	sqldriver "database/sql/driver"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/migrations"
	"github.com/idemhq/idem/internal/sqlident"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Config configures the driver. The zero value is valid.
type Config struct {
	// TablePrefix is prepended to every table name. It must match
	// [a-z_][a-z0-9_]* and be at most 40 bytes. Default "idem_". The
	// tables live in the connection's database.
	TablePrefix string
	// SessionIsolation says the connections already run at READ
	// COMMITTED (the DSN sets transaction_isolation, as Open does), so
	// the driver opens its transactions without setting the level, one
	// statement fewer each. Default false: every transaction the driver
	// opens sets READ COMMITTED itself.
	SessionIsolation bool
	// MaxRetries bounds how many times the driver runs a transaction
	// again after a deadlock (1213) or lock wait timeout (1205), where it
	// may (see the package documentation). Default 16; negative: none.
	MaxRetries int
}

// Driver implements driver.Driver[*sql.Tx] for MySQL and MariaDB.
type Driver struct {
	db         *sql.DB
	prefix     string
	t          tables
	txOpts     *sql.TxOptions
	maxRetries int
	// handlerIDs caches handler name → id (see handlerID).
	handlerIDs sync.Map
	// versionRows remembers the version rows known to exist, committed.
	versionRows seenRows
	// sequenceRows remembers the ordering guard's rows known to exist,
	// committed (see createSequenceRows).
	sequenceRows seenRows
	// noSetStatement: the server has no SET STATEMENT (MySQL 8); see
	// execNoWait.
	noSetStatement atomic.Bool
	// sideStatements counts the statements autocommitNoWait is running:
	// each holds a connection of the pool for a moment, and gives it back
	// (see createVersionRow).
	sideStatements atomic.Int32
	// countsMatched caches what the pool's connections count as affected
	// by an UPDATE: 0 not known yet, 1 the rows changed (the default), 2
	// the rows matched (clientFoundRows=true); see rowsCountMatched.
	countsMatched atomic.Int32
	// sessionOK says a pooled connection's session was found to run
	// with autocommit on and completion_type NO_CHAIN (see ready); once
	// true it stays true.
	sessionOK atomic.Bool
	// checking serializes the first calls' checks of the session, so
	// that workers starting at once send one check, not one each.
	checking chan struct{}
	sql      statements
}

type tables struct {
	migrations, handlers, markers, leases string
	sequences, gaps, versions             string
	deadLetters, deadLetterLog            string
	handlerStats                          string
	outbox, outboxClaims, outboxLog       string
}

// statements are the hot path's SQL, built once.
type statements struct {
	insertMarker, selectHash string
}

var (
	_ driver.Driver[*sql.Tx]                  = (*Driver)(nil)
	_ driver.BeginMarkerInserter[*sql.Tx]     = (*Driver)(nil)
	_ driver.BeginMarkerManyInserter[*sql.Tx] = (*Driver)(nil)
	_ driver.MarkerDeleter[*sql.Tx]           = (*Driver)(nil)
	_ driver.Clock                            = (*Driver)(nil)
)

// ErrNotMigrated is returned (wrapped) when idem's tables are missing: call
// Migrate first.
var ErrNotMigrated = errors.New("mysql: idem's tables are missing: call Migrate first")

// nowMicros is the server's clock in Unix microseconds, whatever the
// session's time zone.
const nowMicros = `TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))`

// quote quotes an identifier that sqlident.Check accepted.
func quote(s string) string { return "`" + s + "`" }

// New returns a driver over db. It does not touch the database until
// Migrate or the first operation. The driver's statements outside its
// transactions rely on autocommit, so before its first operation that
// reaches the pool (and in Migrate) the driver checks, on one of the
// pool's connections, that the session runs with autocommit=1 and
// completion_type NO_CHAIN; otherwise that operation fails with an error
// wrapping idem.ErrInvalidConfig that names the setting, and so does every
// later one until a check passes. A passed check is not repeated. Only one
// connection is checked: such settings come from the DSN, the pool's
// init statements or the user's defaults, the same for each connection.
func New(db *sql.DB, cfg *Config) (*Driver, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: mysql: nil *sql.DB", idem.ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	prefix := cfg.TablePrefix
	if prefix == "" {
		prefix = "idem_"
	}
	if err := sqlident.Check("mysql: TablePrefix", prefix, false); err != nil {
		return nil, fmt.Errorf("%w: %w", idem.ErrInvalidConfig, err)
	}
	d := &Driver{db: db, prefix: prefix, maxRetries: cfg.MaxRetries, checking: make(chan struct{}, 1)}
	if d.maxRetries == 0 {
		d.maxRetries = 16
	}
	if !cfg.SessionIsolation {
		d.txOpts = &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	d.t = tables{
		migrations:    quote(prefix + "migrations"),
		handlers:      quote(prefix + "handlers"),
		markers:       quote(prefix + "markers"),
		leases:        quote(prefix + "leases"),
		sequences:     quote(prefix + "sequences"),
		gaps:          quote(prefix + "gaps"),
		versions:      quote(prefix + "versions"),
		deadLetters:   quote(prefix + "dead_letters"),
		deadLetterLog: quote(prefix + "dead_letter_log"),
		handlerStats:  quote(prefix + "handler_stats"),
		outbox:        quote(prefix + "outbox"),
		outboxClaims:  quote(prefix + "outbox_claims"),
		outboxLog:     quote(prefix + "outbox_log"),
	}
	d.sql = statements{
		insertMarker: `INSERT INTO ` + d.t.markers + ` (handler_id, message_id, payload_hash, processed_at) VALUES (?, ?, ?, ` + nowMicros + `)`,
		// A locking read: it sees the latest committed marker whatever
		// the transaction's isolation level and snapshot.
		selectHash: `SELECT payload_hash FROM ` + d.t.markers + ` WHERE handler_id = ? AND message_id = ? LOCK IN SHARE MODE`,
	}
	return d, nil
}

// DB returns the database the driver uses.
func (d *Driver) DB() *sql.DB { return d.db }

// lockName is the name of a GET_LOCK lock of this driver's tables: at most
// 64 characters, as MySQL requires, whatever the database and prefix.
func (d *Driver) lockName(ctx context.Context, c *sql.Conn, what string) (string, error) {
	var dbName sql.NullString
	if err := c.QueryRowContext(ctx, `SELECT DATABASE()`).Scan(&dbName); err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(dbName.String + "." + d.prefix))
	return "idem-" + what + "-" + hex.EncodeToString(sum[:12]), nil
}

// withLock runs f on a connection holding the named GET_LOCK lock, waiting
// for it up to wait.
func (d *Driver) withLock(ctx context.Context, what string, wait time.Duration, f func(c *sql.Conn) error) error {
	c, err := d.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	name, err := d.lockName(ctx, c, what)
	if err != nil {
		return err
	}
	var got sql.NullInt64
	if err := c.QueryRowContext(ctx, `SELECT GET_LOCK(?, ?)`, name, int(wait.Seconds())).Scan(&got); err != nil {
		return err
	}
	if !got.Valid || got.Int64 != 1 {
		return fmt.Errorf("mysql: %s lock %s not granted within %v", what, name, wait)
	}
	defer func() { _, _ = c.ExecContext(context.WithoutCancel(ctx), `SELECT RELEASE_LOCK(?)`, name) }()
	return f(c)
}

// Migrate applies the embedded migrations not yet recorded, under a
// GET_LOCK lock, so concurrent calls from several instances are safe. DDL
// commits implicitly in MySQL; every statement is idempotent, so a
// migration interrupted halfway is completed by the next call. It first
// checks the session's settings, as the driver's first operation does
// (see New), and refuses autocommit=0 and a completion_type other than
// NO_CHAIN with an error wrapping idem.ErrInvalidConfig.
func (d *Driver) Migrate(ctx context.Context) error {
	ms, err := migrations.Load(migrationFS, "migrations", strings.NewReplacer(
		"{{handlers}}", d.t.handlers,
		"{{handlers_name}}", quote(d.prefix+"handlers_name"),
		"{{markers}}", d.t.markers,
		"{{leases}}", d.t.leases,
		"{{sequences}}", d.t.sequences,
		"{{gaps}}", d.t.gaps,
		"{{versions}}", d.t.versions,
		"{{dead_letters}}", d.t.deadLetters,
		"{{dead_letters_key}}", quote(d.prefix+"dead_letters_key"),
		"{{dead_letters_state}}", quote(d.prefix+"dead_letters_state"),
		"{{dead_letter_log}}", d.t.deadLetterLog,
		"{{dead_letter_log_dl}}", quote(d.prefix+"dead_letter_log_dl"),
		"{{handler_stats}}", d.t.handlerStats,
		"{{outbox}}", d.t.outbox,
		"{{outbox_pending}}", quote(d.prefix+"outbox_pending"),
		"{{outbox_key}}", quote(d.prefix+"outbox_key"),
		"{{outbox_claims}}", d.t.outboxClaims,
		"{{outbox_parked}}", quote(d.prefix+"outbox_parked"),
		"{{outbox_log}}", d.t.outboxLog,
		"{{outbox_log_at}}", quote(d.prefix+"outbox_log_at"),
	))
	if err != nil {
		return fmt.Errorf("mysql: load migrations: %w", err)
	}
	return d.withLock(ctx, "migrate", time.Minute, func(c *sql.Conn) error {
		if err := d.checkSession(ctx, c); err != nil {
			return err
		}
		// CREATE TABLE IF NOT EXISTS needs the CREATE privilege even
		// when the table is there: an account that may only read and
		// write, calling Migrate at start on a migrated database, would
		// be refused. So the table is looked up first.
		var present int
		if err := c.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?`,
			d.prefix+"migrations").Scan(&present); err != nil {
			return fmt.Errorf("mysql: look up the migrations table: %w", err)
		}
		if present == 0 {
			if _, err := c.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+d.t.migrations+
				` (version INT NOT NULL PRIMARY KEY, name VARCHAR(255) NOT NULL, applied_at BIGINT NOT NULL) ENGINE = InnoDB`); err != nil {
				return fmt.Errorf("mysql: create migrations table: %w", err)
			}
		}
		for _, m := range ms {
			var n int
			if err := c.QueryRowContext(ctx, `SELECT count(*) FROM `+d.t.migrations+` WHERE version = ?`, m.Version).Scan(&n); err != nil {
				return fmt.Errorf("mysql: migration %s: %w", m.Name, err)
			}
			if n > 0 {
				continue
			}
			for _, stmt := range splitStatements(m.SQL) {
				if _, err := c.ExecContext(ctx, stmt); err != nil && !appliedAlready(err) {
					return fmt.Errorf("mysql: migration %s: %w", m.Name, err)
				}
			}
			if _, err := c.ExecContext(ctx, `INSERT INTO `+d.t.migrations+` (version, name, applied_at) VALUES (?, ?, `+nowMicros+`)`,
				m.Version, m.Name); err != nil {
				return fmt.Errorf("mysql: migration %s: %w", m.Name, err)
			}
		}
		return nil
	})
}

// ready returns nil once a pooled connection's session was found fit for
// the driver's statements (see checkSession); until then it checks one,
// a single caller at a time, and on success remembers it, so that later
// calls cost an atomic load. The settings come from the DSN, the pool's
// init statements or the user's defaults, the same for every connection
// of a pool, so one connection stands for them all. A failed check is not
// remembered: a bad setting fails every call, and a check that could not
// run (no connection, a cancelled context) is run again by the next call.
// Migrate checks its own connection and counts as a check.
//
// It runs before the driver's own transactions (Begin) and its statements
// on the pool outside a transaction, and not in methods that run in the
// caller's transaction: those only reach the pool (interning a handler's
// name, creating a version row) on connections they take themselves,
// checked there.
func (d *Driver) ready(ctx context.Context) error {
	if d.sessionOK.Load() {
		return nil
	}
	select {
	case d.checking <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("mysql: check the session's settings: %w", ctx.Err())
	}
	defer func() { <-d.checking }()
	if d.sessionOK.Load() {
		return nil
	}
	return d.checkSession(ctx, d.db)
}

// checkSession reads the session's autocommit and completion_type on q, a
// connection outside a transaction or the pool, and refuses settings the
// driver cannot work with: its statements outside a transaction
// (interning a handler name, lease writes, dead-letter state, stats, the
// outbox relay's updates) rely on autocommit, and on a session that turns
// it off they would never commit and would hold their locks for the
// connection's life; a completion_type of CHAIN begins a transaction at
// each COMMIT (the same), RELEASE disconnects. A bad setting is an error
// wrapping idem.ErrInvalidConfig naming it; a failure to read them is
// returned as it is. Found fit, the driver remembers it (see ready).
func (d *Driver) checkSession(ctx context.Context, q querier) error {
	var (
		autocommit int
		completion string
	)
	if err := q.QueryRowContext(ctx, `SELECT @@autocommit, @@completion_type`).Scan(&autocommit, &completion); err != nil {
		return fmt.Errorf("mysql: read the session's autocommit and completion_type: %w", err)
	}
	if autocommit == 0 {
		return fmt.Errorf("%w: mysql: the pool's sessions run with autocommit=0 (set in the DSN or init commands?): idem needs it on outside its transactions; drop the setting, or use mysql.Open, which manages it", idem.ErrInvalidConfig)
	}
	if !strings.EqualFold(completion, "NO_CHAIN") && completion != "0" {
		return fmt.Errorf("%w: mysql: the pool's sessions run with completion_type=%s: a COMMIT would begin (or disconnect) what idem does not expect; drop the setting", idem.ErrInvalidConfig, completion)
	}
	d.sessionOK.Store(true)
	return nil
}

// appliedAlready reports whether a migration statement failed because an
// earlier, interrupted run applied it: MySQL has no IF NOT EXISTS for the
// columns and keys an ALTER TABLE adds.
func appliedAlready(err error) bool {
	n := errNumber(err)
	return n == errDupFieldName || n == errDupKeyName
}

// splitStatements splits a migration into its statements: comment lines
// are dropped, and a statement ends with a line ending in ";". The DSN
// need not allow several statements in one call.
func splitStatements(src string) []string {
	var out []string
	var cur strings.Builder
	for _, line := range strings.Split(src, "\n") {
		trimmed := strings.TrimSpace(line)
		if trimmed == "" || strings.HasPrefix(trimmed, "--") {
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
		if strings.HasSuffix(trimmed, ";") {
			out = append(out, strings.TrimSuffix(strings.TrimSpace(cur.String()), ";"))
			cur.Reset()
		}
	}
	if s := strings.TrimSpace(cur.String()); s != "" {
		out = append(out, s)
	}
	return out
}

// MySQL and MariaDB error numbers the driver acts on.
const (
	errDupFieldName    = 1060
	errDupKeyName      = 1061
	errDupEntry        = 1062
	errParse           = 1064
	errNoSuchTable     = 1146
	errLockWaitTimeout = 1205
	errDeadlock        = 1213
	// The statement, or the connection, was stopped from outside.
	errServerShutdown   = 1053
	errQueryInterrupted = 1317
	errConnectionKilled = 1927
)

// errNumber returns the server's error number in err, or 0.
func errNumber(err error) uint16 {
	var me *gomysql.MySQLError
	if errors.As(err, &me) {
		return me.Number
	}
	return 0
}

// notMigrated wraps ErrNotMigrated around a "table doesn't exist" error.
func notMigrated(err error) error {
	if errNumber(err) == errNoSuchTable && !errors.Is(err, ErrNotMigrated) {
		return fmt.Errorf("%w: %w", ErrNotMigrated, err)
	}
	return err
}

// retryable reports whether err ended the transaction in a way that running
// it again may cure: a deadlock victim, a lock wait timeout, or
// driver.ErrBadConn, which go-sql-driver returns when the statement was
// not sent or the connection was closed already: either way nothing of it
// ran, and the connection is dropped with whatever it had open.
func retryable(err error) bool {
	n := errNumber(err)
	return n == errDeadlock || n == errLockWaitTimeout || errors.Is(err, sqldriver.ErrBadConn)
}

// retry runs f again after a deadlock or lock wait timeout, up to the
// configured number of times, with a short jittered pause so that the
// transactions that collided do not collide again at once.
func (d *Driver) retry(ctx context.Context, f func() error) error {
	for attempt := 0; ; attempt++ {
		err := f()
		if err == nil || !retryable(err) || attempt >= d.maxRetries {
			return err
		}
		pause := time.Duration(1+rand.IntN(5<<min(attempt, 5))) * time.Millisecond
		select {
		case <-ctx.Done():
			return err
		case <-time.After(pause):
		}
	}
}

// Begin opens a read-write transaction at READ COMMITTED (see the package
// documentation).
// On a pool from Open, the transaction sends no begin of its own: its
// first statement begins it (see Open). The driver's first operation
// checks the pool's session settings first (see New).
func (d *Driver) Begin(ctx context.Context) (*sql.Tx, error) {
	if err := d.ready(ctx); err != nil {
		return nil, err
	}
	return d.db.BeginTx(context.WithValue(ctx, foldBegin{}, true), d.txOpts)
}

// Commit commits tx.
func (d *Driver) Commit(_ context.Context, tx *sql.Tx) error { return tx.Commit() }

// Rollback rolls tx back; a finished transaction is not an error.
func (d *Driver) Rollback(_ context.Context, tx *sql.Tx) error {
	if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return err
	}
	return nil
}

// Now implements driver.Clock: the server's clock.
func (d *Driver) Now(ctx context.Context) (time.Time, error) {
	var us int64
	if err := d.db.QueryRowContext(ctx, `SELECT `+nowMicros).Scan(&us); err != nil {
		return time.Time{}, fmt.Errorf("mysql: read the server's clock: %w", err)
	}
	return time.UnixMicro(us), nil
}

// micros converts a time to the Unix microseconds the tables hold.
func micros(t time.Time) int64 { return t.UnixMicro() }

// fromMicros converts a nullable column of Unix microseconds.
func fromMicros(v sql.NullInt64) time.Time {
	if !v.Valid {
		return time.Time{}
	}
	return time.UnixMicro(v.Int64)
}
