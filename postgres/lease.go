package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemhq/idem/driver"
)

var (
	_ driver.LeaseDriver    = (*Driver)(nil)
	_ driver.LeaseSequencer = (*Driver)(nil)
)

// Lease mode on Postgres runs every operation as one auto-committed
// statement on a pooled connection, never inside a transaction that stays
// open while the handler runs. Every time comes from the database's clock
// (now()), so workers on different hosts agree on when a lease expires
// whatever their own clocks say. Durations travel as microseconds.

// leaseClaimSQL is one atomic statement: a concurrent claim of the same key
// waits on the primary key (or the row lock) and then evaluates the WHERE
// against the committed winner, so only one claimer gets a row back. A key
// with an atomic marker of the same handler name (%[2]s, since migration
// 010) is not claimed: LeaseGet reads that marker as done.
const leaseClaimSQL = `INSERT INTO %[1]s AS t
    (handler, message_id, payload_hash, status, owner, lease_until, token, attempts)
SELECT $1, $2, $3, 'running', $4, now() + $5::bigint * interval '1 microsecond', 1, 1
WHERE NOT EXISTS (SELECT 1 FROM %[2]s WHERE handler_id = $6 AND message_key = $7)
ON CONFLICT (handler, message_id) DO UPDATE SET
    status = 'running', owner = excluded.owner, lease_until = excluded.lease_until,
    token = t.token + 1, attempts = t.attempts + 1, next_attempt_at = NULL
WHERE t.payload_hash = excluded.payload_hash
  AND ((t.status = 'running' AND t.lease_until <= now())
    OR (t.status = 'failed' AND t.next_attempt_at <= now()))
RETURNING t.token, t.attempts, t.lease_until`

// LeaseClaim implements driver.LeaseDriver.
func (d *Driver) LeaseClaim(ctx context.Context, p *driver.LeaseClaimParams) (driver.LeaseClaimResult, error) {
	var res driver.LeaseClaimResult
	hid, err := d.handlerID(ctx, d.pool, p.Handler)
	if err != nil {
		return driver.LeaseClaimResult{}, err
	}
	err = d.auto.QueryRow(ctx, fmt.Sprintf(leaseClaimSQL, d.t.processed, d.t.markers),
		p.Handler, p.MessageID, p.PayloadHash, p.Owner, p.TTL.Microseconds(), hid, messageKey(p.MessageID)).Scan(&res.Token, &res.Attempt, &res.LeaseUntil)
	switch {
	case err == nil:
		res.Claimed = true
		return res, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return driver.LeaseClaimResult{}, fmt.Errorf("postgres: claim lease: %w", notMigrated(err))
	}
	row, err := d.LeaseGet(ctx, &driver.LeaseGetParams{Handler: p.Handler, MessageID: p.MessageID})
	if err != nil {
		return driver.LeaseClaimResult{}, err
	}
	return driver.LeaseClaimResult{Existing: row}, nil
}

// LeaseHeartbeat implements driver.LeaseDriver.
func (d *Driver) LeaseHeartbeat(ctx context.Context, p *driver.LeaseHeartbeatParams) (driver.LeaseWriteResult, error) {
	tag, err := d.auto.Exec(ctx, `UPDATE `+d.t.processed+` SET lease_until = now() + $4::bigint * interval '1 microsecond'
WHERE handler = $1 AND message_id = $2 AND token = $3 AND status = 'running'`,
		p.Handler, p.MessageID, p.Token, p.TTL.Microseconds())
	return d.fencedWrite(ctx, "heartbeat", p.Handler, p.MessageID, tag, err)
}

// LeaseComplete implements driver.LeaseDriver.
func (d *Driver) LeaseComplete(ctx context.Context, p *driver.LeaseCompleteParams) (driver.LeaseWriteResult, error) {
	if p.Advance != nil {
		return d.leaseCompleteAdvance(ctx, p)
	}
	tag, err := d.auto.Exec(ctx, `UPDATE `+d.t.processed+`
SET status = 'done', lease_until = NULL, next_attempt_at = NULL, last_error = NULL, processed_at = now()
WHERE handler = $1 AND message_id = $2 AND token = $3 AND status = 'running'`,
		p.Handler, p.MessageID, p.Token)
	return d.fencedWrite(ctx, "mark done", p.Handler, p.MessageID, tag, err)
}

// leaseCompleteAdvance marks the lease done and advances the aggregate's
// sequence in one statement: the sequence moves only if the fenced update
// matched.
func (d *Driver) leaseCompleteAdvance(ctx context.Context, p *driver.LeaseCompleteParams) (driver.LeaseWriteResult, error) {
	var n int64
	err := d.auto.QueryRow(ctx, `WITH done AS (
  UPDATE `+d.t.processed+`
  SET status = 'done', lease_until = NULL, next_attempt_at = NULL, last_error = NULL, processed_at = now()
  WHERE handler = $1 AND message_id = $2 AND token = $3 AND status = 'running'
  RETURNING handler
), adv AS (
  INSERT INTO `+d.t.sequences+` AS s (handler, aggregate_id, last_seq)
  SELECT handler, $4, $5::bigint FROM done
  ON CONFLICT (handler, aggregate_id) DO UPDATE SET last_seq = GREATEST(s.last_seq, excluded.last_seq)
)
SELECT count(*) FROM done`, p.Handler, p.MessageID, p.Token, p.Advance.AggregateID, p.Advance.Seq).Scan(&n)
	return d.fencedWrite(ctx, "mark done", p.Handler, p.MessageID, pgconn.NewCommandTag(fmt.Sprintf("UPDATE %d", n)), err)
}

// SequenceLast implements driver.LeaseSequencer.
func (d *Driver) SequenceLast(ctx context.Context, handler, aggregateID string) (int64, error) {
	var last int64
	err := d.pool.QueryRow(ctx, `SELECT COALESCE(max(last_seq), 0) FROM `+d.t.sequences+` WHERE handler = $1 AND aggregate_id = $2`,
		handler, aggregateID).Scan(&last)
	if err != nil {
		return 0, fmt.Errorf("postgres: read last sequence: %w", err)
	}
	return last, nil
}

// LeaseFail implements driver.LeaseDriver.
func (d *Driver) LeaseFail(ctx context.Context, p *driver.LeaseFailParams) (driver.LeaseWriteResult, error) {
	var retryIn *int64 // NULL: never again
	if !p.Permanent {
		us := p.RetryIn.Microseconds()
		retryIn = &us
	}
	tag, err := d.auto.Exec(ctx, `UPDATE `+d.t.processed+`
SET status = 'failed', lease_until = NULL, last_error = $4, processed_at = now(),
    next_attempt_at = now() + $5::bigint * interval '1 microsecond',
    attempts = CASE WHEN $6::boolean THEN attempts - 1 ELSE attempts END
WHERE handler = $1 AND message_id = $2 AND token = $3 AND status = 'running'`,
		p.Handler, p.MessageID, p.Token, p.LastError, retryIn, p.NotCalled)
	return d.fencedWrite(ctx, "mark failed", p.Handler, p.MessageID, tag, err)
}

// LeaseRearm implements driver.LeaseRearmer.
func (d *Driver) LeaseRearm(ctx context.Context, handler, messageID string) error {
	if _, err := d.auto.Exec(ctx, `UPDATE `+d.t.processed+` SET next_attempt_at = now(), attempts = 0
WHERE handler = $1 AND message_id = $2 AND status = 'failed'`, handler, messageID); err != nil {
		return fmt.Errorf("postgres: rearm lease: %w", err)
	}
	return nil
}

// fencedWrite turns the result of a token-guarded UPDATE into a
// LeaseWriteResult, reading the current row when the token was stale.
func (d *Driver) fencedWrite(ctx context.Context, op, handler, id string, tag pgconn.CommandTag, err error) (driver.LeaseWriteResult, error) {
	if err != nil {
		return driver.LeaseWriteResult{}, fmt.Errorf("postgres: lease %s: %w", op, err)
	}
	if tag.RowsAffected() == 1 {
		return driver.LeaseWriteResult{OK: true}, nil
	}
	row, err := d.LeaseGet(ctx, &driver.LeaseGetParams{Handler: handler, MessageID: id})
	if err != nil {
		return driver.LeaseWriteResult{}, err
	}
	return driver.LeaseWriteResult{Current: row}, nil
}

// LeaseGet implements driver.LeaseDriver. A key without a lease row but
// with an atomic marker of the same handler name reads as done, with
// token 0, as it did when both shared one table.
func (d *Driver) LeaseGet(ctx context.Context, p *driver.LeaseGetParams) (*driver.LeaseRow, error) {
	var (
		row               driver.LeaseRow
		status            string
		leaseUntil, nextA *time.Time
	)
	err := d.pool.QueryRow(ctx, `SELECT status, payload_hash, coalesce(owner, ''), token, attempts,
    lease_until, next_attempt_at, coalesce(last_error, ''), now()
FROM `+d.t.processed+` WHERE handler = $1 AND message_id = $2`, p.Handler, p.MessageID).Scan(
		&status, &row.PayloadHash, &row.Owner, &row.Token, &row.Attempts, &leaseUntil, &nextA, &row.LastError, &row.Now)
	if errors.Is(err, pgx.ErrNoRows) {
		return d.atomicAsLease(ctx, p)
	}
	if err != nil {
		return nil, fmt.Errorf("postgres: read lease: %w", err)
	}
	row.Status = driver.LeaseStatus(status)
	if leaseUntil != nil {
		row.LeaseUntil = *leaseUntil
	}
	if nextA != nil {
		row.NextAttemptAt = *nextA
	}
	return &row, nil
}

// atomicAsLease reads the atomic marker of (p.Handler, p.MessageID) as a
// done lease row with token 0; nil when there is none.
func (d *Driver) atomicAsLease(ctx context.Context, p *driver.LeaseGetParams) (*driver.LeaseRow, error) {
	hid, err := d.handlerID(ctx, d.pool, p.Handler)
	if err != nil {
		return nil, err
	}
	row := driver.LeaseRow{Status: driver.LeaseDone}
	err = d.pool.QueryRow(ctx, `SELECT payload_hash, now() FROM `+d.t.markers+` WHERE handler_id = $1 AND message_key = $2`,
		hid, messageKey(p.MessageID)).Scan(&row.PayloadHash, &row.Now)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("postgres: read atomic marker: %w", err)
	}
	return &row, nil
}
