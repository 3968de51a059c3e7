package mysql

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strings"
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
// the marker INSERT's duplicate key (1062) says the transaction is open.
// After any other error the state is unknown, so the next statement first
// rolls back whatever is open and begins again, and the end of the
// transaction rolls back. A transaction that ends before any statement ran
// sends nothing: there is nothing to commit or undo.

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
	// pending is what must run before the transaction's next statement,
	// "" when nothing is.
	pending string
	// unsure says pending starts with a ROLLBACK: a prefixed statement
	// failed in a way that leaves unknown whether the begin ran.
	unsure bool
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
	c.pending, c.unsure = begin, false
	return &foldTx{c: c}, nil
}

// ExecContext implements driver.ExecerContext, sending a pending begin in
// the same packet as query.
func (c *foldConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if c.pending == "" {
		return c.innerConn.ExecContext(ctx, query, args)
	}
	pending := c.pending
	c.pending = ""
	res, err := c.innerConn.ExecContext(ctx, pending+";"+query, args)
	if err != nil && errNumber(err) != errDupEntry {
		c.retryBegin(pending)
	}
	return res, err
}

// retryBegin makes the next statement roll back whatever is open and
// begin again, after the statement that carried begin failed.
func (c *foldConn) retryBegin(begin string) {
	begin = strings.TrimPrefix(begin, "ROLLBACK;")
	c.pending, c.unsure = "ROLLBACK;"+begin, true
}

// flush sends a pending begin on its own, before a statement that cannot
// carry it (a query, whose first result would be the begin's, or a
// prepare).
func (c *foldConn) flush(ctx context.Context) error {
	if c.pending == "" {
		return nil
	}
	pending := c.pending
	c.pending = ""
	if _, err := c.innerConn.ExecContext(ctx, pending, nil); err != nil {
		c.retryBegin(pending)
		return err
	}
	c.unsure = false
	return nil
}

// QueryContext implements driver.QueryerContext.
func (c *foldConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	if err := c.flush(ctx); err != nil {
		return nil, err
	}
	return c.innerConn.QueryContext(ctx, query, args)
}

// PrepareContext implements driver.ConnPrepareContext.
func (c *foldConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	if err := c.flush(ctx); err != nil {
		return nil, err
	}
	return c.innerConn.PrepareContext(ctx, query)
}

// Prepare implements driver.Conn.
func (c *foldConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

// Begin implements driver.Conn; database/sql calls BeginTx instead.
func (c *foldConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

// ResetSession implements driver.SessionResetter. database/sql always
// ends a transaction before it pools the connection; a begin still
// pending here would be a bug, and the connection is dropped.
func (c *foldConn) ResetSession(ctx context.Context) error {
	if c.pending != "" {
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
	case c.pending == "":
		_, err := c.innerConn.ExecContext(context.Background(), stmt, nil)
		return err
	case c.unsure:
		// The statement that carried the begin failed: whatever it
		// left open is rolled back, and there is nothing to commit.
		c.pending, c.unsure = "", false
		_, err := c.innerConn.ExecContext(context.Background(), "ROLLBACK", nil)
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
