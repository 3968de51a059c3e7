package bench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/mysql"
)

// MySQLTarget is a Target on a MySQL or MariaDB database: the tables of
// the benchmark and idem's carry TablePrefix, in the connection's
// database.
type MySQLTarget struct {
	db *sql.DB
	idemVariants[*sql.Tx]
	upsertOne string
	balances  string
	hand      string
}

// OpenMySQL migrates idem into db's database and creates the balances
// table. db should come from mysql.Open (its connections are at READ
// COMMITTED, which both variants then run at) and allow at least as many
// connections as the workload has workers. Close the target when done.
func OpenMySQL(ctx context.Context, db *sql.DB) (*MySQLTarget, error) {
	t := &MySQLTarget{db: db}
	if err := t.setup(ctx); err != nil {
		return nil, errors.Join(err, t.Close(context.WithoutCancel(ctx)))
	}
	return t, nil
}

func (t *MySQLTarget) setup(ctx context.Context) error {
	if t.db == nil {
		return errors.New("bench: nil *sql.DB")
	}
	drv, err := mysql.New(t.db, &mysql.Config{TablePrefix: TablePrefix, SessionIsolation: true})
	if err != nil {
		return fmt.Errorf("bench: mysql driver: %w", err)
	}
	if err := drv.Migrate(ctx); err != nil {
		return fmt.Errorf("bench: migrate: %w", err)
	}
	t.balances = "`" + TablePrefix + "balances`"
	if _, err := t.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+t.balances+
		` (account VARBINARY(255) PRIMARY KEY, amount BIGINT NOT NULL) ENGINE = InnoDB`); err != nil {
		return fmt.Errorf("bench: create balances table: %w", err)
	}
	t.hand = "`" + handTable + "`"
	if _, err := t.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+t.hand+
		` (message_id VARBINARY(255) PRIMARY KEY, processed_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB`); err != nil {
		return fmt.Errorf("bench: create hand-rolled dedupe table: %w", err)
	}
	t.upsertOne = `INSERT INTO ` + t.balances + ` (account, amount) VALUES (?, ?) ON DUPLICATE KEY UPDATE amount = amount + VALUES(amount)`
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		return fmt.Errorf("bench: processor: %w", err)
	}
	h := &idem.Handler[*sql.Tx]{Name: handlerName, Apply: t.applyOne, ApplyBatch: t.applyBatch}
	t.idemVariants = newIdemVariants(proc, h)
	return nil
}

// Name returns "mysql".
func (t *MySQLTarget) Name() string { return "mysql" }

func (t *MySQLTarget) applyOne(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
	account, amount, err := Decode(msg)
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, t.upsertOne, account, amount); err != nil {
		return fmt.Errorf("bench: upsert balance: %w", err)
	}
	return nil
}

// applyBatch upserts the aggregated balances with one multi-row statement.
func (t *MySQLTarget) applyBatch(ctx context.Context, tx *sql.Tx, msgs []*idem.Message) error {
	accounts, amounts, err := Aggregate(msgs)
	if err != nil {
		return err
	}
	if len(accounts) == 0 {
		return nil
	}
	args := make([]any, 0, 2*len(accounts))
	for i, a := range accounts {
		args = append(args, a, amounts[i])
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+t.balances+` (account, amount) VALUES (?, ?)`+strings.Repeat(", (?, ?)", len(accounts)-1)+
		` ON DUPLICATE KEY UPDATE amount = amount + VALUES(amount)`, args...); err != nil {
		return fmt.Errorf("bench: upsert balances: %w", err)
	}
	return nil
}

// PlainOne implements Target.
func (t *MySQLTarget) PlainOne(ctx context.Context, msg *idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error { return t.applyOne(ctx, tx, msg) })
}

// PlainBatch implements Target.
func (t *MySQLTarget) PlainBatch(ctx context.Context, msgs []*idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error { return t.applyBatch(ctx, tx, msgs) })
}

// PlainBatchPerEvent implements PerEventTarget.
func (t *MySQLTarget) PlainBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error {
		for _, m := range msgs {
			if err := t.applyOne(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
}

// HandOne implements HandRolledTarget: the ID's INSERT IGNORE, then the
// upsert if it added a row, in a transaction begun with the pool's
// BeginTx, as a team writes it on database/sql.
func (t *MySQLTarget) HandOne(ctx context.Context, msg *idem.Message) error {
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `INSERT IGNORE INTO `+t.hand+` (message_id) VALUES (?)`, msg.ID)
		if err != nil {
			return fmt.Errorf("bench: insert processed ID: %w", err)
		}
		if n, err := res.RowsAffected(); err != nil || n != 1 {
			// Every benchmark message is new: a skip here is a bug.
			return fmt.Errorf("bench: message %q already processed (%v)", msg.ID, err)
		}
		return t.applyOne(ctx, tx, msg)
	})
}

// HandBatchPerEvent implements HandRolledTarget: one multi-row INSERT
// IGNORE of the IDs, then one upsert per event. Every benchmark message is
// new, so a batch whose insert added fewer rows than it has messages is an
// error rather than a search for the ones to skip.
func (t *MySQLTarget) HandBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	args := make([]any, len(msgs))
	for i, m := range msgs {
		args[i] = m.ID
	}
	return inSQLTx(ctx, t.db, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `INSERT IGNORE INTO `+t.hand+` (message_id) VALUES (?)`+strings.Repeat(", (?)", len(msgs)-1), args...)
		if err != nil {
			return fmt.Errorf("bench: insert processed IDs: %w", err)
		}
		if n, err := res.RowsAffected(); err != nil || n != int64(len(msgs)) {
			return fmt.Errorf("bench: %d of %d messages already processed (%v)", int64(len(msgs))-n, len(msgs), err)
		}
		for _, m := range msgs {
			if err := t.applyOne(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
}

// Close drops every table carrying TablePrefix in the connection's
// database: the benchmark's and idem's. It does not close the pool.
func (t *MySQLTarget) Close(ctx context.Context) error {
	if t.db == nil {
		return nil
	}
	rows, err := t.db.QueryContext(ctx, `SELECT TABLE_NAME FROM information_schema.TABLES
WHERE TABLE_SCHEMA = DATABASE() AND LEFT(TABLE_NAME, CHAR_LENGTH(?)) = ?`, TablePrefix, TablePrefix)
	if err != nil {
		return fmt.Errorf("bench: list tables: %w", err)
	}
	var names []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			rows.Close()
			return fmt.Errorf("bench: list tables: %w", err)
		}
		names = append(names, n)
	}
	rows.Close()
	var errs []error
	for _, n := range names {
		// The names come from the catalog and start with TablePrefix;
		// a backtick in one is doubled all the same.
		if _, err := t.db.ExecContext(ctx, "DROP TABLE IF EXISTS `"+strings.ReplaceAll(n, "`", "``")+"`"); err != nil {
			errs = append(errs, fmt.Errorf("bench: drop table: %w", err))
		}
	}
	return errors.Join(errs...)
}
