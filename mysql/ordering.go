package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

var (
	_ driver.SequenceGuard[*sql.Tx]         = (*Driver)(nil)
	_ driver.BeginSequenceAdvancer[*sql.Tx] = (*Driver)(nil)
	_ driver.SequenceBatchStore[*sql.Tx]    = (*Driver)(nil)
	_ driver.VersionStore[*sql.Tx]          = (*Driver)(nil)
	_ driver.GapPruner                      = (*Driver)(nil)
)

// SequenceAdvance implements driver.SequenceGuard with one conditional
// write: an upsert when the sequence may create the row (1, or any under
// AllowGap), else an UPDATE of the row at Seq−1. Both wait on the row of a
// concurrent transaction and then decide on its committed value. When
// nothing moved, the last sequence is read with a locking read, which sees
// the latest committed value at any isolation level.
//
// The upsert's count tells an unchanged row (0) from an advanced one only
// on connections that count changed rows, MySQL's default. On a pool with
// clientFoundRows=true the unchanged branch counts 1, as an insert does:
// there (and until rowsCountMatched finds out) the row is upserted at 0
// first, which creates it or takes its exclusive lock, then moved by an
// UPDATE whose new value always differs from the one it matched, so
// matched and changed are one count. An UPDATE before the upsert would,
// at REPEATABLE READ, gap-lock a missing row and deadlock concurrent
// creators.
func (d *Driver) SequenceAdvance(ctx context.Context, tx *sql.Tx, p *driver.SequenceAdvanceParams) (driver.SequenceAdvanceResult, error) {
	var (
		advanced bool
		err      error
	)
	if p.Seq == 1 || p.AllowGap {
		if d.rowsCountMatched(ctx) {
			if _, err = tx.ExecContext(ctx, `INSERT INTO `+d.t.sequences+` (handler, aggregate_id, last_seq) VALUES (?, ?, 0)
ON DUPLICATE KEY UPDATE last_seq = last_seq`, p.Handler, p.AggregateID); err == nil {
				advanced, err = d.advanceRow(ctx, tx, p)
			}
		} else {
			var r sql.Result
			if r, err = tx.ExecContext(ctx, `INSERT INTO `+d.t.sequences+` (handler, aggregate_id, last_seq) VALUES (?, ?, ?)
ON DUPLICATE KEY UPDATE last_seq = IF(last_seq = VALUES(last_seq) - 1 OR (? AND last_seq < VALUES(last_seq)), VALUES(last_seq), last_seq)`,
				p.Handler, p.AggregateID, p.Seq, p.AllowGap); err == nil {
				// 1 inserted, 2 updated, 0 unchanged.
				var n int64
				n, err = r.RowsAffected()
				advanced = n > 0
			}
		}
	} else {
		advanced, err = d.advanceRow(ctx, tx, p)
	}
	if err != nil {
		return driver.SequenceAdvanceResult{}, notMigrated(err)
	}
	if advanced {
		return driver.SequenceAdvanceResult{Advanced: true}, nil
	}
	var last int64
	err = tx.QueryRowContext(ctx, `SELECT last_seq FROM `+d.t.sequences+` WHERE handler = ? AND aggregate_id = ? LOCK IN SHARE MODE`,
		p.Handler, p.AggregateID).Scan(&last)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return driver.SequenceAdvanceResult{}, err
	}
	return driver.SequenceAdvanceResult{Last: last}, nil
}

// advanceRow moves an existing sequence row to p.Seq when p.Seq follows
// it (or, with AllowGap, is later), and reports whether it did. The new
// value always differs from the one matched, so the count is the same
// whether the connection counts matched rows or changed ones.
func (d *Driver) advanceRow(ctx context.Context, tx *sql.Tx, p *driver.SequenceAdvanceParams) (bool, error) {
	r, err := tx.ExecContext(ctx, `UPDATE `+d.t.sequences+` SET last_seq = ?
WHERE handler = ? AND aggregate_id = ? AND (last_seq = ? OR (? AND last_seq < ?))`,
		p.Seq, p.Handler, p.AggregateID, p.Seq-1, p.AllowGap, p.Seq)
	if err != nil {
		return false, err
	}
	n, err := r.RowsAffected()
	return n > 0, err
}

// rowsCountMatched reports whether the pool's connections count the rows
// an UPDATE matched rather than those it changed (CLIENT_FOUND_ROWS, the
// DSN's clientFoundRows=true), found once: in a transaction of its own,
// rolled back, a sequence row no handler can have (the empty name) is
// inserted, then set to the value it holds, which changes nothing but
// matches one row. It needs a second connection while the caller holds
// one: when none comes within probeWait (a pool of one, a busy pool), it
// answers true, and SequenceAdvance takes the path right on either kind
// of connection, one statement longer, until a later call finds out.
func (d *Driver) rowsCountMatched(ctx context.Context) bool {
	switch d.countsMatched.Load() {
	case 1:
		return false
	case 2:
		return true
	}
	pctx, cancel := context.WithTimeout(ctx, probeWait)
	defer cancel()
	matched, err := func() (bool, error) {
		tx, err := d.db.BeginTx(pctx, d.txOpts)
		if err != nil {
			return false, err
		}
		defer func() { _ = tx.Rollback() }()
		q := `INSERT INTO ` + d.t.sequences + ` (handler, aggregate_id, last_seq) VALUES ('', '', 0) ON DUPLICATE KEY UPDATE last_seq = last_seq`
		if _, err := tx.ExecContext(pctx, q); err != nil {
			return false, err
		}
		r, err := tx.ExecContext(pctx, q)
		if err != nil {
			return false, err
		}
		n, err := r.RowsAffected()
		return n > 0, err
	}()
	switch {
	case err != nil:
		return true
	case matched:
		d.countsMatched.Store(2)
	default:
		d.countsMatched.Store(1)
	}
	return matched
}

// probeWait bounds rowsCountMatched's wait for a connection and its
// statements.
const probeWait = time.Second

// BeginSequenceAdvance implements driver.BeginSequenceAdvancer: it opens a
// transaction and runs SequenceAdvance, both again after a deadlock or
// lock wait timeout (the handler has not run yet).
func (d *Driver) BeginSequenceAdvance(ctx context.Context, p *driver.SequenceAdvanceParams) (*sql.Tx, driver.SequenceAdvanceResult, error) {
	var (
		tx  *sql.Tx
		res driver.SequenceAdvanceResult
	)
	err := d.retry(ctx, func() error {
		var err error
		if tx, err = d.Begin(ctx); err != nil {
			return err
		}
		if res, err = d.SequenceAdvance(ctx, tx, p); err != nil {
			_ = tx.Rollback()
			return err
		}
		return nil
	})
	if err != nil {
		return nil, driver.SequenceAdvanceResult{}, err
	}
	return tx, res, nil
}

// inList returns "(?, ?, …)" for n values.
func inList(n int) string { return "(?" + strings.Repeat(", ?", n-1) + ")" }

// SequenceLockMany implements driver.SequenceBatchStore: rows this driver
// has not seen created at 0 first, outside the transaction (see
// createSequenceRows), then a locking read of the rows (in key order, as
// every batch), then any still missing inserted at 0, which locks them
// too. Should another transaction create
// one of those first, the insert waits for it and locks the row, whose
// value a second read takes.
func (d *Driver) SequenceLockMany(ctx context.Context, tx *sql.Tx, p *driver.SequenceLockManyParams) ([]int64, error) {
	if len(p.AggregateIDs) == 0 {
		return nil, nil
	}
	unseen, err := d.createSequenceRows(ctx, p.Handler, p.AggregateIDs)
	if err != nil {
		return nil, err
	}
	last := make(map[string]int64, len(p.AggregateIDs))
	found, err := d.lockSequences(ctx, tx, p.Handler, p.AggregateIDs)
	if err != nil {
		return nil, err
	}
	var missing []string
	for _, a := range p.AggregateIDs {
		if v, ok := found[a]; ok {
			last[a] = v
		} else {
			missing = append(missing, a)
		}
	}
	// Those found are committed (a locking read waits for their creator):
	// seen from now on.
	d.sequenceRows.addFound(p.Handler, unseen, found)
	if len(missing) > 0 {
		args := make([]any, 0, 2*len(missing))
		for _, a := range missing {
			args = append(args, p.Handler, a)
		}
		// ON DUPLICATE KEY UPDATE, not INSERT IGNORE: on a row another
		// transaction created meanwhile, IGNORE takes a shared lock, and
		// the exclusive one the batch needs next was an upgrade two
		// batches deadlocked on; this takes the exclusive lock at once.
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.sequences+` (handler, aggregate_id, last_seq) VALUES (?, ?, 0)`+
			strings.Repeat(", (?, ?, 0)", len(missing)-1)+` ON DUPLICATE KEY UPDATE last_seq = last_seq`, args...); err != nil {
			return nil, notMigrated(err)
		}
		// Read what the rows hold (0, or what a transaction that created
		// one meanwhile committed), locked already. Rows affected cannot
		// tell: a DSN with clientFoundRows counts a found row as changed.
		again, err := d.lockSequences(ctx, tx, p.Handler, missing)
		if err != nil {
			return nil, err
		}
		for a, v := range again {
			last[a] = v
		}
	}
	out := make([]int64, len(p.AggregateIDs))
	for i, a := range p.AggregateIDs {
		out[i] = last[a]
	}
	return out, nil
}

// lockSequences reads and locks the sequence rows of aggs that exist.
func (d *Driver) lockSequences(ctx context.Context, tx *sql.Tx, handler string, aggs []string) (map[string]int64, error) {
	args := make([]any, 0, 1+len(aggs))
	args = append(args, handler)
	for _, a := range aggs {
		args = append(args, a)
	}
	rows, err := tx.QueryContext(ctx, `SELECT aggregate_id, last_seq FROM `+d.t.sequences+` WHERE handler = ? AND aggregate_id IN `+
		inList(len(aggs))+` ORDER BY aggregate_id FOR UPDATE`, args...)
	if err != nil {
		return nil, notMigrated(err)
	}
	defer rows.Close()
	out := make(map[string]int64, len(aggs))
	for rows.Next() {
		var (
			a string
			v int64
		)
		if err := rows.Scan(&a, &v); err != nil {
			return nil, err
		}
		out[a] = v
	}
	return out, rows.Err()
}

// SequenceSetMany implements driver.SequenceBatchStore with one upsert.
func (d *Driver) SequenceSetMany(ctx context.Context, tx *sql.Tx, p *driver.SequenceSetManyParams) error {
	if len(p.AggregateIDs) != len(p.Seqs) {
		return fmt.Errorf("mysql: %d aggregate IDs for %d sequences", len(p.AggregateIDs), len(p.Seqs))
	}
	if len(p.AggregateIDs) == 0 {
		return nil
	}
	args := make([]any, 0, 3*len(p.AggregateIDs))
	for i, a := range p.AggregateIDs {
		args = append(args, p.Handler, a, p.Seqs[i])
	}
	_, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.sequences+` (handler, aggregate_id, last_seq) VALUES (?, ?, ?)`+
		strings.Repeat(", (?, ?, ?)", len(p.AggregateIDs)-1)+` ON DUPLICATE KEY UPDATE last_seq = VALUES(last_seq)`, args...)
	return err
}

// GapSighting implements driver.SequenceGuard on the server's clock. The
// clock is read once, first: a new sighting is stamped with it and
// reported with it, so however long the statements take in between (a
// loaded server), the first sighting never looks older than it is. An
// INSERT IGNORE keeps an earlier sighting, which the last read returns.
func (d *Driver) GapSighting(ctx context.Context, p *driver.GapSightingParams) (driver.GapSightingResult, error) {
	if err := d.ready(ctx); err != nil {
		return driver.GapSightingResult{}, err
	}
	var first, now int64
	err := d.retry(ctx, func() error {
		if err := d.db.QueryRowContext(ctx, `SELECT `+nowMicros).Scan(&now); err != nil {
			return err
		}
		if _, err := d.db.ExecContext(ctx, `INSERT IGNORE INTO `+d.t.gaps+` (handler, aggregate_id, seq, first_seen_at) VALUES (?, ?, ?, ?)`,
			p.Handler, p.AggregateID, p.Seq, now); err != nil {
			return err
		}
		return d.db.QueryRowContext(ctx, `SELECT first_seen_at FROM `+d.t.gaps+` WHERE handler = ? AND aggregate_id = ? AND seq = ?`,
			p.Handler, p.AggregateID, p.Seq).Scan(&first)
	})
	if err != nil {
		return driver.GapSightingResult{}, fmt.Errorf("mysql: record gap sighting: %w", notMigrated(err))
	}
	return driver.GapSightingResult{FirstSeen: time.UnixMicro(first), Now: time.UnixMicro(max(now, first))}, nil
}

// SequenceLast implements driver.LeaseSequencer.
func (d *Driver) SequenceLast(ctx context.Context, handler, aggregateID string) (int64, error) {
	if err := d.ready(ctx); err != nil {
		return 0, err
	}
	var last int64
	err := d.db.QueryRowContext(ctx, `SELECT COALESCE(MAX(last_seq), 0) FROM `+d.t.sequences+` WHERE handler = ? AND aggregate_id = ?`,
		handler, aggregateID).Scan(&last)
	if err != nil {
		return 0, fmt.Errorf("mysql: read last sequence: %w", notMigrated(err))
	}
	return last, nil
}

// PruneGaps implements driver.GapPruner: one bounded DELETE of sightings
// whose sequence the guard has reached, or first seen before before.
func (d *Driver) PruneGaps(ctx context.Context, before time.Time, limit int) (int, error) {
	if err := d.ready(ctx); err != nil {
		return 0, err
	}
	r, err := d.db.ExecContext(ctx, `DELETE g FROM `+d.t.gaps+` g JOIN (
  SELECT g2.handler, g2.aggregate_id, g2.seq FROM `+d.t.gaps+` g2 LEFT JOIN `+d.t.sequences+` s
    ON s.handler = g2.handler AND s.aggregate_id = g2.aggregate_id
  WHERE g2.first_seen_at < ? OR g2.seq <= s.last_seq LIMIT ?) x
  ON x.handler = g.handler AND x.aggregate_id = g.aggregate_id AND x.seq = g.seq`, micros(before), limit)
	if err != nil {
		return 0, fmt.Errorf("mysql: prune gap sightings: %w", err)
	}
	n, err := r.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("mysql: prune gap sightings: %w", err)
	}
	return int(n), nil
}

// VersionNext implements driver.VersionStore. The row is incremented with
// one UPDATE, whose LAST_INSERT_ID(expr) carries the new version back in
// the statement's reply: concurrent allocations queue on the row's lock,
// which a plain UPDATE takes without the gap locks of an upsert (those
// make InnoDB pick deadlock victims among concurrent upserts of one key).
// The row stays locked until tx ends, so a rolled back transaction gives
// its number back.
//
// A new aggregate's row is first created at version 0, committed on its
// own (see createVersionRow). Created inside tx, the row would vanish if
// tx rolled back, and the allocations queued behind it would deadlock
// among themselves (1213), losing their transactions, which are the
// caller's; concurrent upserts of one new key deadlock even when none
// rolls back. So when the UPDATE finds no row (the first attempt to create
// it met another's lock, or had no connection to spare), the row is
// created outside tx once more, waiting for a connection this time,
// before tx creates it itself.
func (d *Driver) VersionNext(ctx context.Context, tx *sql.Tx, p *driver.VersionParams) (int64, error) {
	k := [2]string{p.Stream, p.AggregateID}
	if err := d.createVersionRow(ctx, p, false); err != nil {
		return 0, err
	}
	for again := true; ; again = false {
		r, err := tx.ExecContext(ctx, `UPDATE `+d.t.versions+` SET version = LAST_INSERT_ID(version + 1) WHERE stream = ? AND aggregate_id = ?`,
			p.Stream, p.AggregateID)
		if err != nil {
			return 0, notMigrated(err)
		}
		if n, err := r.RowsAffected(); err != nil {
			return 0, err
		} else if n == 1 {
			return r.LastInsertId()
		}
		// No row: createVersionRow could not create it, or the row it
		// saw once is gone.
		d.versionRows.forget(k)
		if !again {
			break
		}
		if err := d.createVersionRow(ctx, p, true); err != nil {
			return 0, err
		}
		if !d.versionRows.has(k) {
			break
		}
	}
	r, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.versions+` (stream, aggregate_id, version) VALUES (?, ?, LAST_INSERT_ID(1))
ON DUPLICATE KEY UPDATE version = LAST_INSERT_ID(version + 1)`, p.Stream, p.AggregateID)
	if err != nil {
		return 0, notMigrated(err)
	}
	return r.LastInsertId()
}

// versionRowWait bounds how long createVersionRow waits for a connection.
const versionRowWait = 500 * time.Millisecond

// createVersionRow creates the version row of an aggregate this driver has
// not seen at version 0, if it is missing, with an INSERT IGNORE of its
// own, committed on another connection than the caller's transaction.
// Rows seen already (versionRows) cost nothing.
//
// The INSERT must not wait on a lock: the caller's transaction may hold
// one it needs (a gap lock of REPEATABLE READ, the row itself, updated
// earlier in the transaction), and nothing would release it. It runs with
// innodb_lock_wait_timeout 0 (MariaDB's SET STATEMENT), which fails at
// once instead. The lock met is most often another delivery's: the same
// INSERT of the same new row, committed a moment later, or an allocation
// holding the row. So a lock met is tried again a few times over
// versionRowRetry, looking first, without a lock, whether the row is
// there now. Whenever the row is not created (a lock held longer, a pool
// with no connection to spare, as a pool of one, none within
// versionRowWait, a server without SET STATEMENT), the caller creates the
// row inside its transaction, as idem did before this existed. A server
// that cannot parse SET STATEMENT (MySQL) is not asked again. With wait,
// a pool without a connection to spare is waited on, within
// versionRowWait, when statements of this kind hold some of its
// connections, which they give back in a moment.
//
// The INSERT commits by itself, so it runs on a connection whose session
// settings were checked (see ready), on that connection when the driver
// has not checked any yet. The error is that check's refusal, wrapping
// idem.ErrInvalidConfig; whatever else fails leaves the row to the caller.
func (d *Driver) createVersionRow(ctx context.Context, p *driver.VersionParams, wait bool) error {
	k := [2]string{p.Stream, p.AggregateID}
	if d.noSetStatement.Load() || d.versionRows.has(k) {
		return nil
	}
	if !d.spareConn() && (!wait || d.sideStatements.Load() == 0) {
		// A pool without a connection to spare gives one back soon only
		// when some are held by statements of this kind, a moment each;
		// when transactions hold them all (the caller's among them), none
		// may come before tx ends: waiting would stall every new
		// aggregate for versionRowWait.
		return nil
	}
	return d.autocommitNoWait(ctx, func(ctx context.Context, e execer) {
		deadline := time.Now().Add(versionRowRetry)
		for {
			err := d.execNoWait(ctx, e, `INSERT IGNORE INTO `+d.t.versions+` (stream, aggregate_id, version) VALUES (?, ?, 0)`,
				p.Stream, p.AggregateID)
			if err == nil {
				// The row exists, committed: the INSERT made it, or met
				// it without waiting.
				d.versionRows.add(k)
				return
			}
			if errNumber(err) != errLockWaitTimeout || !time.Now().Before(deadline) {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Duration(1+rand.IntN(2)) * time.Millisecond):
			}
			// A plain read takes no lock: a row committed meanwhile is
			// seen, held or not.
			var one int
			if e.QueryRowContext(ctx, `SELECT 1 FROM `+d.t.versions+` WHERE stream = ? AND aggregate_id = ?`,
				p.Stream, p.AggregateID).Scan(&one) == nil {
				d.versionRows.add(k)
				return
			}
		}
	})
}

// versionRowRetry bounds how long createVersionRow tries again a row whose
// INSERT met a lock.
const versionRowRetry = 20 * time.Millisecond

// execer runs a statement: the pool, or one of its connections.
type execer interface {
	ExecContext(context.Context, string, ...any) (sql.Result, error)
	querier
}

// autocommitNoWait runs f, within versionRowWait, on what a statement that
// commits by itself may run on: the pool, or, when the driver has checked
// no connection's session settings yet, a connection it checks first. The
// error is that check's refusal, wrapping idem.ErrInvalidConfig; when no
// connection comes, f does not run and the caller goes on without.
func (d *Driver) autocommitNoWait(ctx context.Context, f func(context.Context, execer)) error {
	ctx, cancel := context.WithTimeout(ctx, versionRowWait)
	defer cancel()
	var e execer = d.db
	if !d.sessionOK.Load() {
		c, err := d.db.Conn(ctx)
		if err != nil {
			return nil
		}
		defer c.Close()
		if err := d.checkSession(ctx, c); errors.Is(err, idem.ErrInvalidConfig) {
			return err
		} else if err != nil {
			return nil
		}
		e = c
	}
	d.sideStatements.Add(1)
	defer d.sideStatements.Add(-1)
	f(ctx, e)
	return nil
}

// createSequenceRows creates, at 0, the sequence rows of aggs (sorted) this
// driver has not seen, with one INSERT IGNORE committed by itself and
// never waiting on a lock, as createVersionRow creates version rows, so
// that SequenceLockMany then finds every row and locks them all in key
// order. Created inside the batch's transaction, a row came after rows of
// the batch found existing that sort behind it: two batches over the same
// new aggregates could each hold a row the other waited for. A row at 0
// means what a missing one does. Whenever the rows are not created (a
// lock met, no connection to spare, a server without SET STATEMENT),
// SequenceLockMany creates the missing ones inside the transaction. It
// returns the aggregates it has neither seen nor created, which
// SequenceLockMany remembers once its locking read finds their rows; rows
// seen cost one lookup under one lock.
func (d *Driver) createSequenceRows(ctx context.Context, handler string, aggs []string) (unseen []string, err error) {
	if d.noSetStatement.Load() {
		return nil, nil // nothing consults the rows seen
	}
	if unseen = d.sequenceRows.unseen(handler, aggs); len(unseen) == 0 || !d.spareConn() {
		return unseen, nil
	}
	created := false
	err = d.autocommitNoWait(ctx, func(ctx context.Context, e execer) {
		args := make([]any, 0, 2*len(unseen))
		for _, a := range unseen {
			args = append(args, handler, a)
		}
		created = d.execNoWait(ctx, e, `INSERT IGNORE INTO `+d.t.sequences+` (handler, aggregate_id, last_seq) VALUES (?, ?, 0)`+
			strings.Repeat(", (?, ?, 0)", len(unseen)-1), args...) == nil
	})
	if err != nil || !created {
		return unseen, err
	}
	d.sequenceRows.addAll(handler, unseen)
	return nil, nil
}

// errNoSetStatement is execNoWait's error on a server without SET
// STATEMENT.
var errNoSetStatement = errors.New("mysql: the server has no SET STATEMENT")

// execNoWait runs stmt on e with innodb_lock_wait_timeout 0 (MariaDB's SET
// STATEMENT), so that a lock it meets fails it at once (1205) instead of
// being waited on. On a server that cannot parse SET STATEMENT (MySQL) it
// returns errNoSetStatement, and the driver does not ask again.
func (d *Driver) execNoWait(ctx context.Context, e execer, stmt string, args ...any) error {
	if d.noSetStatement.Load() {
		return errNoSetStatement
	}
	_, err := e.ExecContext(ctx, `SET STATEMENT innodb_lock_wait_timeout = 0 FOR `+stmt, args...)
	if errNumber(err) == errParse {
		d.noSetStatement.Store(true)
		return errNoSetStatement
	}
	return err
}

// seenRows remembers, boundedly, the version or sequence rows known to
// exist.
type seenRows struct {
	mu sync.Mutex
	m  map[[2]string]struct{}
}

// seenRowsMax bounds seenRows; past it, the set starts afresh.
const seenRowsMax = 1 << 14

func (s *seenRows) has(k [2]string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.m[k]
	return ok
}

func (s *seenRows) forget(k [2]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, k)
}

// unseen returns the aggregates of aggs whose rows of handler have not
// been seen, under one lock.
func (s *seenRows) unseen(handler string, aggs []string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, a := range aggs {
		if _, ok := s.m[[2]string{handler, a}]; !ok {
			out = append(out, a)
		}
	}
	return out
}

// addAll remembers the rows of handler's aggs.
func (s *seenRows) addAll(handler string, aggs []string) {
	s.addFound(handler, aggs, nil)
}

// addFound remembers the rows of handler's aggs that found holds (all of
// them when found is nil), under one lock.
func (s *seenRows) addFound(handler string, aggs []string, found map[string]int64) {
	if len(aggs) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, a := range aggs {
		if _, ok := found[a]; found != nil && !ok {
			continue
		}
		if s.m == nil || len(s.m) >= seenRowsMax {
			s.m = make(map[[2]string]struct{})
		}
		s.m[[2]string{handler, a}] = struct{}{}
	}
}

func (s *seenRows) add(k [2]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil || len(s.m) >= seenRowsMax {
		s.m = make(map[[2]string]struct{})
	}
	s.m[k] = struct{}{}
}

// VersionAdvance implements driver.VersionStore with one conditional
// statement. With Expected 0, a new aggregate's row is created at 0 first,
// as VersionNext creates it, and created once more, waiting for a
// connection, when the statement finds no row.
func (d *Driver) VersionAdvance(ctx context.Context, tx *sql.Tx, p *driver.VersionParams) (bool, int64, error) {
	k := [2]string{p.Stream, p.AggregateID}
	if p.Expected == 0 {
		if err := d.createVersionRow(ctx, p, false); err != nil {
			return false, 0, err
		}
	}
	advance := func() (int64, error) {
		r, err := tx.ExecContext(ctx, `UPDATE `+d.t.versions+` SET version = version + 1 WHERE stream = ? AND aggregate_id = ? AND version = ?`,
			p.Stream, p.AggregateID, p.Expected)
		if err != nil {
			return 0, notMigrated(err)
		}
		return r.RowsAffected()
	}
	n, err := advance()
	if err != nil {
		return false, 0, err
	}
	if n == 0 && p.Expected == 0 && !d.versionRows.has(k) {
		// createVersionRow could not create the row, or it exists at
		// another version (then this finds it, without changing it).
		if err := d.createVersionRow(ctx, p, true); err != nil {
			return false, 0, err
		}
		if d.versionRows.has(k) {
			if n, err = advance(); err != nil {
				return false, 0, err
			}
		}
	}
	if n == 0 && p.Expected == 0 {
		// Still no row (or one at another version: the INSERT changes
		// nothing).
		var r sql.Result
		if r, err = tx.ExecContext(ctx, `INSERT IGNORE INTO `+d.t.versions+` (stream, aggregate_id, version) VALUES (?, ?, 1)`, p.Stream, p.AggregateID); err != nil {
			return false, 0, notMigrated(err)
		}
		if n, err = r.RowsAffected(); err != nil {
			return false, 0, err
		}
	}
	if n == 1 {
		return true, p.Expected + 1, nil
	}
	var v int64
	err = tx.QueryRowContext(ctx, `SELECT version FROM `+d.t.versions+` WHERE stream = ? AND aggregate_id = ? LOCK IN SHARE MODE`, p.Stream, p.AggregateID).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, fmt.Errorf("mysql: read version: %w", err)
	}
	return false, v, nil
}

// VersionCurrent implements driver.VersionStore.
func (d *Driver) VersionCurrent(ctx context.Context, tx *sql.Tx, p *driver.VersionParams) (int64, error) {
	var v int64
	err := tx.QueryRowContext(ctx, `SELECT version FROM `+d.t.versions+` WHERE stream = ? AND aggregate_id = ?`, p.Stream, p.AggregateID).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return v, notMigrated(err)
}
