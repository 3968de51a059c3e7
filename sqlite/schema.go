package sqlite

import (
	"context"
	"database/sql"
	"fmt"
)

// goSteps are the migrations that run Go in place of their file's SQL.
var goSteps = map[int]func(d *Driver, ctx context.Context, tx *sql.Tx) error{
	10: (*Driver).rewriteStatusCheck,
}

// The lease status CHECK as migration 002 wrote it, and as migration 010
// rewrites it.
const (
	statusCheckIn  = `CHECK (status IN ('running', 'done', 'failed'))`
	statusCheckCmp = `CHECK (status = 'running' OR status = 'done' OR status = 'failed')`
)

// rewriteStatusCheck is migration 010 (see its file): it replaces the
// marker table's status CHECK text in sqlite_schema and bumps the schema
// version, so that every connection rereads the definition. writable_schema
// is a setting of the connection, not of the transaction: it is reset on
// the way out whatever happened, which also rereads the schema on this
// connection.
func (d *Driver) rewriteStatusCheck(ctx context.Context, tx *sql.Tx) (err error) {
	if _, err := tx.ExecContext(ctx, `PRAGMA writable_schema = ON`); err != nil {
		return err
	}
	defer func() {
		if _, rerr := tx.ExecContext(context.WithoutCancel(ctx), `PRAGMA writable_schema = RESET`); rerr != nil && err == nil {
			err = rerr
		}
	}()
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
