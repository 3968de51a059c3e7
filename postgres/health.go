package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// Unavailable implements driver.Prober: err is a failure to connect, a
// connection that broke, a timeout, or one of the server's answers for a
// server that cannot serve now: a connection exception (SQLSTATE class
// 08), the server shutting down or starting (57P01, 57P02, 57P03),
// insufficient resources such as too many connections (class 53), or a
// write refused by a read-only server (25006, as after a failover to a
// standby).
func (d *Driver) Unavailable(err error) bool {
	if err == nil {
		return false
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return strings.HasPrefix(pe.Code, "08") || strings.HasPrefix(pe.Code, "53") ||
			pe.Code == "57P01" || pe.Code == "57P02" || pe.Code == "57P03" || pe.Code == "25006"
	}
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || pgconn.Timeout(err) || pgconn.SafeToRetry(err)
}

// Probe implements driver.Prober: the server answers, and a transaction
// on it may write (a standby after a failover answers, read-only).
func (d *Driver) Probe(ctx context.Context) error {
	var readOnly bool
	if err := d.pool.QueryRow(ctx, "SELECT current_setting('transaction_read_only') = 'on'").Scan(&readOnly); err != nil {
		return fmt.Errorf("postgres: probe: %w", err)
	}
	if readOnly {
		return errors.New("postgres: probe: the server is read-only")
	}
	return nil
}
