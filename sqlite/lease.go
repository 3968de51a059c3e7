package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemhq/idem/driver"
)

var (
	_ driver.LeaseDriver    = (*Driver)(nil)
	_ driver.LeaseSequencer = (*Driver)(nil)
)

// Lease mode on SQLite runs every operation as one auto-committed statement
// on the database's connection, never inside a transaction that stays open
// while the handler runs. Times come from this host's clock, stored as Unix
// microseconds: every process that opens the file runs on the same host.

// LeaseClaim implements driver.LeaseDriver with one INSERT … ON CONFLICT DO
// UPDATE … WHERE … RETURNING: SQLite runs it atomically under its single
// writer lock, so two claimers (goroutines or processes) never both win.
//
// Lease mode begins no transaction of the driver's before its first claim,
// so the claim checks the journal mode first, until a check passed (see
// New).
func (d *Driver) LeaseClaim(ctx context.Context, p *driver.LeaseClaimParams) (driver.LeaseClaimResult, error) {
	if err := d.ready(ctx, d.db); err != nil {
		return driver.LeaseClaimResult{}, err
	}
	now := time.Now()
	until := now.Add(p.TTL)
	var (
		token    int64
		attempts int
	)
	err := d.db.QueryRowContext(ctx, `INSERT INTO `+d.tables.processed+` AS t
    (handler, message_id, payload_hash, processed_at, status, owner, lease_until, token, attempts)
VALUES (?1, ?2, ?3, ?4, 'running', ?5, ?6, 1, 1)
ON CONFLICT (handler, message_id) DO UPDATE SET
    status = 'running', owner = excluded.owner, lease_until = excluded.lease_until,
    token = t.token + 1, attempts = t.attempts + 1, next_attempt_at = NULL
WHERE t.payload_hash = excluded.payload_hash
  AND ((t.status = 'running' AND t.lease_until <= ?4)
    OR (t.status = 'failed' AND t.next_attempt_at <= ?4))
RETURNING token, attempts`,
		p.Handler, p.MessageID, p.PayloadHash, now.UnixMicro(), p.Owner, until.UnixMicro()).Scan(&token, &attempts)
	switch {
	case err == nil:
		return driver.LeaseClaimResult{Claimed: true, Token: token, Attempt: attempts, LeaseUntil: time.UnixMicro(until.UnixMicro())}, nil
	case !errors.Is(err, sql.ErrNoRows):
		return driver.LeaseClaimResult{}, fmt.Errorf("sqlite: claim lease: %w", err)
	}
	row, err := d.LeaseGet(ctx, &driver.LeaseGetParams{Handler: p.Handler, MessageID: p.MessageID})
	if err != nil {
		return driver.LeaseClaimResult{}, err
	}
	return driver.LeaseClaimResult{Existing: row}, nil
}

// LeaseHeartbeat implements driver.LeaseDriver.
func (d *Driver) LeaseHeartbeat(ctx context.Context, p *driver.LeaseHeartbeatParams) (driver.LeaseWriteResult, error) {
	until := time.Now().Add(p.TTL).UnixMicro()
	r, err := d.db.ExecContext(ctx, `UPDATE `+d.tables.processed+` SET lease_until = ?
WHERE handler = ? AND message_id = ? AND token = ? AND status = 'running'`,
		until, p.Handler, p.MessageID, p.Token)
	return d.fencedWrite(ctx, "heartbeat", p.Handler, p.MessageID, r, err)
}

// LeaseComplete implements driver.LeaseDriver.
func (d *Driver) LeaseComplete(ctx context.Context, p *driver.LeaseCompleteParams) (driver.LeaseWriteResult, error) {
	const done = `UPDATE {{t}}
SET status = 'done', lease_until = NULL, next_attempt_at = NULL, last_error = NULL, processed_at = ?
WHERE handler = ? AND message_id = ? AND token = ? AND status = 'running'`
	q := strings.Replace(done, "{{t}}", d.tables.processed, 1)
	if p.Advance == nil {
		r, err := d.db.ExecContext(ctx, q, time.Now().UnixMicro(), p.Handler, p.MessageID, p.Token)
		return d.fencedWrite(ctx, "mark done", p.Handler, p.MessageID, r, err)
	}
	// Mark done and advance the aggregate's sequence in one transaction;
	// the sequence moves only if the fenced update matched.
	tx, err := d.Begin(ctx)
	if err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("sqlite: lease mark done: %w", err)
	}
	defer tx.Rollback()
	r, err := tx.ExecContext(ctx, q, time.Now().UnixMicro(), p.Handler, p.MessageID, p.Token)
	if err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("sqlite: lease mark done: %w", err)
	}
	if n, err := r.RowsAffected(); err != nil || n != 1 {
		tx.Rollback()
		return d.fencedWrite(ctx, "mark done", p.Handler, p.MessageID, r, err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.tables.sequences+` (handler, aggregate_id, last_seq) VALUES (?, ?, ?)
ON CONFLICT (handler, aggregate_id) DO UPDATE SET last_seq = max(last_seq, excluded.last_seq)`,
		p.Handler, p.Advance.AggregateID, p.Advance.Seq); err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("sqlite: lease advance sequence: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("sqlite: lease mark done: %w", err)
	}
	return driver.LeaseWriteResult{OK: true}, nil
}

// SequenceLast implements driver.LeaseSequencer.
func (d *Driver) SequenceLast(ctx context.Context, handler, aggregateID string) (int64, error) {
	var last int64
	err := d.db.QueryRowContext(ctx, `SELECT COALESCE(max(last_seq), 0) FROM `+d.tables.sequences+` WHERE handler = ? AND aggregate_id = ?`,
		handler, aggregateID).Scan(&last)
	if err != nil {
		return 0, fmt.Errorf("sqlite: read last sequence: %w", err)
	}
	return last, nil
}

// LeaseFail implements driver.LeaseDriver.
func (d *Driver) LeaseFail(ctx context.Context, p *driver.LeaseFailParams) (driver.LeaseWriteResult, error) {
	var next sql.NullInt64
	if !p.Permanent {
		next = sql.NullInt64{Int64: time.Now().Add(p.RetryIn).UnixMicro(), Valid: true}
	}
	r, err := d.db.ExecContext(ctx, `UPDATE `+d.tables.processed+`
SET status = 'failed', lease_until = NULL, last_error = ?, next_attempt_at = ?, processed_at = ?,
    attempts = CASE WHEN ? THEN attempts - 1 ELSE attempts END
WHERE handler = ? AND message_id = ? AND token = ? AND status = 'running'`,
		p.LastError, next, time.Now().UnixMicro(), p.NotCalled, p.Handler, p.MessageID, p.Token)
	return d.fencedWrite(ctx, "mark failed", p.Handler, p.MessageID, r, err)
}

// LeaseRearm implements driver.LeaseRearmer.
func (d *Driver) LeaseRearm(ctx context.Context, handler, messageID string) error {
	if _, err := d.db.ExecContext(ctx, `UPDATE `+d.tables.processed+` SET next_attempt_at = ?, attempts = 0
WHERE handler = ? AND message_id = ? AND status = 'failed'`, time.Now().UnixMicro(), handler, messageID); err != nil {
		return fmt.Errorf("sqlite: rearm lease: %w", err)
	}
	return nil
}

// fencedWrite turns the result of a token-guarded UPDATE into a
// LeaseWriteResult, reading the current row when the token was stale.
func (d *Driver) fencedWrite(ctx context.Context, op, handler, id string, r sql.Result, err error) (driver.LeaseWriteResult, error) {
	if err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("sqlite: lease %s: %w", op, err)
	}
	n, err := r.RowsAffected()
	if err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("sqlite: lease %s: %w", op, err)
	}
	if n == 1 {
		return driver.LeaseWriteResult{OK: true}, nil
	}
	row, err := d.LeaseGet(ctx, &driver.LeaseGetParams{Handler: handler, MessageID: id})
	if err != nil {
		return driver.LeaseWriteResult{}, err
	}
	return driver.LeaseWriteResult{Current: row}, nil
}

// LeaseGet implements driver.LeaseDriver.
func (d *Driver) LeaseGet(ctx context.Context, p *driver.LeaseGetParams) (*driver.LeaseRow, error) {
	var (
		row               driver.LeaseRow
		status            string
		leaseUntil, nextA sql.NullInt64
	)
	now := time.Now()
	err := d.db.QueryRowContext(ctx, `SELECT status, payload_hash, coalesce(owner, ''), token, attempts,
    lease_until, next_attempt_at, coalesce(last_error, '')
FROM `+d.tables.processed+` WHERE handler = ? AND message_id = ?`, p.Handler, p.MessageID).Scan(
		&status, &row.PayloadHash, &row.Owner, &row.Token, &row.Attempts, &leaseUntil, &nextA, &row.LastError)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("sqlite: read lease: %w", err)
	}
	row.Status = driver.LeaseStatus(status)
	if leaseUntil.Valid {
		row.LeaseUntil = time.UnixMicro(leaseUntil.Int64)
	}
	if nextA.Valid {
		row.NextAttemptAt = time.UnixMicro(nextA.Int64)
	}
	row.Now = now
	return &row, nil
}
