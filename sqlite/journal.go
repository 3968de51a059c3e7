package sqlite

import (
	"context"
	"database/sql"
	"fmt"
	"strings"

	"github.com/idemhq/idem"
)

// querier is what checkJournal reads the settings through: the pool, a
// connection or a transaction.
type querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// ready returns nil once a connection of the pool was found to journal
// in a mode the driver can work with (see checkJournal); until then it
// checks q, a connection outside a transaction, the pool or the
// transaction the caller is about to use, and on success remembers it,
// so that later calls cost an atomic load. A failed check is not
// remembered: a bad setting fails every call, and a check that could not
// run (no connection, a cancelled context) is run again by the next call.
//
// journal_mode is a setting of each connection (WAL excepted, which the
// file keeps), set by the DSN's pragmas for every connection the pool
// opens, so one connection stands for them all. A connection switched to
// another mode afterwards (PRAGMA journal_mode on the *sql.DB, a
// connector that sets modes unevenly) is not seen.
func (d *Driver) ready(ctx context.Context, q querier) error {
	if d.journalOK.Load() {
		return nil
	}
	return d.checkJournal(ctx, q)
}

// checkJournal reads the journal mode of q's connection and refuses those
// that break idem's guarantees, with an error wrapping
// idem.ErrInvalidConfig that names the setting; a failure to read it is
// returned as it is.
//
//   - OFF keeps no rollback journal: SQLite can then undo neither a
//     statement nor a transaction. A batch's chunk of markers that meets
//     an existing marker fails with a key violation that is meant to undo
//     that statement only; at OFF the rows before the existing one stay,
//     the row-by-row retry finds them and calls them duplicates, and
//     their handlers never run. A handler's failure rolls back nothing
//     either (SQLite calls the outcome undefined).
//   - MEMORY on a database file keeps the rollback journal in the
//     process's memory: rollbacks work, but a crash while a transaction
//     writes its pages to the file (at commit, or when the page cache
//     spills) leaves no journal to undo the half-written pages with, and
//     the file is then likely corrupt: a marker and its effect are no
//     longer committed together, which is the guarantee itself. An
//     in-memory database (":memory:", mode=memory) always journals in
//     memory and ends with the process, so there is nothing to corrupt:
//     it is accepted.
//
// DELETE, TRUNCATE, PERSIST (a journal file) and WAL are accepted.
// synchronous is not checked: at OFF a process crash still keeps every
// guarantee (commits reach the operating system before the call returns),
// and what an operating-system crash or power loss may cost is documented
// with OpenOptions.Synchronous.
func (d *Driver) checkJournal(ctx context.Context, q querier) error {
	var mode string
	if err := q.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode); err != nil {
		return fmt.Errorf("sqlite: read journal_mode: %w", err)
	}
	switch strings.ToLower(mode) {
	case "off":
		return fmt.Errorf("%w: sqlite: the connection runs with journal_mode=OFF (set in the DSN?): without a rollback journal SQLite cannot undo a failed statement or a rolled-back transaction, and idem would record markers of messages whose handlers never ran; use WAL (sqlite.Open sets it) or another journal mode", idem.ErrInvalidConfig)
	case "memory":
		var file string
		if err := q.QueryRowContext(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&file); err != nil {
			return fmt.Errorf("sqlite: read the database's file name: %w", err)
		}
		if file != "" {
			return fmt.Errorf("%w: sqlite: the connection runs with journal_mode=MEMORY on the file %s (set in the DSN?): a crash while a transaction writes its pages leaves no journal to undo them with and the file likely corrupt; use WAL (sqlite.Open sets it) or another journal mode that keeps the journal on disk", idem.ErrInvalidConfig, file)
		}
	}
	var busy int64
	if err := q.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy); err != nil {
		return fmt.Errorf("sqlite: read busy_timeout: %w", err)
	}
	d.waitForLocks.Store(busy == 0)
	d.journalOK.Store(true)
	return nil
}

// setBusyTimeout gives a connection the busy timeout Open sets. Without
// one, a statement that meets another connection's lock fails at once
// with SQLITE_BUSY, which idem takes for the store being down: on a pool
// of several connections (sql.Open's default) every collision of two
// deliveries paused the consumer for a probe, and 800 messages on 4
// workers took a minute instead of a second, with a warning per
// collision. SQLite keeps the setting on the connection, so statements
// that run there later wait too.
const setBusyTimeout = `PRAGMA busy_timeout = 10000`
