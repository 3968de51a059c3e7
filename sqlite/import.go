package sqlite

import (
	"context"
	"fmt"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlident"
)

var _ driver.MarkerImporter = (*Driver)(nil)

// ImportIDs implements driver.MarkerImporter: the column's values after
// after, in the column's order. SQLite has no schemas: src.Schema must be
// empty.
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
	rows, err := d.db.QueryContext(ctx, `SELECT `+col+` FROM `+table+` WHERE `+col+` > ? ORDER BY `+col+` LIMIT ?`, after, limit)
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
