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

// Probe implements driver.Prober: a write transaction can start (BEGIN
// IMMEDIATE takes the write lock), and is rolled back at once.
func (d *Driver) Probe(ctx context.Context) error {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	if err := tx.Rollback(); err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	return nil
}
