package postgres

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// Atomic markers live in the markers table (migration 011): a handler id
// from the handlers table, the message ID as a key of bytes (messageKey),
// the first 16 bytes of the payload's SHA-256 and the processing time.
// The processed table keeps the leases, and the atomic markers written
// before migration 011 until retention deletes them; while any is left
// (marker_layout.legacy_atomic), the atomic path reads both tables.

// legacyRecheck is how long a driver trusts its last reading of
// marker_layout.legacy_atomic while it was true. Once false it stays
// false: nothing writes atomic markers to the old table any more.
const legacyRecheck = 10 * time.Second

// Values of Driver.legacy.
const (
	legacyUnknown int32 = iota
	legacyPresent
	legacyGone
)

// messageKey returns the key a message ID is stored under: a canonical
// UUID string (lowercase, with hyphens, as Postgres prints a uuid) as its
// 16 bytes, any other ID as its own bytes. An ID of 16 bytes that is not
// such a UUID gets a NUL appended, so it cannot be taken for one. IDs
// never hold a NUL, so the mapping is one-to-one and messageID inverts it.
func messageKey(id string) []byte {
	if len(id) == 36 {
		if k, ok := uuidBytes(id); ok {
			return k
		}
	}
	if len(id) == 16 {
		return append([]byte(id), 0)
	}
	return []byte(id)
}

// messageID inverts messageKey.
func messageID(key []byte) string {
	switch {
	case len(key) == 16:
		var b [36]byte
		hex.Encode(b[0:8], key[0:4])
		b[8] = '-'
		hex.Encode(b[9:13], key[4:6])
		b[13] = '-'
		hex.Encode(b[14:18], key[6:8])
		b[18] = '-'
		hex.Encode(b[19:23], key[8:10])
		b[23] = '-'
		hex.Encode(b[24:36], key[10:16])
		return string(b[:])
	case len(key) == 17 && key[16] == 0:
		return string(key[:16])
	}
	return string(key)
}

// uuidBytes parses a canonical UUID string: 36 bytes, hyphens at 8, 13,
// 18 and 23, lowercase hexadecimal elsewhere. Anything else (upper case,
// braces, no hyphens) is not canonical: it would not read back the same.
func uuidBytes(s string) ([]byte, bool) {
	k := make([]byte, 16)
	j := 0
	for i := 0; i < 36; i++ {
		c := s[i]
		if i == 8 || i == 13 || i == 18 || i == 23 {
			if c != '-' {
				return nil, false
			}
			continue
		}
		var v byte
		switch {
		case '0' <= c && c <= '9':
			v = c - '0'
		case 'a' <= c && c <= 'f':
			v = c - 'a' + 10
		default:
			return nil, false
		}
		if j%2 == 0 {
			k[j/2] = v << 4
		} else {
			k[j/2] |= v
		}
		j++
	}
	return k, true
}

// storedHash is the part of a payload hash the markers table keeps.
func storedHash(h []byte) []byte {
	if len(h) > idem.MinStoredHash {
		return h[:idem.MinStoredHash]
	}
	return h
}

// querier is what reads the handlers and the layout, and interns a new
// handler name when it must: the transaction at hand, or the pool.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// handlerID returns the id handler is interned under, adding it to the
// handlers table on first use. Ids known committed are cached for the
// driver's life: a handlers row is never deleted or changed.
//
// A new name is best inserted on a pooled connection of its own and
// committed at once, so that it does not depend on the caller's
// transaction. But when q is a transaction, that transaction holds one of
// the pool's connections, and when the workers of a new handler begin at
// once they may hold them all: each would wait for a connection the others
// hold, for ever. So in a transaction the pooled insert is tried only when
// the pool has a connection to spare, waiting internWait at most;
// otherwise the name is inserted in the caller's transaction, which then
// waits on, or holds, the name's key until the first inserter ends. Under
// REPEATABLE READ or SERIALIZABLE, a name committed after the
// transaction's snapshot fails that insert with a serialization failure,
// which the caller retries as any other.
//
// Such an id may vanish with its transaction, so an id read through a
// transaction is never cached: it may be that transaction's own row,
// inserted here or by another driver. It is used, and cached once a read
// on the pool, which sees committed rows only, finds it too.
func (d *Driver) handlerID(ctx context.Context, q querier, handler string) (int32, error) {
	if id, ok := d.handlerIDs.Load(handler); ok {
		return id.(int32), nil
	}
	if _, pooled := q.(*pgxpool.Pool); pooled {
		return d.internPooled(ctx, handler)
	}
	var id int32
	err := q.QueryRow(ctx, `SELECT id FROM `+d.t.handlers+` WHERE name = $1`, handler).Scan(&id)
	switch {
	case err == nil:
		if d.spareConn() {
			// Confirm on the pool, so that later calls need not read.
			wctx, cancel := context.WithTimeout(ctx, internWait)
			_, _ = d.readPooled(wctx, handler)
			cancel()
		}
		return id, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return 0, fmt.Errorf("postgres: look up handler name: %w", notMigrated(err))
	}
	if d.spareConn() {
		id, ok, err := d.tryInternPooled(ctx, handler)
		if ok || err != nil {
			return id, err
		}
	}
	return d.intern(ctx, q, handler)
}

// internWait bounds how long a transaction's handlerID waits for a pooled
// connection before interning the name in the transaction itself.
const internWait = 500 * time.Millisecond

// tryInternPooled interns handler on a pooled connection, committed at
// once, and caches its id, if it gets a connection within internWait and
// the insert need not wait on a lock: another transaction's uncommitted
// insert of the name would hold it until that transaction ends. ok false
// with a nil error means it could not; the caller then interns the name in
// its transaction.
func (d *Driver) tryInternPooled(ctx context.Context, handler string) (id int32, ok bool, err error) {
	wctx, cancel := context.WithTimeout(ctx, internWait)
	c, err := d.pool.Acquire(wctx)
	cancel()
	if err != nil {
		if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			return 0, false, nil
		}
		return 0, false, fmt.Errorf("postgres: intern handler name: %w", err)
	}
	defer c.Release()
	tx, err := c.BeginTx(ctx, readCommitted())
	if err != nil {
		return 0, false, fmt.Errorf("postgres: intern handler name: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// lock_timeout 0 means none: 10 ms is as near to not waiting as it has.
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '10ms'`); err != nil {
		return 0, false, fmt.Errorf("postgres: intern handler name: %w", err)
	}
	id, err = d.intern(ctx, tx, handler)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, false, fmt.Errorf("postgres: intern handler name: %w", err)
	}
	d.handlerIDs.Store(handler, id)
	return id, true, nil
}

// spareConn reports whether the pool has a connection to spare.
func (d *Driver) spareConn() bool {
	st := d.pool.Stat()
	return st.AcquiredConns() < st.MaxConns()
}

// readPooled reads handler's id on the pool and, when found, caches it:
// a statement outside a transaction sees committed rows only.
func (d *Driver) readPooled(ctx context.Context, handler string) (int32, error) {
	var id int32
	if err := d.pool.QueryRow(ctx, `SELECT id FROM `+d.t.handlers+` WHERE name = $1`, handler).Scan(&id); err != nil {
		return 0, err
	}
	d.handlerIDs.Store(handler, id)
	return id, nil
}

// internPooled reads handler's id on the pool, inserting the name first
// when it is not there, each committed at once, and caches the id.
func (d *Driver) internPooled(ctx context.Context, handler string) (int32, error) {
	id, err := d.readPooled(ctx, handler)
	if !errors.Is(err, pgx.ErrNoRows) {
		if err != nil {
			return 0, fmt.Errorf("postgres: look up handler name: %w", notMigrated(err))
		}
		return id, nil
	}
	// In a READ COMMITTED transaction of its own: under a server default
	// of REPEATABLE READ or SERIALIZABLE, workers interning a new name at
	// once would fail to serialize, and each failure cost an attempt.
	// This runs once per name.
	err = pgx.BeginTxFunc(ctx, d.pool, readCommitted(), func(tx pgx.Tx) error {
		id, err = d.intern(ctx, tx, handler)
		return err
	})
	if err == nil {
		d.handlerIDs.Store(handler, id)
	}
	return id, err
}

// intern reads handler's id through q, inserting the name first when it
// is not there. It caches nothing: q may be a transaction that rolls back.
func (d *Driver) intern(ctx context.Context, q querier, handler string) (int32, error) {
	// ON CONFLICT DO NOTHING returns no row when a concurrent call added
	// the name after this statement's snapshot; the next attempt sees it.
	for range 3 {
		var id int32
		err := q.QueryRow(ctx, `WITH ins AS (
  INSERT INTO `+d.t.handlers+` (name) VALUES ($1) ON CONFLICT (name) DO NOTHING RETURNING id
)
SELECT id FROM ins UNION ALL SELECT id FROM `+d.t.handlers+` WHERE name = $1 LIMIT 1`, handler).Scan(&id)
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("postgres: intern handler name: %w", notMigrated(err))
		}
		return id, nil
	}
	return 0, fmt.Errorf("postgres: intern handler name %q: not found after insert; retry", handler)
}

// legacyAtomic reports whether the old table may still hold atomic
// markers, which the atomic path must then read too.
func (d *Driver) legacyAtomic(ctx context.Context, q querier) (bool, error) {
	switch d.legacy.Load() {
	case legacyGone:
		return false, nil
	case legacyPresent:
		if time.Since(time.Unix(0, d.legacyAt.Load())) < legacyRecheck {
			return true, nil
		}
	}
	var legacy bool
	if err := q.QueryRow(ctx, `SELECT bool_or(legacy_atomic) FROM `+d.t.markerLayout).Scan(&legacy); err != nil {
		return false, fmt.Errorf("postgres: read the marker layout: %w", notMigrated(err))
	}
	d.legacyAt.Store(time.Now().UnixNano())
	if legacy {
		d.legacy.Store(legacyPresent)
	} else {
		d.legacy.Store(legacyGone)
	}
	return legacy, nil
}

// markerSQL holds the atomic path's statements for one layout: markers
// alone, or markers and the old table's atomic rows (legacy). Parameters:
// $1 handler id, $2 key(s), $3 hash(es); legacy statements take the
// handler name and message ID(s) next, for the old table.
type markerSQL struct {
	// insert and insertNew insert one marker, with and without ON
	// CONFLICT DO NOTHING; selectHash reads one marker's hash.
	insert, insertNew, selectHash string
	// insertMany and insertManyNew insert a batch's markers, the first
	// returning the keys it inserted; selectHashes reads the key and hash
	// of existing markers.
	insertMany, insertManyNew, selectHashes string
	// legacy is true for the statements that read the old table too.
	legacy bool
}

// newMarkerSQL builds the statements of both layouts.
func newMarkerSQL(t tables) (fast, legacy markerSQL) {
	cols := `INSERT INTO ` + t.markers + ` (handler_id, message_key, payload_hash) `
	fast = markerSQL{
		insert:        cols + `VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`,
		insertNew:     cols + `VALUES ($1, $2, $3)`,
		selectHash:    `SELECT payload_hash FROM ` + t.markers + ` WHERE handler_id = $1 AND message_key = $2`,
		insertMany:    cols + `SELECT $1, m.k, m.h FROM unnest($2::bytea[], $3::bytea[]) AS m(k, h) ON CONFLICT DO NOTHING RETURNING message_key`,
		insertManyNew: cols + `SELECT $1, m.k, m.h FROM unnest($2::bytea[], $3::bytea[]) AS m(k, h)`,
		selectHashes:  `SELECT message_key, payload_hash FROM ` + t.markers + ` WHERE handler_id = $1 AND message_key = ANY($2::bytea[])`,
	}
	// An old atomic marker has token 0; leases start at 1.
	old := `SELECT 1 FROM ` + t.processed + ` p WHERE p.handler = $4 AND p.message_id = %s AND p.token = 0`
	legacy = markerSQL{
		insert: cols + `SELECT $1, $2, $3 WHERE NOT EXISTS (` + fmt.Sprintf(old, "$5") + `) ON CONFLICT DO NOTHING`,
		selectHash: `(SELECT payload_hash FROM ` + t.markers + ` WHERE handler_id = $1 AND message_key = $2)
UNION ALL (SELECT payload_hash FROM ` + t.processed + ` WHERE handler = $3 AND message_id = $4 AND token = 0) LIMIT 1`,
		insertMany: cols + `SELECT $1, m.k, m.h FROM unnest($2::bytea[], $3::bytea[], $5::text[]) AS m(k, h, id)
WHERE NOT EXISTS (` + fmt.Sprintf(old, "m.id") + `) ON CONFLICT DO NOTHING RETURNING message_key`,
		selectHashes: `SELECT message_key, payload_hash FROM ` + t.markers + ` WHERE handler_id = $1 AND message_key = ANY($2::bytea[])
UNION ALL
SELECT m.k, p.payload_hash FROM unnest($2::bytea[], $4::text[]) AS m(k, id)
JOIN ` + t.processed + ` p ON p.handler = $3 AND p.message_id = m.id AND p.token = 0`,
		legacy: true,
	}
	// Without a plain INSERT's fast path: a legacy marker makes the
	// conditional INSERT affect no row rather than fail.
	legacy.insertNew, legacy.insertManyNew = legacy.insert, ""
	return fast, legacy
}

// marker is one marker as the markers table stores it, with the
// statements of the layout in force.
type marker struct {
	sql     *markerSQL
	hid     int32
	key     []byte
	hash    []byte
	handler string
	id      string
}

// newMarker looks up the handler's id and the layout for p, through q.
func (d *Driver) newMarker(ctx context.Context, q querier, p *driver.MarkerInsertParams) (*marker, error) {
	sql, hid, err := d.markerSetup(ctx, q, p.Handler)
	if err != nil {
		return nil, err
	}
	return &marker{sql: sql, hid: hid, key: messageKey(p.MessageID), hash: storedHash(p.PayloadHash), handler: p.Handler, id: p.MessageID}, nil
}

// markerSetup returns the statements of the layout in force and the
// handler's id, read through q.
func (d *Driver) markerSetup(ctx context.Context, q querier, handler string) (*markerSQL, int32, error) {
	hid, err := d.handlerID(ctx, q, handler)
	if err != nil {
		return nil, 0, err
	}
	legacy, err := d.legacyAtomic(ctx, q)
	if err != nil {
		return nil, 0, err
	}
	if legacy {
		return &d.legacySQL, hid, nil
	}
	return &d.markerSQL, hid, nil
}

// insertArgs are the arguments of insert and insertNew.
func (m *marker) insertArgs() []any {
	if m.sql.legacy {
		return []any{m.hid, m.key, m.hash, m.handler, m.id}
	}
	return []any{m.hid, m.key, m.hash}
}

// hashArgs are the arguments of selectHash.
func (m *marker) hashArgs() []any {
	if m.sql.legacy {
		return []any{m.hid, m.key, m.handler, m.id}
	}
	return []any{m.hid, m.key}
}

// markerBatch is a batch of markers as the markers table stores them.
type markerBatch struct {
	sql     *markerSQL
	hid     int32
	keys    [][]byte
	hashes  [][]byte
	handler string
	ids     []string
}

// newMarkerBatch looks up the handler's id and the layout for p, through q.
func (d *Driver) newMarkerBatch(ctx context.Context, q querier, p *driver.MarkerInsertManyParams) (*markerBatch, error) {
	sql, hid, err := d.markerSetup(ctx, q, p.Handler)
	if err != nil {
		return nil, err
	}
	b := &markerBatch{sql: sql, hid: hid, keys: make([][]byte, len(p.MessageIDs)), hashes: make([][]byte, len(p.MessageIDs)), handler: p.Handler, ids: p.MessageIDs}
	for i, id := range p.MessageIDs {
		b.keys[i] = messageKey(id)
		b.hashes[i] = storedHash(p.PayloadHashes[i])
	}
	return b, nil
}

// insertArgs are the arguments of insertMany and insertManyNew.
func (b *markerBatch) insertArgs() []any {
	if b.sql.legacy {
		return []any{b.hid, byteaArray(b.keys), byteaArray(b.hashes), b.handler, b.ids}
	}
	return []any{b.hid, byteaArray(b.keys), byteaArray(b.hashes)}
}

// hashArgs are the arguments of selectHashes for the IDs at idx.
func (b *markerBatch) hashArgs(idx []int) []any {
	keys := make([][]byte, len(idx))
	ids := make([]string, len(idx))
	for j, i := range idx {
		keys[j], ids[j] = b.keys[i], b.ids[i]
	}
	if b.sql.legacy {
		return []any{b.hid, byteaArray(keys), b.handler, ids}
	}
	return []any{b.hid, byteaArray(keys)}
}

// MarkerMessageID returns the message ID a message_key of the markers
// table stands for. Tools that read the table directly need it: a UUID is
// stored as its 16 bytes.
func MarkerMessageID(key []byte) string { return messageID(key) }
