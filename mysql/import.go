package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlident"
)

var _ driver.MarkerImporter = (*Driver)(nil)

// importSQL validates and quotes an import source. Schema is a database
// on the same server; empty: the connection's.
func importSQL(src *driver.ImportSource) (table, column string, err error) {
	if src == nil {
		return "", "", fmt.Errorf("%w: mysql: nil import source", idem.ErrInvalidConfig)
	}
	for _, p := range []struct {
		what, v    string
		allowEmpty bool
	}{{"schema", src.Schema, true}, {"table", src.Table, false}, {"column", src.Column, false}} {
		if err := sqlident.Check("mysql: import "+p.what, p.v, p.allowEmpty); err != nil {
			return "", "", fmt.Errorf("%w: %w", idem.ErrInvalidConfig, err)
		}
	}
	table = quote(src.Table)
	if src.Schema != "" {
		table = quote(src.Schema) + "." + table
	}
	return table, quote(src.Column), nil
}

// ImportIDs implements driver.MarkerImporter: the column's values after
// after, in the column's order, then by their text's bytes (values equal
// under the column's collation, 'A' and 'a', are distinct IDs, and a page
// boundary between them skips neither). The cursor is compared as an
// integer for an integer column, as text otherwise. An index on the
// column keeps each page cheap.
func (d *Driver) ImportIDs(ctx context.Context, src *driver.ImportSource, after string, limit int) ([]string, error) {
	if err := d.ready(ctx); err != nil {
		return nil, err
	}
	table, col, err := importSQL(src)
	if err != nil {
		return nil, err
	}
	var dataType, columnType string
	err = d.db.QueryRowContext(ctx, `SELECT DATA_TYPE, COLUMN_TYPE FROM information_schema.COLUMNS
WHERE TABLE_SCHEMA = COALESCE(NULLIF(?, ''), DATABASE()) AND TABLE_NAME = ? AND COLUMN_NAME = ?`,
		src.Schema, src.Table, src.Column).Scan(&dataType, &columnType)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("mysql: import: %s has no column %s", table, col)
	} else if err != nil {
		return nil, err
	}
	cursor := `?`
	switch strings.ToLower(dataType) {
	case "tinyint", "smallint", "mediumint", "int", "integer", "bigint":
		cursor = `CAST(? AS SIGNED)`
		if strings.Contains(strings.ToLower(columnType), "unsigned") {
			cursor = `CAST(? AS UNSIGNED)`
		}
	}
	// Empty is tested on the bytes: under a PAD SPACE collation (MariaDB's
	// default) a value of blanks equals '', and is an ID all the same.
	text := `CAST(` + col + ` AS CHAR)`
	q := `SELECT ` + text + ` AS idem_value FROM ` + table + ` WHERE ` + col + ` IS NOT NULL AND CAST(` + text + ` AS BINARY) <> ''`
	args := []any{}
	if after != "" {
		q += ` AND (` + col + ` > ` + cursor + ` OR (` + col + ` = ` + cursor + ` AND CAST(` + text + ` AS BINARY) > CAST(? AS BINARY)))`
		args = append(args, after, after, after)
	}
	q += ` ORDER BY ` + col + `, CAST(` + text + ` AS BINARY) LIMIT ?`
	args = append(args, limit)
	rows, err := d.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("mysql: import: %w", err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, fmt.Errorf("mysql: import: %w", err)
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// InsertImportedMarkers implements driver.MarkerImporter with one
// multi-row INSERT IGNORE per chunk, in one transaction. The IDs were
// validated (at most 255 bytes), so IGNORE skips only existing markers.
func (d *Driver) InsertImportedMarkers(ctx context.Context, handler string, ids []string) (int64, error) {
	hid, err := d.handlerID(ctx, d.db, handler)
	if err != nil {
		return 0, err
	}
	var n int64
	err = d.retry(ctx, func() error {
		n = 0
		tx, err := d.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		for lo := 0; lo < len(ids); lo += markerChunk {
			chunk := ids[lo:min(lo+markerChunk, len(ids))]
			args := make([]any, 0, 2*len(chunk))
			for _, id := range chunk {
				args = append(args, hid, id)
			}
			row := `(?, ?, '', ` + nowMicros + `)`
			r, err := tx.ExecContext(ctx, `INSERT IGNORE INTO `+d.t.markers+` (handler_id, message_id, payload_hash, processed_at) VALUES `+
				row+strings.Repeat(", "+row, len(chunk)-1), args...)
			if err != nil {
				return err
			}
			k, err := r.RowsAffected()
			if err != nil {
				return err
			}
			n += k
		}
		return tx.Commit()
	})
	if err != nil {
		return 0, fmt.Errorf("mysql: import markers: %w", notMigrated(err))
	}
	return n, nil
}
