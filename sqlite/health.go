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

// probePages is how many pages' worth of bytes the probe's row holds: a
// write of a delivery (a marker, a handler's row) that splits a B-tree
// page needs one new page, two when the split reaches the parent.
const probePages = 2

// Probe implements driver.Prober: a write can happen. It commits a
// transaction that inserts into the migrations table a row of probePages
// pages' worth of zeros, under a version no migration has, and deletes it
// again, so that the probe fails where a delivery's write would:
//
//   - The insert takes the write lock and needs the file writable: a
//     BEGIN alone takes no lock on a pool that begins deferred (a *sql.DB
//     of the caller's, without _txlock=immediate), and starts on a file
//     the process may only read.
//   - The row overflows onto pages of its own, which SQLite takes from
//     the free list or by growing the database: at max_page_count with
//     none free the insert fails with SQLITE_FULL, as the deliveries'
//     writes do. A rewrite of the header (user_version) allocates nothing
//     and passes there.
//   - The transaction commits, so its pages are written: appended to the
//     WAL, or to the rollback journal and the file. A transaction rolled
//     back writes nothing in WAL mode, which let a probe that rolled back
//     pass on a full disk while every delivery failed with SQLITE_FULL and
//     spent an attempt.
//
// The row is gone when the transaction commits, so nothing reads it; the
// pages it took go back to the free list, where writes and the next
// probes find them, so the file grows by those pages at most once. It
// runs only while an outage is suspected. The migrations table is the one
// table every migrated database has.
func (d *Driver) Probe(ctx context.Context) error {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if d.waitForLocks.Load() {
		// As Begin does: a lock held a moment by another connection of
		// the pool is no outage.
		if _, err := tx.ExecContext(ctx, setBusyTimeout); err != nil {
			return fmt.Errorf("sqlite: probe: %w", err)
		}
	}
	var pageSize int64
	if err := tx.QueryRowContext(ctx, `PRAGMA page_size`).Scan(&pageSize); err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+d.tables.migrations+` (version, name, applied_at) VALUES (?, zeroblob(?), 0)`,
		probeVersion, probePages*pageSize); err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM `+d.tables.migrations+` WHERE version = ?`, probeVersion); err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("sqlite: probe: %w", err)
	}
	return nil
}

// probeVersion keys the probe's row in the migrations table: migrations
// count from 1.
const probeVersion = -1
