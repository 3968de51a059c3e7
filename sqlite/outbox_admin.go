package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlfilter"
)

var _ driver.OutboxAdmin = (*Driver)(nil)

// OutboxList implements driver.OutboxAdmin.
func (d *Driver) OutboxList(ctx context.Context, f driver.OutboxFilter) (driver.OutboxPage, error) {
	var page driver.OutboxPage
	limit, err := f.Check()
	if err != nil {
		return page, fmt.Errorf("sqlite: list outbox: %w", err)
	}
	where, args := sqlfilter.OutboxScope(f, idsIn)
	err = d.db.QueryRowContext(ctx, `SELECT count(*) FILTER (WHERE `+sqlfilter.OutboxState[driver.OutboxPending]+`),
count(*) FILTER (WHERE `+sqlfilter.OutboxState[driver.OutboxFailing]+`), count(*) FILTER (WHERE `+sqlfilter.OutboxState[driver.OutboxParked]+`)
FROM `+d.tables.outbox+` o WHERE `+strings.Join(where, " AND "), args...).Scan(&page.Counts.Pending, &page.Counts.Failing, &page.Counts.Parked)
	if err != nil {
		return page, fmt.Errorf("sqlite: list outbox: %w", err)
	}
	where, args = sqlfilter.Outbox(f, where, args)
	now := time.Now().UnixMicro()
	args = append([]any{now}, append(args, limit+1)...)
	rows, err := d.db.QueryContext(ctx, `SELECT o.id, o.destination, o.message_id, o.ordering_key, o.aggregate_id, o.seq, o.type, o.headers, o.payload, o.payload_hash,
  o.created_at, o.attempts, o.last_error, o.parked_at, o.parked_by, o.park_reason, c.owner, c.claimed_until,
  (SELECT min(p.id) FROM `+d.tables.outbox+` p WHERE p.ordering_key = o.ordering_key AND p.parked_at IS NOT NULL AND p.published_at IS NULL AND p.id < o.id)
FROM `+d.tables.outbox+` o LEFT JOIN `+d.tables.outboxClaims+` c ON c.ordering_key = o.ordering_key AND c.claimed_until > ?
WHERE `+strings.Join(where, " AND ")+` ORDER BY o.id LIMIT ?`, args...)
	if err != nil {
		return page, fmt.Errorf("sqlite: list outbox: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			e               driver.OutboxEntry
			created         int64
			parked, until   sql.NullInt64
			owner           sql.NullString
			blocked         sql.NullInt64
			parkBy, parkWhy string
		)
		if err := rows.Scan(&e.ID, &e.Destination, &e.MessageID, &e.OrderingKey, &e.AggregateID, &e.Seq, &e.Type, &e.Headers, &e.Payload, &e.PayloadHash,
			&created, &e.Attempts, &e.LastError, &parked, &parkBy, &parkWhy, &owner, &until, &blocked); err != nil {
			return page, fmt.Errorf("sqlite: list outbox: %w", err)
		}
		e.CreatedAt = time.UnixMicro(created)
		var parkedAt, claimEnd time.Time
		if parked.Valid {
			parkedAt, e.ParkedBy, e.ParkReason = time.UnixMicro(parked.Int64), parkBy, parkWhy
		}
		if until.Valid {
			claimEnd = time.UnixMicro(until.Int64)
		}
		e.SetListed(parkedAt, owner.Valid, owner.String, claimEnd)
		e.BlockedBy = blocked.Int64
		page.Rows = append(page.Rows, e)
	}
	if err := rows.Err(); err != nil {
		return page, fmt.Errorf("sqlite: list outbox: %w", err)
	}
	page.Trim(limit)
	return page, nil
}

// OutboxRetryNow implements driver.OutboxAdmin.
func (d *Driver) OutboxRetryNow(ctx context.Context, ids []int64, actor string) (driver.OutboxActionResult, error) {
	res, err := d.outboxAct(ctx, ids, true, func(tx *sql.Tx, free string, now int64) ([]int64, error) {
		done, err := d.outboxLog(ctx, tx, free, "retry", actor, "", now)
		if err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+d.tables.outboxClaims+` WHERE owner = '' AND ordering_key IN (SELECT ordering_key FROM `+d.tables.outbox+` WHERE `+idsIn+`)`, free); err != nil {
			return nil, err
		}
		_, err = tx.ExecContext(ctx, `UPDATE `+d.tables.outbox+` SET parked_at = NULL, parked_by = '', park_reason = '' WHERE `+idsIn, free)
		return done, err
	})
	if err != nil {
		return res, fmt.Errorf("sqlite: retry outbox rows: %w", err)
	}
	return res, nil
}

// OutboxPark implements driver.OutboxAdmin.
func (d *Driver) OutboxPark(ctx context.Context, ids []int64, actor, reason string) (driver.OutboxActionResult, error) {
	res, err := d.outboxAct(ctx, ids, false, func(tx *sql.Tx, free string, now int64) ([]int64, error) {
		// Rows parked already are left as they are, with their actor.
		rows, err := tx.QueryContext(ctx, `SELECT id FROM `+d.tables.outbox+` WHERE parked_at IS NULL AND `+idsIn, free)
		if err != nil {
			return nil, err
		}
		var unparked []int64
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return nil, err
			}
			unparked = append(unparked, id)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, err
		}
		if len(unparked) == 0 {
			return nil, nil
		}
		todo := sqlfilter.JSONIDs(unparked)
		done, err := d.outboxLog(ctx, tx, todo, "park", actor, reason, now)
		if err != nil {
			return nil, err
		}
		_, err = tx.ExecContext(ctx, `UPDATE `+d.tables.outbox+` SET parked_at = ?, parked_by = ?, park_reason = ? WHERE `+idsIn, now, actor, reason, todo)
		return done, err
	})
	if err != nil {
		return res, fmt.Errorf("sqlite: park outbox rows: %w", err)
	}
	return res, nil
}

// OutboxDiscard implements driver.OutboxAdmin. The discarded rows' keys
// lose their holds, so that their later rows go out at the next cycle.
func (d *Driver) OutboxDiscard(ctx context.Context, ids []int64, actor, reason string) (driver.OutboxActionResult, error) {
	res, err := d.outboxAct(ctx, ids, false, func(tx *sql.Tx, free string, now int64) ([]int64, error) {
		done, err := d.outboxLog(ctx, tx, free, "discard", actor, reason, now)
		if err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+d.tables.outboxClaims+` WHERE owner = '' AND ordering_key IN (SELECT ordering_key FROM `+d.tables.outbox+` WHERE `+idsIn+`)`, free); err != nil {
			return nil, err
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM `+d.tables.outbox+` WHERE `+idsIn, free)
		return done, err
	})
	if err != nil {
		return res, fmt.Errorf("sqlite: discard outbox rows: %w", err)
	}
	return res, nil
}

// outboxLog appends an action's entry for each row of the JSON array ids
// and returns their IDs.
func (d *Driver) outboxLog(ctx context.Context, tx *sql.Tx, ids, action, actor, reason string, now int64) ([]int64, error) {
	rows, err := tx.QueryContext(ctx, `INSERT INTO `+d.tables.outboxLog+` (outbox_id, message_id, ordering_key, destination, action, actor, reason, at)
SELECT id, message_id, ordering_key, destination, ?, ?, ?, ? FROM `+d.tables.outbox+` WHERE `+idsIn+` RETURNING outbox_id`, action, actor, reason, now, ids)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var done []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		done = append(done, id)
	}
	return done, rows.Err()
}

// outboxAct runs an action on the unpublished rows ids in one write
// transaction: act gets, as a JSON array, the rows whose key no relay
// holds live (a failure's hold does not count), or all of them when
// anyKey is set, and returns those it applied to. SQLite has one writer,
// so no relay claims a key between the check and the action.
func (d *Driver) outboxAct(ctx context.Context, ids []int64, anyKey bool, act func(tx *sql.Tx, free string, now int64) ([]int64, error)) (res driver.OutboxActionResult, err error) {
	if len(ids) == 0 {
		return res, nil
	}
	tx, err := d.Begin(ctx)
	if err != nil {
		return res, err
	}
	defer func() {
		if err != nil {
			tx.Rollback()
		}
	}()
	now := time.Now().UnixMicro()
	rows, err := tx.QueryContext(ctx, `SELECT o.id, c.owner IS NOT NULL FROM `+d.tables.outbox+` o
LEFT JOIN `+d.tables.outboxClaims+` c ON c.ordering_key = o.ordering_key AND c.owner <> '' AND c.claimed_until > ?
WHERE o.published_at IS NULL AND o.`+idsIn, now, sqlfilter.JSONIDs(ids))
	if err != nil {
		return res, err
	}
	var free, busy []int64
	for rows.Next() {
		var (
			id      int64
			claimed bool
		)
		if err := rows.Scan(&id, &claimed); err != nil {
			rows.Close()
			return res, err
		}
		if claimed && !anyKey {
			busy = append(busy, id)
		} else {
			free = append(free, id)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return res, err
	}
	var done []int64
	if len(free) > 0 {
		if done, err = act(tx, sqlfilter.JSONIDs(free), now); err != nil {
			return res, err
		}
	}
	if err := tx.Commit(); err != nil {
		return res, err
	}
	return driver.OutboxResult(ids, done, busy), nil
}
