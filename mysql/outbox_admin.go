package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlfilter"
)

var _ driver.OutboxAdmin = (*Driver)(nil)

// OutboxList implements driver.OutboxAdmin.
func (d *Driver) OutboxList(ctx context.Context, f driver.OutboxFilter) (driver.OutboxPage, error) {
	if err := d.ready(ctx); err != nil {
		return driver.OutboxPage{}, err
	}
	var page driver.OutboxPage
	limit, err := f.Check()
	if err != nil {
		return page, fmt.Errorf("mysql: list outbox: %w", err)
	}
	f.OrderingKey = fitKey(f.OrderingKey) // as OutboxAdd stored it
	where, args := sqlfilter.OutboxScope(f, idsIn)
	err = d.db.QueryRowContext(ctx, `SELECT COALESCE(SUM(`+sqlfilter.OutboxState[driver.OutboxPending]+`), 0),
COALESCE(SUM(`+sqlfilter.OutboxState[driver.OutboxFailing]+`), 0), COALESCE(SUM(`+sqlfilter.OutboxState[driver.OutboxParked]+`), 0)
FROM `+d.t.outbox+` o WHERE `+strings.Join(where, " AND "), args...).Scan(&page.Counts.Pending, &page.Counts.Failing, &page.Counts.Parked)
	if err != nil {
		return page, fmt.Errorf("mysql: list outbox: %w", notMigrated(err))
	}
	where, args = sqlfilter.Outbox(f, where, args)
	args = append(args, limit+1)
	rows, err := d.db.QueryContext(ctx, `SELECT o.id, o.destination, o.message_id, o.ordering_key, o.aggregate_id, o.seq, o.type, o.headers, o.payload, o.payload_hash,
  o.created_at, o.attempts, o.last_error, o.parked_at, o.parked_by, o.park_reason, c.owner, c.claimed_until,
  (SELECT MIN(p.id) FROM `+d.t.outbox+` p WHERE p.ordering_key = o.ordering_key AND p.published_at IS NULL AND p.parked_at IS NOT NULL AND p.id < o.id)
FROM `+d.t.outbox+` o LEFT JOIN `+d.t.outboxClaims+` c ON c.ordering_key = o.ordering_key AND c.claimed_until > `+nowMicros+`
WHERE `+strings.Join(where, " AND ")+` ORDER BY o.id LIMIT ?`, args...)
	if err != nil {
		return page, fmt.Errorf("mysql: list outbox: %w", notMigrated(err))
	}
	defer rows.Close()
	for rows.Next() {
		var (
			e                        driver.OutboxEntry
			created                  int64
			parked, until, blocked   sql.NullInt64
			lastErr, parkBy, parkWhy sql.NullString
			owner                    sql.NullString
		)
		if err := rows.Scan(&e.ID, &e.Destination, &e.MessageID, &e.OrderingKey, &e.AggregateID, &e.Seq, &e.Type, &e.Headers, &e.Payload, &e.PayloadHash,
			&created, &e.Attempts, &lastErr, &parked, &parkBy, &parkWhy, &owner, &until, &blocked); err != nil {
			return page, fmt.Errorf("mysql: list outbox: %w", err)
		}
		e.CreatedAt = time.UnixMicro(created)
		e.LastError = lastErr.String
		e.SetListed(fromMicros(parked), owner.Valid, owner.String, fromMicros(until))
		e.ParkedBy, e.ParkReason = parkBy.String, parkWhy.String
		e.BlockedBy = blocked.Int64
		page.Rows = append(page.Rows, e)
	}
	if err := rows.Err(); err != nil {
		return page, fmt.Errorf("mysql: list outbox: %w", err)
	}
	page.Trim(limit)
	return page, nil
}

// OutboxRetryNow implements driver.OutboxAdmin: the rows are unparked and
// their keys' holds dropped. No key is taken from a relay: a row made
// publishable early goes out in its key's order all the same.
func (d *Driver) OutboxRetryNow(ctx context.Context, ids []int64, actor string) (driver.OutboxActionResult, error) {
	res, err := d.outboxAct(ctx, ids, false, func(tx *sql.Tx, rows []outboxTarget, now int64) ([]int64, error) {
		done := targetIDs(rows, nil)
		todo := sqlfilter.JSONIDs(done)
		if err := d.outboxLog(ctx, tx, todo, "retry", actor, "", now); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+d.t.outboxClaims+` WHERE owner = '' AND ordering_key IN (SELECT ordering_key FROM `+d.t.outbox+` WHERE `+idsIn+`)`, todo); err != nil {
			return nil, err
		}
		_, err := tx.ExecContext(ctx, `UPDATE `+d.t.outbox+` SET parked_at = NULL, parked_by = NULL, park_reason = NULL WHERE `+idsIn, todo)
		return done, err
	})
	if err != nil {
		return res, fmt.Errorf("mysql: retry outbox rows: %w", notMigrated(err))
	}
	return res, nil
}

// OutboxPark implements driver.OutboxAdmin. Rows parked already are left
// as they are, with their actor, and reported Missing.
func (d *Driver) OutboxPark(ctx context.Context, ids []int64, actor, reason string) (driver.OutboxActionResult, error) {
	res, err := d.outboxAct(ctx, ids, true, func(tx *sql.Tx, rows []outboxTarget, now int64) ([]int64, error) {
		done := targetIDs(rows, func(r outboxTarget) bool { return !r.parked })
		if len(done) == 0 {
			return nil, nil
		}
		todo := sqlfilter.JSONIDs(done)
		if err := d.outboxLog(ctx, tx, todo, "park", actor, reason, now); err != nil {
			return nil, err
		}
		_, err := tx.ExecContext(ctx, `UPDATE `+d.t.outbox+` SET parked_at = ?, parked_by = ?, park_reason = ? WHERE `+idsIn, now, actor, reason, todo)
		return done, err
	})
	if err != nil {
		return res, fmt.Errorf("mysql: park outbox rows: %w", notMigrated(err))
	}
	return res, nil
}

// OutboxDiscard implements driver.OutboxAdmin. The discarded rows' keys
// lose their holds, so that their later rows go out at the next cycle.
func (d *Driver) OutboxDiscard(ctx context.Context, ids []int64, actor, reason string) (driver.OutboxActionResult, error) {
	res, err := d.outboxAct(ctx, ids, true, func(tx *sql.Tx, rows []outboxTarget, now int64) ([]int64, error) {
		done := targetIDs(rows, nil)
		todo := sqlfilter.JSONIDs(done)
		if err := d.outboxLog(ctx, tx, todo, "discard", actor, reason, now); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+d.t.outboxClaims+` WHERE owner = '' AND ordering_key IN (SELECT ordering_key FROM `+d.t.outbox+` WHERE `+idsIn+`)`, todo); err != nil {
			return nil, err
		}
		_, err := tx.ExecContext(ctx, `DELETE FROM `+d.t.outbox+` WHERE `+idsIn, todo)
		return done, err
	})
	if err != nil {
		return res, fmt.Errorf("mysql: discard outbox rows: %w", notMigrated(err))
	}
	return res, nil
}

// outboxTarget is an unpublished row an action named, locked by it.
type outboxTarget struct {
	id     int64
	key    string
	parked bool
}

// targetIDs returns the IDs of the rows keep accepts (all when nil).
func targetIDs(rows []outboxTarget, keep func(outboxTarget) bool) []int64 {
	var ids []int64
	for _, r := range rows {
		if keep == nil || keep(r) {
			ids = append(ids, r.id)
		}
	}
	return ids
}

// outboxLog appends an action's entry for each row of the JSON array ids.
func (d *Driver) outboxLog(ctx context.Context, tx *sql.Tx, ids, action, actor, reason string, now int64) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.outboxLog+` (outbox_id, message_id, ordering_key, destination, action, actor, reason, at)
SELECT id, message_id, ordering_key, destination, ?, ?, ?, ? FROM `+d.t.outbox+` WHERE `+idsIn+` ORDER BY id`, action, actor, reason, now, ids)
	return err
}

// outboxAct runs an action on the unpublished rows ids in one transaction
// on the server's clock, retried after a deadlock or lock wait timeout.
// The rows are locked first, in ID order, as a relay's claim locks its
// candidates before their keys. With takeKeys, their keys are then taken
// as a relay's claim does: the key's claim row is upserted (an expired
// hold where none existed, which claims overwrite) and stays locked until
// the commit, so a relay claiming it meanwhile waits and then reads the
// rows as the action left them; act gets the rows whose key no relay
// holds live (a failure's hold does not count), the others are Busy.
// Without takeKeys, act gets every row. act returns the IDs it applied to.
func (d *Driver) outboxAct(ctx context.Context, ids []int64, takeKeys bool, act func(tx *sql.Tx, rows []outboxTarget, now int64) ([]int64, error)) (driver.OutboxActionResult, error) {
	var res driver.OutboxActionResult
	if len(ids) == 0 {
		return res, nil
	}
	err := d.retry(ctx, func() error {
		tx, err := d.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		var now int64
		if err := tx.QueryRowContext(ctx, `SELECT `+nowMicros).Scan(&now); err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, `SELECT id, ordering_key, parked_at IS NOT NULL FROM `+d.t.outbox+`
WHERE published_at IS NULL AND `+idsIn+` ORDER BY id FOR UPDATE`, sqlfilter.JSONIDs(ids))
		if err != nil {
			return err
		}
		var (
			targets []outboxTarget
			keys    []string
		)
		for rows.Next() {
			var r outboxTarget
			if err := rows.Scan(&r.id, &r.key, &r.parked); err != nil {
				rows.Close()
				return err
			}
			targets = append(targets, r)
			keys = append(keys, r.key)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		free, busy := targets, []int64(nil)
		if takeKeys && len(keys) > 0 {
			if free, busy, err = d.outboxTakeKeys(ctx, tx, targets, keys, now); err != nil {
				return err
			}
		}
		var done []int64
		if len(free) > 0 {
			if done, err = act(tx, free, now); err != nil {
				return err
			}
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		res = driver.OutboxResult(ids, done, busy)
		return nil
	})
	return res, err
}

// outboxTakeKeys locks the claim rows of keys, creating expired holds
// where none exist, and splits targets into the rows whose key is free or
// only held after a failure, and the IDs of those a relay holds live.
func (d *Driver) outboxTakeKeys(ctx context.Context, tx *sql.Tx, targets []outboxTarget, keys []string, now int64) (free []outboxTarget, busy []int64, err error) {
	// One order for every relay and action: concurrent upserts queue.
	slices.Sort(keys)
	keys = slices.Compact(keys)
	args := make([]any, 0, 2*len(keys))
	for _, k := range keys {
		args = append(args, k, now)
	}
	// The no-op update locks an existing claim row as the relay's
	// upsert does.
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.outboxClaims+` (ordering_key, owner, claimed_until) VALUES (?, '', ?)`+
		strings.Repeat(", (?, '', ?)", len(keys)-1)+` ON DUPLICATE KEY UPDATE owner = owner`, args...); err != nil {
		return nil, nil, err
	}
	keyArgs := make([]any, len(keys))
	for i, k := range keys {
		keyArgs[i] = k
	}
	rows, err := tx.QueryContext(ctx, `SELECT ordering_key FROM `+d.t.outboxClaims+`
WHERE owner <> '' AND claimed_until > ? AND ordering_key IN (?`+strings.Repeat(", ?", len(keys)-1)+`) FOR UPDATE`,
		append([]any{now}, keyArgs...)...)
	if err != nil {
		return nil, nil, err
	}
	held := map[string]bool{}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			rows.Close()
			return nil, nil, err
		}
		held[k] = true
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	for _, r := range targets {
		if held[r.key] {
			busy = append(busy, r.id)
		} else {
			free = append(free, r)
		}
	}
	return free, busy, nil
}
