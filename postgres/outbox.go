package postgres

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlident"
)

var (
	_ driver.OutboxWriter[Tx] = (*Driver)(nil)
	_ driver.OutboxRelayStore = (*Driver)(nil)
	_ driver.OutboxNotifier   = (*Driver)(nil)
)

// outboxChannel is the LISTEN/NOTIFY channel of this driver's outbox: the
// qualified table name, or a hash of it past Postgres' 63-byte limit.
func (d *Driver) outboxChannel() string {
	name := d.prefix + "outbox"
	if d.schema != "" {
		name = d.schema + "." + name
	}
	if len(name) <= 63 {
		return name
	}
	h := fnv.New64a()
	h.Write([]byte(name))
	return "idem_outbox_" + strconv.FormatUint(h.Sum64(), 16)
}

// OutboxAdd implements driver.OutboxWriter: one INSERT in tx, the rows
// passed as one array per column, so that any number of rows is one
// statement with nine parameters (a VALUES list would reach the protocol's
// 65,535 parameters at 7,282 rows). The rows get their IDs in the order
// given.
func (d *Driver) OutboxAdd(ctx context.Context, tx Tx, rows []driver.OutboxRow) error {
	if len(rows) == 0 {
		return nil
	}
	var (
		dest, ids, keys, aggs, types []string
		seqs                         []int64
		headers, payloads, hashes    [][]byte
	)
	for _, r := range rows {
		payload := r.Payload
		if payload == nil {
			payload = []byte{}
		}
		dest, ids, keys = append(dest, r.Destination), append(ids, r.MessageID), append(keys, r.OrderingKey)
		aggs, types, seqs = append(aggs, r.AggregateID), append(types, r.Type), append(seqs, r.Seq)
		headers, payloads, hashes = append(headers, r.Headers), append(payloads, payload), append(hashes, r.PayloadHash)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+d.t.outbox+` (destination, message_id, ordering_key, aggregate_id, seq, type, headers, payload, payload_hash)
SELECT r.dest, r.id, r.key, r.agg, r.seq, r.type, r.headers, r.payload, r.hash
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], $7::bytea[], $8::bytea[], $9::bytea[])
  WITH ORDINALITY AS r(dest, id, key, agg, seq, type, headers, payload, hash, n)
ORDER BY r.n`, dest, ids, keys, aggs, seqs, types, byteaArray(headers), byteaArray(payloads), byteaArray(hashes)); err != nil {
		return fmt.Errorf("postgres: add outbox rows: %w", err)
	}
	return nil
}

// OutboxAddNext implements driver.OutboxNextAdder: the version upsert and
// the outbox insert in one statement, one round trip.
func (d *Driver) OutboxAddNext(ctx context.Context, tx Tx, r *driver.OutboxRow) (int64, error) {
	payload := r.Payload
	if payload == nil {
		payload = []byte{}
	}
	var seq int64
	err := tx.QueryRow(ctx, `WITH v AS (
  INSERT INTO `+d.t.versions+` AS v (stream, aggregate_id, version) VALUES ($1, $2, 1)
  ON CONFLICT (stream, aggregate_id) DO UPDATE SET version = v.version + 1 RETURNING version)
INSERT INTO `+d.t.outbox+` (destination, message_id, ordering_key, aggregate_id, seq, type, headers, payload, payload_hash)
SELECT $1, $8::text || v.version, $3, $2, v.version, $4, $5, $6, $7 FROM v RETURNING seq`,
		r.Destination, r.AggregateID, r.OrderingKey, r.Type, r.Headers, payload, r.PayloadHash, r.MessageID).Scan(&seq)
	if err != nil {
		return 0, fmt.Errorf("postgres: add next outbox row: %w", err)
	}
	return seq, nil
}

// OutboxClaim implements driver.OutboxRelayStore. Times come from the
// database clock, so relays on skewed hosts agree on claim expiry.
func (d *Driver) OutboxClaim(ctx context.Context, owner string, limit, maxBytes int, ttl time.Duration) ([]driver.OutboxRow, bool, error) {
	// Candidate keys: the oldest pending rows whose key no other live
	// claim holds, and that no parked row of their key precedes.
	rows, err := d.pool.Query(ctx, `SELECT o.ordering_key FROM `+d.t.outbox+` o
WHERE o.published_at IS NULL AND NOT EXISTS (SELECT 1 FROM `+d.t.outboxClaims+` c
  WHERE c.ordering_key = o.ordering_key AND c.owner <> $1 AND c.claimed_until > clock_timestamp())
AND `+d.notParked("o")+`
ORDER BY o.id LIMIT $2`, owner, limit)
	if err != nil {
		return nil, false, fmt.Errorf("postgres: outbox candidates: %w", err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, false, fmt.Errorf("postgres: outbox candidates: %w", err)
	}
	if len(keys) == 0 {
		return nil, false, nil
	}
	keys = uniqueStrings(keys)
	// Claim them: a key another relay holds live is left alone (the
	// upsert's WHERE re-checks it under the row lock).
	rows, err = d.auto.Query(ctx, `INSERT INTO `+d.t.outboxClaims+` AS c (ordering_key, owner, claimed_until)
SELECT k, $2, clock_timestamp() + $3::bigint * interval '1 microsecond' FROM unnest($1::text[]) AS k
ON CONFLICT (ordering_key) DO UPDATE SET owner = excluded.owner, claimed_until = excluded.claimed_until
WHERE c.owner = excluded.owner OR c.claimed_until <= clock_timestamp()
RETURNING c.ordering_key`, keys, owner, ttl.Microseconds())
	if err != nil {
		return nil, false, fmt.Errorf("postgres: claim outbox keys: %w", err)
	}
	won, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, false, fmt.Errorf("postgres: claim outbox keys: %w", err)
	}
	if len(won) == 0 {
		return nil, false, nil
	}
	// Read the won keys' pending rows now, after the claim: anything
	// another relay marked published before we won is not returned.
	// A parked row and its key's later rows stay (an operator's park
	// takes the key as a claim does, so none was parked after our claim).
	rows, err = d.pool.Query(ctx, `SELECT id, destination, message_id, ordering_key, aggregate_id, seq, type, headers, payload, payload_hash, created_at, attempts
FROM `+d.t.outbox+` o WHERE published_at IS NULL AND ordering_key = ANY($1) AND `+d.notParked("o")+` ORDER BY id LIMIT $2`, won, limit)
	if err != nil {
		return nil, false, fmt.Errorf("postgres: read claimed outbox rows: %w", err)
	}
	defer rows.Close()
	var (
		out  []driver.OutboxRow
		used int
		cut  bool
	)
	for rows.Next() {
		var o driver.OutboxRow
		if err := rows.Scan(&o.ID, &o.Destination, &o.MessageID, &o.OrderingKey, &o.AggregateID, &o.Seq, &o.Type, &o.Headers, &o.Payload, &o.PayloadHash, &o.CreatedAt, &o.Attempts); err != nil {
			return nil, false, fmt.Errorf("postgres: read claimed outbox rows: %w", err)
		}
		if cut = !driver.OutboxClaimFits(len(out), used, len(o.Payload), maxBytes); cut {
			break // Close reads the rest off the connection, a row at a time
		}
		used += len(o.Payload)
		out = append(out, o)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, false, fmt.Errorf("postgres: read claimed outbox rows: %w", err)
	}
	if cut {
		if idle := driver.OutboxIdleKeys(won, out); len(idle) > 0 {
			if _, err := d.auto.Exec(ctx, `DELETE FROM `+d.t.outboxClaims+` WHERE owner = $1 AND ordering_key = ANY($2)`, owner, idle); err != nil {
				return nil, false, fmt.Errorf("postgres: release outbox keys left out: %w", err)
			}
		}
	}
	return out, cut, nil
}

// notParked is the condition that the outbox row aliased o is not parked
// and no parked row of its key precedes it. The lookup reads the partial
// index of parked rows, empty unless an operator parked some.
func (d *Driver) notParked(o string) string {
	return `NOT EXISTS (SELECT 1 FROM ` + d.t.outbox + ` p WHERE p.ordering_key = ` + o + `.ordering_key
  AND p.parked_at IS NOT NULL AND p.published_at IS NULL AND p.id <= ` + o + `.id)`
}

func uniqueStrings(in []string) []string {
	seen := make(map[string]bool, len(in))
	out := in[:0]
	for _, s := range in {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}

// OutboxMarkPublished implements driver.OutboxRelayStore.
func (d *Driver) OutboxMarkPublished(ctx context.Context, ids []int64) error {
	if _, err := d.auto.Exec(ctx, `UPDATE `+d.t.outbox+` SET published_at = now() WHERE id = ANY($1) AND published_at IS NULL`, ids); err != nil {
		return fmt.Errorf("postgres: mark outbox rows published: %w", err)
	}
	return nil
}

// OutboxFailed implements driver.OutboxRelayStore: the attempt and the
// key's hold in one statement.
func (d *Driver) OutboxFailed(ctx context.Context, owner string, id int64, errText string, holdFor time.Duration) error {
	if _, err := d.auto.Exec(ctx, `WITH f AS (
  UPDATE `+d.t.outbox+` SET attempts = attempts + 1, last_error = $2 WHERE id = $1 RETURNING ordering_key)
INSERT INTO `+d.t.outboxClaims+` AS c (ordering_key, owner, claimed_until)
SELECT ordering_key, '', clock_timestamp() + $3::bigint * interval '1 microsecond' FROM f
ON CONFLICT (ordering_key) DO UPDATE SET owner = '', claimed_until = excluded.claimed_until
WHERE c.owner = $4 OR c.owner = '' OR c.claimed_until <= clock_timestamp()`, id, errText, holdFor.Microseconds(), owner); err != nil {
		return fmt.Errorf("postgres: record outbox failure: %w", err)
	}
	return nil
}

// OutboxRelease implements driver.OutboxRelayStore.
func (d *Driver) OutboxRelease(ctx context.Context, owner string) error {
	if _, err := d.auto.Exec(ctx, `DELETE FROM `+d.t.outboxClaims+` WHERE owner = $1`, owner); err != nil {
		return fmt.Errorf("postgres: release outbox claims: %w", err)
	}
	return nil
}

// OutboxStats implements driver.OutboxRelayStore.
func (d *Driver) OutboxStats(ctx context.Context) (driver.OutboxStats, error) {
	var (
		s      driver.OutboxStats
		oldest *time.Time
		last   *string
	)
	err := d.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE published_at IS NULL), count(*) FILTER (WHERE published_at IS NOT NULL),
min(created_at) FILTER (WHERE published_at IS NULL AND parked_at IS NULL),
count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL AND attempts > 0),
count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NOT NULL),
(SELECT last_error FROM `+d.t.outbox+` WHERE published_at IS NULL AND parked_at IS NULL AND attempts > 0 ORDER BY id DESC LIMIT 1)
FROM `+d.t.outbox).Scan(&s.Pending, &s.Published, &oldest, &s.Failing, &s.Parked, &last)
	if err != nil {
		return s, fmt.Errorf("postgres: outbox stats: %w", err)
	}
	if oldest != nil {
		s.OldestPending = *oldest
	}
	if last != nil {
		s.LastError = *last
	}
	return s, nil
}

// OutboxPrune implements driver.OutboxRelayStore: one bounded DELETE
// walking the primary key.
func (d *Driver) OutboxPrune(ctx context.Context, before time.Time, after int64, limit int) (int, int64, error) {
	if after == 0 {
		// A pass starts: drop the expired claims and holds too (a dead
		// relay's, a failure's hold). They mean nothing once expired and
		// are overwritten by the next claim of their key, but a key that
		// never comes back would keep its row. SQLite deletes them at
		// every claim; here that would cost each relay cycle a statement.
		if _, err := d.auto.Exec(ctx, `DELETE FROM `+d.t.outboxClaims+` WHERE claimed_until <= clock_timestamp()`); err != nil {
			return 0, after, fmt.Errorf("postgres: prune expired outbox claims: %w", err)
		}
		// The operators' log of retries, parks and discards ages with
		// the rows it is about: a few rows a day, deleted in one go.
		if _, err := d.auto.Exec(ctx, `DELETE FROM `+d.t.outboxLog+` WHERE at < $1`, before); err != nil {
			return 0, after, fmt.Errorf("postgres: prune outbox log: %w", err)
		}
	}
	rows, err := d.auto.Query(ctx, `DELETE FROM `+d.t.outbox+` WHERE id IN (SELECT id FROM `+d.t.outbox+`
WHERE id > $1 AND published_at < $2 ORDER BY id LIMIT $3) RETURNING id`, after, before, limit)
	if err != nil {
		return 0, after, fmt.Errorf("postgres: prune outbox: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return 0, after, fmt.Errorf("postgres: prune outbox: %w", err)
	}
	last := after
	for _, id := range ids {
		last = max(last, id)
	}
	return len(ids), last, nil
}

// SetOutboxNotify installs (on) or removes (off) the trigger that wakes
// listening relays when outbox rows commit. It changes the schema, for
// every process using it, and is off after Migrate.
//
// On, a relay publishes a commit within milliseconds instead of within
// its PollInterval. The price is paid by the writers: a transaction that
// notifies takes a database-wide lock at commit, held until its commit
// record is flushed, so concurrent writers of outbox rows commit one at a
// time. On the CI machine (pgbench, a one-row upsert plus an outbox row
// per transaction) notifying cost 18% of the rate with one writer, 35%
// with 4 and 51% with 8. Turn it on when latency matters more than that
// and the outbox has few concurrent writers.
func (d *Driver) SetOutboxNotify(ctx context.Context, on bool) error {
	trigger := sqlident.Quote(d.prefix + "outbox_notify")
	err := pgx.BeginTxFunc(ctx, d.pool, readCommitted(), func(tx pgx.Tx) error {
		// Under Migrate's lock: a migration still to run could undo the
		// choice, and concurrent callers would race on the trigger.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, d.migrateLockKey()); err != nil {
			return err
		}
		var migrated bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+d.t.migrations+` WHERE version = $1)`,
			outboxNotifyOptInVersion).Scan(&migrated); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
				return ErrNotMigrated
			}
			return err
		}
		if !migrated {
			return ErrNotMigrated
		}
		exists, err := d.outboxNotifyOn(ctx, tx)
		if err != nil {
			return err
		}
		if exists == on {
			return nil // as wanted: no lock on the outbox taken
		}
		// Creating or dropping a trigger locks the outbox against its
		// writers: give up rather than queue behind a long transaction
		// with them all waiting behind us.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
			return err
		}
		q := `DROP TRIGGER ` + trigger + ` ON ` + d.t.outbox
		if on {
			q = `CREATE TRIGGER ` + trigger + ` AFTER INSERT ON ` + d.t.outbox +
				` FOR EACH STATEMENT EXECUTE FUNCTION ` + sqlident.Qualified(d.schema, d.prefix+"outbox_notify") + `()`
		}
		_, err = tx.Exec(ctx, q)
		return err
	})
	if err != nil && !errors.Is(err, ErrNotMigrated) {
		err = fmt.Errorf("postgres: set outbox notify %t: %w", on, err)
	}
	return err
}

// OutboxNotifyOn reports whether the outbox's NOTIFY trigger is installed
// (see SetOutboxNotify).
func (d *Driver) OutboxNotifyOn(ctx context.Context) (bool, error) {
	on, err := d.outboxNotifyOn(ctx, d.pool)
	if err != nil {
		return false, fmt.Errorf("postgres: read outbox notify: %w", err)
	}
	return on, nil
}

func (d *Driver) outboxNotifyOn(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (bool, error) {
	var on bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname = $2 AND NOT tgisinternal)`,
		d.t.outbox, d.prefix+"outbox_notify").Scan(&on)
	return on, err
}

// outboxNotifyOptInVersion is the migration that made the outbox's NOTIFY
// trigger opt-in (it drops the trigger).
const outboxNotifyOptInVersion = 9

// ErrNotMigrated is returned by SetOutboxNotify when the schema lacks a
// migration of this version of idem (Migrate would undo the setting), and
// wrapped in the error of a message's processing (Process, ProcessBatch,
// a lease claim) that finds idem's tables missing.
var ErrNotMigrated = errors.New("postgres: the schema is not migrated to this version of idem; run Migrate first")

// OutboxListen implements driver.OutboxNotifier: a connection of its own,
// outside the pool (opened with its settings), LISTENs on the outbox
// channel. A lost connection is re-made
// after a second, and so is one that could not be made at first (the
// error is logged, not returned); the relay polls meanwhile, and is woken
// once each new LISTEN is in place, for the rows committed while none
// was. Nothing is notified unless SetOutboxNotify turned the trigger on.
func (d *Driver) OutboxListen(ctx context.Context) (<-chan struct{}, error) {
	ch := make(chan struct{}, 1)
	listen := func() (*pgx.Conn, func(), error) {
		// A connection of its own, opened with the pool's settings but
		// outside it: one acquired from the pool would hold a pooled
		// connection for the relay's life, and relays as many as the
		// pool's connections would leave none to claim rows with.
		c, err := pgx.ConnectConfig(ctx, d.pool.Config().ConnConfig.Copy())
		if err != nil {
			return nil, nil, err
		}
		closeConn := func() { _ = c.Close(context.Background()) }
		if _, err := c.Exec(ctx, `LISTEN `+sqlident.Quote(d.outboxChannel())); err != nil {
			closeConn()
			return nil, nil, err
		}
		return c, closeConn, nil
	}
	conn, closeConn, err := listen()
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("postgres: listen for outbox rows: %w", err)
		}
		d.logger.Warn("postgres: cannot listen for outbox rows yet; retrying every second, the relay polls meanwhile", slog.Any("error", err))
		conn, closeConn = nil, nil
	}
	wake := func() {
		select {
		case ch <- struct{}{}:
		default: // a wake-up is already pending
		}
	}
	go func() {
		defer close(ch)
		defer func() {
			if closeConn != nil {
				closeConn()
			}
		}()
		for {
			if conn == nil {
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Second):
				}
				if conn, closeConn, err = listen(); err != nil {
					conn, closeConn = nil, nil
					continue
				}
				wake() // rows may have been committed while no LISTEN was in place
			}
			_, err := conn.WaitForNotification(ctx)
			if ctx.Err() != nil {
				return
			}
			if err != nil {
				d.logger.Debug("postgres: outbox listener lost its connection; reconnecting", slog.Any("error", err))
				closeConn()
				conn, closeConn = nil, nil
				continue
			}
			wake()
		}
	}()
	return ch, nil
}

var _ driver.OutboxPrunableCounter = (*Driver)(nil)

// OutboxCountPrunable implements driver.OutboxPrunableCounter.
func (d *Driver) OutboxCountPrunable(ctx context.Context, before time.Time) (int64, error) {
	var n int64
	if err := d.pool.QueryRow(ctx, `SELECT count(*) FROM `+d.t.outbox+` WHERE published_at < $1`, before).Scan(&n); err != nil {
		return 0, fmt.Errorf("postgres: count prunable outbox rows: %w", err)
	}
	return n, nil
}
