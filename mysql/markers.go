package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// Atomic markers live in the markers table: a handler id from the handlers
// table, the message ID's bytes, the first 16 bytes of the payload's
// SHA-256 and the processing time. Message IDs are at most 255 bytes
// (idem.MaxIDLen), so the primary key (4 + 255 bytes) stays far below
// InnoDB's 3,072-byte bound and the ID is its own key, compared exactly.

// markerChunk bounds the rows of one multi-row INSERT (three placeholders
// each, far below the protocol's 65,535).
const markerChunk = 1000

// storedHash is the part of a payload hash the markers table keeps.
func storedHash(h []byte) []byte {
	if len(h) > idem.MinStoredHash {
		return h[:idem.MinStoredHash]
	}
	if h == nil {
		return []byte{}
	}
	return h
}

// querier is where handlerID reads handler names: the transaction at
// hand, or the pool.
type querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// handlerID returns the id handler is interned under, adding it to the
// handlers table on first use. Ids known committed are cached for the
// driver's life: a handlers row is never deleted or changed.
//
// A new name is best inserted on a pooled connection of its own and
// committed at once, so that it does not depend on the caller's
// transaction. But when q is a transaction, that transaction holds one of
// the pool's connections, and when every worker of a new handler begins at
// once they may hold them all: each would wait for a connection the others
// hold, for ever. So in a transaction the pooled insert is tried only when
// the pool has a connection to spare, waiting internWait at most;
// otherwise the name is inserted in the caller's transaction, which then
// waits on, or holds, the name's key until the first inserter ends.
//
// Such an id may vanish with its transaction, so an id read through a
// transaction is never cached: it may be that transaction's own row,
// inserted here or by another driver. It is used, and cached once a read
// on the pool at READ COMMITTED, which sees committed rows only, finds it
// too.
func (d *Driver) handlerID(ctx context.Context, q querier, handler string) (int32, error) {
	if id, ok := d.handlerIDs.Load(handler); ok {
		return id.(int32), nil
	}
	tx, inTx := q.(*sql.Tx)
	if !inTx {
		return d.internPooled(ctx, handler)
	}
	var id int32
	err := tx.QueryRowContext(ctx, `SELECT id FROM `+d.t.handlers+` WHERE name = ?`, handler).Scan(&id)
	if err == nil {
		// Under READ UNCOMMITTED that may be another transaction's
		// uncommitted row. A locking read of a row that exists locks that
		// row alone (no gap, so concurrent interns cannot deadlock on it),
		// waits for its inserter and sees the latest committed version.
		err = tx.QueryRowContext(ctx, `SELECT id FROM `+d.t.handlers+` WHERE name = ? LOCK IN SHARE MODE`, handler).Scan(&id)
	}
	switch {
	case err == nil:
		if d.spareConn() {
			// Confirm on the pool, so that later calls need not read.
			wctx, cancel := context.WithTimeout(ctx, internWait)
			_, _ = d.readCommitted(wctx, d.db, handler)
			cancel()
		}
		return id, nil
	case !errors.Is(err, sql.ErrNoRows):
		return 0, fmt.Errorf("mysql: look up handler name: %w", notMigrated(err))
	}
	if d.spareConn() && !d.noSetStatement.Load() {
		id, ok, err := d.tryInternPooled(ctx, handler)
		if ok || err != nil {
			return id, err
		}
	}
	if _, err := tx.ExecContext(ctx, `INSERT IGNORE INTO `+d.t.handlers+` (name) VALUES (?)`, handler); err != nil {
		return 0, fmt.Errorf("mysql: intern handler name: %w", notMigrated(err))
	}
	if err := tx.QueryRowContext(ctx, `SELECT id FROM `+d.t.handlers+` WHERE name = ? LOCK IN SHARE MODE`, handler).Scan(&id); err != nil {
		return 0, fmt.Errorf("mysql: intern handler name: %w", notMigrated(err))
	}
	return id, nil
}

// readCommitted reads handler's id on b, the pool or a connection of it,
// and when found caches it. It reads in a read-only transaction at READ
// COMMITTED, which sees committed rows only, whatever the sessions'
// default level.
func (d *Driver) readCommitted(ctx context.Context, b interface {
	BeginTx(context.Context, *sql.TxOptions) (*sql.Tx, error)
}, handler string) (int32, error) {
	tx, err := b.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted, ReadOnly: true})
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	var id int32
	if err := tx.QueryRowContext(ctx, `SELECT id FROM `+d.t.handlers+` WHERE name = ?`, handler).Scan(&id); err != nil {
		return 0, err
	}
	d.handlerIDs.Store(handler, id)
	return id, nil
}

// internWait bounds how long a transaction's handlerID waits for a pooled
// connection before interning the name in the transaction itself.
const internWait = 500 * time.Millisecond

// tryInternPooled interns handler on a pooled connection, committed at
// once, and caches its id, if it gets a connection within internWait and
// the insert need not wait on a lock: another transaction's uncommitted
// insert of the name would hold it until that transaction ends. ok false
// with a nil error means it could not; the caller then interns the name in
// its transaction.
func (d *Driver) tryInternPooled(ctx context.Context, handler string) (id int32, ok bool, err error) {
	wctx, cancel := context.WithTimeout(ctx, internWait)
	c, err := d.db.Conn(wctx)
	cancel()
	if err != nil {
		if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			return 0, false, nil
		}
		return 0, false, fmt.Errorf("mysql: intern handler name: %w", err)
	}
	defer c.Close()
	// The insert commits by itself, on a session whose settings the
	// driver may not have checked yet: check them on this connection,
	// as the pool may have none to spare for another. A check that could
	// not run leaves the name to the caller's transaction.
	if !d.sessionOK.Load() {
		if err := d.checkSession(ctx, c); errors.Is(err, idem.ErrInvalidConfig) {
			return 0, false, err
		} else if err != nil {
			return 0, false, nil
		}
	}
	err = d.execNoWait(ctx, c, `INSERT IGNORE INTO `+d.t.handlers+` (name) VALUES (?)`, handler)
	switch n := errNumber(err); {
	case errors.Is(err, errNoSetStatement) || n == errLockWaitTimeout || n == errDeadlock:
		return 0, false, nil
	case err != nil:
		return 0, false, fmt.Errorf("mysql: intern handler name: %w", notMigrated(err))
	}
	if id, err = d.readCommitted(ctx, c, handler); err != nil {
		return 0, false, fmt.Errorf("mysql: intern handler name: %w", notMigrated(err))
	}
	return id, true, nil
}

// spareConn reports whether the pool may have a connection for a statement
// of its own: it is unbounded or not all its connections are in use.
func (d *Driver) spareConn() bool {
	st := d.db.Stats()
	return st.MaxOpenConnections == 0 || st.InUse < st.MaxOpenConnections
}

// internPooled reads handler's id on the pool, inserting the name first
// when it is not there, each committed at once, and caches the id.
func (d *Driver) internPooled(ctx context.Context, handler string) (int32, error) {
	if err := d.ready(ctx); err != nil {
		return 0, err
	}
	var id int32
	err := d.retry(ctx, func() error {
		var err error
		if id, err = d.readCommitted(ctx, d.db, handler); !errors.Is(err, sql.ErrNoRows) {
			return err
		}
		if _, err := d.db.ExecContext(ctx, `INSERT IGNORE INTO `+d.t.handlers+` (name) VALUES (?)`, handler); err != nil {
			return err
		}
		id, err = d.readCommitted(ctx, d.db, handler)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("mysql: intern handler name: %w", notMigrated(err))
	}
	return id, nil
}

// MarkerInsert implements driver.Driver: a plain INSERT, which waits on an
// uncommitted marker of the same key and then either inserts (the other
// transaction rolled back) or fails with a duplicate key (it committed).
// The duplicate's hash is then read with a locking read, which sees the
// committed row whatever the isolation level. A duplicate key undoes the
// statement only, not the transaction.
func (d *Driver) MarkerInsert(ctx context.Context, tx *sql.Tx, p *driver.MarkerInsertParams) (driver.MarkerInsertResult, error) {
	res, err := d.markerInsert(ctx, tx, p)
	return res, notMigrated(err)
}

func (d *Driver) markerInsert(ctx context.Context, tx *sql.Tx, p *driver.MarkerInsertParams) (driver.MarkerInsertResult, error) {
	hid, err := d.handlerID(ctx, tx, p.Handler)
	if err != nil {
		return driver.MarkerInsertResult{}, err
	}
	hash := storedHash(p.PayloadHash)
	for range 3 {
		_, err := tx.ExecContext(ctx, d.sql.insertMarker, hid, p.MessageID, hash)
		if err == nil {
			return driver.MarkerInsertResult{Inserted: true}, nil
		}
		if errNumber(err) != errDupEntry {
			return driver.MarkerInsertResult{}, err
		}
		var existing []byte
		err = tx.QueryRowContext(ctx, d.sql.selectHash, hid, p.MessageID).Scan(&existing)
		if err == nil {
			if existing == nil {
				existing = []byte{}
			}
			return driver.MarkerInsertResult{ExistingHash: existing}, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return driver.MarkerInsertResult{}, fmt.Errorf("mysql: read existing marker: %w", err)
		}
		// Retention deleted the marker in between: insert again.
	}
	return driver.MarkerInsertResult{}, fmt.Errorf("mysql: the marker of %q conflicted, then vanished, three times; retry", p.MessageID)
}

// BeginMarkerInsert implements driver.BeginMarkerInserter: it opens a
// transaction and inserts the marker, and runs both again after a
// deadlock or lock wait timeout (the handler has not run yet).
func (d *Driver) BeginMarkerInsert(ctx context.Context, p *driver.MarkerInsertParams) (*sql.Tx, driver.MarkerInsertResult, error) {
	// The handler's id first, on the pool, while this call holds no
	// connection: a name interned here is committed and cached.
	if _, err := d.handlerID(ctx, d.db, p.Handler); err != nil {
		return nil, driver.MarkerInsertResult{}, err
	}
	var (
		tx  *sql.Tx
		res driver.MarkerInsertResult
	)
	err := d.retry(ctx, func() error {
		var err error
		if tx, err = d.Begin(ctx); err != nil {
			return err
		}
		if res, err = d.markerInsert(ctx, tx, p); err != nil {
			_ = tx.Rollback()
			return err
		}
		return nil
	})
	if err != nil {
		return nil, driver.MarkerInsertResult{}, notMigrated(err)
	}
	return tx, res, nil
}

// MarkerInsertMany implements driver.Driver. It bets that the batch is
// new: the markers go in multi-row INSERTs of up to markerChunk rows. A
// chunk that meets an existing marker fails as a whole (the statement is
// undone, the transaction stays); the chunk's existing markers are then
// read with a locking read, which waits for uncommitted ones, and the
// others inserted. Should another transaction commit one of those in
// between, the read and insert run again.
func (d *Driver) MarkerInsertMany(ctx context.Context, tx *sql.Tx, p *driver.MarkerInsertManyParams) ([]driver.MarkerInsertResult, error) {
	res, err := d.markerInsertMany(ctx, tx, p)
	return res, notMigrated(err)
}

func (d *Driver) markerInsertMany(ctx context.Context, tx *sql.Tx, p *driver.MarkerInsertManyParams) ([]driver.MarkerInsertResult, error) {
	if len(p.MessageIDs) != len(p.PayloadHashes) {
		return nil, fmt.Errorf("mysql: %d message IDs for %d hashes", len(p.MessageIDs), len(p.PayloadHashes))
	}
	hid, err := d.handlerID(ctx, tx, p.Handler)
	if err != nil {
		return nil, err
	}
	out := make([]driver.MarkerInsertResult, len(p.MessageIDs))
	for lo := 0; lo < len(p.MessageIDs); lo += markerChunk {
		hi := min(lo+markerChunk, len(p.MessageIDs))
		idx := make([]int, 0, hi-lo)
		for i := lo; i < hi; i++ {
			idx = append(idx, i)
		}
		if err := d.insertChunk(ctx, tx, hid, p, idx, out); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// insertChunk inserts the markers at idx, filling out.
func (d *Driver) insertChunk(ctx context.Context, tx *sql.Tx, hid int32, p *driver.MarkerInsertManyParams, idx []int, out []driver.MarkerInsertResult) error {
	err := d.insertRows(ctx, tx, hid, p, idx)
	if err == nil {
		for _, i := range idx {
			out[i].Inserted = true
		}
		return nil
	}
	if errNumber(err) != errDupEntry {
		return err
	}
	// Each duplicate key means another transaction committed one of the
	// markers, which the next read finds: the loop ends. The bound guards
	// against markers that retention deletes in between, over and over.
	for range 2*len(idx) + 5 {
		existing, err := d.existingHashes(ctx, tx, hid, p, idx)
		if err != nil {
			return err
		}
		var rest []int
		for _, i := range idx {
			if h, ok := existing[p.MessageIDs[i]]; ok {
				out[i].ExistingHash = h
			} else {
				rest = append(rest, i)
			}
		}
		if len(rest) == 0 {
			return nil
		}
		err = d.insertRows(ctx, tx, hid, p, rest)
		if err == nil {
			for _, i := range rest {
				out[i].Inserted = true
			}
			return nil
		}
		if errNumber(err) != errDupEntry {
			return err
		}
		idx = rest
	}
	return fmt.Errorf("mysql: markers of handler %q kept conflicting with concurrent inserts; retry", p.Handler)
}

// insertRows inserts the markers at idx with one plain multi-row INSERT.
func (d *Driver) insertRows(ctx context.Context, tx *sql.Tx, hid int32, p *driver.MarkerInsertManyParams, idx []int) error {
	var q strings.Builder
	q.WriteString(`INSERT INTO ` + d.t.markers + ` (handler_id, message_id, payload_hash, processed_at) VALUES `)
	args := make([]any, 0, 3*len(idx))
	for j, i := range idx {
		if j > 0 {
			q.WriteString(", ")
		}
		q.WriteString(`(?, ?, ?, ` + nowMicros + `)`)
		args = append(args, hid, p.MessageIDs[i], storedHash(p.PayloadHashes[i]))
	}
	_, err := tx.ExecContext(ctx, q.String(), args...)
	return err
}

// existingHashes reads, with a locking read, the hashes of the markers at
// idx that exist (committed, or this transaction's own).
func (d *Driver) existingHashes(ctx context.Context, tx *sql.Tx, hid int32, p *driver.MarkerInsertManyParams, idx []int) (map[string][]byte, error) {
	args := make([]any, 0, 1+len(idx))
	args = append(args, hid)
	for _, i := range idx {
		args = append(args, p.MessageIDs[i])
	}
	rows, err := tx.QueryContext(ctx, `SELECT message_id, payload_hash FROM `+d.t.markers+
		` WHERE handler_id = ? AND message_id IN (?`+strings.Repeat(", ?", len(idx)-1)+`) LOCK IN SHARE MODE`, args...)
	if err != nil {
		return nil, fmt.Errorf("mysql: read existing markers: %w", err)
	}
	defer rows.Close()
	out := make(map[string][]byte, len(idx))
	for rows.Next() {
		var (
			id string
			h  []byte
		)
		if err := rows.Scan(&id, &h); err != nil {
			return nil, fmt.Errorf("mysql: read existing markers: %w", err)
		}
		if h == nil {
			h = []byte{}
		}
		out[id] = h
	}
	return out, rows.Err()
}

// BeginMarkerInsertMany implements driver.BeginMarkerManyInserter: it
// opens a transaction and inserts the batch's markers, and runs both again
// after a deadlock or lock wait timeout (the handler has not run yet).
func (d *Driver) BeginMarkerInsertMany(ctx context.Context, p *driver.MarkerInsertManyParams) (*sql.Tx, []driver.MarkerInsertResult, error) {
	// The handler's id first, on the pool, while this call holds no
	// connection: a name interned here is committed and cached.
	if _, err := d.handlerID(ctx, d.db, p.Handler); err != nil {
		return nil, nil, err
	}
	var (
		tx  *sql.Tx
		res []driver.MarkerInsertResult
	)
	err := d.retry(ctx, func() error {
		var err error
		if tx, err = d.Begin(ctx); err != nil {
			return err
		}
		if res, err = d.markerInsertMany(ctx, tx, p); err != nil {
			_ = tx.Rollback()
			return err
		}
		return nil
	})
	if err != nil {
		return nil, nil, notMigrated(err)
	}
	return tx, res, nil
}

// MarkerDelete implements driver.MarkerDeleter with one statement.
func (d *Driver) MarkerDelete(ctx context.Context, tx *sql.Tx, p *driver.MarkerDeleteParams) error {
	if len(p.MessageIDs) == 0 {
		return nil
	}
	hid, err := d.handlerID(ctx, tx, p.Handler)
	if err != nil {
		return err
	}
	args := make([]any, 0, 1+len(p.MessageIDs))
	args = append(args, hid)
	for _, id := range p.MessageIDs {
		args = append(args, id)
	}
	_, err = tx.ExecContext(ctx, `DELETE FROM `+d.t.markers+` WHERE handler_id = ? AND message_id IN (?`+
		strings.Repeat(", ?", len(p.MessageIDs)-1)+`)`, args...)
	return err
}
