package postgres

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/driver"
)

var _ driver.StatsStore = (*Driver)(nil)

// StatsAdd implements driver.StatsStore.
func (d *Driver) StatsAdd(ctx context.Context, handler string, s driver.StatsDelta) error {
	_, err := d.auto.Exec(ctx, `INSERT INTO `+d.t.handlerStats+` AS h
(handler, duplicates, stale) VALUES ($1, $2, $3)
ON CONFLICT (handler) DO UPDATE SET duplicates = h.duplicates + excluded.duplicates,
  stale = h.stale + excluded.stale, updated_at = now()`,
		handler, s.Duplicates, s.Stale)
	if err != nil {
		return fmt.Errorf("postgres: add handler stats: %w", err)
	}
	return nil
}

// StatsRead implements driver.StatsStore.
func (d *Driver) StatsRead(ctx context.Context) (map[string]driver.StatsDelta, error) {
	rows, err := d.pool.Query(ctx, `SELECT handler, duplicates, stale FROM `+d.t.handlerStats)
	if err != nil {
		return nil, fmt.Errorf("postgres: read handler stats: %w", err)
	}
	out := map[string]driver.StatsDelta{}
	var (
		h string
		s driver.StatsDelta
	)
	_, err = pgx.ForEachRow(rows, []any{&h, &s.Duplicates, &s.Stale}, func() error {
		out[h] = s
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("postgres: read handler stats: %w", err)
	}
	return out, nil
}
