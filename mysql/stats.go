package mysql

import (
	"context"
	"fmt"

	"github.com/idemhq/idem/driver"
)

var _ driver.StatsStore = (*Driver)(nil)

// StatsAdd implements driver.StatsStore with one upsert.
func (d *Driver) StatsAdd(ctx context.Context, handler string, s driver.StatsDelta) error {
	if err := d.ready(ctx); err != nil {
		return err
	}
	err := d.retry(ctx, func() error {
		_, err := d.db.ExecContext(ctx, `INSERT INTO `+d.t.handlerStats+` (handler, duplicates, stale, updated_at) VALUES (?, ?, ?, `+nowMicros+`)
ON DUPLICATE KEY UPDATE duplicates = duplicates + VALUES(duplicates), stale = stale + VALUES(stale), updated_at = VALUES(updated_at)`,
			handler, s.Duplicates, s.Stale)
		return err
	})
	if err != nil {
		return fmt.Errorf("mysql: add handler stats: %w", notMigrated(err))
	}
	return nil
}

// StatsRead implements driver.StatsStore.
func (d *Driver) StatsRead(ctx context.Context) (map[string]driver.StatsDelta, error) {
	if err := d.ready(ctx); err != nil {
		return nil, err
	}
	rows, err := d.db.QueryContext(ctx, `SELECT handler, duplicates, stale FROM `+d.t.handlerStats)
	if err != nil {
		return nil, fmt.Errorf("mysql: read handler stats: %w", notMigrated(err))
	}
	defer rows.Close()
	out := map[string]driver.StatsDelta{}
	for rows.Next() {
		var (
			h string
			s driver.StatsDelta
		)
		if err := rows.Scan(&h, &s.Duplicates, &s.Stale); err != nil {
			return nil, fmt.Errorf("mysql: read handler stats: %w", err)
		}
		out[h] = s
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("mysql: read handler stats: %w", err)
	}
	return out, nil
}
