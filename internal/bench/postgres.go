package bench

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/sqlident"
	"github.com/idemhq/idem/postgres"
)

// PostgresOptions configures OpenPostgres.
type PostgresOptions struct {
	// Schema holds the benchmark's tables. It is created if missing, and
	// then dropped again by Close. Default: none (the search_path).
	Schema string
	// ConflictAwareInserts is passed to postgres.Config.
	ConflictAwareInserts bool
}

// PostgresTarget is a Target on a PostgreSQL database.
type PostgresTarget struct {
	pool          *pgxpool.Pool
	schema        string
	createdSchema bool
	conflictAware bool
	idemVariants[postgres.Tx]
	upsertOne  string
	upsertMany string
	handOne    string
	handMany   string
	// The in-row guard's statements and handler; see setupInRow.
	rowLock, rowUpsert                        string
	rowLockMany, rowUpsertMany, rowInsertMany string
	inRowProc                                 *idem.Processor[postgres.Tx]
	inRowH                                    *idem.Handler[postgres.Tx]
}

// OpenPostgres migrates idem into opts.Schema and creates the balances
// table there. The pool should allow at least as many connections as the
// workload has workers. Close the target when done.
func OpenPostgres(ctx context.Context, pool *pgxpool.Pool, opts *PostgresOptions) (*PostgresTarget, error) {
	if opts == nil {
		opts = &PostgresOptions{}
	}
	t := &PostgresTarget{pool: pool, schema: opts.Schema, conflictAware: opts.ConflictAwareInserts}
	if err := t.setup(ctx); err != nil {
		return nil, errors.Join(err, t.Close(context.WithoutCancel(ctx)))
	}
	return t, nil
}

func (t *PostgresTarget) setup(ctx context.Context) error {
	if t.pool == nil {
		return errors.New("bench: nil pool")
	}
	if err := sqlident.Check("bench: schema", t.schema, true); err != nil {
		return err
	}
	if t.schema != "" {
		var exists bool
		if err := t.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, t.schema).Scan(&exists); err != nil {
			return fmt.Errorf("bench: look up schema: %w", err)
		}
		t.createdSchema = !exists
	}
	drv, err := postgres.New(t.pool, &postgres.Config{Schema: t.schema, TablePrefix: TablePrefix, ConflictAwareInserts: t.conflictAware})
	if err != nil {
		return fmt.Errorf("bench: postgres driver: %w", err)
	}
	if err := drv.Migrate(ctx); err != nil {
		return fmt.Errorf("bench: migrate: %w", err)
	}
	balances := sqlident.Qualified(t.schema, TablePrefix+"balances")
	if _, err := t.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+balances+
		` (account text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		return fmt.Errorf("bench: create balances table: %w", err)
	}
	hand := sqlident.Qualified(t.schema, handTable)
	if _, err := t.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+hand+
		` (message_id text PRIMARY KEY, processed_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return fmt.Errorf("bench: create hand-rolled dedupe table: %w", err)
	}
	t.handOne = `INSERT INTO ` + hand + ` (message_id) VALUES ($1) ON CONFLICT DO NOTHING`
	t.handMany = `INSERT INTO ` + hand + ` (message_id) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING RETURNING message_id`
	t.upsertOne = `INSERT INTO ` + balances + ` AS b (account, amount) VALUES ($1, $2)
ON CONFLICT (account) DO UPDATE SET amount = b.amount + excluded.amount`
	t.upsertMany = `INSERT INTO ` + balances + ` AS b (account, amount)
SELECT a, n FROM unnest($1::text[], $2::bigint[]) AS u(a, n)
ON CONFLICT (account) DO UPDATE SET amount = b.amount + excluded.amount`
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		return fmt.Errorf("bench: processor: %w", err)
	}
	h := &idem.Handler[postgres.Tx]{Name: handlerName, Apply: t.applyOne, ApplyBatch: t.applyBatch}
	t.idemVariants = newIdemVariants(proc, h)
	return t.setupInRow(ctx, proc)
}

// Name returns "postgres", or "postgres-conflict-aware" with
// ConflictAwareInserts.
func (t *PostgresTarget) Name() string {
	if t.conflictAware {
		return "postgres-conflict-aware"
	}
	return "postgres"
}

func (t *PostgresTarget) applyOne(ctx context.Context, tx postgres.Tx, msg *idem.Message) error {
	account, amount, err := Decode(msg)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, t.upsertOne, account, amount); err != nil {
		return fmt.Errorf("bench: upsert balance: %w", err)
	}
	return nil
}

// applyBatch upserts the aggregated balances with one statement over
// unnested arrays.
func (t *PostgresTarget) applyBatch(ctx context.Context, tx postgres.Tx, msgs []*idem.Message) error {
	accounts, amounts, err := Aggregate(msgs)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, t.upsertMany, accounts, amounts); err != nil {
		return fmt.Errorf("bench: upsert balances: %w", err)
	}
	return nil
}

// inTx runs fn in a transaction begun with the pool's Begin and commits it.
func (t *PostgresTarget) inTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	tx, err := t.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("bench: begin: %w", err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("bench: commit: %w", err)
	}
	return nil
}

// PlainOne implements Target.
func (t *PostgresTarget) PlainOne(ctx context.Context, msg *idem.Message) error {
	return t.inTx(ctx, func(tx pgx.Tx) error { return t.applyOne(ctx, tx, msg) })
}

// PlainBatch implements Target.
func (t *PostgresTarget) PlainBatch(ctx context.Context, msgs []*idem.Message) error {
	return t.inTx(ctx, func(tx pgx.Tx) error { return t.applyBatch(ctx, tx, msgs) })
}

// Close drops the tables the target created, and the schema if
// OpenPostgres created it. It does not close the pool.
func (t *PostgresTarget) Close(ctx context.Context) error {
	if t.pool == nil {
		return nil
	}
	var errs []error
	// Every table idem's migrations created carries TablePrefix: drop them
	// all, whatever migrations exist.
	rows, err := t.pool.Query(ctx, `SELECT tablename FROM pg_tables
WHERE schemaname = COALESCE(NULLIF($1, ''), current_schema()) AND starts_with(tablename, $2)`, t.schema, TablePrefix)
	if err != nil {
		return fmt.Errorf("bench: list tables: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("bench: list tables: %w", err)
	}
	for _, name := range names {
		if _, err := t.pool.Exec(ctx, `DROP TABLE IF EXISTS `+sqlident.Qualified(t.schema, name)+` CASCADE`); err != nil {
			errs = append(errs, fmt.Errorf("bench: drop table: %w", err))
		}
	}
	if t.createdSchema {
		if _, err := t.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+sqlident.Quote(t.schema)); err != nil {
			errs = append(errs, fmt.Errorf("bench: drop schema: %w", err))
		}
	}
	return errors.Join(errs...)
}

// PlainBatchPerEvent implements PerEventTarget.
func (t *PostgresTarget) PlainBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	return t.inTx(ctx, func(tx pgx.Tx) error {
		for _, m := range msgs {
			if err := t.applyOne(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
}

// HandOne implements HandRolledTarget: the ID's insert, then the upsert if
// the insert added a row, in a transaction begun with the pool's Begin.
func (t *PostgresTarget) HandOne(ctx context.Context, msg *idem.Message) error {
	return t.inTx(ctx, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, t.handOne, msg.ID)
		if err != nil {
			return fmt.Errorf("bench: insert processed ID: %w", err)
		}
		if tag.RowsAffected() == 0 {
			// Every benchmark message is new: a skip here is a bug.
			return fmt.Errorf("bench: message %q already processed", msg.ID)
		}
		return t.applyOne(ctx, tx, msg)
	})
}

// HandBatchPerEvent implements HandRolledTarget: one multi-row insert of
// the IDs returning those it added, then one upsert per added ID.
func (t *PostgresTarget) HandBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	return t.inTx(ctx, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, t.handMany, ids)
		if err != nil {
			return fmt.Errorf("bench: insert processed IDs: %w", err)
		}
		added, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return fmt.Errorf("bench: insert processed IDs: %w", err)
		}
		isNew := make(map[string]struct{}, len(added))
		for _, id := range added {
			isNew[id] = struct{}{}
		}
		if len(isNew) != len(msgs) { // every benchmark message is new
			return fmt.Errorf("bench: %d of %d messages already processed", len(msgs)-len(isNew), len(msgs))
		}
		for _, m := range msgs {
			if _, ok := isNew[m.ID]; !ok {
				continue
			}
			if err := t.applyOne(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
}

// setupInRow creates the in-row balances table, whose rows hold each
// account's last applied sequence, and its handler.
func (t *PostgresTarget) setupInRow(ctx context.Context, proc *idem.Processor[postgres.Tx]) error {
	table := sqlident.Qualified(t.schema, TablePrefix+"balances_in_row")
	if _, err := t.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+
		` (account text PRIMARY KEY, amount bigint NOT NULL, last_seq bigint NOT NULL)`); err != nil {
		return fmt.Errorf("bench: create in-row balances table: %w", err)
	}
	t.rowLock = `SELECT last_seq FROM ` + table + ` WHERE account = $1 FOR UPDATE`
	t.rowUpsert = `INSERT INTO ` + table + ` AS b (account, amount, last_seq) VALUES ($1, $2, $3)
ON CONFLICT (account) DO UPDATE SET amount = b.amount + excluded.amount, last_seq = excluded.last_seq
WHERE b.last_seq < $4`
	t.rowLockMany = `SELECT u.a, s.last_seq FROM unnest($1::text[]) WITH ORDINALITY AS u(a, n),
LATERAL (SELECT last_seq FROM ` + table + ` WHERE account = u.a FOR UPDATE) AS s`
	t.rowUpsertMany = `INSERT INTO ` + table + ` AS b (account, amount, last_seq)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[])
ON CONFLICT (account) DO UPDATE SET amount = b.amount + excluded.amount, last_seq = excluded.last_seq
WHERE b.last_seq < excluded.last_seq
RETURNING account`
	t.rowInsertMany = `INSERT INTO ` + table + ` (account, amount, last_seq)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[])
ON CONFLICT DO NOTHING RETURNING account`
	t.inRowProc, t.inRowH = proc, inRowHandler(t.writeRows)
	return nil
}

// writeRows is the in-row handler's guarded write, as a user would write
// it. One guard: the locked read of the row's sequence and the guarded
// upsert in one round trip. Several: the locked read of every row (one
// index lookup each, in the guards' order), then one upsert of the
// admitted rows that exist and one insert of those that did not, each
// returning the accounts it advanced.
func (t *PostgresTarget) writeRows(ctx context.Context, tx postgres.Tx, gs []*idem.RowGuard) ([]idem.RowWrite, error) {
	ws := make([]idem.RowWrite, len(gs))
	if len(gs) == 1 {
		g := gs[0]
		amount, err := guardAmount(g)
		if err != nil {
			return nil, err
		}
		b := &pgx.Batch{}
		b.Queue(t.rowLock, g.AggregateID)
		b.Queue(t.rowUpsert, g.AggregateID, amount, g.To(), g.From())
		br := tx.SendBatch(ctx, b)
		err = br.QueryRow().Scan(&ws[0].Prev)
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
		if err == nil {
			tag, eerr := br.Exec()
			err, ws[0].Advanced = eerr, tag.RowsAffected() == 1
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return nil, fmt.Errorf("bench: guarded upsert: %w", err)
		}
		return ws, nil
	}
	accounts := make([]string, len(gs))
	for i, g := range gs {
		accounts[i] = g.AggregateID
	}
	rows, err := tx.Query(ctx, t.rowLockMany, accounts)
	if err != nil {
		return nil, fmt.Errorf("bench: lock in-row balances: %w", err)
	}
	last := make(map[string]int64, len(gs))
	var (
		a string
		n int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&a, &n}, func() error { last[a] = n; return nil }); err != nil {
		return nil, fmt.Errorf("bench: lock in-row balances: %w", err)
	}
	type write struct {
		accounts      []string
		amounts, seqs []int64
	}
	var upd, ins write
	for i, g := range gs {
		prev, found := last[g.AggregateID]
		ws[i].Prev = prev
		if !g.Admits(prev) {
			continue
		}
		amount, err := guardAmount(g)
		if err != nil {
			return nil, err
		}
		w := &ins
		if found {
			w = &upd
		}
		w.accounts, w.amounts, w.seqs = append(w.accounts, g.AggregateID), append(w.amounts, amount), append(w.seqs, g.To())
	}
	advanced := make(map[string]bool, len(gs))
	for _, s := range []struct {
		sql string
		w   *write
	}{{t.rowUpsertMany, &upd}, {t.rowInsertMany, &ins}} {
		if len(s.w.accounts) == 0 {
			continue
		}
		rows, err := tx.Query(ctx, s.sql, s.w.accounts, s.w.amounts, s.w.seqs)
		if err == nil {
			_, err = pgx.ForEachRow(rows, []any{&a}, func() error { advanced[a] = true; return nil })
		}
		if err != nil {
			return nil, fmt.Errorf("bench: write in-row balances: %w", err)
		}
	}
	for i, g := range gs {
		ws[i].Advanced = advanced[g.AggregateID]
	}
	return ws, nil
}

// PlainOneInRow implements InRowTarget.
func (t *PostgresTarget) PlainOneInRow(ctx context.Context, msg *idem.Message) error {
	return t.inTx(ctx, func(tx pgx.Tx) error {
		gs := oneGuard(msg)
		ws, err := t.writeRows(ctx, tx, gs)
		if err != nil {
			return err
		}
		return checkAdvanced(gs, ws)
	})
}

// PlainBatchInRow implements InRowTarget.
func (t *PostgresTarget) PlainBatchInRow(ctx context.Context, msgs []*idem.Message) error {
	return t.inTx(ctx, func(tx pgx.Tx) error {
		gs := rowGuards(msgs)
		ws, err := t.writeRows(ctx, tx, gs)
		if err != nil {
			return err
		}
		return checkAdvanced(gs, ws)
	})
}

// IdemOneInRow implements InRowTarget.
func (t *PostgresTarget) IdemOneInRow(ctx context.Context, msg *idem.Message) error {
	out, err := t.inRowProc.Process(ctx, t.inRowH, msg)
	return checkApplied1(msg, out, err)
}

// IdemBatchInRow implements InRowTarget.
func (t *PostgresTarget) IdemBatchInRow(ctx context.Context, msgs []*idem.Message) error {
	return processBatch(ctx, t.inRowProc, t.inRowH, msgs)
}
