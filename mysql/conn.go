package mysql

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
)

// A transaction's BEGIN sent with its first statement, and then not at all.
//
// database/sql begins a transaction with a statement of its own, START
// TRANSACTION, one round trip before the first real statement; on a
// message's hot path (BEGIN, the marker INSERT, the handler's write,
// COMMIT) that is a fourth round trip where a plain transaction of the
// handler's write takes three. The pools Open returns wrap each
// connection so that a transaction the driver begins (Driver.Begin marks
// its context with foldBegin) sends nothing at BEGIN. Its first Exec
// carries what the begin needs in the same packet, which takes the
// connection's multi-statement capability: on a fresh session "SET
// autocommit=0;INSERT …". The session then stays at autocommit=0, where
// a statement outside a transaction begins one by itself, so the next
// transaction the driver begins on that connection sends no begin at all:
// its INSERT is one statement, as a plain transaction's first write is.
// The wrapper turns autocommit back on before anything else runs outside
// a transaction: in the same packet as an Exec ("SET
// autocommit=1;UPDATE …"), in a round trip of its own before a query or
// a prepare. Transactions begun by anyone else on the pool begin with
// START TRANSACTION, as usual, at either autocommit: COMMIT and ROLLBACK
// end them leaving autocommit as it was. (What differs with the session's
// history is only what follows an implicit commit or a deadlock inside
// such a transaction: at autocommit=0 the statements after it are in a
// new transaction that ROLLBACK undoes, at autocommit=1 each commits.)
// An Exec outside a transaction that fails after the SET ran leaves the
// session at autocommit=1: any server error but one that interrupted the
// packet says so.
//
// MySQL runs a multi-statement in order and stops at the first error, so
// the marker INSERT's duplicate key (1062) says the transaction is open and
// it goes on as usual. After any other error it is unknown whether the
// prefix ran, or whether the statement left part of its work (a
// procedure, a statement string of several): the transaction is void,
// with or without a prefix, so that it ends the same on any session.
// Its later statements fail without reaching the server, Commit rolls
// back and returns the error, Rollback rolls back, and both turn
// autocommit back on. A transaction that ends before any statement ran
// sends nothing: there is nothing to commit or undo. A session whose
// autocommit is in doubt after a failure (a failed COMMIT, an Exec after
// SET autocommit=1 whose packet was interrupted or lost) runs nothing
// more and is not pooled again.

// foldBegin marks the context of a BeginTx whose begin may wait for the
// first statement.
type foldBegin struct{}

// foldConnector wraps the go-sql-driver connector; see above.
type foldConnector struct{ inner driver.Connector }

// Connect implements driver.Connector.
func (c foldConnector) Connect(ctx context.Context) (driver.Conn, error) {
	cn, err := c.inner.Connect(ctx)
	if err != nil {
		return nil, err
	}
	if ic, ok := cn.(innerConn); ok {
		return &foldConn{innerConn: ic}, nil
	}
	return cn, nil
}

// Driver implements driver.Connector.
func (c foldConnector) Driver() driver.Driver { return c.inner.Driver() }

// innerConn is what go-sql-driver's connections implement and the wrapper
// passes on.
type innerConn interface {
	driver.Conn
	driver.Execer  // deprecated; go-sql-driver's README offers it through Conn.Raw
	driver.Queryer // likewise
	driver.ConnBeginTx
	driver.ExecerContext
	driver.QueryerContext
	driver.ConnPrepareContext
	driver.Pinger
	driver.SessionResetter
	driver.Validator
	driver.NamedValueChecker
}

// foldConn is a connection whose transaction's begin may be pending.
type foldConn struct {
	innerConn
	// folded says a transaction the driver began is open; began that
	// one of its statements was sent, so the server's transaction is
	// open too.
	folded, began bool
	// pending is what must run before the folded transaction's first
	// statement: "" when nothing must.
	pending string
	// void is the error of a first statement that failed in a way that
	// leaves the transaction's state unknown; nil otherwise.
	void error
	// plain says a transaction begun with START TRANSACTION is open.
	plain bool
	// manual says the session is at autocommit=0, as a folded
	// transaction left it.
	manual bool
	// lost says the session's autocommit is unknown after a failure: the
	// connection is dropped rather than pooled, and runs nothing more
	// (driver.ErrBadConn: nothing was sent, so database/sql may run the
	// statement on another connection).
	lost bool
}

const (
	manualOn  = "SET autocommit=0"
	manualOff = "SET autocommit=1"
	rcNext    = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
)

// BeginTx implements driver.ConnBeginTx: for a context marked by the
// driver, a read-write transaction at the session's level or READ
// COMMITTED begins with its first statement; anything else begins now.
func (c *foldConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if c.lost {
		return nil, driver.ErrBadConn
	}
	level := sql.IsolationLevel(opts.Isolation)
	if ctx.Value(foldBegin{}) == nil || opts.ReadOnly || (level != sql.LevelDefault && level != sql.LevelReadCommitted) {
		tx, err := c.innerConn.BeginTx(ctx, opts)
		if err != nil {
			return nil, err
		}
		c.plain = true
		return &plainTx{inner: tx, c: c}, nil
	}
	var begin []string
	if !c.manual {
		begin = append(begin, manualOn)
	}
	if level == sql.LevelReadCommitted {
		begin = append(begin, rcNext)
	}
	c.folded, c.began, c.pending, c.void = true, false, strings.Join(begin, ";"), nil
	return &foldTx{c: c, ctx: ctx}, nil
}

// ExecContext implements driver.ExecerContext: in a folded transaction,
// the first statement carries the pending begin in its packet; outside a
// transaction, a statement on a session at autocommit=0 carries SET
// autocommit=1.
func (c *foldConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if c.lost {
		return nil, driver.ErrBadConn
	}
	if c.void != nil {
		return nil, c.voidErr()
	}
	var prefix string
	switch {
	case c.folded && !c.began:
		prefix = c.pending
	case !c.folded && !c.plain && c.manual:
		prefix = manualOff
	}
	first := c.folded && !c.began
	if prefix == "" {
		res, err := c.innerConn.ExecContext(ctx, query, args)
		switch {
		case errors.Is(err, driver.ErrSkip) || !c.folded:
		case first && err != nil && errNumber(err) != errDupEntry:
			// As after a prefix: a failed first statement voids the
			// transaction, whatever the session ran before.
			c.began, c.void = true, err
		default:
			c.began = true
		}
		return res, err
	}
	res, err := c.innerConn.ExecContext(ctx, prefix+";"+query, args)
	switch {
	case errors.Is(err, driver.ErrSkip):
		// Nothing was sent: database/sql prepares the statement
		// instead, which sends the prefix first.
	case !c.folded && err != nil && !prefixRan(err):
		c.lost = true
	case !c.folded:
		c.manual = false
	case err != nil && errNumber(err) != errDupEntry:
		c.began, c.void = true, err
	default:
		c.began, c.pending, c.manual = true, "", true
	}
	return res, err
}

// prefixRan reports whether a multi-statement that failed with err ran
// its first statement, a SET that cannot fail: the server answered with
// an error of the statement it stopped at, and not one that interrupted
// the packet's work, whichever statement it was in.
func prefixRan(err error) bool {
	switch errNumber(err) {
	case 0, errQueryInterrupted, errServerShutdown, errConnectionKilled:
		return false
	}
	return true
}

// voidErr is the error of a statement in a void transaction.
func (c *foldConn) voidErr() error { return voidError(c.void) }

// voidError is the error of a statement in, or the commit of, a
// transaction made void by err.
func voidError(err error) error {
	return fmt.Errorf("mysql: the transaction's first statement failed, so it was void and is rolled back: %w", err)
}

// flush readies the session for a statement that cannot carry a prefix
// (a query, whose first result would be the prefix's, or a prepared
// statement): in a folded transaction it sends the pending begin on its
// own; outside any transaction it turns autocommit back on.
func (c *foldConn) flush(ctx context.Context) error {
	if c.lost {
		return driver.ErrBadConn
	}
	if c.void != nil {
		return c.voidErr()
	}
	switch {
	case c.folded && !c.began:
		if c.pending != "" {
			if _, err := c.innerConn.ExecContext(ctx, c.pending, nil); err != nil {
				c.began, c.void = true, err
				return err
			}
			c.pending, c.manual = "", true
		}
		c.began = true
	case !c.folded && !c.plain && c.manual:
		if _, err := c.innerConn.ExecContext(ctx, manualOff, nil); err != nil {
			c.lost = true
			return err
		}
		c.manual = false
	}
	return nil
}

// QueryContext implements driver.QueryerContext.
func (c *foldConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	if err := c.flush(ctx); err != nil {
		return nil, err
	}
	return c.innerConn.QueryContext(ctx, query, args)
}

// Exec implements driver.Execer, for callers that reach the connection
// through sql.Conn.Raw.
func (c *foldConn) Exec(query string, args []driver.Value) (driver.Result, error) {
	if err := c.flush(context.Background()); err != nil {
		return nil, err
	}
	return c.innerConn.Exec(query, args)
}

// Query implements driver.Queryer, for callers that reach the connection
// through sql.Conn.Raw.
func (c *foldConn) Query(query string, args []driver.Value) (driver.Rows, error) {
	if err := c.flush(context.Background()); err != nil {
		return nil, err
	}
	return c.innerConn.Query(query, args)
}

// PrepareContext implements driver.ConnPrepareContext. The statement is
// wrapped: database/sql reuses a statement prepared on this connection
// inside a later transaction (Tx.Stmt), whose begin must then go first.
func (c *foldConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	if err := c.flush(ctx); err != nil {
		return nil, err
	}
	st, err := c.innerConn.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	if is, ok := st.(innerStmt); ok {
		return foldStmt{innerStmt: is, c: c}, nil
	}
	return st, nil
}

// Prepare implements driver.Conn.
func (c *foldConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

// Begin implements driver.Conn; database/sql calls BeginTx instead.
func (c *foldConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

// innerStmt is what go-sql-driver's statements implement and foldStmt
// passes on.
type innerStmt interface {
	driver.Stmt
	driver.StmtExecContext
	driver.StmtQueryContext
	driver.NamedValueChecker
}

// foldStmt is a prepared statement that sends its connection's pending
// begin before it runs.
type foldStmt struct {
	innerStmt
	c *foldConn
}

// ExecContext implements driver.StmtExecContext.
func (s foldStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	if err := s.c.flush(ctx); err != nil {
		return nil, err
	}
	return s.innerStmt.ExecContext(ctx, args)
}

// QueryContext implements driver.StmtQueryContext.
func (s foldStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	if err := s.c.flush(ctx); err != nil {
		return nil, err
	}
	return s.innerStmt.QueryContext(ctx, args)
}

// Exec implements driver.Stmt.
func (s foldStmt) Exec(args []driver.Value) (driver.Result, error) {
	if err := s.c.flush(context.Background()); err != nil {
		return nil, err
	}
	return s.innerStmt.Exec(args)
}

// Query implements driver.Stmt.
func (s foldStmt) Query(args []driver.Value) (driver.Rows, error) {
	if err := s.c.flush(context.Background()); err != nil {
		return nil, err
	}
	return s.innerStmt.Query(args)
}

// ResetSession implements driver.SessionResetter. database/sql always
// ends a transaction before it pools the connection; one still open here
// would be a bug, and a session whose autocommit is unknown cannot be
// pooled: either connection is dropped.
func (c *foldConn) ResetSession(ctx context.Context) error {
	if c.folded || c.plain || c.lost {
		return driver.ErrBadConn
	}
	return c.innerConn.ResetSession(ctx)
}

// foldTx ends a transaction whose begin may not have been sent. Its end
// is sent under ctx, the begin's: database/sql's Commit and Rollback take
// none, and a COMMIT that the end of the transaction's context cannot cut
// would wait as long as TCP does on a path that died (a stop's
// StopGrace cancels that context). A cancelled end drops the connection,
// which the server then rolls back if it has not committed.
type foldTx struct {
	c   *foldConn
	ctx context.Context
}

var errTxDone = errors.New("mysql: transaction already ended")

func (t *foldTx) end(stmt string) error {
	c := t.c
	if c == nil {
		return errTxDone
	}
	t.c = nil
	began, void := c.began, c.void
	c.folded, c.began, c.pending, c.void = false, false, "", nil
	switch {
	case void != nil:
		// Whatever the failed first statement left open is undone, and
		// autocommit, which it may have turned off, is back on; a
		// commit says so.
		if _, err := c.innerConn.ExecContext(t.ctx, "ROLLBACK;"+manualOff, nil); err != nil {
			c.lost = true
			return err
		}
		c.manual = false
		if stmt == "COMMIT" {
			return voidError(void)
		}
		return nil
	case !began:
		// No statement ran: nothing was begun.
		return nil
	default:
		if _, err := c.innerConn.ExecContext(t.ctx, stmt, nil); err != nil {
			c.lost = true
			return err
		}
		return nil
	}
}

// Commit implements driver.Tx.
func (t *foldTx) Commit() error { return t.end("COMMIT") }

// Rollback implements driver.Tx.
func (t *foldTx) Rollback() error { return t.end("ROLLBACK") }

// plainTx is a transaction begun with START TRANSACTION, tracked so that
// autocommit is not turned back on in its middle.
type plainTx struct {
	inner driver.Tx
	c     *foldConn
}

// Commit implements driver.Tx.
func (t *plainTx) Commit() error { return t.end(t.inner.Commit()) }

// Rollback implements driver.Tx.
func (t *plainTx) Rollback() error { return t.end(t.inner.Rollback()) }

// end notes the transaction ended; after an error the session's state is
// unknown, and it is not pooled again.
func (t *plainTx) end(err error) error {
	t.c.plain = false
	if err != nil {
		t.c.lost = true
	}
	return err
}
