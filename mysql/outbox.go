package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlfilter"
)

var (
	_ driver.OutboxWriter[*sql.Tx]    = (*Driver)(nil)
	_ driver.OutboxNextAdder[*sql.Tx] = (*Driver)(nil)
	_ driver.OutboxRelayStore         = (*Driver)(nil)
	_ driver.OutboxPrunableCounter    = (*Driver)(nil)
)

const outboxColumns = `id, destination, message_id, ordering_key, aggregate_id, seq, type, headers, payload, payload_hash, created_at, attempts`

// outboxChunk bounds the rows of one multi-row INSERT (ten placeholders
// each).
const outboxChunk = 500

// OutboxAdd implements driver.OutboxWriter with multi-row INSERTs in tx;
// InnoDB hands a statement's rows rising IDs in the order given.
func (d *Driver) OutboxAdd(ctx context.Context, tx *sql.Tx, rows []driver.OutboxRow) error {
	for lo := 0; lo < len(rows); lo += outboxChunk {
		chunk := rows[lo:min(lo+outboxChunk, len(rows))]
		args := make([]any, 0, 9*len(chunk))
		for i := range chunk {
			r := &chunk[i]
			args = append(args, r.Destination, r.MessageID, fitKey(r.OrderingKey), r.AggregateID, r.Seq, r.Type, r.Headers, payloadOf(r), hashOf(r.PayloadHash))
		}
		row := `(?, ?, ?, ?, ?, ?, ?, ?, ?, ` + nowMicros + `)`
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.outbox+
			` (destination, message_id, ordering_key, aggregate_id, seq, type, headers, payload, payload_hash, created_at) VALUES `+
			row+strings.Repeat(", "+row, len(chunk)-1), args...); err != nil {
			return fmt.Errorf("mysql: add outbox rows: %w", notMigrated(err))
		}
	}
	return nil
}

// maxKeyLen is the width of the ordering_key columns, in bytes.
const maxKeyLen = 255

// fitKey returns key cut to the ordering_key columns' 255 bytes, at a
// character boundary. Only a message without an aggregate ID has a longer
// key ("msg:" and an ID of up to 255 bytes): two such messages whose IDs
// share their first 251 bytes then share a key, and are only published
// one after the other, never out of order.
func fitKey(key string) string {
	if len(key) <= maxKeyLen {
		return key
	}
	n := maxKeyLen
	for n > 0 && !utf8.RuneStart(key[n]) {
		n--
	}
	return key[:n]
}

func payloadOf(r *driver.OutboxRow) []byte {
	if r.Payload == nil {
		return []byte{}
	}
	return r.Payload
}

func hashOf(h []byte) []byte {
	if h == nil {
		return []byte{}
	}
	return h
}

// OutboxAddNext implements driver.OutboxNextAdder: the aggregate's next
// version (VersionNext, whose row stays locked until tx ends), then the
// row.
func (d *Driver) OutboxAddNext(ctx context.Context, tx *sql.Tx, r *driver.OutboxRow) (int64, error) {
	seq, err := d.VersionNext(ctx, tx, &driver.VersionParams{Stream: r.Destination, AggregateID: r.AggregateID})
	if err != nil {
		return 0, fmt.Errorf("mysql: add next outbox row: %w", err)
	}
	row := *r
	row.Seq = seq
	row.MessageID = r.MessageID + strconv.FormatInt(seq, 10)
	if err := d.OutboxAdd(ctx, tx, []driver.OutboxRow{row}); err != nil {
		return 0, err
	}
	return seq, nil
}

// OutboxClaim implements driver.OutboxRelayStore in one short transaction
// on the server's clock. The candidate rows are read FOR UPDATE SKIP
// LOCKED, so relays claiming at once take different rows instead of
// queueing on each other; their keys are then claimed by one upsert that
// re-checks, under each claim row's lock, that no other relay holds the
// key live; last, the pending rows of the keys won are read in ID order.
func (d *Driver) OutboxClaim(ctx context.Context, owner string, limit, maxBytes int, ttl time.Duration) ([]driver.OutboxRow, bool, error) {
	var (
		out []driver.OutboxRow
		cut bool
	)
	err := d.retry(ctx, func() error {
		out, cut = nil, false
		tx, err := d.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		var now int64
		if err := tx.QueryRowContext(ctx, `SELECT `+nowMicros).Scan(&now); err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, `SELECT o.ordering_key FROM `+d.t.outbox+` o
WHERE o.published_at IS NULL AND NOT EXISTS (SELECT 1 FROM `+d.t.outboxClaims+` c
  WHERE c.ordering_key = o.ordering_key AND c.owner <> ? AND c.claimed_until > ?)
AND `+d.notParked("o")+`
ORDER BY o.published_at, o.id LIMIT ? FOR UPDATE SKIP LOCKED`, owner, now, limit)
		if err != nil {
			return err
		}
		var keys []string
		for rows.Next() {
			var k string
			if err := rows.Scan(&k); err != nil {
				rows.Close()
				return err
			}
			keys = append(keys, k)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if len(keys) == 0 {
			return tx.Commit()
		}
		// One order for every relay: concurrent upserts queue, never
		// deadlock.
		slices.Sort(keys)
		keys = slices.Compact(keys)
		until := now + ttl.Microseconds()
		args := make([]any, 0, 3*len(keys)+1)
		for _, k := range keys {
			args = append(args, k, owner, until)
		}
		args = append(args, now)
		// The owner is decided first, on the row as found; claimed_until
		// then moves only where the owner is now this relay.
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.outboxClaims+` (ordering_key, owner, claimed_until) VALUES (?, ?, ?)`+
			strings.Repeat(", (?, ?, ?)", len(keys)-1)+`
ON DUPLICATE KEY UPDATE owner = IF(owner = VALUES(owner) OR claimed_until <= ?, VALUES(owner), owner),
  claimed_until = IF(owner = VALUES(owner), VALUES(claimed_until), claimed_until)`, args...); err != nil {
			return err
		}
		// A parked row and its key's later rows stay: an operator's park
		// locks the key's claim row as a claim does, so none was parked
		// after the upsert above.
		rows, err = tx.QueryContext(ctx, `SELECT `+outboxColumns+` FROM `+d.t.outbox+` o
WHERE published_at IS NULL AND `+d.notParked("o")+` AND ordering_key IN (SELECT ordering_key FROM `+d.t.outboxClaims+` WHERE owner = ? AND claimed_until = ?)
ORDER BY id LIMIT ?`, owner, until, limit)
		if err != nil {
			return err
		}
		used := 0 // payload bytes in out
		for rows.Next() {
			var (
				o       driver.OutboxRow
				created int64
			)
			if err := rows.Scan(&o.ID, &o.Destination, &o.MessageID, &o.OrderingKey, &o.AggregateID, &o.Seq, &o.Type, &o.Headers, &o.Payload, &o.PayloadHash, &created, &o.Attempts); err != nil {
				rows.Close()
				return err
			}
			if cut = !driver.OutboxClaimFits(len(out), used, len(o.Payload), maxBytes); cut {
				break
			}
			used += len(o.Payload)
			o.CreatedAt = time.UnixMicro(created)
			out = append(out, o)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if cut {
			// One statement, as the claim's upsert; keys another relay
			// holds do not match the owner.
			if idle := driver.OutboxIdleKeys(keys, out); len(idle) > 0 {
				args := []any{owner, until}
				for _, k := range idle {
					args = append(args, k)
				}
				if _, err := tx.ExecContext(ctx, `DELETE FROM `+d.t.outboxClaims+` WHERE owner = ? AND claimed_until = ? AND ordering_key IN (?`+
					strings.Repeat(", ?", len(idle)-1)+`)`, args...); err != nil {
					return err
				}
			}
		}
		return tx.Commit()
	})
	if err != nil {
		return nil, false, fmt.Errorf("mysql: claim outbox rows: %w", notMigrated(err))
	}
	return out, cut, nil
}

// notParked is the condition that the outbox row aliased o is not parked
// and no parked unpublished row of its key precedes it, read from the
// outbox_parked index.
func (d *Driver) notParked(o string) string {
	return `NOT EXISTS (SELECT 1 FROM ` + d.t.outbox + ` p WHERE p.ordering_key = ` + o + `.ordering_key
  AND p.published_at IS NULL AND p.parked_at IS NOT NULL AND p.id <= ` + o + `.id)`
}

// OutboxMarkPublished implements driver.OutboxRelayStore.
func (d *Driver) OutboxMarkPublished(ctx context.Context, ids []int64) error {
	if err := d.ready(ctx); err != nil {
		return err
	}
	if len(ids) == 0 {
		return nil
	}
	err := d.retry(ctx, func() error {
		_, err := d.db.ExecContext(ctx, `UPDATE `+d.t.outbox+` SET published_at = `+nowMicros+` WHERE published_at IS NULL AND `+idsIn, sqlfilter.JSONIDs(ids))
		return err
	})
	if err != nil {
		return fmt.Errorf("mysql: mark outbox rows published: %w", notMigrated(err))
	}
	return nil
}

// OutboxFailed implements driver.OutboxRelayStore: the attempt and the
// key's hold in one transaction, the claim row locked while it decides.
func (d *Driver) OutboxFailed(ctx context.Context, owner string, id int64, errText string, holdFor time.Duration) error {
	err := d.retry(ctx, func() error {
		tx, err := d.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if _, err := tx.ExecContext(ctx, `UPDATE `+d.t.outbox+` SET attempts = attempts + 1, last_error = ? WHERE id = ?`, errText, id); err != nil {
			return err
		}
		var key string
		var now int64
		err = tx.QueryRowContext(ctx, `SELECT ordering_key, `+nowMicros+` FROM `+d.t.outbox+` WHERE id = ?`, id).Scan(&key, &now)
		if errors.Is(err, sql.ErrNoRows) {
			return tx.Commit()
		}
		if err != nil {
			return err
		}
		until := now + holdFor.Microseconds()
		var (
			holder  string
			expires int64
		)
		err = tx.QueryRowContext(ctx, `SELECT owner, claimed_until FROM `+d.t.outboxClaims+` WHERE ordering_key = ? FOR UPDATE`, key).Scan(&holder, &expires)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			_, err = tx.ExecContext(ctx, `INSERT INTO `+d.t.outboxClaims+` (ordering_key, owner, claimed_until) VALUES (?, '', ?)
ON DUPLICATE KEY UPDATE owner = owner`, key, until)
		case err != nil:
		case holder == owner || holder == "" || expires <= now:
			_, err = tx.ExecContext(ctx, `UPDATE `+d.t.outboxClaims+` SET owner = '', claimed_until = ? WHERE ordering_key = ?`, until, key)
		}
		if err != nil {
			return err
		}
		return tx.Commit()
	})
	if err != nil {
		return fmt.Errorf("mysql: record outbox failure: %w", notMigrated(err))
	}
	return nil
}

// OutboxRelease implements driver.OutboxRelayStore.
func (d *Driver) OutboxRelease(ctx context.Context, owner string) error {
	if err := d.ready(ctx); err != nil {
		return err
	}
	err := d.retry(ctx, func() error {
		_, err := d.db.ExecContext(ctx, `DELETE FROM `+d.t.outboxClaims+` WHERE owner = ?`, owner)
		return err
	})
	if err != nil {
		return fmt.Errorf("mysql: release outbox claims: %w", notMigrated(err))
	}
	return nil
}

// OutboxStats implements driver.OutboxRelayStore.
func (d *Driver) OutboxStats(ctx context.Context) (driver.OutboxStats, error) {
	if err := d.ready(ctx); err != nil {
		return driver.OutboxStats{}, err
	}
	var (
		s      driver.OutboxStats
		oldest sql.NullInt64
		last   sql.NullString
	)
	err := d.db.QueryRowContext(ctx, `SELECT COALESCE(SUM(published_at IS NULL), 0), COALESCE(SUM(published_at IS NOT NULL), 0),
MIN(IF(published_at IS NULL AND parked_at IS NULL, created_at, NULL)),
COALESCE(SUM(published_at IS NULL AND parked_at IS NULL AND attempts > 0), 0),
COALESCE(SUM(published_at IS NULL AND parked_at IS NOT NULL), 0),
(SELECT last_error FROM `+d.t.outbox+` WHERE published_at IS NULL AND parked_at IS NULL AND attempts > 0 ORDER BY id DESC LIMIT 1)
FROM `+d.t.outbox).Scan(&s.Pending, &s.Published, &oldest, &s.Failing, &s.Parked, &last)
	if err != nil {
		return s, fmt.Errorf("mysql: outbox stats: %w", notMigrated(err))
	}
	s.OldestPending = fromMicros(oldest)
	s.LastError = last.String
	return s, nil
}

// OutboxPrune implements driver.OutboxRelayStore: the IDs of the next
// batch, then one DELETE of that ID range. The first call of a pass also
// deletes expired claims and holds, and the outbox log's entries made
// before the cut-off.
func (d *Driver) OutboxPrune(ctx context.Context, before time.Time, after int64, limit int) (int, int64, error) {
	if err := d.ready(ctx); err != nil {
		return 0, after, err
	}
	if after == 0 {
		if _, err := d.db.ExecContext(ctx, `DELETE FROM `+d.t.outboxClaims+` WHERE claimed_until <= `+nowMicros); err != nil {
			return 0, after, fmt.Errorf("mysql: prune outbox claims: %w", notMigrated(err))
		}
		if _, err := d.db.ExecContext(ctx, `DELETE FROM `+d.t.outboxLog+` WHERE at < ?`, micros(before)); err != nil {
			return 0, after, fmt.Errorf("mysql: prune outbox log: %w", notMigrated(err))
		}
	}
	var last, n int64
	err := d.db.QueryRowContext(ctx, `SELECT COALESCE(MAX(id), 0), count(*) FROM (SELECT id FROM `+d.t.outbox+`
WHERE id > ? AND published_at < ? ORDER BY id LIMIT ?) x`, after, micros(before), limit).Scan(&last, &n)
	if err != nil {
		return 0, after, fmt.Errorf("mysql: prune outbox: %w", notMigrated(err))
	}
	if n == 0 {
		return 0, after, nil
	}
	r, err := d.db.ExecContext(ctx, `DELETE FROM `+d.t.outbox+` WHERE id > ? AND id <= ? AND published_at < ?`, after, last, micros(before))
	if err != nil {
		return 0, after, fmt.Errorf("mysql: prune outbox: %w", err)
	}
	deleted, err := r.RowsAffected()
	if err != nil {
		return 0, after, fmt.Errorf("mysql: prune outbox: %w", err)
	}
	return int(deleted), last, nil
}

// OutboxCountPrunable implements driver.OutboxPrunableCounter.
func (d *Driver) OutboxCountPrunable(ctx context.Context, before time.Time) (int64, error) {
	if err := d.ready(ctx); err != nil {
		return 0, err
	}
	var n int64
	if err := d.db.QueryRowContext(ctx, `SELECT count(*) FROM `+d.t.outbox+` WHERE published_at < ?`, micros(before)).Scan(&n); err != nil {
		return 0, fmt.Errorf("mysql: count prunable outbox rows: %w", notMigrated(err))
	}
	return n, nil
}
