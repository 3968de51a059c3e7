package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The driver's writes outside a transaction (lease claims and fenced
// updates, dead-letter state changes, handler stats, gap records, outbox
// claims, retention's deletes) are single statements, and a single
// statement runs at the session's default_transaction_isolation. At READ
// COMMITTED, a statement that meets a row another writer changed and
// committed meanwhile re-reads it and goes on; at REPEATABLE READ or
// SERIALIZABLE it fails to serialize (SQLSTATE 40001), which would cost
// the message an attempt (two workers claiming one expired lease, two
// operators replaying one dead letter). autocommit runs those statements
// on the pool as they are where the default is READ COMMITTED, the
// server's own default, and otherwise sends BEGIN ISOLATION LEVEL READ
// COMMITTED, the statement and COMMIT in one round trip.
type autocommit struct{ d *Driver }

// pooled reports whether a statement may run on the pool as it is: the
// sessions' default isolation is READ COMMITTED. When the defaults could
// not be read it answers false, the safe path.
func (a autocommit) pooled(ctx context.Context) bool {
	s := a.d.sessionDefaults(ctx)
	return s != nil && s.readCommitted
}

// sessionSettings are the settings of the pool's sessions that change how
// the driver's statements run.
type sessionSettings struct {
	// readCommitted: default_transaction_isolation is READ COMMITTED.
	readCommitted bool
	// lockTimeout and statementTimeout are the sessions' values, "0"
	// when off.
	lockTimeout, statementTimeout string
}

// sessionDefaults returns the settings of the pool's sessions, read once
// on the pool (so never while the caller holds a connection: the pool may
// have no other), outside any transaction: one connection speaks for the pool, since
// they come from the server's configuration, the role, the database or
// the pool's connection parameters. A failed read returns nil and is
// tried again next time. The settings are not read again: a change of
// the server's configuration while the driver runs is seen by the next
// process.
func (d *Driver) sessionDefaults(ctx context.Context) *sessionSettings {
	if s := d.session.Load(); s != nil {
		return s
	}
	var level string
	s := &sessionSettings{}
	err := d.pool.QueryRow(ctx, `SELECT current_setting('default_transaction_isolation'),
  current_setting('lock_timeout'), current_setting('statement_timeout')`).Scan(&level, &s.lockTimeout, &s.statementTimeout)
	if err != nil {
		return nil
	}
	s.readCommitted = strings.EqualFold(level, "read committed")
	d.session.Store(s)
	return s
}

// Exec runs sql as its own READ COMMITTED transaction.
func (a autocommit) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if a.pooled(ctx) {
		return a.d.pool.Exec(ctx, sql, args...)
	}
	s, err := a.send(ctx, nil, sql, args)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := s.br.Exec()
	return tag, s.finish(ctx, err)
}

// ExecWaiting is Exec for a statement that may wait on another
// transaction's uncommitted marker (an import's insert): where the
// sessions set a lock or statement timeout, it runs as its own READ
// COMMITTED transaction with both lifted for it (see liftTimeouts), in
// the same round trip; nothing needs restoring, the transaction ends with
// the statement.
func (a autocommit) ExecWaiting(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	lift := a.d.liftTimeouts(ctx)
	if lift == nil {
		return a.Exec(ctx, sql, args...)
	}
	s, err := a.send(ctx, lift, sql, args)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := s.br.Exec()
	return tag, s.finish(ctx, err)
}

// QueryRow runs sql as its own READ COMMITTED transaction.
func (a autocommit) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if a.pooled(ctx) {
		return a.d.pool.QueryRow(ctx, sql, args...)
	}
	s, err := a.send(ctx, nil, sql, args)
	if err != nil {
		return errRow{err}
	}
	return &autocommitRow{ctx: ctx, s: s}
}

// Query runs sql as its own READ COMMITTED transaction, which commits
// when the rows are closed.
func (a autocommit) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if a.pooled(ctx) {
		return a.d.pool.Query(ctx, sql, args...)
	}
	s, err := a.send(ctx, nil, sql, args)
	if err != nil {
		return nil, err
	}
	rows, err := s.br.Query()
	if err != nil {
		return nil, s.finish(ctx, err)
	}
	return &autocommitRows{Rows: rows, ctx: ctx, s: s}, nil
}

// sent is a BEGIN, statement, COMMIT batch whose BEGIN has been read.
type sent struct {
	tx *connTx
	br pgx.BatchResults
}

// send acquires a connection and sends BEGIN, the lifting of the
// sessions' timeouts when lift is not nil, sql and COMMIT in one round
// trip.
func (a autocommit) send(ctx context.Context, lift *timeoutLift, sql string, args []any) (*sent, error) {
	c, err := a.d.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	b := &pgx.Batch{}
	b.Queue(beginSQL)
	lift.off(b)
	b.Queue(sql, args...)
	b.Queue("commit")
	s := &sent{tx: &connTx{c: c}, br: c.SendBatch(ctx, b)}
	_, err = s.br.Exec()
	if err == nil {
		err = lift.read(s.br)
	}
	if err != nil {
		return nil, s.finish(ctx, err)
	}
	return s, nil
}

// finish reads the COMMIT after the statement's result, whose error was
// err, and returns the connection: a transaction left open (the
// statement failed, so the server skipped COMMIT) is rolled back first.
// pgx.ErrNoRows is the statement's answer, not its failure.
func (s *sent) finish(ctx context.Context, err error) error {
	if err == nil || errors.Is(err, pgx.ErrNoRows) {
		tag, cerr := s.br.Exec()
		switch {
		case cerr != nil:
			err = cerr
		case tag.String() != "COMMIT":
			err = fmt.Errorf("%w (%s)", ErrCommitRolledBack, tag)
		}
	}
	if cerr := s.br.Close(); err == nil {
		err = cerr
	}
	if s.tx.c.Conn().PgConn().TxStatus() == 'I' {
		s.tx.c.Release()
		return err
	}
	_, _ = s.tx.end(context.WithoutCancel(ctx), "rollback")
	return err
}

// autocommitRow is the row of an autocommit statement: scanning it
// commits.
type autocommitRow struct {
	ctx context.Context
	s   *sent
}

func (r *autocommitRow) Scan(dest ...any) error {
	return r.s.finish(r.ctx, r.s.br.QueryRow().Scan(dest...))
}

// autocommitRows are the rows of an autocommit statement: closing them
// commits.
type autocommitRows struct {
	pgx.Rows
	ctx    context.Context
	s      *sent
	closed bool
	err    error
}

func (r *autocommitRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *autocommitRows) Close() {
	if r.closed {
		return
	}
	r.closed = true
	r.Rows.Close()
	r.err = r.s.finish(r.ctx, r.Rows.Err())
}

func (r *autocommitRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.err
}

// A delivery whose marker another delivery holds, uncommitted, waits for
// that transaction to end and then reports Duplicate (or applies, if it
// rolled back): the wait lasts as long as the other delivery's handler.
// A lock_timeout or statement_timeout on the sessions would cut it short
// with an error, costing the message an attempt where it was a duplicate.
// So where the sessions set either, the statements that wait on another
// delivery in a transaction the driver began lift both for themselves:
// the lift saves the values in force (idem.* placeholders, local to the
// transaction) and sets them to 0 in the same round trip as the waiting
// statement, and the restore sets the saved values back after it, so the
// handler's statements keep them, a SET LOCAL of the caller's included.
// Contexts still bound the wait. (PostgreSQL 17's transaction_timeout is
// not lifted.)
const (
	liftTimeoutsSQL = `SELECT set_config('idem.lock_timeout', current_setting('lock_timeout'), true),
  set_config('idem.statement_timeout', current_setting('statement_timeout'), true),
  set_config('lock_timeout', '0', true), set_config('statement_timeout', '0', true)`
	restoreTimeoutsSQL = `SELECT set_config('lock_timeout', current_setting('idem.lock_timeout'), true),
  set_config('statement_timeout', current_setting('idem.statement_timeout'), true)`
	// restoreLockTimeoutSQL restores only the lock_timeout liftTimeoutsSQL
	// saved (Migrate: see there).
	restoreLockTimeoutSQL = `SELECT set_config('lock_timeout', current_setting('idem.lock_timeout'), true)`
)

// timeoutLift lifts the sessions' timeouts around a waiting statement; a
// nil *timeoutLift, for sessions with neither timeout, does nothing.
type timeoutLift struct{}

// bounded reports whether the sessions set a lock or statement timeout.
func (s *sessionSettings) bounded() bool {
	return s.lockTimeout != "0" || s.statementTimeout != "0"
}

// liftTimeouts returns the lift for the pool's sessions: nil when they set
// neither timeout (or their settings could not be read). The caller holds
// no connection yet (see sessionDefaults).
func (d *Driver) liftTimeouts(ctx context.Context) *timeoutLift {
	s := d.sessionDefaults(ctx)
	if s == nil || !s.bounded() {
		return nil
	}
	return &timeoutLift{}
}

// off queues the lifting; on queues the restoring.
func (l *timeoutLift) off(b *pgx.Batch) {
	if l != nil {
		b.Queue(liftTimeoutsSQL)
	}
}

func (l *timeoutLift) on(b *pgx.Batch) {
	if l != nil {
		b.Queue(restoreTimeoutsSQL)
	}
}

// read reads the result of what off or on queued.
func (l *timeoutLift) read(br pgx.BatchResults) error {
	if l == nil {
		return nil
	}
	_, err := br.Exec()
	return err
}

// queued is how many statements off (or on) queued.
func (l *timeoutLift) queued() int {
	if l == nil {
		return 0
	}
	return 1
}

// liftAround runs f, which waits on concurrent deliveries in tx, with the
// sessions' timeouts lifted when tx is one of this driver's (from one of
// its Begin methods; a pgx.Tx of the caller's keeps the caller's
// settings). It costs a round trip before and after f, and only where the
// sessions set a timeout, or their settings have not been read yet: they
// are not read here, inside a transaction whose SET LOCALs would pass for
// the sessions'.
func (d *Driver) liftAround(ctx context.Context, tx Tx, f func() error) error {
	if _, ours := tx.(*connTx); !ours {
		return f()
	}
	if s := d.session.Load(); s != nil && !s.bounded() {
		return f()
	}
	if _, err := tx.Exec(ctx, liftTimeoutsSQL); err != nil {
		return err
	}
	if err := f(); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, restoreTimeoutsSQL)
	return err
}
