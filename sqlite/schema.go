package sqlite

import (
	"context"
	"database/sql"
	"fmt"
)

// step returns the Go that runs in place of migration version's SQL, or
// nil when its file's SQL runs.
func (d *Driver) step(version int) func(context.Context, *sql.Tx) error {
	if version == 10 {
		return d.rewriteStatusCheck
	}
	return nil
}

// The lease status CHECK as migration 002 wrote it, and as migration 010
// rewrites it.
const (
	statusCheckIn  = `CHECK (status IN ('running', 'done', 'failed'))`
	statusCheckCmp = `CHECK (status = 'running' OR status = 'done' OR status = 'failed')`
)

// rewriteStatusCheck is migration 010 (see its file): it replaces the
// marker table's status CHECK text in sqlite_schema and bumps the schema
// version, so that every connection rereads the definition. It turns
// writable_schema on; apply turns it off again on the connection (which
// also rereads the schema there) once the transaction is over.
func (d *Driver) rewriteStatusCheck(ctx context.Context, tx *sql.Tx) error {
	if _, err := tx.ExecContext(ctx, `PRAGMA writable_schema = ON`); err != nil {
		return err
	}
	if d.schemaWritable != nil {
		d.schemaWritable()
	}
	var on int
	if err := tx.QueryRowContext(ctx, `PRAGMA writable_schema`).Scan(&on); err != nil {
		return err
	}
	if on != 1 {
		return nil // defensive mode: the IN list stays
	}
	var version int64
	if err := tx.QueryRowContext(ctx, `PRAGMA schema_version`).Scan(&version); err != nil {
		return err
	}
	res, err := tx.ExecContext(ctx, `UPDATE sqlite_schema SET sql = replace(sql, ?1, ?2)
WHERE type = 'table' AND name = ?3 AND instr(sql, ?1) > 0`, statusCheckIn, statusCheckCmp, d.prefix+"processed")
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return err // a definition edited by hand stays as it is
	}
	_, err = tx.ExecContext(ctx, fmt.Sprintf(`PRAGMA schema_version = %d`, version+1))
	return err
}
