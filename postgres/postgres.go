// Package postgres is idem's production store driver, on pgx v5.
//
//	pool, err := pgxpool.New(ctx, "postgres://…")
//	drv, err := postgres.New(pool, &postgres.Config{Schema: "app"})
//	err = drv.Migrate(ctx)
//	proc, err := idem.NewProcessor(drv, nil)
//
// Handlers receive a postgres.Tx: the transaction that holds the marker.
// pgx.Tx satisfies it, so ProcessTx accepts a transaction the caller began
// with pool.Begin.
//
// For Process the driver sends BEGIN and the marker INSERT in one round trip
// (a pgx batch), which is why the transaction type is the Tx interface rather
// than pgx.Tx itself.
//
// Isolation: the transactions the driver opens (Process, ProcessBatch,
// Begin, dead letters, migrations) run at READ COMMITTED, whatever the
// server's default_transaction_isolation. A concurrent delivery of the
// same ID blocks on the primary key until the first transaction ends, then
// sees its committed marker and reports Duplicate; under REPEATABLE READ
// or SERIALIZABLE it would fail with a serialization error instead. In a
// transaction of your own (ProcessTx) the level is yours, with that
// consequence.
//
// Any pgx exec mode works, the default and the two that send parameters
// as text without describing the statement first (QueryExecModeExec, and
// QueryExecModeSimpleProtocol, which pools behind PgBouncer in
// transaction mode use); the conformance suite runs in both.
//
// Atomic markers live in <prefix>markers, keyed by an interned handler id
// and the message ID packed losslessly (docs/performance.md). A handler
// name's first use ever adds it to <prefix>handlers on a pooled
// connection of its own, committed at once; after that the driver reads
// the id through the transaction at hand and caches it.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/atomic-mode.md#drivers
package postgres

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/migrations"
	"github.com/idemhq/idem/internal/sqlident"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Tx is the transaction a handler receives. pgx.Tx satisfies it, and so
// does the subset of it that sqlc-generated code needs (DBTX).
type Tx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error)
	// Conn returns the underlying connection.
	Conn() *pgx.Conn
}

// Config configures the driver. The zero value is valid.
type Config struct {
	// Schema holds idem's tables. It must match [a-z_][a-z0-9_]* (at most
	// 40 bytes); Migrate creates it if missing. Default: none, so tables
	// resolve through the connection's search_path.
	Schema string
	// TablePrefix is prepended to every table name, with the same rules.
	// Default "idem_".
	TablePrefix string
	// ConflictAwareInserts makes every marker insert in a transaction idem
	// opens an INSERT … ON CONFLICT DO NOTHING. By default such a
	// transaction bets that its messages are new and sends a plain INSERT,
	// which spares the server ON CONFLICT's speculative insertion: 1–4% of
	// a whole per-message transaction and about 20% of a batch of 100 with
	// 4 workers on a 2-core machine (BenchmarkInsertBet). A redelivery
	// loses the bet with a unique violation, which the server logs at
	// ERROR level; a single message then takes as many round trips as with
	// ON CONFLICT, a batch two more. After a lost bet the driver stops
	// betting for a second, so a burst of redeliveries costs a few log
	// lines, not one per message. Set ConflictAwareInserts where even
	// those are unwelcome. Transactions the caller owns (ProcessTx) always
	// use ON CONFLICT: a failed statement would abort them.
	ConflictAwareInserts bool
	// Logger receives what the driver notices but need not fail for: the
	// outbox listener losing its connection and reconnecting (at Debug).
	// Default: slog.Default().
	Logger *slog.Logger
}

// lostBetPause is how long a Driver inserts markers conflict-aware after
// a plain INSERT met an existing marker (see Config.ConflictAwareInserts).
// Redeliveries come in bursts: a consumer restarting, a rebalance, a
// producer retrying. Betting through a burst would log a unique violation
// per message and redo each transaction or batch; pausing bounds that to
// about one per second and per transaction in flight when the burst
// begins, while a stream of new messages keeps the bet's saving.
const lostBetPause = time.Second

// Driver implements driver.Driver[postgres.Tx].
type Driver struct {
	pool          *pgxpool.Pool
	schema        string
	prefix        string
	conflictAware bool // Config.ConflictAwareInserts
	logger        *slog.Logger
	t             tables
	markerSQL     markerSQL // the atomic path's statements
	legacySQL     markerSQL // the same, reading the old table's markers too
	deleteMarkers string
	// handlerIDs caches handler name → id (see handlerID).
	handlerIDs sync.Map
	// legacy is legacyUnknown, legacyPresent or legacyGone (see
	// legacyAtomic); legacyAt is when it was last read, in Unix
	// nanoseconds.
	legacy   atomic.Int32
	legacyAt atomic.Int64
	// noBetUntil is when betting resumes after the last lost bet, in Unix
	// nanoseconds; lostBets counts lost bets (for tests).
	noBetUntil atomic.Int64
	lostBets   atomic.Int64
	// auto runs the driver's writes outside transactions; session holds
	// the pool's session settings once read (sessionDefaults).
	auto    autocommit
	session atomic.Pointer[sessionSettings]
}

// betting reports whether a transaction the driver opens should insert
// its markers with a plain INSERT (see Config.ConflictAwareInserts).
func (d *Driver) betting() bool {
	return !d.conflictAware && time.Now().UnixNano() >= d.noBetUntil.Load()
}

// lostBet records that a plain INSERT met an existing marker: no bets for
// lostBetPause.
func (d *Driver) lostBet() {
	d.lostBets.Add(1)
	d.noBetUntil.Store(time.Now().Add(lostBetPause).UnixNano())
}

type tables struct {
	processed, migrations      string
	markers, handlers          string
	markerLayout               string
	sequences, gaps, versions  string
	deadLetters, deadLetterLog string
	handlerStats               string
	outbox, outboxClaims       string
	outboxLog                  string
}

var (
	_ driver.Driver[Tx]                  = (*Driver)(nil)
	_ driver.BeginMarkerInserter[Tx]     = (*Driver)(nil)
	_ driver.BeginMarkerManyInserter[Tx] = (*Driver)(nil)
	_ driver.MarkerDeleter[Tx]           = (*Driver)(nil)
	_ driver.LeaseRearmer                = (*Driver)(nil)
	_ driver.BeginSequenceAdvancer[Tx]   = (*Driver)(nil)
)

// New returns a driver over pool. It does not touch the database until
// Migrate or the first transaction.
func New(pool *pgxpool.Pool, cfg *Config) (*Driver, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: postgres: nil pool", idem.ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	prefix := cfg.TablePrefix
	if prefix == "" {
		prefix = "idem_"
	}
	if err := sqlident.Check("postgres: Schema", cfg.Schema, true); err != nil {
		return nil, fmt.Errorf("%w: %w", idem.ErrInvalidConfig, err)
	}
	if err := sqlident.Check("postgres: TablePrefix", prefix, false); err != nil {
		return nil, fmt.Errorf("%w: %w", idem.ErrInvalidConfig, err)
	}
	d := &Driver{pool: pool, schema: cfg.Schema, prefix: prefix, conflictAware: cfg.ConflictAwareInserts, logger: cfg.Logger}
	d.auto = autocommit{d: d}
	if d.logger == nil {
		d.logger = slog.Default()
	}
	d.t = tables{
		processed:     sqlident.Qualified(cfg.Schema, prefix+"processed"),
		markers:       sqlident.Qualified(cfg.Schema, prefix+"markers"),
		handlers:      sqlident.Qualified(cfg.Schema, prefix+"handlers"),
		markerLayout:  sqlident.Qualified(cfg.Schema, prefix+"marker_layout"),
		migrations:    sqlident.Qualified(cfg.Schema, prefix+"migrations"),
		sequences:     sqlident.Qualified(cfg.Schema, prefix+"sequences"),
		gaps:          sqlident.Qualified(cfg.Schema, prefix+"gaps"),
		versions:      sqlident.Qualified(cfg.Schema, prefix+"versions"),
		deadLetters:   sqlident.Qualified(cfg.Schema, prefix+"dead_letters"),
		deadLetterLog: sqlident.Qualified(cfg.Schema, prefix+"dead_letter_log"),
		handlerStats:  sqlident.Qualified(cfg.Schema, prefix+"handler_stats"),
		outbox:        sqlident.Qualified(cfg.Schema, prefix+"outbox"),
		outboxClaims:  sqlident.Qualified(cfg.Schema, prefix+"outbox_claims"),
		outboxLog:     sqlident.Qualified(cfg.Schema, prefix+"outbox_log"),
	}
	d.markerSQL, d.legacySQL = newMarkerSQL(d.t)
	d.deleteMarkers = `DELETE FROM ` + d.t.markers + ` WHERE handler_id = $1 AND message_key = ANY($2::bytea[])`
	return d, nil
}

// Pool returns the pool the driver uses.
func (d *Driver) Pool() *pgxpool.Pool { return d.pool }

// migrateLockKey names the advisory lock Migrate (and SetOutboxNotify)
// hold: one per schema and prefix.
func (d *Driver) migrateLockKey() string { return "idem-migrate:" + d.schema + "." + d.prefix }

// Migrate creates the schema if configured and applies the embedded
// migrations not yet recorded, all in one transaction under an advisory
// lock, so concurrent calls from several instances are safe.
//
// The sessions' statement_timeout does not apply to it (a migration of
// millions of markers takes what it takes; ctx bounds it), nor their
// lock_timeout to the wait for another instance's Migrate. Their
// lock_timeout does apply to the migrations' own locks on idem's tables,
// which a busy service holds: set one to fail a migration rather than
// queue every delivery behind its lock.
func (d *Driver) Migrate(ctx context.Context) error {
	ms, err := migrations.Load(migrationFS, "migrations", strings.NewReplacer(
		"{{processed}}", d.t.processed,
		"{{markers}}", d.t.markers,
		"{{handlers}}", d.t.handlers,
		"{{marker_layout}}", d.t.markerLayout,
		"{{mirror_fn}}", sqlident.Qualified(d.schema, d.prefix+"processed_mirror"),
		"{{mirror_trigger}}", sqlident.Quote(d.prefix+"processed_mirror"),
		"{{processed_at_idx}}", sqlident.Quote(d.prefix+"processed_at_brin"),
		"{{sequences}}", d.t.sequences,
		"{{gaps}}", d.t.gaps,
		"{{versions}}", d.t.versions,
		"{{dead_letters}}", d.t.deadLetters,
		"{{dead_letters_key}}", sqlident.Quote(d.prefix+"dead_letters_key"),
		"{{dead_letters_key_qualified}}", sqlident.Qualified(d.schema, d.prefix+"dead_letters_key"),
		"{{dead_letters_payload_key}}", sqlident.Quote(d.prefix+"dead_letters_payload_key"),
		"{{dead_letters_state_check}}", sqlident.Quote(d.prefix+"dead_letters_state_check"),
		"{{dead_letters_state}}", sqlident.Quote(d.prefix+"dead_letters_state"),
		"{{dead_letters_source}}", sqlident.Quote(d.prefix+"dead_letters_source"),
		"{{dead_letter_log}}", d.t.deadLetterLog,
		"{{handler_stats}}", d.t.handlerStats,
		"{{dead_letter_log_dl}}", sqlident.Quote(d.prefix+"dead_letter_log_dl"),
		"{{outbox}}", d.t.outbox,
		"{{outbox_pending}}", sqlident.Quote(d.prefix+"outbox_pending"),
		"{{outbox_pending_id}}", sqlident.Quote(d.prefix+"outbox_pending_id"),
		"{{outbox_claims}}", d.t.outboxClaims,
		"{{outbox_notify_fn}}", sqlident.Qualified(d.schema, d.prefix+"outbox_notify"),
		"{{outbox_notify}}", sqlident.Quote(d.prefix+"outbox_notify"),
		"{{outbox_channel}}", d.outboxChannel(),
		"{{outbox_parked}}", sqlident.Quote(d.prefix+"outbox_parked"),
		"{{outbox_log}}", d.t.outboxLog,
	))
	if err != nil {
		return fmt.Errorf("postgres: load migrations: %w", err)
	}
	// READ COMMITTED whatever the server's default: each statement after
	// the lock must see what a concurrent call committed while this one
	// waited for it.
	return pgx.BeginTxFunc(ctx, d.pool, readCommitted(), func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, liftTimeoutsSQL); err != nil {
			return fmt.Errorf("postgres: migration: %w", err)
		}
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, d.migrateLockKey()); err != nil {
			return fmt.Errorf("postgres: migration lock: %w", err)
		}
		if _, err := tx.Exec(ctx, restoreLockTimeoutSQL); err != nil {
			return fmt.Errorf("postgres: migration: %w", err)
		}
		if d.schema != "" {
			// CREATE SCHEMA IF NOT EXISTS needs the right to create in
			// the database even when the schema exists: an application
			// role given a schema by its DBA has not.
			var exists bool
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, d.schema).Scan(&exists); err != nil {
				return fmt.Errorf("postgres: look up schema: %w", err)
			}
			if !exists {
				if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+sqlident.Quote(d.schema)); err != nil {
					return fmt.Errorf("postgres: create schema: %w", err)
				}
			}
		}
		// CREATE TABLE IF NOT EXISTS needs CREATE on the schema even when
		// the table is there, which a role that only runs the service
		// has not: a schema migrated already needs no DDL.
		var have bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, d.t.migrations).Scan(&have); err != nil {
			return fmt.Errorf("postgres: look up migrations table: %w", err)
		}
		if !have {
			if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+d.t.migrations+
				` (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
				return fmt.Errorf("postgres: create migrations table: %w", err)
			}
		}
		for _, m := range ms {
			var done bool
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+d.t.migrations+` WHERE version = $1)`, m.Version).Scan(&done); err != nil {
				return fmt.Errorf("postgres: migration %s: %w", m.Name, err)
			}
			if done {
				continue
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("postgres: migration %s: %w", m.Name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+d.t.migrations+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
				return fmt.Errorf("postgres: migration %s: %w", m.Name, err)
			}
		}
		return nil
	})
}

// notMigrated wraps ErrNotMigrated around err when err is Postgres's
// "relation does not exist": idem's tables are missing.
func notMigrated(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		return fmt.Errorf("%w: %w", ErrNotMigrated, err)
	}
	return err
}

// beginSQL opens the transactions the driver begins itself (Process,
// ProcessBatch, lease and ordering writes) at READ COMMITTED, whatever the
// server's default_transaction_isolation: a delivery that waits on a
// concurrent one's marker must then see it, and report Duplicate, where
// REPEATABLE READ or SERIALIZABLE would fail with a serialization error.
// A handler that needs another level runs in the caller's own
// transaction, with ProcessTx.
const beginSQL = "begin isolation level read committed"

// readCommitted is beginSQL for pgx.BeginTxFunc.
func readCommitted() pgx.TxOptions { return pgx.TxOptions{IsoLevel: pgx.ReadCommitted} }

// connTx is a transaction on a pooled connection that the driver began
// itself. It lets BEGIN travel in the same round trip as the first INSERT,
// which pgx.Tx cannot represent.
type connTx struct {
	c *pgxpool.Conn
	// deferred: BEGIN has not been sent yet, and goes with the first
	// statement (see BeginDeferred). beginErr is a deferred BEGIN's
	// failure where no statement could report it (Conn).
	deferred bool
	beginErr error
}

func (t *connTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if !t.deferred {
		return t.c.Exec(ctx, sql, args...)
	}
	br, err := t.one(ctx, sql, args)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, err
}

func (t *connTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if !t.deferred {
		return t.c.Query(ctx, sql, args...)
	}
	br, err := t.one(ctx, sql, args)
	if err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		return nil, err
	}
	return &batchRows{Rows: rows, br: br}, nil
}

func (t *connTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !t.deferred {
		return t.c.QueryRow(ctx, sql, args...)
	}
	br, err := t.one(ctx, sql, args)
	if err != nil {
		return errRow{err}
	}
	return &batchRow{row: br.QueryRow(), br: br}
}

func (t *connTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	b, begun := t.withBegin(b)
	br := t.c.SendBatch(ctx, b)
	if begun {
		return &skipBegin{BatchResults: br}
	}
	return br
}

func (t *connTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.begin(ctx); err != nil {
		return 0, err
	}
	return t.c.CopyFrom(ctx, table, columns, src)
}

// Conn returns the connection, with the transaction begun on it.
func (t *connTx) Conn() *pgx.Conn {
	if err := t.begin(context.Background()); err != nil && t.beginErr == nil {
		t.beginErr = err
	}
	return t.c.Conn()
}

// end finishes the transaction with sql ("commit" or "rollback") and returns
// the connection to the pool. A connection left inside a transaction (after
// an error) is destroyed by the pool rather than reused.
func (t *connTx) end(ctx context.Context, sql string) (pgconn.CommandTag, error) {
	if t.c == nil {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	if t.deferred {
		// Nothing ran: there is nothing to end.
		t.c.Release()
		t.c = nil
		return pgconn.NewCommandTag(strings.ToUpper(sql)), nil
	}
	if t.beginErr != nil {
		sql = "rollback"
	}
	tag, err := t.c.Exec(ctx, sql)
	t.c.Release()
	t.c = nil
	return tag, err
}

// ErrCommitRolledBack is returned by Commit when the server rolled the
// transaction back instead (a statement in it had failed).
var ErrCommitRolledBack = errors.New("postgres: commit was rolled back by the server")

// Begin opens a transaction on a pooled connection.
func (d *Driver) Begin(ctx context.Context) (Tx, error) {
	c, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := c.Exec(ctx, beginSQL); err != nil {
		c.Release()
		return nil, err
	}
	return &connTx{c: c}, nil
}

// BeginMarkerInsert opens a transaction and inserts the marker in one round
// trip. Like BeginMarkerInsertMany it bets that the message is new: a plain
// INSERT, without the speculative insertion ON CONFLICT costs (1–4% of a
// whole per-message transaction with 4 workers on the CI machine). A
// redelivery loses the bet with a unique violation, which the server logs,
// and then sends rollback, begin, the conflict-aware insert and the read of
// the existing hash together: two round trips, as many as ON CONFLICT and
// the read take. For a second after a lost bet, and always under
// Config.ConflictAwareInserts, the INSERT is conflict-aware from the start.
// On a schema without idem's tables the error wraps ErrNotMigrated.
func (d *Driver) BeginMarkerInsert(ctx context.Context, p *driver.MarkerInsertParams) (Tx, driver.MarkerInsertResult, error) {
	tx, res, err := d.beginMarkerInsert(ctx, p)
	return tx, res, notMigrated(err)
}

// beginMarkerInsert is BeginMarkerInsert.
func (d *Driver) beginMarkerInsert(ctx context.Context, p *driver.MarkerInsertParams) (Tx, driver.MarkerInsertResult, error) {
	m, err := d.newMarker(ctx, d.pool, p)
	if err != nil {
		return nil, driver.MarkerInsertResult{}, err
	}
	lift := d.liftTimeouts(ctx)
	c, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, driver.MarkerInsertResult{}, err
	}
	tx := &connTx{c: c}
	insert := m.sql.insert
	betting := d.betting() && !m.sql.legacy
	if betting {
		insert = m.sql.insertNew
	}
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	lift.off(b)
	b.Queue(insert, m.insertArgs()...)
	lift.on(b)
	br := c.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil {
		err = lift.read(br)
	}
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
	}
	if err == nil {
		err = lift.read(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	var res driver.MarkerInsertResult
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		// A plain INSERT that succeeded affected its row: no query.
		res, err = d.afterInsert(ctx, tx, tag, m)
	case betting && errors.As(err, &pgErr) && pgErr.Code == "23505":
		d.lostBet()
		res, err = d.reinsertMarker(ctx, c, m, lift)
	}
	if err != nil {
		_, _ = tx.end(context.WithoutCancel(ctx), "rollback")
		return nil, driver.MarkerInsertResult{}, err
	}
	return tx, res, nil
}

// reinsertMarker is BeginMarkerInsert's way back after its bet lost: in one
// round trip it rolls back, begins again, inserts the marker with ON
// CONFLICT DO NOTHING and reads the hash the marker holds (in a statement
// of its own, whose snapshot sees the marker that conflicted). It speaks
// pgconn's pipeline of unnamed statements: pgx's batch would first prepare
// statements it has not cached, inside the aborted transaction.
// It serves the markers-only layout, the one a bet is made on.
func (d *Driver) reinsertMarker(ctx context.Context, c *pgxpool.Conn, m *marker, lift *timeoutLift) (driver.MarkerInsertResult, error) {
	const int4OID, byteaOID = 23, 17
	hid := []byte(strconv.Itoa(int(m.hid)))
	b := &pgconn.Batch{}
	b.ExecParams("rollback", nil, nil, nil, nil)
	b.ExecParams(beginSQL, nil, nil, nil, nil)
	if lift != nil {
		b.ExecParams(liftTimeoutsSQL, nil, nil, nil, nil)
	}
	b.ExecParams(m.sql.insert, [][]byte{hid, m.key, m.hash}, []uint32{int4OID, byteaOID, byteaOID}, []int16{0, 1, 1}, nil)
	b.ExecParams(m.sql.selectHash, [][]byte{hid, m.key}, []uint32{int4OID, byteaOID}, []int16{0, 1}, []int16{1})
	if lift != nil {
		b.ExecParams(restoreTimeoutsSQL, nil, nil, nil, nil)
	}
	results, err := c.Conn().PgConn().ExecBatch(ctx, b).ReadAll()
	if err == nil {
		for _, r := range results {
			if r.Err != nil {
				err = r.Err
				break
			}
		}
	}
	ins := 2 + lift.queued() // the insert's result; the read's follows
	switch {
	case err != nil:
		return driver.MarkerInsertResult{}, err
	case len(results) != ins+2+lift.queued():
		return driver.MarkerInsertResult{}, fmt.Errorf("postgres: reinsert marker: %d results for %d statements", len(results), ins+2+lift.queued())
	case results[ins].CommandTag.RowsAffected() == 1:
		// The marker went away in between (retention): inserted now.
		return driver.MarkerInsertResult{Inserted: true}, nil
	case len(results[ins+1].Rows) == 0:
		return driver.MarkerInsertResult{}, fmt.Errorf("postgres: the marker of %q conflicted, then vanished before it could be read; retry", m.id)
	}
	return driver.MarkerInsertResult{ExistingHash: results[ins+1].Rows[0][0]}, nil
}

// BeginMarkerInsertMany opens a transaction and inserts a batch's markers.
// It bets that the batch is new: BEGIN and a plain multi-row INSERT (no ON
// CONFLICT, no RETURNING) go in one round trip, which costs the server
// markedly less than the speculative insertion ON CONFLICT needs for every
// row. If any marker exists already (unique violation), the transaction is
// rolled back and the batch runs again through MarkerInsertMany, so a batch
// holding a redelivery pays one extra round trip and nothing else changes:
// the plain INSERT waits on uncommitted markers of other transactions just
// as ON CONFLICT does. On a schema without idem's tables the error wraps
// ErrNotMigrated.
func (d *Driver) BeginMarkerInsertMany(ctx context.Context, p *driver.MarkerInsertManyParams) (Tx, []driver.MarkerInsertResult, error) {
	tx, res, err := d.beginMarkerInsertMany(ctx, p)
	return tx, res, notMigrated(err)
}

// beginMarkerInsertMany is BeginMarkerInsertMany.
func (d *Driver) beginMarkerInsertMany(ctx context.Context, p *driver.MarkerInsertManyParams) (Tx, []driver.MarkerInsertResult, error) {
	mb, err := d.newMarkerBatch(ctx, d.pool, p)
	if err != nil {
		return nil, nil, err
	}
	lift := d.liftTimeouts(ctx)
	c, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, nil, err
	}
	tx := &connTx{c: c}
	if !d.betting() || mb.sql.legacy {
		return d.beginInsertManyAware(ctx, tx, mb, lift)
	}
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	lift.off(b)
	b.Queue(mb.sql.insertManyNew, mb.insertArgs()...)
	lift.on(b)
	br := c.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil {
		err = lift.read(br)
	}
	if err == nil {
		_, err = br.Exec()
	}
	if err == nil {
		err = lift.read(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		out := make([]driver.MarkerInsertResult, len(p.MessageIDs))
		for i := range out {
			out[i].Inserted = true
		}
		return tx, out, nil
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" {
		_, _ = tx.end(context.WithoutCancel(ctx), "rollback")
		return nil, nil, err
	}
	// Some marker exists: start again with the conflict-aware statement on
	// the same connection.
	d.lostBet()
	restart := "rollback; " + beginSQL
	if lift != nil {
		restart += "; " + liftTimeoutsSQL
	}
	if _, err := c.Exec(ctx, restart); err != nil {
		_, _ = tx.end(context.WithoutCancel(ctx), "rollback")
		return nil, nil, err
	}
	res, err := d.markerInsertMany(ctx, tx, mb)
	if err == nil && lift != nil {
		_, err = c.Exec(ctx, restoreTimeoutsSQL)
	}
	if err != nil {
		_, _ = tx.end(context.WithoutCancel(ctx), "rollback")
		return nil, nil, err
	}
	return tx, res, nil
}

// beginInsertManyAware is BeginMarkerInsertMany under
// Config.ConflictAwareInserts: BEGIN and INSERT … ON CONFLICT DO NOTHING
// RETURNING in one round trip, then the hashes of the IDs not inserted.
func (d *Driver) beginInsertManyAware(ctx context.Context, tx *connTx, mb *markerBatch, lift *timeoutLift) (Tx, []driver.MarkerInsertResult, error) {
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	lift.off(b)
	b.Queue(mb.sql.insertMany, mb.insertArgs()...)
	lift.on(b)
	br := tx.c.SendBatch(ctx, b)
	var inserted map[string]struct{}
	_, err := br.Exec()
	if err == nil {
		err = lift.read(br)
	}
	if err == nil {
		var rows pgx.Rows
		if rows, err = br.Query(); err == nil {
			inserted, err = insertedKeys(rows, len(mb.keys))
		}
	}
	if err == nil {
		err = lift.read(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	var res []driver.MarkerInsertResult
	if err == nil {
		res, err = d.markerResults(ctx, tx, mb, inserted)
	}
	if err != nil {
		_, _ = tx.end(context.WithoutCancel(ctx), "rollback")
		return nil, nil, err
	}
	return tx, res, nil
}

// Commit commits a transaction begun by this driver. If the server answers
// ROLLBACK (the transaction had failed), it returns ErrCommitRolledBack.
func (d *Driver) Commit(ctx context.Context, tx Tx) error {
	ct, ok := tx.(*connTx)
	if !ok {
		if c, ok := tx.(interface{ Commit(context.Context) error }); ok {
			return c.Commit(ctx)
		}
		return fmt.Errorf("postgres: Commit of a %T not begun by this driver", tx)
	}
	beginErr := ct.beginErr
	tag, err := ct.end(ctx, "commit")
	if err != nil {
		return err
	}
	if beginErr != nil {
		return fmt.Errorf("postgres: begin: %w", beginErr)
	}
	if tag.String() == "ROLLBACK" {
		return ErrCommitRolledBack
	}
	return nil
}

// Rollback rolls back a transaction begun by this driver.
func (d *Driver) Rollback(ctx context.Context, tx Tx) error {
	ct, ok := tx.(*connTx)
	if !ok {
		if r, ok := tx.(interface{ Rollback(context.Context) error }); ok {
			if err := r.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
				return err
			}
			return nil
		}
		return fmt.Errorf("postgres: Rollback of a %T not begun by this driver", tx)
	}
	if ct.c == nil {
		return nil
	}
	_, err := ct.end(ctx, "rollback")
	return err
}

// MarkerInsert implements driver.Driver.
func (d *Driver) MarkerInsert(ctx context.Context, tx Tx, p *driver.MarkerInsertParams) (driver.MarkerInsertResult, error) {
	m, err := d.newMarker(ctx, tx, p)
	if err != nil {
		return driver.MarkerInsertResult{}, err
	}
	tag, err := tx.Exec(ctx, m.sql.insert, m.insertArgs()...)
	if err != nil {
		return driver.MarkerInsertResult{}, err
	}
	return d.afterInsert(ctx, tx, tag, m)
}

func (d *Driver) afterInsert(ctx context.Context, tx Tx, tag pgconn.CommandTag, m *marker) (driver.MarkerInsertResult, error) {
	if tag.RowsAffected() == 1 {
		return driver.MarkerInsertResult{Inserted: true}, nil
	}
	var existing []byte
	if err := tx.QueryRow(ctx, m.sql.selectHash, m.hashArgs()...).Scan(&existing); err != nil {
		return driver.MarkerInsertResult{}, fmt.Errorf("postgres: read existing marker: %w", err)
	}
	return driver.MarkerInsertResult{ExistingHash: existing}, nil
}

// MarkerDelete implements driver.MarkerDeleter with one statement.
func (d *Driver) MarkerDelete(ctx context.Context, tx Tx, p *driver.MarkerDeleteParams) error {
	if len(p.MessageIDs) == 0 {
		return nil
	}
	hid, err := d.handlerID(ctx, tx, p.Handler)
	if err != nil {
		return err
	}
	keys := make([][]byte, len(p.MessageIDs))
	for i, id := range p.MessageIDs {
		keys[i] = messageKey(id)
	}
	_, err = tx.Exec(ctx, d.deleteMarkers, hid, byteaArray(keys))
	return err
}

// MarkerInsertMany inserts all markers with one multi-row INSERT … ON
// CONFLICT DO NOTHING RETURNING (arrays unnested server-side, so a batch of
// any size is one statement with three parameters), then reads the hashes of
// the IDs that were already there.
func (d *Driver) MarkerInsertMany(ctx context.Context, tx Tx, p *driver.MarkerInsertManyParams) ([]driver.MarkerInsertResult, error) {
	mb, err := d.newMarkerBatch(ctx, tx, p)
	if err != nil {
		return nil, err
	}
	return d.markerInsertMany(ctx, tx, mb)
}

// markerInsertMany is MarkerInsertMany.
func (d *Driver) markerInsertMany(ctx context.Context, tx Tx, mb *markerBatch) ([]driver.MarkerInsertResult, error) {
	rows, err := tx.Query(ctx, mb.sql.insertMany, mb.insertArgs()...)
	if err != nil {
		return nil, err
	}
	inserted, err := insertedKeys(rows, len(mb.keys))
	if err != nil {
		return nil, err
	}
	return d.markerResults(ctx, tx, mb, inserted)
}

// insertedKeys collects the keys an insertMany statement returned.
func insertedKeys(rows pgx.Rows, n int) (map[string]struct{}, error) {
	inserted := make(map[string]struct{}, n)
	var k []byte
	_, err := pgx.ForEachRow(rows, []any{&k}, func() error {
		inserted[string(k)] = struct{}{}
		return nil
	})
	return inserted, err
}

// markerResults returns the outcome of a batch's marker insert: inserted
// for the keys in inserted, and for the others the hash their marker
// holds, read in one statement.
func (d *Driver) markerResults(ctx context.Context, tx Tx, mb *markerBatch, inserted map[string]struct{}) ([]driver.MarkerInsertResult, error) {
	out := make([]driver.MarkerInsertResult, len(mb.keys))
	var missing []int
	for i, k := range mb.keys {
		if _, ok := inserted[string(k)]; ok {
			out[i].Inserted = true
		} else {
			missing = append(missing, i)
		}
	}
	if len(missing) == 0 {
		return out, nil
	}
	rows, err := tx.Query(ctx, mb.sql.selectHashes, mb.hashArgs(missing)...)
	if err != nil {
		return nil, err
	}
	existing := make(map[string][]byte, len(missing))
	var k, h []byte
	_, err = pgx.ForEachRow(rows, []any{&k, &h}, func() error {
		if _, ok := existing[string(k)]; !ok {
			existing[string(k)] = h
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, i := range missing {
		eh, ok := existing[string(mb.keys[i])]
		if !ok {
			return nil, fmt.Errorf("postgres: marker %q was neither inserted nor found", mb.ids[i])
		}
		out[i].ExistingHash = eh
	}
	return out, nil
}

var _ driver.MarkerImporter = (*Driver)(nil)

// ImportIDs implements driver.MarkerImporter: the column's values after
// after, in the column's order. An index on the column keeps each page
// cheap.
func (d *Driver) ImportIDs(ctx context.Context, src *driver.ImportSource, after string, limit int) ([]string, error) {
	table, col, err := importSQL(src)
	if err != nil {
		return nil, err
	}
	// The column's type, from the catalog (format_type quotes what needs
	// it): the cursor is read back as a value of it, so that pages follow
	// the column's own order and its index.
	var typ string
	err = d.pool.QueryRow(ctx, `SELECT format_type(a.atttypid, a.atttypmod)
FROM pg_attribute a WHERE a.attrelid = $1::regclass AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped`, table, src.Column).Scan(&typ)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("postgres: import: %s has no column %s", table, col)
	} else if err != nil {
		return nil, err
	}
	// Pages are ordered by the value, then by its text in byte order:
	// values that compare equal but read differently (numeric 1.5 and
	// 1.50, citext B and b) are distinct IDs, and a page boundary between
	// them must not skip one. The text form is selected under another
	// name: ORDER BY would take an output column of the column's own name,
	// and sort as text.
	// Empty is tested in "C": under a nondeterministic collation that
	// ignores blanks or punctuation, a value of them equals '', and is an
	// ID all the same.
	text := col + `::text`
	order := ` ORDER BY ` + col + `, ` + text + ` COLLATE "C"`
	nonEmpty := text + ` COLLATE "C" <> ''`
	q, args := `SELECT `+text+` AS idem_value FROM `+table+` WHERE `+nonEmpty+order+` LIMIT $1`, []any{limit}
	if after != "" {
		v := `$1::text::` + typ
		q = `SELECT ` + text + ` AS idem_value FROM ` + table + ` WHERE ` + nonEmpty + ` AND ` + col + ` >= ` + v +
			` AND (` + col + ` > ` + v + ` OR ` + text + ` COLLATE "C" > $1::text COLLATE "C")` + order + ` LIMIT $2`
		args = []any{after, limit}
	}
	rows, err := d.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// InsertImportedMarkers implements driver.MarkerImporter with one INSERT.
// An ID whose marker a delivery holds uncommitted waits for it to commit
// (then it counts as existing) or roll back (then it is imported), with
// the sessions' lock and statement timeouts lifted for the INSERT, as for
// a redelivery (see liftTimeouts); the context still bounds the wait.
func (d *Driver) InsertImportedMarkers(ctx context.Context, handler string, ids []string) (int64, error) {
	hid, err := d.handlerID(ctx, d.pool, handler)
	if err != nil {
		return 0, err
	}
	keys := make([][]byte, len(ids))
	for i, id := range ids {
		keys[i] = messageKey(id)
	}
	tag, err := d.auto.ExecWaiting(ctx, `INSERT INTO `+d.t.markers+` (handler_id, message_key, payload_hash)
SELECT $1, k, ''::bytea FROM unnest($2::bytea[]) AS u(k)
ON CONFLICT DO NOTHING`, hid, byteaArray(keys))
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// importSQL validates and quotes an import source.
func importSQL(src *driver.ImportSource) (table, column string, err error) {
	if src == nil {
		return "", "", fmt.Errorf("%w: postgres: nil import source", idem.ErrInvalidConfig)
	}
	table, column, err = sqlident.Column("postgres: import", src.Schema, src.Table, src.Column)
	if err != nil {
		return "", "", fmt.Errorf("%w: %w", idem.ErrInvalidConfig, err)
	}
	return table, column, nil
}
