package mysql

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
)

// A transaction's BEGIN sent with its first statement.
//
// database/sql begins a transaction with a statement of its own, START
// TRANSACTION, one round trip before the first real statement; on a
// message's hot path (BEGIN, the marker INSERT, the handler's write,
// COMMIT) that is a fourth round trip where a plain transaction of the
// handler's write takes three. The pools Open returns wrap each
// connection so that a transaction the driver begins (Driver.Begin marks
// its context with foldBegin) sends nothing at BEGIN and prefixes its
// first Exec with the begin: "START TRANSACTION;INSERT …" in one packet,
// which needs the connection's multi-statement capability. Transactions
// begun by anyone else on the pool, and statements outside transactions,
// pass through unchanged.
//
// MySQL runs a multi-statement in order and stops at the first error, so
// the marker INSERT's duplicate key (1062) says the transaction is open and
// it goes on as usual. After any other error it is unknown whether the
// begin ran, or whether the statement left part of its work (a procedure,
// a statement string of several): the transaction is void. Its later
// statements fail without reaching the server, Commit rolls back and
// returns the error, Rollback rolls back. A transaction that ends before
// any statement ran sends nothing: there is nothing to commit or undo.

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
	// pending is the begin that must run before the transaction's next
	// statement, "" when nothing is.
	pending string
	// void is the error of a first statement that failed in a way that
	// leaves the transaction's state unknown; nil otherwise.
	void error
}

const startTx = "START TRANSACTION"

// BeginTx implements driver.ConnBeginTx: for a context marked by the
// driver, a read-write transaction at the session's level or READ
// COMMITTED begins with its first statement; anything else begins now.
func (c *foldConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if ctx.Value(foldBegin{}) == nil || opts.ReadOnly {
		return c.innerConn.BeginTx(ctx, opts)
	}
	begin := startTx
	switch sql.IsolationLevel(opts.Isolation) {
	case sql.LevelDefault:
	case sql.LevelReadCommitted:
		begin = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED;" + startTx
	default:
		return c.innerConn.BeginTx(ctx, opts)
	}
	c.pending, c.void = begin, nil
	return &foldTx{c: c}, nil
}

// ExecContext implements driver.ExecerContext, sending a pending begin in
// the same packet as query.
func (c *foldConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if c.void != nil {
		return nil, c.voidErr()
	}
	if c.pending == "" {
		return c.innerConn.ExecContext(ctx, query, args)
	}
	pending := c.pending
	c.pending = ""
	res, err := c.innerConn.ExecContext(ctx, pending+";"+query, args)
	switch {
	case errors.Is(err, driver.ErrSkip):
		// Nothing was sent: database/sql prepares the statement
		// instead, which flushes the begin first.
		c.pending = pending
	case err != nil && errNumber(err) != errDupEntry:
		c.void = err
	}
	return res, err
}

// voidErr is the error of a statement in a void transaction.
func (c *foldConn) voidErr() error {
	return fmt.Errorf("mysql: the transaction's first statement failed, so it was void and is rolled back: %w", c.void)
}

// flush sends a pending begin on its own, before a statement that cannot
// carry it (a query, whose first result would be the begin's, or a
// prepared statement).
func (c *foldConn) flush(ctx context.Context) error {
	if c.void != nil {
		return c.voidErr()
	}
	if c.pending == "" {
		return nil
	}
	pending := c.pending
	c.pending = ""
	if _, err := c.innerConn.ExecContext(ctx, pending, nil); err != nil {
		c.void = err
		return err
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
// ends a transaction before it pools the connection; a begin still
// pending here would be a bug, and the connection is dropped.
func (c *foldConn) ResetSession(ctx context.Context) error {
	if c.pending != "" || c.void != nil {
		return driver.ErrBadConn
	}
	return c.innerConn.ResetSession(ctx)
}

// foldTx ends a transaction whose begin may not have been sent.
type foldTx struct{ c *foldConn }

var errTxDone = errors.New("mysql: transaction already ended")

func (t *foldTx) end(stmt string) error {
	c := t.c
	if c == nil {
		return errTxDone
	}
	t.c = nil
	switch {
	case c.void != nil:
		// Whatever the failed first statement left open is undone;
		// a commit says so.
		err := c.voidErr()
		c.void, c.pending = nil, ""
		if _, rerr := c.innerConn.ExecContext(context.Background(), "ROLLBACK", nil); rerr != nil {
			return rerr
		}
		if stmt == "COMMIT" {
			return err
		}
		return nil
	case c.pending == "":
		_, err := c.innerConn.ExecContext(context.Background(), stmt, nil)
		return err
	default:
		// No statement ran: nothing was begun.
		c.pending = ""
		return nil
	}
}

// Commit implements driver.Tx.
func (t *foldTx) Commit() error { return t.end("COMMIT") }

// Rollback implements driver.Tx.
func (t *foldTx) Rollback() error { return t.end("ROLLBACK") }
