package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/idemhq/idem/driver"
)

var _ driver.DeadLetterStore = (*Driver)(nil)

const deadLetterColumns = `id, handler, message_id, envelope, raw, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state`

// DeadLetterPut implements driver.DeadLetterStore.
func (d *Driver) DeadLetterPut(ctx context.Context, dl *driver.DeadLetter) (int64, error) {
	now := time.Now().UnixMicro()
	var id int64
	err := d.db.QueryRowContext(ctx, `INSERT INTO `+d.tables.deadLetters+`
(handler, message_id, envelope, raw, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'parked')
ON CONFLICT (handler, message_id) WHERE message_id <> '' DO UPDATE SET
  envelope = excluded.envelope, raw = excluded.raw, source = excluded.source, error = excluded.error,
  class = excluded.class, fingerprint = excluded.fingerprint, attempts = excluded.attempts,
  last_failed_at = excluded.last_failed_at, state = 'parked'
RETURNING id`, dl.Handler, dl.MessageID, dl.Envelope, dl.Raw, dl.Source, dl.Error, dl.Class, dl.Fingerprint,
		dl.Attempts, now, now).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("sqlite: store dead letter: %w", err)
	}
	return id, nil
}

// DeadLetterList implements driver.DeadLetterStore.
func (d *Driver) DeadLetterList(ctx context.Context, f *driver.DeadLetterFilter) ([]driver.DeadLetter, error) {
	where, args := []string{"1 = 1"}, []any{}
	if f != nil {
		if f.Handler != "" {
			where, args = append(where, "handler = ?"), append(args, f.Handler)
		}
		if f.Fingerprint != "" {
			where, args = append(where, "fingerprint = ?"), append(args, f.Fingerprint)
		}
		if f.State != "" {
			where, args = append(where, "state = ?"), append(args, f.State)
		}
		if len(f.IDs) > 0 {
			where = append(where, "id IN (?"+strings.Repeat(", ?", len(f.IDs)-1)+")")
			for _, id := range f.IDs {
				args = append(args, id)
			}
		}
		if !f.Since.IsZero() {
			where, args = append(where, "last_failed_at >= ?"), append(args, f.Since.UnixMicro())
		}
		if !f.Until.IsZero() {
			where, args = append(where, "last_failed_at < ?"), append(args, f.Until.UnixMicro())
		}
	}
	q := `SELECT ` + deadLetterColumns + ` FROM ` + d.tables.deadLetters + ` WHERE ` + strings.Join(where, " AND ") + ` ORDER BY id`
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
		)
		if err := rows.Scan(&dl.ID, &dl.Handler, &dl.MessageID, &dl.Envelope, &dl.Raw, &dl.Source, &dl.Error, &dl.Class,
			&dl.Fingerprint, &dl.Attempts, &first, &last, &dl.State); err != nil {
			return nil, fmt.Errorf("sqlite: list dead letters: %w", err)
		}
		dl.FirstFailed, dl.LastFailed = time.UnixMicro(first), time.UnixMicro(last)
		out = append(out, dl)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("sqlite: list dead letters: %w", err)
	}
	return out, nil
}

// DeadLetterSetState implements driver.DeadLetterStore.
func (d *Driver) DeadLetterSetState(ctx context.Context, ids []int64, from []string, state string) (int, error) {
	if len(ids) == 0 || len(from) == 0 {
		return 0, nil
	}
	args := []any{state}
	for _, s := range from {
		args = append(args, s)
	}
	for _, id := range ids {
		args = append(args, id)
	}
	var r sql.Result
	r, err := d.db.ExecContext(ctx, `UPDATE `+d.tables.deadLetters+` SET state = ? WHERE state IN (?`+strings.Repeat(", ?", len(from)-1)+
		`) AND id IN (?`+strings.Repeat(", ?", len(ids)-1)+`)`, args...)
	if err != nil {
		return 0, fmt.Errorf("sqlite: set dead-letter state: %w", err)
	}
	n, err := r.RowsAffected()
	return int(n), err
}
