package sqlite

import (
	"context"
	"errors"
	"fmt"
)

// Primary SQLite result codes that mean the database cannot be written
// now, whatever the statement: another connection holds the lock past
// the busy timeout, the file is read-only or cannot be opened, the disk
// failed or is full.
const (
	codeBusy     = 5
	codeLocked   = 6
	codeReadOnly = 8
	codeIOErr    = 10
	codeFull     = 13
	codeCantOpen = 14
	codeProtocol = 15
)

// Unavailable implements driver.Prober: err carries one of SQLite's codes
// for a database that cannot be written now (busy or locked past the busy
// timeout, read-only, an I/O error, a full disk, a file that cannot be
// opened).
func (d *Driver) Unavailable(err error) bool {
	var coded interface{ Code() int }
	if !errors.As(err, &coded) {
		return false
	}
	switch coded.Code() & 0xff {
	case codeBusy, codeLocked, codeReadOnly, codeIOErr, codeFull, codeCantOpen, codeProtocol:
		return true
	}
	return false
}

// Probe implements driver.Prober: a write can happen. In a transaction
// rolled back at once it rewrites the header's user_version with the
// value it holds, which takes the write lock and needs the file
// writable: a BEGIN alone takes no lock on a pool that begins deferred
// (a *sql.DB of the caller's, without _txlock=immediate), and starts on
// a file the process may only read.
func (d *Driver) Probe(ctx context.Context) error {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	var v int64
	if err := tx.QueryRowContext(ctx, `PRAGMA user_version`).Scan(&v); err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	if _, err := tx.ExecContext(ctx, fmt.Sprintf(`PRAGMA user_version = %d`, v)); err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	if err := tx.Rollback(); err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	return nil
}
