package mysql

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
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

// dedupeKey is the dead_letters.dedupe_key of dl: the SHA-256 of what
// makes two writes one dead letter, each part length-prefixed, or nil
// when nothing identifies it (no message ID and no source).
func dedupeKey(dl *driver.DeadLetter) []byte {
	var parts [][]byte
	switch {
	case dl.MessageID != "":
		parts = [][]byte{[]byte("id"), []byte(dl.Handler), []byte(dl.MessageID), dl.PayloadHash}
	case dl.Source != "":
		raw := append([]byte{0}, dl.Raw...)
		if dl.Raw == nil {
			raw = []byte{1} // NULL differs from an empty payload
		}
		parts = [][]byte{[]byte("source"), []byte(dl.Handler), []byte(dl.Source), raw, []byte(dl.Error)}
	default:
		return nil
	}
	h := sha256.New()
	for _, p := range parts {
		_ = binary.Write(h, binary.BigEndian, uint64(len(p)))
		h.Write(p)
	}
	return h.Sum(nil)
}

// errDeadLetterRace says a concurrent write inserted the same dead letter
// first; DeadLetterPut then updates it.
var errDeadLetterRace = errors.New("mysql: dead letter inserted concurrently")

// DeadLetterPut implements driver.DeadLetterStore. The dead letter's key
// (dedupeKey) is unique: the lookup takes the row's lock, and two writers
// of a new dead letter race on the INSERT, where the loser waits and then
// updates the winner's row.
func (d *Driver) DeadLetterPut(ctx context.Context, dl *driver.DeadLetter) (int64, error) {
	key := dedupeKey(dl)
	var id int64
	for range 3 {
		err := d.retry(ctx, func() error {
			tx, err := d.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			if id, err = d.putTx(ctx, tx, dl, key); err != nil {
				return err
			}
			return tx.Commit()
		})
		if errors.Is(err, errDeadLetterRace) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("mysql: store dead letter: %w", notMigrated(err))
		}
		return id, nil
	}
	return 0, fmt.Errorf("mysql: store dead letter: %w", errDeadLetterRace)
}

func (d *Driver) putTx(ctx context.Context, tx *sql.Tx, dl *driver.DeadLetter, key []byte) (int64, error) {
	var (
		id  int64
		was string
		err = sql.ErrNoRows
	)
	hash := dl.PayloadHash
	if hash == nil {
		hash = []byte{}
	}
	if key != nil {
		err = tx.QueryRowContext(ctx, `SELECT id, state FROM `+d.t.deadLetters+` WHERE dedupe_key = ? FOR UPDATE`, key).Scan(&id, &was)
	}
	// Large bodies go in statements of their own (writeBodies), each in a
	// packet of its own.
	envelope, raw := dl.Envelope, dl.Raw
	apart := len(envelope)+len(raw) > inlineBodies
	if apart {
		envelope, raw = nil, nil
	}
	if errors.Is(err, sql.ErrNoRows) {
		r, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.deadLetters+`
(handler, message_id, payload_hash, dedupe_key, envelope, raw, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, `+nowMicros+`, `+nowMicros+`, 'parked')`,
			dl.Handler, dl.MessageID, hash, key, envelope, raw, dl.Source, dl.Error, dl.Class, dl.Fingerprint, dl.Attempts)
		if errNumber(err) == errDupEntry {
			return 0, errDeadLetterRace
		}
		if err != nil {
			return 0, err
		}
		if id, err = r.LastInsertId(); err != nil {
			return 0, err
		}
		if apart {
			return id, d.writeBodies(ctx, tx, id, dl)
		}
		return id, nil
	}
	if err != nil {
		return 0, err
	}
	if dl.Repeat {
		// The failure recorded earlier, seen again: its error and group
		// stay.
		_, err = tx.ExecContext(ctx, `UPDATE `+d.t.deadLetters+` SET
  envelope = ?, raw = ?, source = ?, attempts = ?, last_failed_at = `+nowMicros+`, state = 'parked'
WHERE id = ?`, envelope, raw, dl.Source, dl.Attempts, id)
	} else {
		_, err = tx.ExecContext(ctx, `UPDATE `+d.t.deadLetters+` SET
  envelope = ?, raw = ?, source = ?, error = ?, class = ?, fingerprint = ?, attempts = ?, last_failed_at = `+nowMicros+`, state = 'parked'
WHERE id = ?`, envelope, raw, dl.Source, dl.Error, dl.Class, dl.Fingerprint, dl.Attempts, id)
	}
	if err != nil {
		return 0, err
	}
	if apart {
		if err := d.writeBodies(ctx, tx, id, dl); err != nil {
			return 0, err
		}
	}
	if was != driver.DeadLetterParked || dl.Repeat {
		actor, outcome := driver.RefailLog(dl)
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.deadLetterLog+` (dead_letter_id, at, state, actor, outcome) VALUES (?, `+nowMicros+`, ?, ?, ?)`,
			id, driver.DeadLetterParked, actor, outcome); err != nil {
			return 0, err
		}
	}
	return id, nil
}

// inlineBodies is the most body bytes (envelope and raw payload together)
// a dead letter's write carries in the statement that writes its other
// columns; larger bodies are written by writeBodies.
const inlineBodies = 1 << 20

// writeBodies writes dl's envelope and raw payload into the row id, one
// statement each. A statement travels in one packet, which the server
// refuses above max_allowed_packet (error 1153; 16 MiB on MariaDB, 64 MiB
// on MySQL 8 by default): carrying both bodies, whose envelope holds the
// payload again in base64, a message of about 40% of the limit could not
// be dead-lettered, and its delivery came back for ever. Apart, each fits
// until the envelope alone (about 4/3 of the payload) exceeds it.
func (d *Driver) writeBodies(ctx context.Context, tx *sql.Tx, id int64, dl *driver.DeadLetter) error {
	if _, err := tx.ExecContext(ctx, `UPDATE `+d.t.deadLetters+` SET envelope = ? WHERE id = ?`, dl.Envelope, id); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, `UPDATE `+d.t.deadLetters+` SET raw = ? WHERE id = ?`, dl.Raw, id)
	return err
}

// idsIn matches the rows whose IDs a JSON array holds (sqlfilter.JSONIDs): one
// parameter however many IDs, where a list of ? would stop at the
// protocol's 65,535 placeholders. JSON_TABLE is in MySQL 8.0 and MariaDB
// 10.6.
const idsIn = `id IN (SELECT j.v FROM JSON_TABLE(?, '$[*]' COLUMNS (v BIGINT PATH '$')) AS j)`

// DeadLetterList implements driver.DeadLetterStore.
func (d *Driver) DeadLetterList(ctx context.Context, f *driver.DeadLetterFilter) ([]driver.DeadLetter, error) {
	if err := d.ready(ctx); err != nil {
		return nil, err
	}
	where, args := sqlfilter.DeadLetters(f, idsIn)
	cols := deadLetterColumns
	if f != nil && f.Summary {
		cols = deadLetterSummaryColumns
	}
	q := `SELECT ` + cols + ` FROM ` + d.t.deadLetters + ` WHERE ` + strings.Join(where, " AND ") + ` ORDER BY id`
	if f != nil && f.Limit > 0 {
		q += " LIMIT " + strconv.Itoa(f.Limit)
	}
	rows, err := d.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("mysql: list dead letters: %w", notMigrated(err))
	}
	defer rows.Close()
	var out []driver.DeadLetter
	for rows.Next() {
		var (
			dl          driver.DeadLetter
			first, last int64
		)
		if err := rows.Scan(&dl.ID, &dl.Handler, &dl.MessageID, &dl.PayloadHash, &dl.Envelope, &dl.Raw, &dl.Source, &dl.Error, &dl.Class,
			&dl.Fingerprint, &dl.Attempts, &first, &last, &dl.State); err != nil {
			return nil, fmt.Errorf("mysql: list dead letters: %w", err)
		}
		if len(dl.PayloadHash) == 0 {
			dl.PayloadHash = nil
		}
		dl.FirstFailed, dl.LastFailed = time.UnixMicro(first), time.UnixMicro(last)
		out = append(out, dl)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("mysql: list dead letters: %w", err)
	}
	return out, nil
}

// DeadLetterSetState implements driver.DeadLetterStore: the rows to move
// are locked by a locking read, moved, and logged, in one transaction.
func (d *Driver) DeadLetterSetState(ctx context.Context, c *driver.DeadLetterStateChange) (int, error) {
	if len(c.IDs) == 0 || len(c.From) == 0 {
		return 0, nil
	}
	args := []any{}
	for _, s := range c.From {
		args = append(args, s)
	}
	args = append(args, sqlfilter.JSONIDs(c.IDs))
	var moved []int64
	err := d.retry(ctx, func() error {
		moved = moved[:0]
		tx, err := d.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		rows, err := tx.QueryContext(ctx, `SELECT id FROM `+d.t.deadLetters+` WHERE state IN `+inList(len(c.From))+
			` AND `+idsIn+` ORDER BY id FOR UPDATE`, args...)
		if err != nil {
			return err
		}
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return err
			}
			moved = append(moved, id)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if len(moved) == 0 {
			return nil
		}
		ids := sqlfilter.JSONIDs(moved)
		if _, err := tx.ExecContext(ctx, `UPDATE `+d.t.deadLetters+` SET state = ? WHERE `+idsIn, c.To, ids); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.t.deadLetterLog+` (dead_letter_id, at, state, actor, outcome)
SELECT j.v, `+nowMicros+`, ?, ?, ? FROM JSON_TABLE(?, '$[*]' COLUMNS (v BIGINT PATH '$')) AS j ORDER BY j.v`,
			c.To, c.Actor, c.Outcome, ids); err != nil {
			return err
		}
		return tx.Commit()
	})
	if err != nil {
		return 0, fmt.Errorf("mysql: set dead-letter state: %w", notMigrated(err))
	}
	return len(moved), nil
}

// DeadLetterHistory implements driver.DeadLetterStore.
func (d *Driver) DeadLetterHistory(ctx context.Context, id int64) ([]driver.DeadLetterEvent, error) {
	if err := d.ready(ctx); err != nil {
		return nil, err
	}
	rows, err := d.db.QueryContext(ctx, `SELECT at, state, actor, outcome FROM `+d.t.deadLetterLog+` WHERE dead_letter_id = ? ORDER BY id`, id)
	if err != nil {
		return nil, fmt.Errorf("mysql: dead-letter history: %w", notMigrated(err))
	}
	defer rows.Close()
	var out []driver.DeadLetterEvent
	for rows.Next() {
		var (
			ev driver.DeadLetterEvent
			at int64
		)
		if err := rows.Scan(&at, &ev.State, &ev.Actor, &ev.Outcome); err != nil {
			return nil, fmt.Errorf("mysql: dead-letter history: %w", err)
		}
		ev.At = time.UnixMicro(at)
		out = append(out, ev)
	}
	return out, rows.Err()
}
