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
	h := &idem.Handler[postgres.Tx]{
		Name: handlerName,
		Apply: func(ctx context.Context, tx postgres.Tx, msg *idem.Message) error {
			return t.applyOne(ctx, tx, msg)
		},
		ApplyBatch: func(ctx context.Context, tx postgres.Tx, msgs []*idem.Message) error {
			return t.applyBatch(ctx, tx, msgs)
		},
	}
	t.idemVariants = newIdemVariants(proc, h)
	return nil
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
