package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/idemhq/idem/driver"
)

var (
	_ driver.LeaseDriver    = (*Driver)(nil)
	_ driver.LeaseSequencer = (*Driver)(nil)
	_ driver.LeaseRearmer   = (*Driver)(nil)
)

// Lease mode keeps its rows in the leases table. Every operation is a
// short statement or transaction of its own; no transaction stays open
// while a handler runs. Times come from the server's clock, so workers on
// several hosts agree on when a lease expires.

// LeaseClaim implements driver.LeaseDriver in one short transaction: a
// conditional UPDATE takes over an expired or due row (it waits on a
// concurrent claimer's row lock, then re-checks the condition on the
// committed row, so two claimers never both win), and where there is no
// row an INSERT creates it, unless the handler has an atomic or imported
// marker of the message, which LeaseGet then reads as done (a concurrent
// insert makes it fail with a duplicate key: the other claimer won). The new token and lease are read
// back inside the transaction, under the row's lock.
func (d *Driver) LeaseClaim(ctx context.Context, p *driver.LeaseClaimParams) (driver.LeaseClaimResult, error) {
	ttl := p.TTL.Microseconds()
	for range 3 {
		var res driver.LeaseClaimResult
		err := d.retry(ctx, func() error {
			res = driver.LeaseClaimResult{}
			tx, err := d.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			r, err := tx.ExecContext(ctx, `UPDATE `+d.t.leases+` SET status = 'running', owner = ?, lease_until = `+nowMicros+` + ?,
  token = token + 1, attempts = attempts + 1, next_attempt_at = NULL
WHERE handler = ? AND message_id = ? AND payload_hash = ?
  AND ((status = 'running' AND lease_until <= `+nowMicros+`) OR (status = 'failed' AND next_attempt_at <= `+nowMicros+`))`,
				p.Owner, ttl, p.Handler, p.MessageID, p.PayloadHash)
			if err != nil {
				return err
			}
			n, err := r.RowsAffected()
			if err != nil {
				return err
			}
			if n == 0 {
				// No lease row to take over: a new one, unless the key
				// has a marker of the handler name (imported, or
				// written by atomic mode), which LeaseGet reads as done.
				r, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.leases+`
  (handler, message_id, payload_hash, processed_at, status, owner, lease_until, token, attempts)
SELECT ?, ?, ?, `+nowMicros+`, 'running', ?, `+nowMicros+` + ?, 1, 1 FROM DUAL
WHERE NOT EXISTS (`+d.markerOfName()+`)`,
					p.Handler, p.MessageID, p.PayloadHash, p.Owner, ttl, p.Handler, p.MessageID)
				if errNumber(err) == errDupEntry {
					return nil // a row exists and is not claimable
				}
				if err != nil {
					return err
				}
				if n, err := r.RowsAffected(); err != nil || n == 0 {
					return err // a marker: not claimable
				}
			}
			var until int64
			if err := tx.QueryRowContext(ctx, `SELECT token, attempts, lease_until FROM `+d.t.leases+` WHERE handler = ? AND message_id = ?`,
				p.Handler, p.MessageID).Scan(&res.Token, &res.Attempt, &until); err != nil {
				return err
			}
			if err := tx.Commit(); err != nil {
				return err
			}
			res.Claimed, res.LeaseUntil = true, time.UnixMicro(until)
			return nil
		})
		if err != nil {
			return driver.LeaseClaimResult{}, fmt.Errorf("mysql: claim lease: %w", notMigrated(err))
		}
		if res.Claimed {
			return res, nil
		}
		row, err := d.LeaseGet(ctx, &driver.LeaseGetParams{Handler: p.Handler, MessageID: p.MessageID})
		if err != nil {
			return driver.LeaseClaimResult{}, err
		}
		if row != nil {
			return driver.LeaseClaimResult{Existing: row}, nil
		}
		// The row went away in between (retention): claim again.
	}
	return driver.LeaseClaimResult{}, nil
}

// LeaseHeartbeat implements driver.LeaseDriver.
func (d *Driver) LeaseHeartbeat(ctx context.Context, p *driver.LeaseHeartbeatParams) (driver.LeaseWriteResult, error) {
	if err := d.ready(ctx); err != nil {
		return driver.LeaseWriteResult{}, err
	}
	r, err := d.db.ExecContext(ctx, `UPDATE `+d.t.leases+` SET lease_until = `+nowMicros+` + ?
WHERE handler = ? AND message_id = ? AND token = ? AND status = 'running'`,
		p.TTL.Microseconds(), p.Handler, p.MessageID, p.Token)
	return d.fencedWrite(ctx, "heartbeat", p.Handler, p.MessageID, p.Token, r, err)
}

// leaseDoneSQL is LeaseComplete's fenced update.
const leaseDoneSQL = ` SET status = 'done', lease_until = NULL, next_attempt_at = NULL, last_error = NULL, processed_at = ` + nowMicros + `
WHERE handler = ? AND message_id = ? AND token = ? AND status = 'running'`

// LeaseComplete implements driver.LeaseDriver. With Advance, the fenced
// update and the sequence's advance share one transaction.
func (d *Driver) LeaseComplete(ctx context.Context, p *driver.LeaseCompleteParams) (driver.LeaseWriteResult, error) {
	if err := d.ready(ctx); err != nil {
		return driver.LeaseWriteResult{}, err
	}
	if p.Advance == nil {
		r, err := d.db.ExecContext(ctx, `UPDATE `+d.t.leases+leaseDoneSQL, p.Handler, p.MessageID, p.Token)
		return d.fencedWrite(ctx, "mark done", p.Handler, p.MessageID, p.Token, r, err)
	}
	var ok bool
	err := d.retry(ctx, func() error {
		ok = false
		tx, err := d.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		r, err := tx.ExecContext(ctx, `UPDATE `+d.t.leases+leaseDoneSQL, p.Handler, p.MessageID, p.Token)
		if err != nil {
			return err
		}
		if n, err := r.RowsAffected(); err != nil || n != 1 {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.sequences+` (handler, aggregate_id, last_seq) VALUES (?, ?, ?)
ON DUPLICATE KEY UPDATE last_seq = GREATEST(last_seq, VALUES(last_seq))`, p.Handler, p.Advance.AggregateID, p.Advance.Seq); err != nil {
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		ok = true
		return nil
	})
	if err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("mysql: lease mark done: %w", notMigrated(err))
	}
	if ok {
		return driver.LeaseWriteResult{OK: true}, nil
	}
	return d.staleToken(ctx, p.Handler, p.MessageID)
}

// LeaseFail implements driver.LeaseDriver.
func (d *Driver) LeaseFail(ctx context.Context, p *driver.LeaseFailParams) (driver.LeaseWriteResult, error) {
	if err := d.ready(ctx); err != nil {
		return driver.LeaseWriteResult{}, err
	}
	r, err := d.db.ExecContext(ctx, `UPDATE `+d.t.leases+`
SET status = 'failed', lease_until = NULL, last_error = ?, next_attempt_at = IF(?, NULL, `+nowMicros+` + ?),
    processed_at = `+nowMicros+`, attempts = IF(?, attempts - 1, attempts)
WHERE handler = ? AND message_id = ? AND token = ? AND status = 'running'`,
		p.LastError, p.Permanent, p.RetryIn.Microseconds(), p.NotCalled, p.Handler, p.MessageID, p.Token)
	return d.fencedWrite(ctx, "mark failed", p.Handler, p.MessageID, p.Token, r, err)
}

// LeaseRearm implements driver.LeaseRearmer.
func (d *Driver) LeaseRearm(ctx context.Context, handler, messageID string) error {
	if err := d.ready(ctx); err != nil {
		return err
	}
	if _, err := d.db.ExecContext(ctx, `UPDATE `+d.t.leases+` SET next_attempt_at = `+nowMicros+`, attempts = 0
WHERE handler = ? AND message_id = ? AND status = 'failed'`, handler, messageID); err != nil {
		return fmt.Errorf("mysql: rearm lease: %w", notMigrated(err))
	}
	return nil
}

// fencedWrite turns the result of a token-guarded UPDATE into a
// LeaseWriteResult. InnoDB counts changed rows, not matched ones: a
// heartbeat that sets the lease to the value it holds changes nothing, so
// when no row changed the row is read, and a current token with a running
// lease is a success.
func (d *Driver) fencedWrite(ctx context.Context, op, handler, id string, token int64, r sql.Result, err error) (driver.LeaseWriteResult, error) {
	if err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("mysql: lease %s: %w", op, notMigrated(err))
	}
	n, err := r.RowsAffected()
	if err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("mysql: lease %s: %w", op, err)
	}
	if n == 1 {
		return driver.LeaseWriteResult{OK: true}, nil
	}
	row, err := d.LeaseGet(ctx, &driver.LeaseGetParams{Handler: handler, MessageID: id})
	if err != nil {
		return driver.LeaseWriteResult{}, err
	}
	if op == "heartbeat" && row != nil && row.Token == token && row.Status == driver.LeaseRunning {
		return driver.LeaseWriteResult{OK: true}, nil
	}
	return driver.LeaseWriteResult{Current: row}, nil
}

// staleToken is the answer of a fenced write that matched no row.
func (d *Driver) staleToken(ctx context.Context, handler, id string) (driver.LeaseWriteResult, error) {
	row, err := d.LeaseGet(ctx, &driver.LeaseGetParams{Handler: handler, MessageID: id})
	if err != nil {
		return driver.LeaseWriteResult{}, err
	}
	return driver.LeaseWriteResult{Current: row}, nil
}

// LeaseGet implements driver.LeaseDriver.
func (d *Driver) LeaseGet(ctx context.Context, p *driver.LeaseGetParams) (*driver.LeaseRow, error) {
	if err := d.ready(ctx); err != nil {
		return nil, err
	}
	var (
		row               driver.LeaseRow
		status            string
		leaseUntil, nextA sql.NullInt64
		now               int64
	)
	err := d.db.QueryRowContext(ctx, `SELECT status, payload_hash, COALESCE(owner, ''), token, attempts,
    lease_until, next_attempt_at, COALESCE(last_error, ''), `+nowMicros+`
FROM `+d.t.leases+` WHERE handler = ? AND message_id = ?`, p.Handler, p.MessageID).Scan(
		&status, &row.PayloadHash, &row.Owner, &row.Token, &row.Attempts, &leaseUntil, &nextA, &row.LastError, &now)
	if errors.Is(err, sql.ErrNoRows) {
		return d.markerAsLease(ctx, p)
	}
	if err != nil {
		return nil, fmt.Errorf("mysql: read lease: %w", notMigrated(err))
	}
	row.Status = driver.LeaseStatus(status)
	row.LeaseUntil, row.NextAttemptAt = fromMicros(leaseUntil), fromMicros(nextA)
	row.Now = time.UnixMicro(now)
	return &row, nil
}

// markerOfName is a query of the marker of handler name ? and message ID
// ?, for EXISTS: it reads the name through the handlers table, so that
// no name is interned for it.
func (d *Driver) markerOfName() string {
	return `SELECT m.payload_hash FROM ` + d.t.markers + ` m JOIN ` + d.t.handlers + ` h ON h.id = m.handler_id
WHERE h.name = ? AND m.message_id = ?`
}

// markerAsLease reads the marker of (p.Handler, p.MessageID) in the
// markers table (imported, or written by atomic mode) as a done lease row
// with token 0, as the Postgres driver does and as SQLite's shared table
// reads; nil when there is none.
func (d *Driver) markerAsLease(ctx context.Context, p *driver.LeaseGetParams) (*driver.LeaseRow, error) {
	row := driver.LeaseRow{Status: driver.LeaseDone}
	var now int64
	err := d.db.QueryRowContext(ctx, `SELECT x.payload_hash, `+nowMicros+` FROM (`+d.markerOfName()+`) x`,
		p.Handler, p.MessageID).Scan(&row.PayloadHash, &now)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("mysql: read marker: %w", notMigrated(err))
	}
	row.Now = time.UnixMicro(now)
	return &row, nil
}
