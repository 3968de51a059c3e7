package bench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/sqlident"
	"github.com/idemhq/idem/sqlite"
)

// SQLiteOptions configures OpenSQLite.
type SQLiteOptions struct {
	// Open is passed to sqlite.Open. Nil gives idem's defaults
	// (synchronous=FULL).
	Open *sqlite.OpenOptions
	// RemoveOnClose deletes the database file (and its -wal and -shm
	// files) when the target is closed.
	RemoveOnClose bool
}

// SQLiteTarget is a Target on an SQLite database file.
type SQLiteTarget struct {
	path   string
	remove bool
	db     *sql.DB
	idemVariants[*sql.Tx]
	upsert, hand *sql.Stmt
	// The in-row guard's statements and handler; see setupInRow.
	rowRead, rowUpsert *sql.Stmt
	inRowProc          *idem.Processor[*sql.Tx]
	inRowH             *idem.Handler[*sql.Tx]
}

// OpenSQLite opens (creating if needed) the SQLite database at path with
// sqlite.Open, migrates idem into it and creates the balances table. Close
// the target when done.
func OpenSQLite(ctx context.Context, path string, opts *SQLiteOptions) (*SQLiteTarget, error) {
	if opts == nil {
		opts = &SQLiteOptions{}
	}
	db, err := sqlite.Open(path, opts.Open)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	t := &SQLiteTarget{path: path, remove: opts.RemoveOnClose, db: db}
	if err := t.setup(ctx); err != nil {
		return nil, errors.Join(err, t.Close())
	}
	return t, nil
}

func (t *SQLiteTarget) setup(ctx context.Context) error {
	drv, err := sqlite.New(t.db, &sqlite.Config{TablePrefix: TablePrefix})
	if err != nil {
		return fmt.Errorf("bench: sqlite driver: %w", err)
	}
	if err := drv.Migrate(ctx); err != nil {
		return fmt.Errorf("bench: migrate: %w", err)
	}
	balances := sqlident.Quote(TablePrefix + "balances")
	if _, err := t.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+balances+
		` (account TEXT PRIMARY KEY, amount INTEGER NOT NULL) WITHOUT ROWID`); err != nil {
		return fmt.Errorf("bench: create balances table: %w", err)
	}
	if t.upsert, err = t.db.PrepareContext(ctx, `INSERT INTO `+balances+` (account, amount) VALUES (?, ?)
ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`); err != nil {
		return fmt.Errorf("bench: prepare upsert: %w", err)
	}
	hand := sqlident.Quote(handTable)
	if _, err := t.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+hand+
		` (message_id TEXT PRIMARY KEY, processed_at INTEGER NOT NULL DEFAULT (unixepoch())) WITHOUT ROWID`); err != nil {
		return fmt.Errorf("bench: create hand-rolled dedupe table: %w", err)
	}
	if t.hand, err = t.db.PrepareContext(ctx, `INSERT INTO `+hand+` (message_id) VALUES (?) ON CONFLICT DO NOTHING`); err != nil {
		return fmt.Errorf("bench: prepare hand-rolled insert: %w", err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		return fmt.Errorf("bench: processor: %w", err)
	}
	h := &idem.Handler[*sql.Tx]{Name: handlerName, Apply: t.applyOne, ApplyBatch: t.applyBatch}
	t.idemVariants = newIdemVariants(proc, h)
	return t.setupInRow(ctx, proc)
}

// Name returns "sqlite".
func (t *SQLiteTarget) Name() string { return "sqlite" }

// DB returns the database the target uses.
func (t *SQLiteTarget) DB() *sql.DB { return t.db }

func (t *SQLiteTarget) applyOne(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
	account, amount, err := Decode(msg)
	if err != nil {
		return err
	}
	if _, err := tx.StmtContext(ctx, t.upsert).ExecContext(ctx, account, amount); err != nil {
		return fmt.Errorf("bench: upsert balance: %w", err)
	}
	return nil
}

// applyBatch upserts the aggregated balances with the prepared single-row
// statement, once per account, inside tx.
func (t *SQLiteTarget) applyBatch(ctx context.Context, tx *sql.Tx, msgs []*idem.Message) error {
	accounts, amounts, err := Aggregate(msgs)
	if err != nil {
		return err
	}
	st := tx.StmtContext(ctx, t.upsert)
	for i, a := range accounts {
		if _, err := st.ExecContext(ctx, a, amounts[i]); err != nil {
			return fmt.Errorf("bench: upsert balance: %w", err)
		}
	}
	return nil
}

// PlainOne implements Target.
func (t *SQLiteTarget) PlainOne(ctx context.Context, msg *idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error { return t.applyOne(ctx, tx, msg) })
}

// PlainBatch implements Target.
func (t *SQLiteTarget) PlainBatch(ctx context.Context, msgs []*idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error { return t.applyBatch(ctx, tx, msgs) })
}

// Close closes the database and, with RemoveOnClose, deletes its files.
func (t *SQLiteTarget) Close() error {
	var errs []error
	for _, st := range []*sql.Stmt{t.upsert, t.hand, t.rowRead, t.rowUpsert} {
		if st != nil {
			errs = append(errs, st.Close())
		}
	}
	if err := t.db.Close(); err != nil {
		errs = append(errs, fmt.Errorf("bench: close %s: %w", t.path, err))
	}
	if t.remove {
		for _, p := range []string{t.path, t.path + "-wal", t.path + "-shm"} {
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("bench: %w", err))
			}
		}
	}
	return errors.Join(errs...)
}

// processBatch applies msgs with p.ProcessBatch and h, and reports an
// error unless every outcome is Applied.
func processBatch[TTx any](ctx context.Context, p *idem.Processor[TTx], h *idem.Handler[TTx], msgs []*idem.Message) error {
	outs, err := p.ProcessBatch(ctx, h, msgs)
	if err != nil {
		return err
	}
	return checkApplied(msgs, outs)
}

// checkApplied reports an error unless every outcome is Applied.
func checkApplied(msgs []*idem.Message, outs []idem.Outcome) error {
	if len(outs) != len(msgs) {
		return fmt.Errorf("bench: %d outcomes for %d messages", len(outs), len(msgs))
	}
	for i, o := range outs {
		if o != idem.Applied {
			return fmt.Errorf("bench: message %q: outcome %v, want applied", msgs[i].ID, o)
		}
	}
	return nil
}

// PlainBatchPerEvent implements PerEventTarget.
func (t *SQLiteTarget) PlainBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error {
		for _, m := range msgs {
			if err := t.applyOne(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
}

// handApply is the hand-rolled dedupe inside tx: the ID's insert with the
// prepared statement, then the upsert if the insert added a row.
func (t *SQLiteTarget) handApply(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
	r, err := tx.StmtContext(ctx, t.hand).ExecContext(ctx, msg.ID)
	if err != nil {
		return fmt.Errorf("bench: insert processed ID: %w", err)
	}
	n, err := r.RowsAffected()
	if err != nil {
		return fmt.Errorf("bench: insert processed ID: %w", err)
	}
	if n == 0 {
		// Every benchmark message is new: a skip here is a bug.
		return fmt.Errorf("bench: message %q already processed", msg.ID)
	}
	return t.applyOne(ctx, tx, msg)
}

// HandOne implements HandRolledTarget.
func (t *SQLiteTarget) HandOne(ctx context.Context, msg *idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error { return t.handApply(ctx, tx, msg) })
}

// HandBatchPerEvent implements HandRolledTarget: the hand-rolled dedupe
// per message, in one transaction.
func (t *SQLiteTarget) HandBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error {
		for _, m := range msgs {
			if err := t.handApply(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
}

// setupInRow creates the in-row balances table, whose rows hold each
// account's last applied sequence, and its handler.
func (t *SQLiteTarget) setupInRow(ctx context.Context, proc *idem.Processor[*sql.Tx]) error {
	table := sqlident.Quote(TablePrefix + "balances_in_row")
	if _, err := t.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+table+
		` (account TEXT PRIMARY KEY, amount INTEGER NOT NULL, last_seq INTEGER NOT NULL) WITHOUT ROWID`); err != nil {
		return fmt.Errorf("bench: create in-row balances table: %w", err)
	}
	var err error
	if t.rowRead, err = t.db.PrepareContext(ctx, `SELECT last_seq FROM `+table+` WHERE account = ?`); err != nil {
		return fmt.Errorf("bench: prepare in-row read: %w", err)
	}
	if t.rowUpsert, err = t.db.PrepareContext(ctx, `INSERT INTO `+table+` (account, amount, last_seq) VALUES (?1, ?2, ?3)
ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount, last_seq = excluded.last_seq
WHERE last_seq < ?4`); err != nil {
		return fmt.Errorf("bench: prepare in-row upsert: %w", err)
	}
	t.inRowProc, t.inRowH = proc, inRowHandler(t.writeRows)
	return nil
}

// writeRows is the in-row handler's guarded write: per guard, the read of
// the row's sequence and the guarded upsert, both prepared (a statement is
// an in-process call). The transaction holds SQLite's write lock from its
// start, so the read stays true.
func (t *SQLiteTarget) writeRows(ctx context.Context, tx *sql.Tx, gs []*idem.RowGuard) ([]idem.RowWrite, error) {
	ws := make([]idem.RowWrite, len(gs))
	read, upsert := tx.StmtContext(ctx, t.rowRead), tx.StmtContext(ctx, t.rowUpsert)
	for i, g := range gs {
		if err := read.QueryRowContext(ctx, g.AggregateID).Scan(&ws[i].Prev); err != nil && !errors.Is(err, sql.ErrNoRows) {
			return nil, fmt.Errorf("bench: read in-row balance: %w", err)
		}
		amount, err := guardAmount(g)
		if err != nil {
			return nil, err
		}
		r, err := upsert.ExecContext(ctx, g.AggregateID, amount, g.To(), g.From())
		if err != nil {
			return nil, fmt.Errorf("bench: guarded upsert: %w", err)
		}
		n, err := r.RowsAffected()
		if err != nil {
			return nil, fmt.Errorf("bench: guarded upsert: %w", err)
		}
		ws[i].Advanced = n == 1
	}
	return ws, nil
}

// PlainOneInRow implements InRowTarget.
func (t *SQLiteTarget) PlainOneInRow(ctx context.Context, msg *idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error {
		gs := oneGuard(msg)
		ws, err := t.writeRows(ctx, tx, gs)
		if err != nil {
			return err
		}
		return checkAdvanced(gs, ws)
	})
}

// PlainBatchInRow implements InRowTarget.
func (t *SQLiteTarget) PlainBatchInRow(ctx context.Context, msgs []*idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error {
		gs := rowGuards(msgs)
		ws, err := t.writeRows(ctx, tx, gs)
		if err != nil {
			return err
		}
		return checkAdvanced(gs, ws)
	})
}

// IdemOneInRow implements InRowTarget.
func (t *SQLiteTarget) IdemOneInRow(ctx context.Context, msg *idem.Message) error {
	out, err := t.inRowProc.Process(ctx, t.inRowH, msg)
	return checkApplied1(msg, out, err)
}

// IdemBatchInRow implements InRowTarget.
func (t *SQLiteTarget) IdemBatchInRow(ctx context.Context, msgs []*idem.Message) error {
	return processBatch(ctx, t.inRowProc, t.inRowH, msgs)
}
