package sqlite

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlident"
)

var _ driver.MarkerImporter = (*Driver)(nil)

// ImportIDs implements driver.MarkerImporter: the column's values after
// after, in the column's order. SQLite has no schemas: src.Schema must be
// empty.
//
// SQLite orders every number before every text, so the cursor is read back
// as the value it came from: a number when after reads as one and the
// column holds that number (an INTEGER key, or a column without a type
// holding numbers). Compared as text, no number is greater than "1000",
// and the import would stop after a page.
func (d *Driver) ImportIDs(ctx context.Context, src *driver.ImportSource, after string, limit int) ([]string, error) {
	if src == nil {
		return nil, fmt.Errorf("%w: sqlite: nil import source", idem.ErrInvalidConfig)
	}
	if src.Schema != "" {
		return nil, fmt.Errorf("%w: sqlite: import schema %q: SQLite has no schemas", idem.ErrInvalidConfig, src.Schema)
	}
	table, col, err := sqlident.Column("sqlite: import", "", src.Table, src.Column)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", idem.ErrInvalidConfig, err)
	}
	// Qualified: SQLite reads a double-quoted name that is no column as a
	// string literal, and a mistyped column would import its own name
	// once per row. "table"."col" is an error instead.
	col = table + "." + col
	// Pages are ordered by the value, then by its text: values that
	// compare equal but read differently (5 and 5.0 in a column without a
	// type, B and b under NOCASE) are distinct IDs, and a page boundary
	// between them must not skip one. NULL and empty values are left out
	// on every page: after a number, '' sorts greater. Empty is tested
	// by bytes: under a column's RTRIM collation a value of blanks equals
	// '', and is an ID all the same.
	text := `CAST(` + col + ` AS TEXT)`
	where := col + ` IS NOT NULL AND ` + col + ` <> '' COLLATE BINARY`
	order := ` ORDER BY ` + col + `, ` + text + ` COLLATE BINARY`
	q, args := `SELECT `+text+` AS idem_value FROM `+table+` WHERE `+where+order+` LIMIT ?`, []any{limit}
	if after != "" {
		cursor, err := d.importCursor(ctx, table, col, after)
		if err != nil {
			return nil, err
		}
		q = `SELECT ` + text + ` AS idem_value FROM ` + table + ` WHERE ` + where + ` AND ` + col + ` >= ? AND (` + col + ` > ? OR ` + text + ` COLLATE BINARY > ?)` + order + ` LIMIT ?`
		args = []any{cursor, cursor, after, limit}
	}
	rows, err := d.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

// importCursor is after as the value it was read from: the integer or
// real it reads as if the column holds that number, the BLOB if it holds
// those bytes as a BLOB and not as text, else the text.
func (d *Driver) importCursor(ctx context.Context, table, col, after string) (any, error) {
	var num any
	if n, err := strconv.ParseInt(after, 10, 64); err == nil {
		num = n
	} else if f, err := strconv.ParseFloat(after, 64); err == nil {
		num = f
	} else {
		// Text, or a BLOB: Go code that stores []byte IDs (Kafka keys
		// and headers are bytes) stores BLOBs even in a TEXT column, and
		// SQLite orders every BLOB after every text.
		var isText, isBlob bool
		if err := d.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM `+table+` WHERE `+col+` = ?),
EXISTS (SELECT 1 FROM `+table+` WHERE `+col+` = ?)`, after, []byte(after)).Scan(&isText, &isBlob); err != nil {
			return nil, err
		}
		if isBlob && !isText {
			return []byte(after), nil
		}
		return after, nil
	}
	var isNum, isText, isBlob bool
	if err := d.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM `+table+` WHERE `+col+` = ? AND typeof(`+col+`) <> 'text'),
EXISTS (SELECT 1 FROM `+table+` WHERE `+col+` = ?), EXISTS (SELECT 1 FROM `+table+` WHERE `+col+` = ?)`, num, after, []byte(after)).Scan(&isNum, &isText, &isBlob); err != nil {
		return nil, err
	}
	switch {
	case isNum:
		return num, nil
	case isText:
		return after, nil
	case isBlob: // digits stored as bytes: a Kafka key, say
		return []byte(after), nil
	}
	// Neither (a real whose text form does not read back exactly): the
	// page after it cannot be found; say so rather than end the import
	// early.
	return nil, fmt.Errorf("sqlite: import: cannot find %q back in %s.%s to read the values after it", after, table, col)
}

// InsertImportedMarkers implements driver.MarkerImporter: one transaction,
// one prepared INSERT … ON CONFLICT DO NOTHING per ID.
func (d *Driver) InsertImportedMarkers(ctx context.Context, handler string, ids []string) (n int64, err error) {
	tx, err := d.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() {
		if err != nil {
			_ = d.Rollback(ctx, tx)
		}
	}()
	ins, err := tx.PrepareContext(ctx, `INSERT INTO `+d.tables.processed+
		` (handler, message_id, payload_hash, processed_at) VALUES (?, ?, x'', ?) ON CONFLICT DO NOTHING`)
	if err != nil {
		return 0, err
	}
	defer ins.Close()
	now := time.Now().UnixMicro()
	for _, id := range ids {
		res, err := ins.ExecContext(ctx, handler, id, now)
		if err != nil {
			return 0, err
		}
		k, err := res.RowsAffected()
		if err != nil {
			return 0, err
		}
		n += k
	}
	return n, tx.Commit()
}
