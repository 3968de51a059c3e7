// Package redisstore is idem's store driver for read models kept in Redis:
// atomic mode where the marker and the handler's writes commit in one
// MULTI/EXEC.
//
//	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
//	drv, err := redisstore.New(client, &redisstore.Config{Prefix: "idem:"})
//	proc, err := idem.NewProcessor(drv, nil)
//
// A handler receives a *Tx. Its writes go through Tx.Queue: they are queued
// on the client and run at commit in one MULTI/EXEC together with the
// markers, so either all of them and the markers are applied, or none.
// Reads go through Tx.Conn and run at once; a handler that reads a key to
// compute what it writes (read-modify-write) first calls Tx.Watch on it, so
// that a concurrent change of that key aborts the commit with ErrAborted
// instead of being overwritten.
//
// # How a marker is taken
//
// Each (handler, message ID) has two keys: the marker, which holds the
// payload hash once a transaction applied the message, and a lock, taken
// with SET NX PX when a transaction starts on the message. The transaction
// WATCHes the marker before it looks at it, and its EXEC writes the marker
// and deletes the lock. So:
//
//   - a redelivery after commit finds the marker: Duplicate (or Conflict if
//     the payload hash differs), and the handler is not called;
//   - a concurrent delivery of the same ID finds the lock, waits until the
//     first transaction ends, then finds the marker (Duplicate) or the lock
//     gone (the first rolled back: it applies);
//   - a process that dies mid-transaction leaves only its lock, which expires
//     after Config.LockTTL; then the message can be applied again;
//   - a transaction that outlives its lock cannot double-apply: whoever
//     applies the message meanwhile writes the marker, which the slow
//     transaction WATCHes, so its EXEC aborts.
//
// A batch takes its locks in message-ID order and waits at the first one
// another transaction holds, so overlapping batches cannot deadlock.
//
// # What Redis does and does not promise
//
// MULTI/EXEC is atomic with respect to other clients, but Redis does not
// roll back a transaction in which a queued command fails when it runs (a
// command against a key of the wrong type, say): the other commands,
// markers included, are applied. Commit then returns an error wrapping
// ErrExecPartial. Queue only commands that cannot fail that way, or check
// types in the handler before queuing.
//
// Durability is Redis's: with the default snapshotting a crash of the Redis
// server can lose recently applied markers together with the effects they
// guard (they were written in one EXEC, so they are lost together and the
// redelivered messages apply again). Use appendonly yes with appendfsync
// always where that matters. Replication is asynchronous: a failover can
// lose acknowledged writes.
//
// Redis Cluster runs MULTI/EXEC only on keys of one hash slot. Put a hash
// tag in Config.Prefix (for example "idem:{balances}:") and in the keys the
// handler writes.
//
// The driver implements atomic mode, the dead-letter store and the stats
// counters, so an idem.Consumer (and the Kafka and JetStream adapters) can
// run on Redis alone. It has no ordering guard, lease mode or outbox.
package redisstore

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// Errors of the Redis driver.
var (
	// ErrAborted matches a commit that Redis refused because a key the
	// transaction WATCHed changed: a key the handler watched, or the
	// marker (the transaction outlived its lock and another applied the
	// message). Nothing was applied; retry the delivery.
	ErrAborted = errors.New("redisstore: transaction aborted: a watched key changed")
	// ErrExecPartial matches a commit whose EXEC ran but in which a queued
	// command failed. Redis applied the other commands, the markers
	// included; see the package documentation.
	ErrExecPartial = errors.New("redisstore: a queued command failed inside EXEC; the other commands and the markers were applied")
	// ErrLockBusy matches a marker insert or sequence read that found the
	// key locked by a concurrent transaction, inside a transaction in
	// which Tx.Watch was called before (a caller's transaction given to
	// ProcessTx, say). Waiting would mean dropping the caller's watches,
	// so it fails instead. Roll back and retry the transaction.
	ErrLockBusy = errors.New("redisstore: message locked by a concurrent transaction")
)

// Config configures the driver. The zero value is valid.
type Config struct {
	// Prefix starts every key the driver writes. 1–64 bytes of printable
	// ASCII without spaces. Default "idem:".
	Prefix string
	// LockTTL is how long a transaction's lock on a message outlives a
	// process that died holding it. A live transaction that runs longer
	// loses its lock and cannot commit (ErrAborted). Default 30s.
	LockTTL time.Duration
	// MarkerTTL, if positive, expires markers that long after they were
	// written: the window in which a redelivery is recognised. Zero keeps
	// them until deleted.
	MarkerTTL time.Duration
}

// Driver implements driver.Driver[*redisstore.Tx].
type Driver struct {
	client    *redis.Client
	prefix    string
	lockTTL   time.Duration
	markerTTL time.Duration
}

var _ driver.Driver[*Tx] = (*Driver)(nil)

// New returns a driver over client. It does not touch the server until the
// first transaction.
func New(client *redis.Client, cfg *Config) (*Driver, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: redisstore: nil client", idem.ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	d := &Driver{client: client, prefix: cfg.Prefix, lockTTL: cfg.LockTTL, markerTTL: cfg.MarkerTTL}
	if d.prefix == "" {
		d.prefix = "idem:"
	}
	if err := checkPrefix(d.prefix); err != nil {
		return nil, fmt.Errorf("%w: %w", idem.ErrInvalidConfig, err)
	}
	if d.lockTTL == 0 {
		d.lockTTL = 30 * time.Second
	}
	if d.lockTTL < time.Millisecond {
		return nil, fmt.Errorf("%w: redisstore: LockTTL %v is below 1ms", idem.ErrInvalidConfig, cfg.LockTTL)
	}
	if d.markerTTL < 0 {
		return nil, fmt.Errorf("%w: redisstore: MarkerTTL %v is negative", idem.ErrInvalidConfig, cfg.MarkerTTL)
	}
	return d, nil
}

func checkPrefix(p string) error {
	if len(p) > 64 {
		return fmt.Errorf("redisstore: Prefix is %d bytes; the maximum is 64", len(p))
	}
	for i := 0; i < len(p); i++ {
		if c := p[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("redisstore: Prefix has %q at offset %d; allowed is printable ASCII without spaces", c, i)
		}
	}
	return nil
}

// MarkerKey returns the key of the marker of (handler, messageID): the
// prefix, "m:", the handler name, "|" (never part of a handler name) and
// the message ID. It holds the SHA-256 of the payload.
func (d *Driver) MarkerKey(handler, messageID string) string {
	return d.prefix + "m:" + handler + "|" + messageID
}

// lockKey returns the key of the lock on the marker of (handler,
// messageID).
func (d *Driver) lockKey(handler, messageID string) string {
	return d.prefix + "lm:" + handler + "|" + messageID
}

// Migrate checks that the server answers. Redis needs no schema.
func (d *Driver) Migrate(ctx context.Context) error {
	if err := d.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redisstore: ping: %w", err)
	}
	return nil
}

// Tx is a transaction on one connection of the client: reads run at once,
// writes are queued and run at commit in one MULTI/EXEC with the markers.
// A Tx is not safe for concurrent use.
type Tx struct {
	d     *Driver
	conn  *redis.Conn
	queue redis.Pipeliner
	token string
	// claims are the keys this transaction holds the lock of, by the key
	// the lock guards (a marker or a sequence), in the order taken.
	claims map[string]*claim
	order  []*claim
	// watching: some key is WATCHed on conn. userWatched: the caller
	// watched keys through Watch, whose reads the driver cannot check
	// again, so it must never drop the watches.
	watching, userWatched bool
	done                  bool
}

// claim is a key guarded by a lock this transaction holds: the key was
// WATCHed before it was read, and must still read seen (absent when
// !exists) at commit for the transaction to be valid.
type claim struct {
	key, lock string
	seen      string
	exists    bool
	// write, when hasWrite, is what the commit stores in key. marker
	// marks a marker (which expires after Config.MarkerTTL).
	write    []byte
	hasWrite bool
	marker   bool
}

// Conn returns the transaction's connection. Commands on it run at once:
// use it for reads, and call Watch before reading a key the handler's
// writes depend on. Writes belong in Queue.
func (tx *Tx) Conn() *redis.Conn { return tx.conn }

// Queue returns where the handler's writes go: commands issued on it are
// queued and run at commit, in one MULTI/EXEC with the markers. Their
// results are set only once Commit returned; do not call Exec on it.
func (tx *Tx) Queue() redis.Pipeliner { return tx.queue }

// Watch WATCHes keys on the transaction's connection: if any of them
// changes before the commit, the commit fails with ErrAborted and nothing
// is applied. Call it before reading a key whose value the handler's
// writes depend on.
func (tx *Tx) Watch(ctx context.Context, keys ...string) error {
	if len(keys) == 0 {
		return nil
	}
	tx.watching, tx.userWatched = true, true
	if err := tx.conn.Do(ctx, watchArgs(keys)...).Err(); err != nil {
		return fmt.Errorf("redisstore: watch: %w", err)
	}
	return nil
}

func watchArgs(keys []string) []any {
	args := make([]any, 0, len(keys)+1)
	args = append(args, "watch")
	for _, k := range keys {
		args = append(args, k)
	}
	return args
}

// Begin implements driver.Driver. It takes a connection from the client's
// pool, which it holds until Commit or Rollback.
func (d *Driver) Begin(ctx context.Context) (*Tx, error) {
	var b [16]byte
	if _, err := crand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("redisstore: lock token: %w", err)
	}
	conn := d.client.Conn()
	return &Tx{d: d, conn: conn, queue: conn.TxPipeline(), token: hex.EncodeToString(b[:]), claims: map[string]*claim{}}, nil
}

// acquireScript walks (key, lock) pairs in order. In marker mode (ARGV[3]
// "m") a key that exists is reported as 1 and its value, and its lock is
// not taken. Otherwise the lock is taken (or, if this transaction's,
// extended) and 0 reported with the key's value ("" when absent); if
// another transaction holds the lock it reports 2 and stops. ARGV: token,
// lock TTL in milliseconds, mode.
var acquireScript = redis.NewScript(`
local out = {}
for i = 1, #KEYS, 2 do
  local v = redis.call('GET', KEYS[i])
  if v and ARGV[3] == 'm' then
    out[#out+1] = 1
    out[#out+1] = v
  else
    local l = redis.call('GET', KEYS[i+1])
    if l == ARGV[1] then
      redis.call('PEXPIRE', KEYS[i+1], ARGV[2])
    elseif l or not redis.call('SET', KEYS[i+1], ARGV[1], 'NX', 'PX', ARGV[2]) then
      out[#out+1] = 2
      out[#out+1] = ''
      return out
    end
    out[#out+1] = 0
    out[#out+1] = v or ''
  end
end
return out
`)

// verifyScript checks, for (key, lock) pairs, that each key still holds
// the value seen (ARGV[2+i], "" for absent) and each lock still holds the
// token ARGV[1], whose expiry it extends to ARGV[2] milliseconds. It
// returns 1 if all do.
var verifyScript = redis.NewScript(`
for i = 1, #KEYS, 2 do
  local v = redis.call('GET', KEYS[i]) or ''
  if v ~= ARGV[2 + (i+1)/2] or redis.call('GET', KEYS[i+1]) ~= ARGV[1] then return 0 end
  redis.call('PEXPIRE', KEYS[i+1], ARGV[2])
end
return 1
`)

// releaseScript deletes the locks in KEYS that hold the token ARGV[1].
var releaseScript = redis.NewScript(`
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
return 0
`)

// acquired is what acquire found for one key.
type acquired struct {
	held   bool   // the lock is this transaction's
	value  string // the key's value, "" when absent
	exists bool
}

// acquire WATCHes keys, then takes their locks in order (see
// acquireScript). Where another transaction holds a lock it waits, with
// backoff, and tries again: the locks already taken stay held (a prefix in
// key order, so no cycle of waits can form); the watches are dropped while
// waiting and, on the next pass, taken again and the claims made before
// checked unchanged. In a transaction the caller watched keys in, it does
// not wait: it fails with ErrLockBusy.
func (tx *Tx) acquire(ctx context.Context, keys, locks []string, markers bool) ([]acquired, error) {
	if tx.done {
		return nil, errors.New("redisstore: transaction is finished")
	}
	mode := "s"
	if markers {
		mode = "m"
	}
	pairs := make([]string, 0, 2*len(keys))
	for i, k := range keys {
		pairs = append(pairs, k, locks[i])
	}
	ttl := tx.d.lockTTL.Milliseconds()
	wait := 200 * time.Microsecond
	recheck := false
	for {
		pipe := tx.conn.Pipeline()
		watch := keys
		var verify *redis.Cmd
		if recheck && len(tx.claims) > 0 {
			// Claims of earlier calls lost their watches while this one
			// waited: watch them again, then check nothing moved.
			vkeys := make([]string, 0, 2*len(tx.order))
			vargs := make([]any, 0, 2+len(tx.order))
			vargs = append(vargs, tx.token, ttl)
			watch = append([]string(nil), keys...)
			for _, c := range tx.order {
				if tx.claims[c.key] != c {
					continue // dropped
				}
				watch = append(watch, c.key)
				vkeys = append(vkeys, c.key, c.lock)
				vargs = append(vargs, c.seen)
			}
			pipe.Do(ctx, watchArgs(watch)...)
			verify = verifyScript.EvalSha(ctx, pipe, vkeys, vargs...)
		} else {
			pipe.Do(ctx, watchArgs(watch)...)
		}
		res := acquireScript.EvalSha(ctx, pipe, pairs, tx.token, ttl, mode)
		_, err := pipe.Exec(ctx)
		tx.watching = true
		if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			if err := loadScripts(ctx, tx.conn); err != nil {
				return nil, err
			}
			continue
		}
		if verify != nil {
			if ok, err := verify.Int(); err != nil {
				return nil, fmt.Errorf("redisstore: check claims: %w", err)
			} else if ok != 1 {
				return nil, fmt.Errorf("redisstore: a lock of this transaction expired while it waited: %w", ErrAborted)
			}
		}
		vals, err := res.Slice()
		if err != nil {
			return nil, fmt.Errorf("redisstore: take locks: %w", err)
		}
		out := make([]acquired, len(keys))
		blocked := false
		for k := 0; 2*k+1 < len(vals); k++ {
			code, _ := vals[2*k].(int64)
			v, _ := vals[2*k+1].(string)
			switch code {
			case 0:
				out[k] = acquired{held: true, value: v, exists: v != ""}
				if _, ok := tx.claims[keys[k]]; !ok {
					c := &claim{key: keys[k], lock: locks[k], seen: v, exists: v != "", marker: markers}
					tx.claims[keys[k]] = c
					tx.order = append(tx.order, c)
				}
			case 1:
				out[k] = acquired{value: v, exists: true}
				// A lock taken on an earlier pass expired, and another
				// transaction applied the message meanwhile.
				tx.dropClaim(keys[k])
			default:
				tx.dropClaim(keys[k])
				blocked = true
			}
		}
		if !blocked {
			return out, nil
		}
		if tx.userWatched {
			return nil, ErrLockBusy
		}
		if err := tx.conn.Do(ctx, "unwatch").Err(); err != nil {
			return nil, fmt.Errorf("redisstore: unwatch: %w", err)
		}
		tx.watching, recheck = false, true
		t := time.NewTimer(wait/2 + rand.N(wait/2+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("redisstore: waiting for a concurrent transaction: %w", ctx.Err())
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// dropClaim forgets the claim on key (its lock, if still this
// transaction's, is released at the end).
func (tx *Tx) dropClaim(key string) {
	c, ok := tx.claims[key]
	if !ok {
		return
	}
	delete(tx.claims, key)
	c.hasWrite = false
	// Keep it in order so that its lock is released with the others.
}

func loadScripts(ctx context.Context, c redis.Scripter) error {
	for _, s := range []*redis.Script{acquireScript, verifyScript} {
		if err := s.Load(ctx, c).Err(); err != nil {
			return fmt.Errorf("redisstore: load script: %w", err)
		}
	}
	return nil
}

// MarkerInsert implements driver.Driver.
func (d *Driver) MarkerInsert(ctx context.Context, tx *Tx, p *driver.MarkerInsertParams) (driver.MarkerInsertResult, error) {
	res, err := d.MarkerInsertMany(ctx, tx, &driver.MarkerInsertManyParams{
		Handler:       p.Handler,
		MessageIDs:    []string{p.MessageID},
		PayloadHashes: [][]byte{p.PayloadHash},
	})
	if err != nil {
		return driver.MarkerInsertResult{}, err
	}
	return res[0], nil
}

// MarkerInsertMany implements driver.Driver. It WATCHes the markers, then
// takes their locks in ID order with one script; where another transaction
// holds a lock it waits (polling, with backoff) and tries again.
func (d *Driver) MarkerInsertMany(ctx context.Context, tx *Tx, p *driver.MarkerInsertManyParams) ([]driver.MarkerInsertResult, error) {
	if tx == nil {
		return nil, errors.New("redisstore: nil transaction")
	}
	out := make([]driver.MarkerInsertResult, len(p.MessageIDs))
	var keys, locks []string
	var idx []int // position in p of each key
	for i, id := range p.MessageIDs {
		m := d.MarkerKey(p.Handler, id)
		if c, ok := tx.claims[m]; ok && c.hasWrite {
			// This transaction inserted it already: as with a row it
			// inserted, the second insert finds it.
			out[i].ExistingHash = c.write
			continue
		}
		keys = append(keys, m)
		locks = append(locks, d.lockKey(p.Handler, id))
		idx = append(idx, i)
	}
	if len(keys) == 0 {
		return out, nil
	}
	got, err := tx.acquire(ctx, keys, locks, true)
	if err != nil {
		return nil, fmt.Errorf("redisstore: insert markers of %q: %w", p.Handler, err)
	}
	for k, a := range got {
		i := idx[k]
		if !a.held {
			out[i].ExistingHash = []byte(a.value)
			continue
		}
		c := tx.claims[keys[k]]
		c.write, c.hasWrite = p.PayloadHashes[i], true
		out[i].Inserted = true
	}
	return out, nil
}

// MarkerDelete implements driver.MarkerDeleter: the markers this
// transaction inserted are not written at commit.
func (d *Driver) MarkerDelete(ctx context.Context, tx *Tx, p *driver.MarkerDeleteParams) error {
	for _, id := range p.MessageIDs {
		if c, ok := tx.claims[d.MarkerKey(p.Handler, id)]; ok && c.marker {
			c.hasWrite = false
		}
	}
	return nil
}

// Commit implements driver.Driver: one MULTI/EXEC with the queued writes,
// the markers and sequences and the release of the locks. On any error
// the transaction is over: its locks are released and its connection
// returned.
func (d *Driver) Commit(ctx context.Context, tx *Tx) error {
	if tx == nil || tx.done {
		return errors.New("redisstore: commit of a finished transaction")
	}
	locks := make([]string, 0, len(tx.order))
	for _, c := range tx.order {
		locks = append(locks, c.lock)
		if !c.hasWrite {
			continue
		}
		var ttl time.Duration
		if c.marker {
			ttl = d.markerTTL
		}
		tx.queue.Set(ctx, c.key, c.write, ttl)
	}
	if len(locks) > 0 {
		// EVAL, not EVALSHA: inside MULTI a missing script would fail
		// only this command, and the locks would stay until they expire.
		releaseScript.Eval(ctx, tx.queue, locks, tx.token)
	}
	if tx.queue.Len() == 0 {
		return d.finish(ctx, tx, false)
	}
	cmds, err := tx.queue.Exec(ctx)
	switch {
	case err == nil:
		tx.watching = false // EXEC drops the watches
		return d.finish(ctx, tx, false)
	case errors.Is(err, redis.TxFailedErr):
		tx.watching = false
		return errors.Join(fmt.Errorf("redisstore: commit: %w", ErrAborted), d.finish(ctx, tx, true))
	case execRan(cmds):
		tx.watching = false
		if err := firstFailure(cmds); err != nil {
			return errors.Join(fmt.Errorf("redisstore: commit: %w: %w", ErrExecPartial, err), d.finish(ctx, tx, false))
		}
		// Only queued reads that found nothing (redis.Nil).
		return d.finish(ctx, tx, false)
	}
	// The connection failed: the EXEC may or may not have run. Release the
	// locks if still ours (a no-op if it ran), so a redelivery need not
	// wait for them to expire.
	return errors.Join(fmt.Errorf("redisstore: commit: %w", err), d.finish(ctx, tx, true))
}

// execRan reports whether the EXEC itself answered, so that any error came
// from the queued commands rather than the connection.
func execRan(cmds []redis.Cmder) bool {
	for _, c := range cmds {
		if err := c.Err(); err == nil || errors.Is(err, redis.Nil) {
			return true
		}
	}
	return false
}

// firstFailure returns the first error of a queued command other than
// redis.Nil.
func firstFailure(cmds []redis.Cmder) error {
	for _, c := range cmds {
		if err := c.Err(); err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("%s: %w", c.Name(), err)
		}
	}
	return nil
}

// Rollback implements driver.Driver: it discards the queued writes,
// releases the transaction's locks and returns its connection.
func (d *Driver) Rollback(ctx context.Context, tx *Tx) error {
	if tx == nil || tx.done {
		return nil
	}
	return d.finish(ctx, tx, true)
}

// finish ends tx: it releases its locks if asked, drops its watches and
// returns its connection to the pool.
func (d *Driver) finish(ctx context.Context, tx *Tx, release bool) error {
	tx.done = true
	tx.queue.Discard()
	ctx = context.WithoutCancel(ctx)
	var errs []error
	release = release && len(tx.order) > 0
	if release || tx.watching {
		pipe := tx.conn.Pipeline()
		if release {
			locks := make([]string, len(tx.order))
			for i, c := range tx.order {
				locks[i] = c.lock
			}
			releaseScript.Eval(ctx, pipe, locks, tx.token)
		}
		if tx.watching {
			pipe.Do(ctx, "unwatch")
		}
		if _, err := pipe.Exec(ctx); err != nil {
			errs = append(errs, fmt.Errorf("redisstore: release locks: %w", err))
		}
	}
	if err := tx.conn.Close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
