package postgres

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlfilter"
)

var _ driver.OutboxAdmin = (*Driver)(nil)

// OutboxList implements driver.OutboxAdmin.
func (d *Driver) OutboxList(ctx context.Context, f driver.OutboxFilter) (driver.OutboxPage, error) {
	var page driver.OutboxPage
	limit, err := f.Check()
	if err != nil {
		return page, fmt.Errorf("postgres: list outbox: %w", err)
	}
	where, args := []string{"o.published_at IS NULL"}, []any{}
	add := func(cond string, v any) {
		args = append(args, v)
		where = append(where, strings.ReplaceAll(cond, "$?", fmt.Sprintf("$%d", len(args))))
	}
	if f.Destination != "" {
		add("o.destination = $?", f.Destination)
	}
	if f.OrderingKey != "" {
		add("o.ordering_key = $?", f.OrderingKey)
	}
	if f.IDs != nil {
		add("o.id = ANY($?)", f.IDs)
	}
	err = d.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE `+sqlfilter.OutboxState[driver.OutboxPending]+`),
count(*) FILTER (WHERE `+sqlfilter.OutboxState[driver.OutboxFailing]+`), count(*) FILTER (WHERE `+sqlfilter.OutboxState[driver.OutboxParked]+`)
FROM `+d.t.outbox+` o WHERE `+strings.Join(where, " AND "), args...).Scan(&page.Counts.Pending, &page.Counts.Failing, &page.Counts.Parked)
	if err != nil {
		return page, fmt.Errorf("postgres: list outbox: %w", notMigrated(err))
	}
	if f.State != "" {
		where = append(where, sqlfilter.OutboxState[f.State])
	}
	if f.AfterID > 0 {
		add("o.id > $?", f.AfterID)
	}
	args = append(args, limit+1)
	rows, err := d.pool.Query(ctx, `SELECT o.id, o.destination, o.message_id, o.ordering_key, o.aggregate_id, o.seq, o.type, o.headers, o.payload, o.payload_hash,
  o.created_at, o.attempts, o.last_error, o.parked_at, o.parked_by, o.park_reason, c.owner, c.claimed_until,
  (SELECT min(p.id) FROM `+d.t.outbox+` p WHERE p.ordering_key = o.ordering_key AND p.parked_at IS NOT NULL AND p.published_at IS NULL AND p.id < o.id)
FROM `+d.t.outbox+` o LEFT JOIN `+d.t.outboxClaims+` c ON c.ordering_key = o.ordering_key AND c.claimed_until > clock_timestamp()
WHERE `+strings.Join(where, " AND ")+fmt.Sprintf(` ORDER BY o.id LIMIT $%d`, len(args)), args...)
	if err != nil {
		return page, fmt.Errorf("postgres: list outbox: %w", notMigrated(err))
	}
	page.Rows, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (driver.OutboxEntry, error) {
		var (
			e       driver.OutboxEntry
			parked  *time.Time
			owner   *string
			until   *time.Time
			blocked *int64
		)
		err := r.Scan(&e.ID, &e.Destination, &e.MessageID, &e.OrderingKey, &e.AggregateID, &e.Seq, &e.Type, &e.Headers, &e.Payload, &e.PayloadHash,
			&e.CreatedAt, &e.Attempts, &e.LastError, &parked, &e.ParkedBy, &e.ParkReason, &owner, &until, &blocked)
		if err != nil {
			return e, err
		}
		var (
			parkedAt, claimEnd time.Time
			claimant           string
		)
		if parked != nil {
			parkedAt = *parked
		}
		if owner != nil {
			claimant, claimEnd = *owner, *until
		}
		e.SetListed(parkedAt, owner != nil, claimant, claimEnd)
		if blocked != nil {
			e.BlockedBy = *blocked
		}
		return e, nil
	})
	if err != nil {
		return page, fmt.Errorf("postgres: list outbox: %w", err)
	}
	page.Trim(limit)
	return page, nil
}

// OutboxRetryNow implements driver.OutboxAdmin: the rows are unparked and
// their keys' holds dropped in one statement. No key is taken from a
// relay: a row made publishable early goes out in its key's order all the
// same.
func (d *Driver) OutboxRetryNow(ctx context.Context, ids []int64, actor string) (driver.OutboxActionResult, error) {
	if len(ids) == 0 {
		return driver.OutboxActionResult{}, nil
	}
	rows, err := d.auto.Query(ctx, `WITH r AS (
  UPDATE `+d.t.outbox+` SET parked_at = NULL, parked_by = '', park_reason = ''
  WHERE id = ANY($1) AND published_at IS NULL RETURNING id, message_id, ordering_key, destination),
h AS (DELETE FROM `+d.t.outboxClaims+` WHERE owner = '' AND ordering_key IN (SELECT ordering_key FROM r)),
l AS (INSERT INTO `+d.t.outboxLog+` (outbox_id, message_id, ordering_key, destination, action, actor)
  SELECT id, message_id, ordering_key, destination, 'retry', $2 FROM r)
SELECT id FROM r`, ids, actor)
	if err != nil {
		return driver.OutboxActionResult{}, fmt.Errorf("postgres: retry outbox rows: %w", notMigrated(err))
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return driver.OutboxActionResult{}, fmt.Errorf("postgres: retry outbox rows: %w", err)
	}
	return driver.OutboxResult(ids, done, nil), nil
}

// OutboxPark implements driver.OutboxAdmin.
func (d *Driver) OutboxPark(ctx context.Context, ids []int64, actor, reason string) (driver.OutboxActionResult, error) {
	res, err := d.outboxAct(ctx, ids, func(tx pgx.Tx, free []int64) ([]int64, error) {
		rows, err := tx.Query(ctx, `WITH r AS (
  UPDATE `+d.t.outbox+` SET parked_at = clock_timestamp(), parked_by = $2, park_reason = $3
  WHERE id = ANY($1) AND published_at IS NULL AND parked_at IS NULL RETURNING id, message_id, ordering_key, destination),
l AS (INSERT INTO `+d.t.outboxLog+` (outbox_id, message_id, ordering_key, destination, action, actor, reason)
  SELECT id, message_id, ordering_key, destination, 'park', $2, $3 FROM r)
SELECT id FROM r`, free, actor, reason)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, pgx.RowTo[int64])
	})
	if err != nil {
		return res, fmt.Errorf("postgres: park outbox rows: %w", notMigrated(err))
	}
	return res, nil
}

// OutboxDiscard implements driver.OutboxAdmin. The discarded rows' keys
// lose their holds, so that their later rows go out at the next cycle.
func (d *Driver) OutboxDiscard(ctx context.Context, ids []int64, actor, reason string) (driver.OutboxActionResult, error) {
	res, err := d.outboxAct(ctx, ids, func(tx pgx.Tx, free []int64) ([]int64, error) {
		rows, err := tx.Query(ctx, `WITH r AS (
  DELETE FROM `+d.t.outbox+` WHERE id = ANY($1) AND published_at IS NULL RETURNING id, message_id, ordering_key, destination),
h AS (DELETE FROM `+d.t.outboxClaims+` WHERE owner = '' AND ordering_key IN (SELECT ordering_key FROM r)),
l AS (INSERT INTO `+d.t.outboxLog+` (outbox_id, message_id, ordering_key, destination, action, actor, reason)
  SELECT id, message_id, ordering_key, destination, 'discard', $2, $3 FROM r)
SELECT id FROM r`, free, actor, reason)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, pgx.RowTo[int64])
	})
	if err != nil {
		return res, fmt.Errorf("postgres: discard outbox rows: %w", notMigrated(err))
	}
	return res, nil
}

// outboxAct runs an action on the unpublished rows ids in one
// transaction, after taking their keys as a relay's claim does: act gets
// the rows whose key no relay holds live (a failure's hold does not count)
// and returns those it applied to. The key's claim row stays locked until
// the commit, so a relay claiming it meanwhile waits and then reads the
// rows as the action left them; where no claim row existed, an expired
// hold is left, which claims overwrite.
func (d *Driver) outboxAct(ctx context.Context, ids []int64, act func(tx pgx.Tx, free []int64) ([]int64, error)) (driver.OutboxActionResult, error) {
	var res driver.OutboxActionResult
	if len(ids) == 0 {
		return res, nil
	}
	err := pgx.BeginTxFunc(ctx, d.pool, readCommitted(), func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `SELECT id, ordering_key FROM `+d.t.outbox+` WHERE id = ANY($1) AND published_at IS NULL`, ids)
		if err != nil {
			return err
		}
		byKey := map[string][]int64{}
		var keys []string
		for rows.Next() {
			var (
				id  int64
				key string
			)
			if err := rows.Scan(&id, &key); err != nil {
				rows.Close()
				return err
			}
			if byKey[key] == nil {
				keys = append(keys, key)
			}
			byKey[key] = append(byKey[key], id)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if len(keys) == 0 {
			res = driver.OutboxResult(ids, nil, nil)
			return nil
		}
		slices.Sort(keys) // two actions lock shared keys in one order
		rows, err = tx.Query(ctx, `INSERT INTO `+d.t.outboxClaims+` AS c (ordering_key, owner, claimed_until)
SELECT k, '', clock_timestamp() FROM unnest($1::text[]) AS k
ON CONFLICT (ordering_key) DO UPDATE SET owner = c.owner
WHERE c.owner = '' OR c.claimed_until <= clock_timestamp()
RETURNING c.ordering_key`, keys)
		if err != nil {
			return err
		}
		won, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		var free, busy []int64
		isWon := map[string]bool{}
		for _, k := range won {
			isWon[k] = true
			free = append(free, byKey[k]...)
		}
		for _, k := range keys {
			if !isWon[k] {
				busy = append(busy, byKey[k]...)
			}
		}
		var done []int64
		if len(free) > 0 {
			if done, err = act(tx, free); err != nil {
				return err
			}
		}
		res = driver.OutboxResult(ids, done, busy)
		return nil
	})
	return res, err
}
