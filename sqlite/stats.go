package sqlite

import (
	"context"
	"fmt"
	"time"

	"github.com/idemhq/idem/driver"
)

var _ driver.StatsStore = (*Driver)(nil)

// StatsAdd implements driver.StatsStore.
func (d *Driver) StatsAdd(ctx context.Context, handler string, s driver.StatsDelta) error {
	_, err := d.db.ExecContext(ctx, `INSERT INTO `+d.tables.handlerStats+` AS h
(handler, duplicates, stale, updated_at) VALUES (?, ?, ?, ?)
ON CONFLICT (handler) DO UPDATE SET duplicates = h.duplicates + excluded.duplicates,
  stale = h.stale + excluded.stale, updated_at = excluded.updated_at`,
		handler, s.Duplicates, s.Stale, time.Now().UnixMicro())
	if err != nil {
		return fmt.Errorf("sqlite: add handler stats: %w", err)
	}
	return nil
}

// StatsRead implements driver.StatsStore.
func (d *Driver) StatsRead(ctx context.Context) (map[string]driver.StatsDelta, error) {
	rows, err := d.db.QueryContext(ctx, `SELECT handler, duplicates, stale FROM `+d.tables.handlerStats)
	if err != nil {
		return nil, fmt.Errorf("sqlite: read handler stats: %w", err)
	}
	defer rows.Close()
	out := map[string]driver.StatsDelta{}
	for rows.Next() {
		var (
			h string
			s driver.StatsDelta
		)
		if err := rows.Scan(&h, &s.Duplicates, &s.Stale); err != nil {
			return nil, fmt.Errorf("sqlite: read handler stats: %w", err)
		}
		out[h] = s
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("sqlite: read handler stats: %w", err)
	}
	return out, nil
}
