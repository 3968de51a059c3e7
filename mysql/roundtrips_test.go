package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// countingConn counts the writes of a connection: go-sql-driver writes a
// command in one call and then waits for its answer, so a write is a round
// trip. It also keeps the text of the queries the last few writes sent.
type countingConn struct {
	net.Conn
	n    *atomic.Int64
	sent *sentLog
}

func (c countingConn) Write(b []byte) (int, error) {
	c.n.Add(1)
	// A packet: 3 bytes of length, 1 of sequence, then the command;
	// COM_QUERY (3) is followed by the query's text.
	if len(b) > 5 && b[4] == 3 {
		c.sent.add(string(b[5:]))
	}
	return c.Conn.Write(b)
}

// sentLog is the queries a pool sent, in order.
type sentLog struct {
	mu sync.Mutex
	q  []string
}

func (l *sentLog) add(q string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.q = append(l.q, q)
}

// since returns the queries sent after the first n, and the count so far.
func (l *sentLog) since(n int) ([]string, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.q[min(n, len(l.q)):]...), len(l.q)
}

// openCounted opens a pool of conns connections through mysql.Open whose
// writes n counts, and a driver on it.
func openCounted(t *testing.T, conns int) (*sql.DB, *mysql.Driver, *atomic.Int64) {
	db, drv, n, _, _ := openRecorded(t, conns)
	return db, drv, n
}

// openRecorded is openCounted that also returns the queries the pool
// sends and the database's DSN, for a pool of one's own.
func openRecorded(t *testing.T, conns int) (*sql.DB, *mysql.Driver, *atomic.Int64, *sentLog, string) {
	t.Helper()
	ctx := context.Background()
	dsn := testenv.MySQLDatabase(t)
	cfg, err := gomysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	n, sent := &atomic.Int64{}, &sentLog{}
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countingConn{Conn: c, n: n, sent: sent}, nil
	}
	db, err := mysql.Open(ctx, cfg)
	if err != nil {
		testenv.Unavailable(t, "MySQL/MariaDB", cfg.Addr, err)
	}
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	t.Cleanup(func() { db.Close() })
	drv, err := mysql.New(db, &mysql.Config{SessionIsolation: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE balances (account VARBINARY(64) PRIMARY KEY, amount BIGINT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return db, drv, n, sent, dsn
}

const upsertBalance = `INSERT INTO balances (account, amount) VALUES (?, 1) ON DUPLICATE KEY UPDATE amount = amount + 1`

// TestRoundTripsPerMessage counts the round trips of one message through
// Process, its handler one upsert, against the same transaction without
// idem (BEGIN, the upsert, COMMIT) on the same pool: idem must not add
// one. On a pool from Open the transaction sends no begin: the first
// one on a connection sends SET autocommit=0 with the marker's INSERT,
// and the INSERT begins the next ones alone.
func TestRoundTripsPerMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// Two connections: a handler's name is interned on a connection of
	// its own the first time (in the warm-up).
	db, drv, rt := openCounted(t, 2)
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		_, err := tx.ExecContext(ctx, upsertBalance, m.AggregateID)
		return err
	}}
	plain := func(i int) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, upsertBalance, fmt.Sprint("a-", i%7)); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	}
	through := func(i int) error {
		out, err := proc.Process(ctx, h, &idem.Message{ID: fmt.Sprint("m-", i), AggregateID: fmt.Sprint("a-", i%7)})
		if err == nil && out != idem.Applied {
			err = fmt.Errorf("outcome %v", out)
		}
		return err
	}
	count := func(name string, f func(int) error, from int) float64 {
		for i := range 3 { // warm-up: the handler's id is looked up once
			if err := f(from + i); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		const n = 20
		before := rt.Load()
		for i := range n {
			if err := f(from + 3 + i); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		return float64(rt.Load()-before) / n
	}
	p, i := count("plain", plain, 0), count("idem", through, 100)
	t.Logf("round trips a message: plain %.2f, idem %.2f", p, i)
	if p != 3 {
		t.Fatalf("the plain transaction takes %.2f round trips, want 3 (BEGIN, the upsert, COMMIT)", p)
	}
	if i > p {
		t.Fatalf("idem takes %.2f round trips a message, the plain transaction %.2f", i, p)
	}
	before := rt.Load()
	if out, err := proc.Process(ctx, h, &idem.Message{ID: "m-103", AggregateID: "a-5"}); out != idem.Duplicate || err != nil {
		t.Fatalf("redelivery: (%v, %v)", out, err)
	}
	t.Logf("round trips of a redelivery: %d", rt.Load()-before)
	want := map[string]int64{}
	for i := range 23 {
		want[fmt.Sprint("a-", i%7)]++
		want[fmt.Sprint("a-", (100+i)%7)]++
	}
	checkBalances(t, db, want)
}

func checkBalances(t *testing.T, db *sql.DB, want map[string]int64) {
	t.Helper()
	got, err := readPairs(context.Background(), db, `SELECT account, CAST(amount AS CHAR) FROM balances`)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("balances %v, want %v", got, want)
	}
	for a, n := range want {
		if got[a] != fmt.Sprint(n) {
			t.Fatalf("balance of %s = %s, want %d (all: %v)", a, got[a], n, got)
		}
	}
}

// inTransaction reports whether the pool's one connection is inside a
// transaction.
func inTransaction(t *testing.T, db *sql.DB) bool {
	t.Helper()
	var in int
	if err := db.QueryRowContext(context.Background(), `SELECT @@in_transaction`).Scan(&in); err != nil {
		t.Fatal(err)
	}
	return in != 0
}

// TestFoldedBeginEdges drives the transactions whose begin waits for
// their first statement through the ways they can end: with no
// statement, after a first statement that failed, with a query first.
// Each must leave the connection outside any transaction, commit exactly
// what ran after a failure, and send nothing for an empty transaction.
func TestFoldedBeginEdges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, drv, rt := openCounted(t, 1)

	// Nothing ran: no round trip, for commit and rollback.
	before := rt.Load()
	for _, end := range []func(*sql.Tx) error{(*sql.Tx).Commit, (*sql.Tx).Rollback} {
		tx, err := drv.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := end(tx); err != nil {
			t.Fatal(err)
		}
	}
	if n := rt.Load() - before; n != 0 {
		t.Fatalf("two empty transactions took %d round trips, want 0", n)
	}

	// The first statement fails (no such table): the transaction is
	// void. A later statement fails without running, and a commit rolls
	// back and says so; a rollback succeeds. The connection is clean.
	for _, commit := range []bool{true, false} {
		tx, err := drv.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO no_such_table VALUES (1)`); err == nil {
			t.Fatal("insert into a missing table succeeded")
		}
		if _, err := tx.ExecContext(ctx, upsertBalance, "after-failure"); err == nil {
			t.Fatal("a statement after a failed first statement ran")
		}
		if commit {
			if err := tx.Commit(); err == nil {
				t.Fatal("commit after a failed first statement reported success")
			}
		} else if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		if inTransaction(t, db) {
			t.Fatal("the connection is still in a transaction after a failed first statement")
		}
		var ac int
		if err := db.QueryRowContext(ctx, `SELECT @@autocommit`).Scan(&ac); err != nil || ac != 1 {
			t.Fatalf("after a failed first statement the session is at autocommit %d (%v), want 1", ac, err)
		}
	}

	// A statement prepared on the connection before, reused in the
	// transaction: the begin goes first, and the rollback undoes it.
	st, err := db.PrepareContext(ctx, upsertBalance)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.ExecContext(ctx, "prepared"); err != nil {
		t.Fatal(err)
	}
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.StmtContext(ctx, st).ExecContext(ctx, "prepared"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}

	// A duplicate key as the first statement leaves the transaction
	// open; a write after it rolls back with it.
	tx, err = drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES ('prepared', 5)`)
	var me *gomysql.MySQLError
	if !errors.As(err, &me) || me.Number != 1062 {
		t.Fatalf("duplicate insert: %v, want error 1062", err)
	}
	if !inTransactionTx(t, tx) {
		t.Fatal("a duplicate key as the first statement left no transaction open")
	}
	if _, err := tx.ExecContext(ctx, upsertBalance, "rolled-back"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}

	// A query first: the begin goes before it, on its own (or, with
	// autocommit off, the query begins the transaction).
	tx, err = drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM balances`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if !inTransactionTx(t, tx) {
		t.Fatal("a query as the first statement ran outside a transaction")
	}
	if _, err := tx.ExecContext(ctx, upsertBalance, "after-query"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}

	// A transaction begun on the pool by anyone but the driver begins at
	// once.
	plain, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !inTransactionTx(t, plain) {
		t.Fatal("a plain transaction is not open after BeginTx")
	}
	if err := plain.Rollback(); err != nil {
		t.Fatal(err)
	}
	checkBalances(t, db, map[string]int64{"after-query": 1, "prepared": 1})
}

func inTransactionTx(t *testing.T, tx *sql.Tx) bool {
	t.Helper()
	var in int
	if err := tx.QueryRowContext(context.Background(), `SELECT @@in_transaction`).Scan(&in); err != nil {
		t.Fatal(err)
	}
	return in != 0
}

// TestAutocommitBetweenTransactions checks the session a driver's
// transaction leaves at autocommit=0: the next such transaction sends its
// INSERT alone, with no begin, and whatever else runs on the connection
// outside a transaction (an Exec, a query, a prepared statement, after a
// plain transaction, a failed handler or a void transaction) commits by
// itself, as on any pool: another connection sees it at once.
func TestAutocommitBetweenTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, drv, _, sent, dsn := openRecorded(t, 1)
	other := testenv.MySQL(t, dsn, 1)
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	fail := errors.New("handler failed")
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		if _, err := tx.ExecContext(ctx, upsertBalance, m.AggregateID); err != nil {
			return err
		}
		if string(m.Payload) == "fail" {
			return idem.Permanent(fail)
		}
		return nil
	}}
	want := map[string]int64{}
	n := 0
	message := func() {
		t.Helper()
		n++
		m := &idem.Message{ID: fmt.Sprint("m-", n), AggregateID: "messages"}
		if out, err := proc.Process(ctx, h, m); out != idem.Applied || err != nil {
			t.Fatalf("message %s: (%v, %v)", m.ID, out, err)
		}
		want["messages"]++
	}
	// committed says the pool's write to account is visible to another
	// connection, and the pool's session is back at autocommit=1.
	committed := func(what, account string) {
		t.Helper()
		want[account]++
		var got int64
		if err := other.QueryRowContext(ctx, `SELECT amount FROM balances WHERE account = ?`, account).Scan(&got); err != nil {
			t.Fatalf("%s: another connection does not see the write: %v", what, err)
		}
		if got != want[account] {
			t.Fatalf("%s: another connection sees %s = %d, want %d", what, account, got, want[account])
		}
	}

	// exec runs the upsert of account on the pool, outside a transaction.
	exec := func(account string) {
		t.Helper()
		if _, err := db.ExecContext(ctx, upsertBalance, account); err != nil {
			t.Fatal(err)
		}
	}
	// inPlainTx runs it in a transaction begun with db.BeginTx, ended by end.
	inPlainTx := func(account string, end func(*sql.Tx) error) {
		t.Helper()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.ExecContext(ctx, upsertBalance, account); err != nil {
			t.Fatal(err)
		}
		if err := end(tx); err != nil {
			t.Fatal(err)
		}
	}

	message() // the handler's name is interned
	message() // the session is left at autocommit=0
	_, from := sent.since(0)
	message()
	got, _ := sent.since(from)
	if len(got) != 3 || !strings.HasPrefix(got[0], "INSERT INTO ") || strings.Contains(got[0], ";") ||
		strings.Contains(got[0], "START TRANSACTION") || got[2] != "COMMIT" {
		t.Fatalf("a message on a session at autocommit=0 sent %q, want the marker INSERT alone, the upsert, COMMIT", got)
	}

	_, from = sent.since(0)
	exec("exec")
	if got, _ := sent.since(from); len(got) != 1 || !strings.HasPrefix(got[0], "SET autocommit=1;INSERT INTO balances") {
		t.Fatalf("an Exec outside a transaction sent %q, want SET autocommit=1 in the same packet", got)
	}
	committed("an Exec after a message", "exec")

	message()
	var ac int
	if err := db.QueryRowContext(ctx, `SELECT @@autocommit`).Scan(&ac); err != nil || ac != 1 {
		t.Fatalf("a query after a message sees autocommit %d (%v), want 1", ac, err)
	}

	message()
	st, err := db.PrepareContext(ctx, upsertBalance)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	message()
	if _, err := st.ExecContext(ctx, "prepared"); err != nil {
		t.Fatal(err)
	}
	committed("a prepared statement after a message", "prepared")

	message()
	inPlainTx("rolled-back", (*sql.Tx).Rollback)
	inPlainTx("plain", (*sql.Tx).Commit)
	committed("a plain transaction after a message", "plain")
	exec("after-plain")
	committed("an Exec after a plain transaction begun at autocommit=0", "after-plain")

	message()
	if out, err := proc.Process(ctx, h, &idem.Message{ID: "fails", AggregateID: "failed", Payload: []byte("fail")}); out == idem.Applied || !errors.Is(err, fail) {
		t.Fatalf("failing handler: (%v, %v)", out, err)
	}
	exec("after-failure")
	committed("an Exec after a rolled-back message", "after-failure")

	message()
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO no_such_table VALUES (1)`); err == nil {
		t.Fatal("insert into a missing table succeeded")
	}
	// Void as on a fresh session, though no prefix was sent.
	if _, err := tx.ExecContext(ctx, upsertBalance, "void"); err == nil {
		_ = tx.Rollback()
		t.Fatal("a statement after a failed first statement ran")
	}
	if err := tx.Commit(); err == nil {
		t.Fatal("commit after a failed first statement reported success")
	}
	exec("after-void")
	committed("an Exec after a void transaction", "after-void")

	// A statement outside a transaction that fails after the SET ran
	// keeps the connection: the session's autocommit is known.
	message()
	var id1, id2 int64
	if err := db.QueryRowContext(ctx, `SELECT CONNECTION_ID()`).Scan(&id1); err != nil {
		t.Fatal(err)
	}
	message()
	_, err = db.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES ('exec', 1)`)
	var me *gomysql.MySQLError
	if !errors.As(err, &me) || me.Number != 1062 {
		t.Fatalf("duplicate insert outside a transaction: %v, want error 1062", err)
	}
	if err := db.QueryRowContext(ctx, `SELECT CONNECTION_ID()`).Scan(&id2); err != nil {
		t.Fatal(err)
	}
	if id1 != id2 {
		t.Fatalf("a duplicate key outside a transaction cost the connection (%d, then %d)", id1, id2)
	}
	if err := db.QueryRowContext(ctx, `SELECT @@autocommit`).Scan(&ac); err != nil || ac != 1 {
		t.Fatalf("after a failed Exec the session is at autocommit %d (%v), want 1", ac, err)
	}
	message()
	checkBalances(t, other, want)
}
