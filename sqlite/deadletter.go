package sqlite

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlfilter"
)

var _ driver.DeadLetterStore = (*Driver)(nil)

const (
	deadLetterColumns = `id, handler, message_id, payload_hash, envelope, raw, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state`
	// deadLetterSummaryColumns are deadLetterColumns with NULL for the
	// bodies, for a DeadLetterFilter.Summary.
	deadLetterSummaryColumns = `id, handler, message_id, payload_hash, NULL, NULL, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state`
)

// DeadLetterPut implements driver.DeadLetterStore. The lookup of the row
// it updates, the write and the log entry share one write transaction.
//
// Without a message ID to key on (the delivery did not decode, or its ID
// is invalid), the same failure of the same delivery again (handler,
// source, payload and error), redelivered after a crash before the ack,
// updates the row it wrote.
func (d *Driver) DeadLetterPut(ctx context.Context, dl *driver.DeadLetter) (int64, error) {
	now := time.Now().UnixMicro()
	tx, err := d.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("sqlite: store dead letter: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	id, err := d.putTx(ctx, tx, dl, now)
	if err == nil {
		err = tx.Commit()
	}
	if err != nil {
		return 0, fmt.Errorf("sqlite: store dead letter: %w", err)
	}
	return id, nil
}

func (d *Driver) putTx(ctx context.Context, tx *sql.Tx, dl *driver.DeadLetter, now int64) (int64, error) {
	unkeyed := dl.MessageID == ""
	hash := hex.EncodeToString(dl.PayloadHash)
	var (
		id  int64
		was string
		err = sql.ErrNoRows
	)
	switch {
	case !unkeyed:
		// Its own row, or one written before payload hashes were
		// stored that holds the same payload (the hash is filled in
		// below).
		err = tx.QueryRowContext(ctx, `SELECT id, state FROM `+d.tables.deadLetters+`
WHERE handler = ? AND message_id = ? AND (payload_hash = ? OR (payload_hash = '' AND raw IS ?))
ORDER BY payload_hash DESC LIMIT 1`,
			dl.Handler, dl.MessageID, hash, dl.Raw).Scan(&id, &was)
	case dl.Source != "":
		err = tx.QueryRowContext(ctx, `SELECT id, state FROM `+d.tables.deadLetters+`
WHERE handler = ? AND message_id = '' AND source = ? AND raw IS ? AND error = ? ORDER BY id LIMIT 1`,
			dl.Handler, dl.Source, dl.Raw, dl.Error).Scan(&id, &was)
	}
	if errors.Is(err, sql.ErrNoRows) {
		err = tx.QueryRowContext(ctx, `INSERT INTO `+d.tables.deadLetters+`
(handler, message_id, payload_hash, envelope, raw, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'parked')
RETURNING id`, dl.Handler, dl.MessageID, hash, dl.Envelope, dl.Raw, dl.Source, dl.Error, dl.Class, dl.Fingerprint,
			dl.Attempts, now, now).Scan(&id)
		return id, err
	}
	if err != nil {
		return 0, err
	}
	if dl.Repeat {
		// The failure recorded earlier, seen again: its error and group
		// stay.
		_, err = tx.ExecContext(ctx, `UPDATE `+d.tables.deadLetters+` SET
  payload_hash = ?, envelope = ?, raw = ?, source = ?, attempts = ?, last_failed_at = ?, state = 'parked'
WHERE id = ?`, hash, dl.Envelope, dl.Raw, dl.Source, dl.Attempts, now, id)
	} else {
		_, err = tx.ExecContext(ctx, `UPDATE `+d.tables.deadLetters+` SET
  payload_hash = ?, envelope = ?, raw = ?, source = ?, error = ?, class = ?, fingerprint = ?, attempts = ?, last_failed_at = ?, state = 'parked'
WHERE id = ?`, hash, dl.Envelope, dl.Raw, dl.Source, dl.Error, dl.Class, dl.Fingerprint, dl.Attempts, now, id)
	}
	if err != nil {
		return 0, err
	}
	if was != driver.DeadLetterParked || dl.Repeat {
		actor, outcome := driver.RefailLog(dl)
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.tables.deadLetterLog+` (dead_letter_id, at, state, actor, outcome) VALUES (?, ?, ?, ?, ?)`,
			id, now, driver.DeadLetterParked, actor, outcome); err != nil {
			return 0, err
		}
	}
	return id, nil
}

// idsIn matches the rows whose IDs a JSON array holds (sqlfilter.JSONIDs): one
// parameter however many IDs, where a list of ? would stop at SQLite's
// 32,766 bound variables — a backlog "idem dlq replay" must still move,
// and a relay's batch of marks is the user's to size.
const idsIn = `id IN (SELECT value FROM json_each(?))`

// DeadLetterList implements driver.DeadLetterStore.
func (d *Driver) DeadLetterList(ctx context.Context, f *driver.DeadLetterFilter) ([]driver.DeadLetter, error) {
	where, args := sqlfilter.DeadLetters(f, idsIn)
	cols := deadLetterColumns
	if f != nil && f.Summary {
		cols = deadLetterSummaryColumns
	}
	q := `SELECT ` + cols + ` FROM ` + d.tables.deadLetters + ` WHERE ` + strings.Join(where, " AND ") + ` ORDER BY id`
	if f != nil && f.Limit > 0 {
		q += fmt.Sprintf(" LIMIT %d", f.Limit)
	}
	rows, err := d.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("sqlite: list dead letters: %w", err)
	}
	defer rows.Close()
	var out []driver.DeadLetter
	for rows.Next() {
		var (
			dl          driver.DeadLetter
			first, last int64
			hash        string
		)
		if err := rows.Scan(&dl.ID, &dl.Handler, &dl.MessageID, &hash, &dl.Envelope, &dl.Raw, &dl.Source, &dl.Error, &dl.Class,
			&dl.Fingerprint, &dl.Attempts, &first, &last, &dl.State); err != nil {
			return nil, fmt.Errorf("sqlite: list dead letters: %w", err)
		}
		dl.FirstFailed, dl.LastFailed = time.UnixMicro(first), time.UnixMicro(last)
		if hash != "" {
			if dl.PayloadHash, err = hex.DecodeString(hash); err != nil {
				return nil, fmt.Errorf("sqlite: list dead letters: payload hash of %d: %w", dl.ID, err)
			}
		}
		out = append(out, dl)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("sqlite: list dead letters: %w", err)
	}
	return out, nil
}

// DeadLetterSetState implements driver.DeadLetterStore.
func (d *Driver) DeadLetterSetState(ctx context.Context, c *driver.DeadLetterStateChange) (int, error) {
	if len(c.IDs) == 0 || len(c.From) == 0 {
		return 0, nil
	}
	args := []any{c.To}
	for _, s := range c.From {
		args = append(args, s)
	}
	args = append(args, sqlfilter.JSONIDs(c.IDs))
	tx, err := d.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("sqlite: set dead-letter state: %w", err)
	}
	defer tx.Rollback()
	rows, err := tx.QueryContext(ctx, `UPDATE `+d.tables.deadLetters+` SET state = ? WHERE state IN (?`+strings.Repeat(", ?", len(c.From)-1)+
		`) AND `+idsIn+` RETURNING id`, args...)
	if err != nil {
		return 0, fmt.Errorf("sqlite: set dead-letter state: %w", err)
	}
	var moved []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return 0, fmt.Errorf("sqlite: set dead-letter state: %w", err)
		}
		moved = append(moved, id)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("sqlite: set dead-letter state: %w", err)
	}
	now := time.Now().UnixMicro()
	for _, id := range moved {
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.tables.deadLetterLog+` (dead_letter_id, at, state, actor, outcome) VALUES (?, ?, ?, ?, ?)`,
			id, now, c.To, c.Actor, c.Outcome); err != nil {
			return 0, fmt.Errorf("sqlite: log dead-letter state: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("sqlite: set dead-letter state: %w", err)
	}
	return len(moved), nil
}

// DeadLetterHistory implements driver.DeadLetterStore.
func (d *Driver) DeadLetterHistory(ctx context.Context, id int64) ([]driver.DeadLetterEvent, error) {
	rows, err := d.db.QueryContext(ctx, `SELECT at, state, actor, outcome FROM `+d.tables.deadLetterLog+` WHERE dead_letter_id = ? ORDER BY id`, id)
	if err != nil {
		return nil, fmt.Errorf("sqlite: dead-letter history: %w", err)
	}
	defer rows.Close()
	var out []driver.DeadLetterEvent
	for rows.Next() {
		var (
			ev driver.DeadLetterEvent
			at int64
		)
		if err := rows.Scan(&at, &ev.State, &ev.Actor, &ev.Outcome); err != nil {
			return nil, fmt.Errorf("sqlite: dead-letter history: %w", err)
		}
		ev.At = time.UnixMicro(at)
		out = append(out, ev)
	}
	return out, rows.Err()
}
