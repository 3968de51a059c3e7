package postgres

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/driver"
)

var _ driver.DeadLetterStore = (*Driver)(nil)

// DeadLetterPut implements driver.DeadLetterStore, in one transaction:
// the row it updates is locked first (FOR UPDATE), so that its state is
// read after any operator's change in flight, and a dead letter parked
// again from another state is logged as such.
//
// Without a message ID to key on (the delivery did not decode, or its ID
// is invalid), the same failure of the same delivery again (handler,
// source, payload and error), redelivered after a crash before the ack,
// updates the row it wrote. An advisory lock on the handler and source
// serialises concurrent writes of one such delivery (two consumers during
// a rebalance), which no unique index can: rows written before this rule
// may repeat.
func (d *Driver) DeadLetterPut(ctx context.Context, dl *driver.DeadLetter) (int64, error) {
	var id int64
	err := pgx.BeginTxFunc(ctx, d.pool, readCommitted(), func(tx pgx.Tx) error {
		var err error
		id, err = d.putTx(ctx, tx, dl)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("postgres: store dead letter: %w", err)
	}
	return id, nil
}

func (d *Driver) putTx(ctx context.Context, tx pgx.Tx, dl *driver.DeadLetter) (int64, error) {
	hash := hex.EncodeToString(dl.PayloadHash)
	var (
		id  int64
		was string
		err = pgx.ErrNoRows
	)
	switch {
	case dl.MessageID != "":
		// Its own row, or one written before payload hashes were
		// stored that holds the same payload (the hash is filled in
		// below).
		err = tx.QueryRow(ctx, `SELECT id, state FROM `+d.t.deadLetters+`
WHERE handler = $1 AND message_id = $2 AND (payload_hash = $3 OR (payload_hash = '' AND raw IS NOT DISTINCT FROM $4))
ORDER BY payload_hash DESC LIMIT 1 FOR UPDATE`,
			dl.Handler, dl.MessageID, hash, dl.Raw).Scan(&id, &was)
	case dl.Source != "":
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`,
			"idem-dead-letter:"+d.t.deadLetters+"|"+dl.Handler+"|"+dl.Source); err != nil {
			return 0, err
		}
		err = tx.QueryRow(ctx, `SELECT id, state FROM `+d.t.deadLetters+`
WHERE handler = $1 AND message_id = '' AND source = $2 AND raw IS NOT DISTINCT FROM $3 AND error = $4
ORDER BY id LIMIT 1 FOR UPDATE`, dl.Handler, dl.Source, dl.Raw, dl.Error).Scan(&id, &was)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		// A new dead letter; a concurrent first write of the same key
		// meets it here and updates it instead (keeping, for a Repeat,
		// the error the first write stored).
		err = tx.QueryRow(ctx, `INSERT INTO `+d.t.deadLetters+` AS dl
(handler, message_id, payload_hash, envelope, raw, source, error, class, fingerprint, attempts)
VALUES ($1, $2, $3, $4::jsonb, $5, $6, $7, $8, $9, $10)
ON CONFLICT (handler, message_id, payload_hash) WHERE message_id <> '' DO UPDATE SET
  envelope = excluded.envelope, raw = excluded.raw, source = excluded.source,
  error = CASE WHEN $11 THEN dl.error ELSE excluded.error END,
  class = CASE WHEN $11 THEN dl.class ELSE excluded.class END,
  fingerprint = CASE WHEN $11 THEN dl.fingerprint ELSE excluded.fingerprint END,
  attempts = excluded.attempts, last_failed_at = now(), state = 'parked'
RETURNING id`, dl.Handler, dl.MessageID, hash, envelopeArg(dl.Envelope), dl.Raw, dl.Source, dl.Error, dl.Class, dl.Fingerprint,
			dl.Attempts, dl.Repeat).Scan(&id)
		return id, err
	}
	if err != nil {
		return 0, err
	}
	if _, err := tx.Exec(ctx, `UPDATE `+d.t.deadLetters+` SET
  payload_hash = $10, envelope = $2::jsonb, raw = $3, source = $4,
  error = CASE WHEN $9 THEN error ELSE $5 END,
  class = CASE WHEN $9 THEN class ELSE $6 END,
  fingerprint = CASE WHEN $9 THEN fingerprint ELSE $7 END,
  attempts = $8, last_failed_at = now(), state = 'parked'
WHERE id = $1`, id, envelopeArg(dl.Envelope), dl.Raw, dl.Source, dl.Error, dl.Class, dl.Fingerprint, dl.Attempts, dl.Repeat, hash); err != nil {
		return 0, err
	}
	if was != driver.DeadLetterParked || dl.Repeat {
		actor, outcome := driver.RefailLog(dl)
		if _, err := tx.Exec(ctx, `INSERT INTO `+d.t.deadLetterLog+` (dead_letter_id, state, actor, outcome) VALUES ($1, $2, $3, $4)`,
			id, driver.DeadLetterParked, actor, outcome); err != nil {
			return 0, err
		}
	}
	return id, nil
}

// envelopeArg passes an envelope to a jsonb parameter: NULL when absent.
func envelopeArg(env []byte) any {
	if env == nil {
		return nil
	}
	return string(env)
}

// DeadLetterList implements driver.DeadLetterStore.
func (d *Driver) DeadLetterList(ctx context.Context, f *driver.DeadLetterFilter) ([]driver.DeadLetter, error) {
	where, args := []string{"true"}, []any{}
	add := func(cond string, v any) {
		args = append(args, v)
		where = append(where, strings.ReplaceAll(cond, "$?", fmt.Sprintf("$%d", len(args))))
	}
	if f != nil {
		if f.Handler != "" {
			add("handler = $?", f.Handler)
		}
		if f.Fingerprint != "" {
			add("fingerprint = $?", f.Fingerprint)
		}
		if f.State != "" {
			add("state = $?", f.State)
		}
		if f.IDs != nil {
			add("id = ANY($?)", f.IDs)
		}
		if !f.Since.IsZero() {
			add("last_failed_at >= $?", f.Since)
		}
		if !f.Until.IsZero() {
			add("last_failed_at < $?", f.Until)
		}
		if f.AfterID > 0 {
			add("id > $?", f.AfterID)
		}
	}
	bodies := `envelope::text, raw`
	if f != nil && f.Summary {
		bodies = `NULL::text, NULL::bytea`
	}
	q := `SELECT id, handler, message_id, payload_hash, ` + bodies + `, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state
FROM ` + d.t.deadLetters + ` WHERE ` + strings.Join(where, " AND ") + ` ORDER BY id`
	if f != nil && f.Limit > 0 {
		q += fmt.Sprintf(" LIMIT %d", f.Limit)
	}
	rows, err := d.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("postgres: list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (driver.DeadLetter, error) {
		var (
			dl   driver.DeadLetter
			env  *string
			hash string
		)
		err := r.Scan(&dl.ID, &dl.Handler, &dl.MessageID, &hash, &env, &dl.Raw, &dl.Source, &dl.Error, &dl.Class,
			&dl.Fingerprint, &dl.Attempts, &dl.FirstFailed, &dl.LastFailed, &dl.State)
		if env != nil {
			dl.Envelope = []byte(*env)
		}
		if err == nil && hash != "" {
			if dl.PayloadHash, err = hex.DecodeString(hash); err != nil {
				err = fmt.Errorf("payload hash of %d: %w", dl.ID, err)
			}
		}
		return dl, err
	})
	if err != nil {
		return nil, fmt.Errorf("postgres: list dead letters: %w", err)
	}
	return out, nil
}

// DeadLetterSetState implements driver.DeadLetterStore: the update and its
// log rows are one statement.
func (d *Driver) DeadLetterSetState(ctx context.Context, c *driver.DeadLetterStateChange) (int, error) {
	if len(c.IDs) == 0 || len(c.From) == 0 {
		return 0, nil
	}
	var n int
	err := d.auto.QueryRow(ctx, `WITH moved AS (
  UPDATE `+d.t.deadLetters+` SET state = $1 WHERE state = ANY($2) AND id = ANY($3) RETURNING id
), logged AS (
  INSERT INTO `+d.t.deadLetterLog+` (dead_letter_id, state, actor, outcome) SELECT id, $1, $4, $5 FROM moved
)
SELECT count(*) FROM moved`, c.To, c.From, c.IDs, c.Actor, c.Outcome).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("postgres: set dead-letter state: %w", err)
	}
	return n, nil
}

// DeadLetterHistory implements driver.DeadLetterStore.
func (d *Driver) DeadLetterHistory(ctx context.Context, id int64) ([]driver.DeadLetterEvent, error) {
	rows, err := d.pool.Query(ctx, `SELECT at, state, actor, outcome FROM `+d.t.deadLetterLog+` WHERE dead_letter_id = $1 ORDER BY id`, id)
	if err != nil {
		return nil, fmt.Errorf("postgres: dead-letter history: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (driver.DeadLetterEvent, error) {
		var ev driver.DeadLetterEvent
		err := r.Scan(&ev.At, &ev.State, &ev.Actor, &ev.Outcome)
		return ev, err
	})
	if err != nil {
		return nil, fmt.Errorf("postgres: dead-letter history: %w", err)
	}
	return out, nil
}
