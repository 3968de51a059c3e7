// Package sqlite is idem's embedded store driver, on modernc.org/sqlite (pure
// Go, no cgo). It is the default for the demo and for tests that want speed
// with real transactions and unique indexes.
//
// Open a database with Open, which sets the pragmas idem relies on (WAL,
// synchronous=FULL, a busy timeout, BEGIN IMMEDIATE transactions and a single
// connection), then build the driver with New and call Migrate:
//
//	db, err := sqlite.Open("app.db", nil)
//	drv, err := sqlite.New(db, nil)
//	err = drv.Migrate(ctx)
//	proc, err := idem.NewProcessor(drv, nil)
//
// Handlers receive the *sql.Tx that holds the marker.
//
// The connections of a *sql.DB opened otherwise must keep a journal on
// disk (WAL, or a rollback journal: DELETE, TRUNCATE, PERSIST): without
// one SQLite cannot undo a failed statement, and a crash mid-commit can
// corrupt the file. journal_mode=OFF, and MEMORY on a database file, are
// refused with idem.ErrInvalidConfig, by Migrate and by the driver's first
// transaction (see New). synchronous is the caller's choice, with the
// costs OpenOptions.Synchronous lists.
//
// A pool of several connections (sql.Open's default) works too: where its
// connections have no busy timeout, the driver gives each transaction's
// connection one of 10 s, so that deliveries wait for each other's locks
// rather than fail with SQLITE_BUSY, which idem would take for an outage.
//
// SQLite has one writer at a time. Open limits the pool to one connection,
// so concurrent Process calls queue in Go rather than spin on SQLITE_BUSY;
// a handler must therefore do all its work through the transaction it is
// given, never through the *sql.DB (that would wait for itself).
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/atomic-mode.md#drivers
package sqlite

import (
	"context"
	"database/sql"
	sqldriver "database/sql/driver"
	"embed"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/migrations"
	"github.com/idemhq/idem/internal/sqlident"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Config configures the driver. The zero value is valid.
type Config struct {
	// TablePrefix is prepended to every table name. It must match
	// [a-z_][a-z0-9_]* and be at most 40 bytes. Default "idem_".
	TablePrefix string
}

// Driver implements driver.Driver[*sql.Tx] for SQLite.
type Driver struct {
	db     *sql.DB
	prefix string
	tables tables

	insertMarker  *sql.Stmt
	insertMarkers []*sql.Stmt // [n]: n rows, no ON CONFLICT (n ≥ 2)
	selectHash    *sql.Stmt
	advanceSeq    *sql.Stmt // the ordering guard's conditional upsert
	selectSeq     *sql.Stmt
	setSeq        *sql.Stmt // one sequence of an ordered batch

	maintenance sync.Mutex // one pruner at a time in this process

	// journalOK says a connection of the pool was found to run in a
	// journal mode the driver can work with (see ready); once true it
	// stays true.
	journalOK atomic.Bool
	// waitForLocks says the connection checked with journalOK had no busy
	// timeout: Begin then sets one on the connection of every transaction
	// it opens (see setBusyTimeout).
	waitForLocks atomic.Bool

	schemaWritable func() // tests: called once migration 010 turned writable_schema on
}

type tables struct {
	processed, migrations      string
	sequences, gaps, versions  string
	deadLetters, deadLetterLog string
	handlerStats               string
	outbox, outboxClaims       string
	outboxLog                  string
}

var (
	_ driver.Driver[*sql.Tx]        = (*Driver)(nil)
	_ driver.MarkerDeleter[*sql.Tx] = (*Driver)(nil)
	_ driver.LeaseRearmer           = (*Driver)(nil)
)

// OpenOptions tunes Open. The zero value gives idem's defaults.
type OpenOptions struct {
	// Synchronous is the synchronous pragma: "FULL" (default) makes every
	// commit durable against power loss, which "nothing is lost" needs
	// when the broker is acknowledged after commit; "NORMAL" is faster
	// and durable against process crashes only. "OFF" never waits for the
	// disk: a process crash still loses nothing (the commit reached the
	// operating system), but an operating-system crash or power loss may
	// lose commits already acknowledged to the broker, markers and effects
	// alike, and may corrupt the file; it is accepted, for tests and data
	// that can be rebuilt.
	Synchronous string
	// BusyTimeout bounds waiting for a lock held by another process.
	// Default 10s.
	BusyTimeout time.Duration
}

// Open opens (creating if needed) the SQLite database at path with idem's
// recommended settings. path may be ":memory:" for a private in-memory
// database that lives as long as the returned *sql.DB.
func Open(path string, opts *OpenOptions) (*sql.DB, error) {
	if opts == nil {
		opts = &OpenOptions{}
	}
	syncMode := strings.ToUpper(opts.Synchronous)
	switch syncMode {
	case "":
		syncMode = "FULL"
	case "FULL", "NORMAL", "EXTRA", "OFF":
	default:
		return nil, fmt.Errorf("%w: sqlite: synchronous %q is not one of FULL, NORMAL, EXTRA, OFF", idem.ErrInvalidConfig, opts.Synchronous)
	}
	busy := opts.BusyTimeout
	if busy <= 0 {
		busy = 10 * time.Second
	}
	q := url.Values{}
	q.Add("_txlock", "immediate")
	q.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", busy.Milliseconds()))
	q.Add("_pragma", "foreign_keys(1)")
	if path != ":memory:" {
		q.Add("_pragma", "journal_mode(WAL)")
	}
	q.Add("_pragma", "synchronous("+syncMode+")")
	// The DSN is a URI: escape what would end or change its path part,
	// so that "a?b.db" is that file and not "a" with a parameter.
	uriPath := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(path)
	db, err := sql.Open("sqlite", "file:"+uriPath+"?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("sqlite: open %s: %w", path, err)
	}
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	if err := db.Ping(); err != nil {
		db.Close()
		return nil, fmt.Errorf("sqlite: open %s: %w", path, err)
	}
	return db, nil
}

// New returns a driver over db. It prepares no statements and does not touch
// the schema until Migrate.
//
// The driver needs a journal on disk (see the package documentation):
// Migrate, and the driver's first transaction or lease claim (a service may
// run on a file another process migrated), read the connection's
// journal_mode and refuse OFF, and MEMORY on a database file, with an error
// wrapping idem.ErrInvalidConfig that names the setting; so does every
// later call until a check passes. A passed check is kept for the driver's
// life and costs an atomic load after; a check that could not run (a
// connection error, a cancelled context) is made again. journal_mode is a
// setting of each connection, which a DSN's pragmas set alike on every
// connection of the pool, so one connection is checked: a mode changed
// afterwards on some connection is not seen.
func New(db *sql.DB, cfg *Config) (*Driver, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: sqlite: nil *sql.DB", idem.ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	prefix := cfg.TablePrefix
	if prefix == "" {
		prefix = "idem_"
	}
	if err := sqlident.Check("sqlite: TablePrefix", prefix, false); err != nil {
		return nil, fmt.Errorf("%w: %w", idem.ErrInvalidConfig, err)
	}
	return &Driver{db: db, prefix: prefix, tables: tables{
		processed:     sqlident.Quote(prefix + "processed"),
		migrations:    sqlident.Quote(prefix + "migrations"),
		sequences:     sqlident.Quote(prefix + "sequences"),
		gaps:          sqlident.Quote(prefix + "gaps"),
		versions:      sqlident.Quote(prefix + "versions"),
		deadLetters:   sqlident.Quote(prefix + "dead_letters"),
		deadLetterLog: sqlident.Quote(prefix + "dead_letter_log"),
		handlerStats:  sqlident.Quote(prefix + "handler_stats"),
		outbox:        sqlident.Quote(prefix + "outbox"),
		outboxClaims:  sqlident.Quote(prefix + "outbox_claims"),
		outboxLog:     sqlident.Quote(prefix + "outbox_log"),
	}}, nil
}

// DB returns the database the driver uses.
func (d *Driver) DB() *sql.DB { return d.db }

// Migrate applies the embedded migrations not yet recorded, each in its own
// transaction, and prepares the driver's statements. It first checks the
// journal mode, as the driver's first transaction does (see New), and
// refuses journal_mode=OFF, and MEMORY on a database file, with an error
// wrapping idem.ErrInvalidConfig.
func (d *Driver) Migrate(ctx context.Context) error {
	if err := d.ready(ctx, d.db); err != nil {
		return err
	}
	ms, err := migrations.Load(migrationFS, "migrations", strings.NewReplacer(
		"{{processed}}", d.tables.processed,
		"{{sequences}}", d.tables.sequences,
		"{{gaps}}", d.tables.gaps,
		"{{versions}}", d.tables.versions,
		"{{dead_letters}}", d.tables.deadLetters,
		"{{dead_letters_new}}", sqlident.Quote(d.prefix+"dead_letters_new"),
		"{{dead_letters_name}}", d.prefix+"dead_letters",
		"{{dead_letters_new_name}}", d.prefix+"dead_letters_new",
		"{{dead_letters_key}}", sqlident.Quote(d.prefix+"dead_letters_key"),
		"{{dead_letters_state}}", sqlident.Quote(d.prefix+"dead_letters_state"),
		"{{dead_letters_source}}", sqlident.Quote(d.prefix+"dead_letters_source"),
		"{{dead_letter_log}}", d.tables.deadLetterLog,
		"{{handler_stats}}", d.tables.handlerStats,
		"{{dead_letter_log_dl}}", sqlident.Quote(d.prefix+"dead_letter_log_dl"),
		"{{outbox}}", d.tables.outbox,
		"{{outbox_pending}}", sqlident.Quote(d.prefix+"outbox_pending"),
		"{{outbox_pending_id}}", sqlident.Quote(d.prefix+"outbox_pending_id"),
		"{{outbox_claims}}", d.tables.outboxClaims,
		"{{outbox_parked}}", sqlident.Quote(d.prefix+"outbox_parked"),
		"{{outbox_log}}", d.tables.outboxLog,
	))
	if err != nil {
		return fmt.Errorf("sqlite: load migrations: %w", err)
	}
	if _, err := d.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+d.tables.migrations+
		` (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)`); err != nil {
		return fmt.Errorf("sqlite: create migrations table: %w", err)
	}
	for _, m := range ms {
		if err := d.apply(ctx, m); err != nil {
			return fmt.Errorf("sqlite: migration %s: %w", m.Name, err)
		}
	}
	return d.prepare(ctx)
}

func (d *Driver) apply(ctx context.Context, m migrations.Migration) error {
	conn, err := d.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	step := d.step(m.Version)
	if step != nil {
		// A step may turn writable_schema on, a setting of the
		// connection, not of the transaction: it is turned off on the
		// connection once the transaction is over, whatever became of it
		// (database/sql rolls back by itself when ctx ends), or the
		// connection is discarded.
		defer func() {
			if _, err := conn.ExecContext(context.WithoutCancel(ctx), `PRAGMA writable_schema = RESET`); err != nil {
				_ = conn.Raw(func(any) error { return sqldriver.ErrBadConn })
			}
		}()
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM `+d.tables.migrations+` WHERE version = ?`, m.Version).Scan(&n); err != nil {
		return err
	}
	if n > 0 {
		return nil
	}
	if step != nil {
		err = step(ctx, tx)
	} else {
		_, err = tx.ExecContext(ctx, m.SQL)
	}
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.tables.migrations+` (version, name, applied_at) VALUES (?, ?, ?)`,
		m.Version, m.Name, time.Now().UnixMicro()); err != nil {
		return err
	}
	return tx.Commit()
}

func (d *Driver) prepare(ctx context.Context) error {
	if d.insertMarker != nil {
		return nil
	}
	cols := ` (handler, message_id, payload_hash, processed_at) VALUES `
	queries := []string{
		`INSERT INTO ` + d.tables.processed + cols + `(?, ?, ?, ?) ON CONFLICT DO NOTHING`,
		`SELECT payload_hash FROM ` + d.tables.processed + ` WHERE handler = ? AND message_id = ?`,
		`INSERT INTO ` + d.tables.sequences + ` AS s (handler, aggregate_id, last_seq)
SELECT ?1, ?2, ?3 WHERE ?3 = 1 OR ?4
ON CONFLICT (handler, aggregate_id) DO UPDATE SET last_seq = excluded.last_seq
WHERE s.last_seq = excluded.last_seq - 1 OR (?4 AND s.last_seq < excluded.last_seq)
RETURNING last_seq`,
		`SELECT last_seq FROM ` + d.tables.sequences + ` WHERE handler = ? AND aggregate_id = ?`,
		`INSERT INTO ` + d.tables.sequences + ` (handler, aggregate_id, last_seq) VALUES (?, ?, ?)
ON CONFLICT (handler, aggregate_id) DO UPDATE SET last_seq = excluded.last_seq`,
	}
	const firstChunk = 5 // queries[firstChunk] inserts 2 rows
	for n := 2; n <= markerChunk; n++ {
		values := strings.Repeat("(?, ?, ?, ?), ", n)
		queries = append(queries, `INSERT INTO `+d.tables.processed+cols+values[:len(values)-2])
	}
	stmts := make([]*sql.Stmt, 0, len(queries))
	for _, q := range queries {
		st, err := d.db.PrepareContext(ctx, q)
		if err != nil {
			for _, s := range stmts {
				_ = s.Close()
			}
			return fmt.Errorf("sqlite: prepare: %w", err)
		}
		stmts = append(stmts, st)
	}
	// Index the chunk statements by their row count.
	d.insertMarkers = append([]*sql.Stmt{nil, nil}, stmts[firstChunk:]...)
	d.selectHash, d.advanceSeq, d.selectSeq, d.setSeq = stmts[1], stmts[2], stmts[3], stmts[4]
	d.insertMarker = stmts[0] // set last: it marks the set as ready
	return nil
}

var errNotMigrated = errors.New("sqlite: driver not migrated: call Migrate first")

// Begin opens an IMMEDIATE transaction (when the database was opened with
// Open), so the write lock is taken up front and never upgraded. Until a
// check passed, it checks the journal mode of the transaction's connection
// first (see New). On a pool whose connections have no busy timeout
// (a DSN without _pragma=busy_timeout), it gives the transaction's
// connection one of 10 s first (see setBusyTimeout).
func (d *Driver) Begin(ctx context.Context) (*sql.Tx, error) {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	if err := d.ready(ctx, tx); err != nil {
		_ = tx.Rollback()
		return nil, err
	}
	if d.waitForLocks.Load() {
		if _, err := tx.ExecContext(ctx, setBusyTimeout); err != nil {
			_ = tx.Rollback()
			return nil, fmt.Errorf("sqlite: set busy_timeout: %w", err)
		}
	}
	return tx, nil
}

// Commit commits tx.
func (d *Driver) Commit(_ context.Context, tx *sql.Tx) error { return tx.Commit() }

// Rollback rolls tx back; a finished transaction is not an error, nor is
// one SQLite already rolled back itself (after SQLITE_FULL, or a trigger's
// RAISE(ROLLBACK)).
func (d *Driver) Rollback(_ context.Context, tx *sql.Tx) error {
	err := tx.Rollback()
	if err == nil || errors.Is(err, sql.ErrTxDone) || strings.Contains(err.Error(), "no transaction is active") {
		return nil
	}
	return err
}

// MarkerInsert implements driver.Driver.
func (d *Driver) MarkerInsert(ctx context.Context, tx *sql.Tx, p *driver.MarkerInsertParams) (driver.MarkerInsertResult, error) {
	if d.insertMarker == nil {
		return driver.MarkerInsertResult{}, errNotMigrated
	}
	// As in MarkerInsertMany: a statement of microseconds needs no
	// interrupt armed on the caller's context. On a pool from Open the
	// transaction began IMMEDIATE and holds the write lock; on another,
	// a first write waits for the lock no longer than the busy timeout.
	if err := ctx.Err(); err != nil {
		return driver.MarkerInsertResult{}, err
	}
	ctx = context.WithoutCancel(ctx)
	st := d.markerStmts(ctx, tx)
	return st.insertOne(ctx, p.Handler, p.MessageID, p.PayloadHash, time.Now().UnixMicro())
}

// markerStmts are a transaction's statements for markers one by one; the
// read of an existing marker's hash is prepared on first use.
type markerStmts struct {
	d        *Driver
	tx       *sql.Tx
	ins, sel *sql.Stmt
}

func (d *Driver) markerStmts(ctx context.Context, tx *sql.Tx) *markerStmts {
	return &markerStmts{d: d, tx: tx, ins: tx.StmtContext(ctx, d.insertMarker)}
}

// insertOne inserts one marker, reading the existing marker's hash when
// there is one.
func (m *markerStmts) insertOne(ctx context.Context, handler, id string, hash []byte, now int64) (driver.MarkerInsertResult, error) {
	r, err := m.ins.ExecContext(ctx, handler, id, hash, now)
	if err != nil {
		return driver.MarkerInsertResult{}, err
	}
	n, err := r.RowsAffected()
	if err != nil {
		return driver.MarkerInsertResult{}, err
	}
	if n == 1 {
		return driver.MarkerInsertResult{Inserted: true}, nil
	}
	var existing []byte
	if m.sel == nil {
		m.sel = m.tx.StmtContext(ctx, m.d.selectHash)
	}
	if err := m.sel.QueryRowContext(ctx, handler, id).Scan(&existing); err != nil {
		return driver.MarkerInsertResult{}, fmt.Errorf("sqlite: read existing marker: %w", err)
	}
	return driver.MarkerInsertResult{ExistingHash: existing}, nil
}

// markerChunk is how many markers one multi-row INSERT of MarkerInsertMany
// carries at most. Measured on modernc.org/sqlite, chunks of 32 rows insert
// ~1.6× faster than single-row statements: the per-statement cost
// (database/sql, binding, VDBE start and halt) is paid once per chunk.
const markerChunk = 32

// MarkerInsertMany implements driver.Driver. It bets that the batch is new:
// the IDs go in chunks of up to markerChunk, each one plain multi-row
// INSERT (no ON CONFLICT) prepared for its row count. A chunk that holds an
// existing marker fails with a key violation, which in SQLite undoes that
// statement only, not the transaction; the chunk then runs again row by row
// with ON CONFLICT DO NOTHING, which tells new markers from existing ones.
// Undoing the statement needs a journal: at journal_mode=OFF the
// rows before the existing marker would stay and be taken for duplicates,
// so the driver refuses that mode: Migrate, which prepares the statements
// used here, checks it first (see New).
func (d *Driver) MarkerInsertMany(ctx context.Context, tx *sql.Tx, p *driver.MarkerInsertManyParams) ([]driver.MarkerInsertResult, error) {
	if d.insertMarker == nil {
		return nil, errNotMigrated
	}
	st := d.markerStmts(ctx, tx)
	now := time.Now().UnixMicro()
	out := make([]driver.MarkerInsertResult, len(p.MessageIDs))
	// A cancellable context makes the SQLite driver arm an interrupt for
	// every statement, a fifth of a batch's cost. Each statement is
	// microseconds long: check the caller's context between them instead.
	rowCtx := context.WithoutCancel(ctx)
	args := make([]any, 0, 4*min(markerChunk, len(p.MessageIDs)))
	for lo := 0; lo < len(p.MessageIDs); lo += markerChunk {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		hi := min(lo+markerChunk, len(p.MessageIDs))
		if n := hi - lo; n > 1 {
			args = args[:0]
			for i := lo; i < hi; i++ {
				args = append(args, p.Handler, p.MessageIDs[i], p.PayloadHashes[i], now)
			}
			_, err := tx.StmtContext(ctx, d.insertMarkers[n]).ExecContext(rowCtx, args...)
			if err == nil {
				for i := lo; i < hi; i++ {
					out[i].Inserted = true
				}
				continue
			}
			// Only a key violation is sure to leave the transaction open:
			// SQLite rolls back the whole transaction on errors such as
			// SQLITE_FULL or a trigger's RAISE(ROLLBACK), and going on
			// would write outside it.
			if !isKeyViolation(err) {
				return nil, err
			}
		}
		for i := lo; i < hi; i++ {
			r, err := st.insertOne(rowCtx, p.Handler, p.MessageIDs[i], p.PayloadHashes[i], now)
			if err != nil {
				return nil, err
			}
			out[i] = r
		}
	}
	return out, nil
}

// MarkerDelete implements driver.MarkerDeleter. It runs only when an
// ordered batch refuses a message, so the statement is prepared per call.
func (d *Driver) MarkerDelete(ctx context.Context, tx *sql.Tx, p *driver.MarkerDeleteParams) error {
	if len(p.MessageIDs) == 0 {
		return nil
	}
	st, err := tx.PrepareContext(ctx, `DELETE FROM `+d.tables.processed+` WHERE handler = ? AND message_id = ?`)
	if err != nil {
		return err
	}
	defer st.Close()
	for _, id := range p.MessageIDs {
		if _, err := st.ExecContext(ctx, p.Handler, id); err != nil {
			return err
		}
	}
	return nil
}

// isKeyViolation reports whether err is SQLITE_CONSTRAINT_PRIMARYKEY or
// SQLITE_CONSTRAINT_UNIQUE, which undo the failing statement only.
func isKeyViolation(err error) bool {
	const (
		constraintPrimaryKey = 1555
		constraintUnique     = 2067
	)
	var coded interface{ Code() int }
	if !errors.As(err, &coded) {
		return false
	}
	c := coded.Code()
	return c == constraintPrimaryKey || c == constraintUnique
}
