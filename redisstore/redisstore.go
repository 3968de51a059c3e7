// Package redisstore is idem's store driver for read models kept in Redis:
// atomic mode where the marker and the handler's writes commit in one
// MULTI/EXEC.
//
//	client := redis.NewClient(&redis.Options{
//		Addr: "127.0.0.1:6379",
//		// Redis before 8: see "Connections" below.
//		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
//	})
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
// A transaction takes a message by setting its marker, with SET NX PX, to
// a pending value of its own that expires after Config.LockTTL; it then
// WATCHes the marker and reads it back, all in one round trip. Its EXEC
// replaces the pending value with the payload hash. So:
//
//   - a redelivery after commit finds the hash: Duplicate (or Conflict if
//     it differs), and the handler is not called;
//   - a concurrent delivery of the same ID finds the pending value, waits
//     until the first transaction ends, then finds the hash (Duplicate) or
//     no marker (the first rolled back: it applies);
//   - a process that dies mid-transaction leaves only the pending value,
//     which expires after LockTTL; then the message can be applied again;
//   - a transaction that outlives its LockTTL cannot double-apply: whoever
//     takes the message over sets the marker, which the slow transaction
//     WATCHes, so its EXEC aborts.
//
// A batch takes its markers in message-ID order; where one is held by
// another transaction it lets go of those after it and waits, so
// overlapping batches cannot wait on each other in a cycle. Sequences of
// the ordering guard and write-side versions hold a number that must be
// read, so each has a lock key beside it, taken the same way by a script.
//
// # Handlers that only write
//
// With Config.WriteOnly, Process of a handler without an ordering guard
// takes no hold: the handler runs first, and the commit is one script
// call that reads the marker and, if the message is new, writes the
// marker and runs the queued commands. One round trip where the path
// above takes two. Of two concurrent deliveries the first to commit
// applies and the other is a Duplicate; a marker held by a transaction
// of the path above is waited for. The handler then runs for
// redeliveries too (its writes are dropped), so it must not read through
// its transaction: a read makes the commit fail with ErrReadInWriteOnly.
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
// # Connections
//
// Each transaction holds one connection of the client's pool from Begin to
// its end (WATCH state lives on a connection): size PoolSize to the number
// of messages processed at once. Against a server without maintenance
// notifications (Redis before 8), disable them in the client's options as
// above: go-redis's default, auto, mode then rewrites the client's shared
// options as each new connection starts, a data race once transactions
// open connections concurrently (the race detector reports it).
//
// New takes a *redis.Client: one server, or a primary found through
// Sentinel (redis.NewFailoverClient). Redis Cluster is not supported: its
// MULTI/EXEC covers the keys of one hash slot only.
//
// The driver implements atomic mode with batches, the ordering guard
// (version-only mode included), write-side versions, the dead-letter store
// and the stats counters, so an idem.Consumer (and the broker adapters) can
// run on Redis alone. It has no lease mode or outbox.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/redis.md
package redisstore

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// errNilTx is the error of a call given a nil *Tx.
var errNilTx = errors.New("redisstore: nil transaction")

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
	// ErrLockWait matches a wait for one key another transaction holds
	// that lasted over LockTTL, plus up to half as much at random, in a
	// transaction that holds locks of its own: Redis cannot see a lock
	// cycle (two transactions each waiting for a lock the other holds),
	// and the wait keeps the waiter's own locks alive, so a cycle ends
	// this way. Roll back and retry the transaction.
	ErrLockWait = errors.New("redisstore: waited too long for a concurrent transaction while holding locks")
	// ErrTooManyKeys matches a marker insert, sequence lock, version lock
	// or Tx.Watch that would make one transaction WATCH more keys than
	// Config.MaxWatchedKeys. Nothing was locked or watched for it. It
	// wraps idem.ErrInvalidConfig: the batch is too large for the store's
	// setting, and trying again will not help. An idem.Consumer then
	// decides the batch's deliveries one by one; a caller of
	// ProcessBatch splits the batch.
	ErrTooManyKeys = fmt.Errorf("%w: redisstore: too many keys for one transaction", idem.ErrInvalidConfig)
	// ErrNotMarker matches a marker insert or commit that found, at a
	// marker's key, something no transaction of the driver writes there:
	// a key of another type, or a string that is neither a pending value
	// ("p:" and a token, with an expiry) nor an applied one ("d:" and a
	// hash), the empty string included. It matches too a sequence or
	// version of another type, or its lock key holding a key of another
	// type or a string without an expiry. Another writer shares the
	// prefix, or the key was set by hand. Nothing is applied and the key
	// is left alone; the error names it. Delete or fix the key, then retry
	// the delivery.
	ErrNotMarker = errors.New("redisstore: not an idem marker")
)

// DefaultMaxWatchedKeys is Config.MaxWatchedKeys's default.
const DefaultMaxWatchedKeys = 2000

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
	// MaxWatchedKeys bounds the keys one transaction WATCHes: a batch of
	// N messages watches its N markers, plus one sequence per aggregate
	// under an ordering guard and one per version taken, plus the keys
	// given to Tx.Watch. Above it, the call that would watch more fails
	// with ErrTooManyKeys and watches nothing. A batch cannot be split
	// into several transactions without losing its atomicity with the
	// read model, so it is refused instead. The bound is there because
	// WATCH's cost grows with the square of the keys a connection watches
	// (Redis 7), and Redis runs one command at a time: one WATCH took
	// under 10 ms at 1,000 keys, 0.1 s at 2,000, 0.5 s at 5,000 and 2.2 s
	// at 10,000 here; a batch of 20,000 messages stalled the server for
	// about 5 s, and one of 40,000 held its locks until they expired.
	// Default DefaultMaxWatchedKeys (2,000); lower it where a 0.1 s stall
	// of the server matters. Negative is refused.
	MaxWatchedKeys int
	// WriteOnly declares that the handlers of processors over this
	// driver only write, through Tx.Queue: they never read through
	// their transaction (Tx.Conn, Tx.Watch, a write-side version).
	// Process of a handler without an ordering guard then takes the
	// write-only path: the handler runs first, and the commit checks
	// the marker and applies the queued writes with it in one script
	// call, one round trip where the WATCH path takes two. For a
	// message already applied the handler runs too, and its writes are
	// discarded (Duplicate or Conflict, as on the WATCH path). A
	// handler that reads anyway applies nothing: its commit fails with
	// ErrReadInWriteOnly. Batches, ProcessTx and handlers with an
	// ordering guard take the WATCH path whatever this says. Give
	// handlers that read a driver of their own without it (a Driver is
	// only its settings: two can share a client). Default false.
	WriteOnly bool
	// AllowEviction lets Migrate pass on a server whose eviction policy
	// may evict markers (see Migrate): for a server whose memory is sized
	// so that it never reaches maxmemory. A marker evicted is a message
	// applied again on its next redelivery. Default false.
	AllowEviction bool
}

// Driver implements driver.Driver[*redisstore.Tx].
type Driver struct {
	client     *redis.Client
	prefix     string
	lockTTL    time.Duration
	markerTTL  time.Duration
	maxKeys    int
	writeOnly  bool
	allowEvict bool
	// commands is the server's command table, read by the first
	// write-only commit (see scriptable).
	commandsMu sync.Mutex
	commands   map[string]*redis.CommandInfo
	// orphans are the holds of finished transactions that could not be
	// let go of (see releaseOrphans).
	orphans orphanHolds
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
	d := &Driver{client: client, prefix: cfg.Prefix, lockTTL: cfg.LockTTL, markerTTL: cfg.MarkerTTL, maxKeys: cfg.MaxWatchedKeys, writeOnly: cfg.WriteOnly, allowEvict: cfg.AllowEviction}
	if d.maxKeys < 0 {
		return nil, fmt.Errorf("%w: redisstore: MaxWatchedKeys %d is negative", idem.ErrInvalidConfig, cfg.MaxWatchedKeys)
	}
	if d.maxKeys == 0 {
		d.maxKeys = DefaultMaxWatchedKeys
	}
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
	if d.markerTTL < 0 || (d.markerTTL > 0 && d.markerTTL < time.Millisecond) {
		return nil, fmt.Errorf("%w: redisstore: MarkerTTL %v is neither 0 (keep) nor at least 1ms", idem.ErrInvalidConfig, cfg.MarkerTTL)
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
// the message ID. Once the message is applied it holds "d:" and the
// SHA-256 of the payload; while a transaction works on the message, "p:"
// and that transaction's token, with an expiry of Config.LockTTL.
func (d *Driver) MarkerKey(handler, messageID string) string {
	return d.prefix + "m:" + handler + "|" + messageID
}

// Migrate checks that the server answers and will not evict markers.
// Redis needs no schema. With a maxmemory set, a maxmemory-policy of
// allkeys-* may evict any key, and volatile-* any key with an expiry,
// markers included when Config.MarkerTTL gives them one: Migrate refuses
// those with an error wrapping idem.ErrInvalidConfig, unless
// Config.AllowEviction. A server that does not let the client read its
// configuration (CONFIG disabled or not permitted, as on some managed
// services) is not checked.
func (d *Driver) Migrate(ctx context.Context) error {
	if err := d.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redisstore: ping: %w", err)
	}
	if d.allowEvict {
		return nil
	}
	cfg, err := d.client.ConfigGet(ctx, "maxmemory*").Result()
	if err != nil {
		var rerr redis.Error
		if errors.As(err, &rerr) {
			return nil // CONFIG refused: nothing to check with
		}
		return fmt.Errorf("redisstore: read the eviction policy: %w", err)
	}
	return d.checkEviction(cfg["maxmemory"], cfg["maxmemory-policy"])
}

// checkEviction refuses an eviction policy that may evict markers.
func (d *Driver) checkEviction(maxmemory, policy string) error {
	if maxmemory == "" || maxmemory == "0" {
		return nil // no limit: nothing is evicted
	}
	policy = strings.ToLower(policy)
	if strings.HasPrefix(policy, "allkeys-") || (d.markerTTL > 0 && strings.HasPrefix(policy, "volatile-")) {
		return fmt.Errorf("%w: redisstore: the server runs with maxmemory %s and maxmemory-policy %s, which may evict markers, and a marker evicted is a message applied again on its next redelivery: set maxmemory-policy noeviction (writes then fail while memory is full, and are retried), or set Config.AllowEviction if memory is sized never to fill", idem.ErrInvalidConfig, maxmemory, policy)
	}
	return nil
}

// Tx is a transaction on one connection of the client: reads run at once,
// writes are queued and run at commit in one MULTI/EXEC with the markers.
// A Tx is not safe for concurrent use.
type Tx struct {
	d       *Driver
	conn    *redis.Conn
	queue   redis.Pipeliner
	token   string
	pending string // a marker's value while this transaction holds it
	// claims are the keys this transaction holds, by key, and in the
	// order taken.
	claims map[string]*claim
	order  []*claim
	// unsure are the keys (markers, locks) this transaction tried to
	// take without learning whether it did (the connection failed), each
	// with the value it holds if taken: a rollback lets go of them too,
	// each only if it holds that value.
	unsure []unsureKey
	// watching: some key is WATCHed on conn. userWatched: the caller
	// watched keys through Watch, whose reads the driver cannot check
	// again, so it must never drop the watches.
	watching, userWatched bool
	// foreign: among the keys WATCHed are markers other transactions
	// applied; see rewatch.
	foreign bool
	done    bool
	// userKeys counts the keys the caller gave Tx.Watch.
	userKeys int
	// at is the marker of a transaction of the write-only path (see
	// Config.WriteOnly), which holds no key and has no connection of
	// its own until the handler asks for one; nil on the WATCH path.
	at *atCommit
}

// checkKeys returns ErrTooManyKeys, naming what, if watching n more keys
// would take the transaction above Config.MaxWatchedKeys. It counts the
// keys held and the caller's, which the connection watches (or will again).
func (tx *Tx) checkKeys(n int, what string) error {
	if total := len(tx.claims) + tx.userKeys + n; total > tx.d.maxKeys {
		return fmt.Errorf("%w: %s would make it watch %d keys; Config.MaxWatchedKeys is %d (split the batch)", ErrTooManyKeys, what, total, tx.d.maxKeys)
	}
	return nil
}

// claim is a key this transaction holds. A marker is its own lock: it
// holds tx.pending until the commit writes it. A sequence or version has
// a lock key beside it, holding tx.token, and must still read seen ("" for
// absent) at commit. Either way the key was WATCHed before it was read.
type claim struct {
	key  string
	lock string // "" for a marker
	seen string
	// write, when hasWrite, is what the commit stores: the payload hash
	// of a marker, the new value of a sequence or version.
	write    []byte
	hasWrite bool
}

func (c *claim) marker() bool { return c.lock == "" }

// Conn returns the transaction's connection. Commands on it run at once:
// use it for reads, and call Watch before reading a key the handler's
// writes depend on. Writes belong in Queue.
//
// On the write-only path (Config.WriteOnly) the handler must not read:
// the transaction then refuses to commit, with ErrReadInWriteOnly.
func (tx *Tx) Conn() *redis.Conn {
	if tx.conn == nil {
		_ = tx.readable()
		tx.conn = tx.d.client.Conn()
	}
	return tx.conn
}

// Queue returns where the handler's writes go: commands issued on it are
// queued and run at commit, in one MULTI/EXEC with the markers. Their
// results are set only once Commit returned; do not call Exec on it.
func (tx *Tx) Queue() redis.Pipeliner { return tx.queue }

// Watch WATCHes keys on the transaction's connection: if any of them
// changes before the commit, the commit fails with ErrAborted and nothing
// is applied. Call it before reading a key whose value the handler's
// writes depend on.
func (tx *Tx) Watch(ctx context.Context, keys ...string) error {
	if tx == nil {
		return errNilTx
	}
	if len(keys) == 0 {
		return nil
	}
	if err := tx.readable(); err != nil {
		return fmt.Errorf("redisstore: watch: %w", err)
	}
	if err := tx.checkKeys(len(keys), "Watch"); err != nil {
		return err
	}
	tx.userKeys += len(keys)
	if tx.foreign {
		// Last chance to narrow the driver's watches: the caller's
		// cannot be dropped after this.
		if err := tx.rewatch(ctx); err != nil {
			return err
		}
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
// pool, which it holds until Commit or Rollback (WATCH state lives on a
// connection): size the pool to the number of messages processed at once.
func (d *Driver) Begin(ctx context.Context) (*Tx, error) {
	var b [16]byte
	if _, err := crand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("redisstore: lock token: %w", err)
	}
	d.releaseOrphans(ctx)
	conn := d.client.Conn()
	token := hex.EncodeToString(b[:])
	return &Tx{d: d, conn: conn, queue: conn.TxPipeline(), token: token, pending: pendingPrefix + token, claims: map[string]*claim{}}, nil
}

// A marker's value: pendingPrefix and the holder's token while a
// transaction holds it, appliedPrefix and the payload hash once applied.
// Any other value (the empty string included) is not a marker's:
// ErrNotMarker.
const (
	pendingPrefix = "p:"
	appliedPrefix = "d:"
)

// pendingValue reports whether v is a transaction's hold of a marker:
// pendingPrefix and a token, which is never empty. Such a value expires
// after Config.LockTTL, so it is waited on.
func pendingValue(v string) bool {
	return len(v) > len(pendingPrefix) && strings.HasPrefix(v, pendingPrefix)
}

// lockScript takes the locks in KEYS in order, or extends the ones this
// transaction holds, and returns how many it holds: all of them, or those
// before the first one another transaction holds. A key that is no
// transaction's lock (a key of another type, or a string without an
// expiry: every lock expires) would be waited on forever: for the i-th
// such key it returns -i. ARGV: token, lock TTL in milliseconds.
var lockScript = redis.NewScript(`
for i = 1, #KEYS do
  local l = redis.pcall('GET', KEYS[i])
  if type(l) == 'table' and l.err then return -i end
  if l == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
  elseif l then
    if redis.call('PTTL', KEYS[i]) == -1 then return -i end
    return i - 1
  elseif not redis.call('SET', KEYS[i], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return i - 1
  end
end
return #KEYS
`)

// verifyScript checks that this transaction still holds its claims and,
// if ARGV[2] is not "0", extends them by that many milliseconds. ARGV:
// token, TTL, then per claim its kind and the value it must read: "m" and
// the pending value for a marker (one key), "s" and the value seen for a
// sequence (two keys: it, its lock). It returns 1 if all hold.
//
// Extending a marker changes a key the transaction WATCHes, which would
// abort its own EXEC: extend before the WATCH, check after it.
var verifyScript = redis.NewScript(`
local k = 1
local ext = ARGV[2] ~= '0'
for a = 3, #ARGV, 2 do
  if ARGV[a] == 'm' then
    if redis.call('GET', KEYS[k]) ~= ARGV[a+1] then return 0 end
    if ext then redis.call('PEXPIRE', KEYS[k], ARGV[2]) end
    k = k + 1
  else
    if (redis.call('GET', KEYS[k]) or '') ~= ARGV[a+1] or redis.call('GET', KEYS[k+1]) ~= ARGV[1] then return 0 end
    if ext then redis.call('PEXPIRE', KEYS[k+1], ARGV[2]) end
    k = k + 2
  end
end
return 1
`)

// noExpiryScript returns 1 if KEYS[1] still holds ARGV[1] and has no
// expiry, else 0: read together, so that a hold its transaction replaced
// meanwhile by an applied marker (which need not expire) is not taken for
// one without an expiry.
var noExpiryScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('PTTL', KEYS[1]) == -1 then return 1 end
return 0
`)

// setNXScript sets each key in KEYS that does not exist to ARGV[1], to
// expire after ARGV[2] milliseconds, in order, and stops at the first that
// holds another transaction's pending value (one starting with ARGV[3]):
// the caller waits for that one and would let go of the keys after it, so
// taking them would only block other transactions for a round trip.
var setNXScript = redis.NewScript(`
for i = 1, #KEYS do
  if not redis.call('SET', KEYS[i], ARGV[1], 'NX', 'PX', ARGV[2]) then
    local v = redis.pcall('GET', KEYS[i])
    if type(v) == 'string' and v ~= ARGV[1] and #v > #ARGV[3] and string.sub(v, 1, #ARGV[3]) == ARGV[3] then return i - 1 end
  end
end
return #KEYS
`)

// releaseScript deletes each key in KEYS whose value is the matching ARGV.
// A key of another type (one a marker insert reported with ErrNotMarker)
// is not this transaction's: it is left alone, and does not keep the
// others from being let go of.
var releaseScript = redis.NewScript(`
for i = 1, #KEYS do
  if redis.pcall('GET', KEYS[i]) == ARGV[i] then redis.call('DEL', KEYS[i]) end
end
return 0
`)

// held returns the claims this transaction still holds, in the order
// taken.
func (tx *Tx) held() []*claim {
	out := make([]*claim, 0, len(tx.claims))
	for _, c := range tx.order {
		if tx.claims[c.key] == c {
			out = append(out, c)
		}
	}
	return out
}

func (tx *Tx) addClaim(c *claim) {
	tx.claims[c.key] = c
	tx.order = append(tx.order, c)
}

// waitFor runs attempt until it is not blocked. An attempt queues its
// commands on pipe and returns a function that reads their results and
// returns the key it waits for, one another transaction holds ("" when
// none). While blocked
// the transaction keeps what it holds, drops its watches and sleeps, with
// backoff; the next attempt first watches its claims again and checks that
// nothing moved (a lock that expired meanwhile: ErrAborted). In a
// transaction the caller watched keys in, it does not wait: ErrLockBusy;
// nor for longer than lockWaitLimit for one key while it holds locks:
// ErrLockWait.
//
// The bound is per key waited for, not for the whole call: a batch that
// trails others through its markers waits for one after another, each
// briefly, as their holders apply them, and that is progress however long
// it adds up to. A lock cycle waits on the same key throughout.
func (tx *Tx) waitFor(ctx context.Context, attempt func(pipe redis.Pipeliner) func() (string, error)) error {
	if tx.done {
		return errors.New("redisstore: transaction is finished")
	}
	if err := tx.readable(); err != nil {
		return err
	}
	ttl := tx.d.lockTTL.Milliseconds()
	wait := 200 * time.Microsecond
	recheck := false
	var (
		waitStart time.Time
		waitLimit time.Duration
		waitKey   string // the key waited for, since waitStart if set
	)
	for {
		pipe := tx.conn.Pipeline()
		var verify *redis.Cmd
		if held := tx.held(); recheck && len(held) > 0 {
			keys, watch, args := tx.verifyArgs(held, ttl)
			verifyScript.EvalSha(ctx, pipe, keys, args...) // extend
			pipe.Do(ctx, watchArgs(watch)...)
			args[1] = 0
			verify = verifyScript.EvalSha(ctx, pipe, keys, args...) // check
		}
		after := attempt(pipe)
		_, err := pipe.Exec(ctx)
		tx.watching = true
		if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			// The server lost its script cache (a restart, SCRIPT
			// FLUSH). The pipeline's WATCH ran although its script did
			// not, and a connection that writes a key it watches
			// aborts its own EXEC: drop the watches before the retry
			// writes those keys, and watch what is held again. The
			// caller's watches cannot be dropped (its commit would miss
			// a change of its keys), so its transaction starts over.
			if tx.userWatched {
				if err := loadScripts(ctx, tx.conn); err != nil {
					return err
				}
				return fmt.Errorf("redisstore: the server lost its scripts while the caller's keys were watched: %w", ErrAborted)
			}
			if err := tx.conn.Do(ctx, "unwatch").Err(); err != nil {
				return fmt.Errorf("redisstore: unwatch: %w", err)
			}
			tx.watching, recheck = false, true
			if err := loadScripts(ctx, tx.conn); err != nil {
				return err
			}
			continue
		}
		if verify != nil {
			if ok, err := verify.Int(); err != nil {
				return fmt.Errorf("redisstore: check claims: %w", err)
			} else if ok != 1 {
				return fmt.Errorf("redisstore: a lock of this transaction expired while it waited: %w", ErrAborted)
			}
		}
		blockedOn, err := after()
		if err != nil || blockedOn == "" {
			return err
		}
		if tx.userWatched {
			return ErrLockBusy
		}
		if blockedOn != waitKey {
			// Past the key waited for: it was applied, or this
			// transaction took it. Wait for the next one afresh, from
			// the shortest backoff.
			waitKey, waitStart, wait = blockedOn, time.Time{}, 200*time.Microsecond
		}
		if held := len(tx.held()); held > 0 {
			// Redis sees no lock cycle, and this wait keeps the
			// transaction's own locks alive: bound it, a little
			// differently for each transaction so that one of a cycle
			// gives up first.
			if waitStart.IsZero() {
				waitStart, waitLimit = time.Now(), lockWaitLimit(tx.d.lockTTL)
			} else if waited := time.Since(waitStart); waited > waitLimit {
				return fmt.Errorf("%w (%s, holding %d; a lock cycle?)", ErrLockWait, waited.Round(time.Millisecond), held)
			}
		}
		if err := tx.conn.Do(ctx, "unwatch").Err(); err != nil {
			return fmt.Errorf("redisstore: unwatch: %w", err)
		}
		tx.watching, recheck = false, true
		t := time.NewTimer(wait/2 + rand.N(wait/2+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("redisstore: waiting for a concurrent transaction: %w", ctx.Err())
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// lockWaitLimit returns how long a transaction that holds locks waits for
// another's before it fails with ErrLockWait: lockTTL, as long as its own
// locks would last unrenewed, plus up to half of it at random. Two
// transactions that each wait for a lock the other holds (a handler that
// takes two aggregates' versions in either order, say) would otherwise
// wait until their contexts end, renewing their locks.
func lockWaitLimit(lockTTL time.Duration) time.Duration {
	extra := rand.N(lockTTL/2 + 1)
	if lockTTL > math.MaxInt64-extra {
		return math.MaxInt64 // a LockTTL near "never": do not wrap around
	}
	return lockTTL + extra
}

// verifyArgs returns verifyScript's keys and arguments for the claims
// held (extending them by ttl milliseconds, or not if ttl is 0) and the
// keys to WATCH for them.
func (tx *Tx) verifyArgs(held []*claim, ttl int64) (keys, watch []string, args []any) {
	args = []any{tx.token, ttl}
	for _, c := range held {
		watch = append(watch, c.key)
		keys = append(keys, c.key)
		if c.marker() {
			args = append(args, "m", c.seen)
		} else {
			keys = append(keys, c.lock)
			args = append(args, "s", c.seen)
		}
	}
	return keys, watch, args
}

// rewatch narrows the connection's watches to the claims the transaction
// holds, and checks that it still holds them (ErrAborted if not).
//
// A marker insert WATCHes all of its markers and then reads them, in one
// pipeline but not atomically: another transaction's commit can apply a
// marker between the WATCH and the read. The read then shows it applied
// (a Duplicate, rightly), but the watch is dirty, and this transaction's
// EXEC would abort although nothing it holds changed. Markers applied
// elsewhere are not this transaction's business. So an insert that read
// one sets foreign, and before the commit's EXEC (or the caller's first
// Watch) the transaction UNWATCHes, watches only its own claims and reads
// them again, one round trip, so that a take-over after that still aborts
// the commit as it must. A transaction that only found duplicates and is
// rolled back never pays it. Once the caller watched keys, the watches
// cannot be dropped: rewatch does nothing, and such a commit can fail
// with ErrAborted (the delivery is retried).
func (tx *Tx) rewatch(ctx context.Context) error {
	if tx.userWatched {
		return nil
	}
	for range 2 {
		held := tx.held()
		pipe := tx.conn.Pipeline()
		pipe.Do(ctx, "unwatch")
		var verify *redis.Cmd
		if len(held) > 0 {
			keys, watch, args := tx.verifyArgs(held, 0)
			pipe.Do(ctx, watchArgs(watch)...)
			verify = verifyScript.EvalSha(ctx, pipe, keys, args...)
		}
		_, err := pipe.Exec(ctx)
		tx.watching = err != nil || len(held) > 0 // on a failed pipeline, not known
		if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			if err := loadScripts(ctx, tx.conn); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("redisstore: watch claims: %w", err)
		}
		if verify != nil {
			if ok, err := verify.Int(); err != nil {
				return fmt.Errorf("redisstore: check claims: %w", err)
			} else if ok != 1 {
				return fmt.Errorf("redisstore: a lock of this transaction expired: %w", ErrAborted)
			}
		}
		tx.foreign = false
		return nil
	}
	return errors.New("redisstore: watch claims: the server keeps losing its scripts")
}

func loadScripts(ctx context.Context, c redis.Scripter) error {
	for _, s := range []*redis.Script{lockScript, verifyScript, setNXScript} {
		if err := s.Load(ctx, c).Err(); err != nil {
			return fmt.Errorf("redisstore: load script: %w", err)
		}
	}
	return nil
}

// lockValues locks keys (each guarded by the lock at the same index), in
// order, and claims them with the values they hold. The keys are WATCHed
// after their locks are taken and read after that, so a write by a holder
// whose lock expired either shows in the value read or aborts the commit.
func (tx *Tx) lockValues(ctx context.Context, keys, locks []string) error {
	if err := tx.readable(); err != nil {
		// Nothing was sent: no key is in doubt.
		return err
	}
	if err := tx.checkKeys(len(keys), "locking "+plural(len(keys), "key")); err != nil {
		return err
	}
	err := tx.waitFor(ctx, func(pipe redis.Pipeliner) func() (string, error) {
		n := lockScript.EvalSha(ctx, pipe, locks, tx.token, tx.d.lockTTL.Milliseconds())
		pipe.Do(ctx, watchArgs(keys)...)
		gets := make([]*redis.StringCmd, len(keys))
		for i, k := range keys {
			gets[i] = pipe.Get(ctx, k)
		}
		return func() (string, error) {
			held, err := n.Int()
			if err != nil {
				return "", fmt.Errorf("redisstore: take locks: %w", err)
			}
			if held < 0 {
				return "", fmt.Errorf("redisstore: take locks: key %q is no lock (a key of another type, or one without an expiry): %w", locks[-held-1], ErrNotMarker)
			}
			for k := range held {
				v, err := gets[k].Result()
				if redis.HasErrorPrefix(err, "WRONGTYPE") {
					return "", fmt.Errorf("redisstore: read %q: a key of another type: %w", keys[k], ErrNotMarker)
				}
				if err != nil && !errors.Is(err, redis.Nil) {
					return "", fmt.Errorf("redisstore: read %q: %w", keys[k], err)
				}
				if _, ok := tx.claims[keys[k]]; !ok {
					tx.addClaim(&claim{key: keys[k], lock: locks[k], seen: v})
				}
			}
			if held < len(keys) {
				return locks[held], nil
			}
			return "", nil
		}
	})
	if err != nil {
		for k, l := range locks {
			if _, ok := tx.claims[keys[k]]; !ok {
				tx.unsure = append(tx.unsure, unsureKey{l, tx.token})
			}
		}
	}
	return err
}

// unsureKey is a key a transaction may hold, and the value it holds then.
type unsureKey struct{ key, val string }

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

// MarkerInsertMany implements driver.Driver in one round trip when no
// other transaction holds any of the markers: SET NX of each marker to
// this transaction's pending value, WATCH them, GET them. A marker that
// holds another transaction's pending value is waited for (see waitFor);
// the markers after it in ID order are not taken meanwhile (let go, if
// this transaction took them on an earlier pass), so that overlapping
// batches cannot wait on each other in a cycle, nor block each other on
// markers their holders are not ready to use.
func (d *Driver) MarkerInsertMany(ctx context.Context, tx *Tx, p *driver.MarkerInsertManyParams) ([]driver.MarkerInsertResult, error) {
	if tx == nil {
		return nil, errNilTx
	}
	out := make([]driver.MarkerInsertResult, len(p.MessageIDs))
	var keys []string
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
		idx = append(idx, i)
	}
	if len(keys) == 0 {
		return out, nil
	}
	if err := tx.checkKeys(len(keys), "inserting "+plural(len(keys), "marker")); err != nil {
		return nil, fmt.Errorf("redisstore: insert markers of %q: %w", p.Handler, err)
	}
	foreign := false // a marker applied by another transaction was watched
	err := tx.waitFor(ctx, func(pipe redis.Pipeliner) func() (string, error) {
		var set redis.Cmder
		if len(keys) == 1 {
			set = pipe.SetNX(ctx, keys[0], tx.pending, d.lockTTL)
		} else {
			// One command rather than one per marker: for a batch the
			// per-command cost, on both ends, is most of the work.
			set = setNXScript.EvalSha(ctx, pipe, keys, tx.pending, d.lockTTL.Milliseconds(), pendingPrefix)
		}
		pipe.Do(ctx, watchArgs(keys)...)
		mget := pipe.MGet(ctx, keys...)
		return func() (string, error) {
			foreign = false
			// A refused SET (out of memory, a replica) would read below
			// as a marker another transaction holds: waited on forever.
			if err := set.Err(); err != nil && !errors.Is(err, redis.Nil) {
				return "", err
			}
			// The caller below names the handler.
			vals, err := mget.Result()
			if err != nil {
				return "", err
			}
			if len(vals) != len(keys) {
				return "", fmt.Errorf("MGET returned %d values for %d keys", len(vals), len(keys))
			}
			gets := make([]string, len(vals))
			strs := make([]bool, len(vals)) // a string, "" included
			for k, v := range vals {
				// nil: no marker, or a key of another type.
				gets[k], strs[k] = v.(string)
			}
			blocked := -1
			for k, v := range gets {
				i := idx[k]
				switch {
				case blocked >= 0:
					// Past the first marker held elsewhere: let go of it
					// below if this transaction holds it.
				case v == tx.pending:
					c, ok := tx.claims[keys[k]]
					if !ok {
						c = &claim{key: keys[k], seen: tx.pending}
						tx.addClaim(c)
					}
					c.write, c.hasWrite = p.PayloadHashes[i], true
					out[i] = driver.MarkerInsertResult{Inserted: true}
				case strings.HasPrefix(v, appliedPrefix):
					// Applied; if this transaction held it on an earlier
					// pass, its hold expired and another applied it.
					delete(tx.claims, keys[k])
					out[i] = driver.MarkerInsertResult{ExistingHash: []byte(v[len(appliedPrefix):])}
					foreign = true
				case !strs[k]:
					// Gone since the SET (a hold let go of), or a key of
					// another type, which SET NX leaves and MGET reads as
					// nothing: that would be waited on forever.
					if t, err := tx.conn.Type(ctx, keys[k]).Result(); err != nil {
						return "", err
					} else if t != "none" && t != "string" {
						return "", fmt.Errorf("key %q holds a %s: %w", keys[k], t, ErrNotMarker)
					}
					blocked = k
				case pendingValue(v):
					// Every hold expires: one without an expiry was set
					// by hand, and would be waited on forever.
					if stuck, err := noExpiryScript.Eval(ctx, tx.conn, []string{keys[k]}, v).Int(); err != nil {
						return "", err
					} else if stuck == 1 {
						return "", fmt.Errorf("key %q holds %q without an expiry, which no transaction's hold lacks: %w", keys[k], v, ErrNotMarker)
					}
					blocked = k
				default:
					// The empty string too: it is no hold to wait for,
					// and SET NX leaves it.
					return "", fmt.Errorf("key %q holds %q: %w", keys[k], v, ErrNotMarker)
				}
			}
			if blocked < 0 {
				return "", nil
			}
			var let []string
			for k := blocked + 1; k < len(keys); k++ {
				if gets[k] == tx.pending {
					delete(tx.claims, keys[k])
					let = append(let, keys[k])
				}
			}
			if len(let) > 0 {
				args := make([]any, len(let))
				for i := range args {
					args[i] = tx.pending
				}
				if err := releaseScript.Run(ctx, tx.conn, let, args...).Err(); err != nil && !errors.Is(err, redis.Nil) {
					return "", fmt.Errorf("redisstore: let go of markers: %w", err)
				}
			}
			return keys[blocked], nil
		}
	})
	if err != nil {
		for _, k := range keys {
			if _, ok := tx.claims[k]; !ok {
				tx.unsure = append(tx.unsure, unsureKey{k, tx.pending})
			}
		}
		return nil, fmt.Errorf("redisstore: insert markers of %q: %w", p.Handler, err)
	}
	if foreign && !tx.userWatched {
		tx.foreign = true
	}
	return out, nil
}

// MarkerDelete implements driver.MarkerDeleter: the markers this
// transaction inserted are let go at commit instead of written.
func (d *Driver) MarkerDelete(ctx context.Context, tx *Tx, p *driver.MarkerDeleteParams) error {
	if tx == nil {
		return errNilTx
	}
	for _, id := range p.MessageIDs {
		if c, ok := tx.claims[d.MarkerKey(p.Handler, id)]; ok && c.marker() {
			c.hasWrite = false
		}
	}
	return nil
}

// Commit implements driver.Driver: one MULTI/EXEC with the queued writes,
// the markers, sequences and versions, and the release of the locks. On
// any error the transaction is over: what it held is let go and its
// connection returned.
//
// The writes and DELs of the claims need no check that they are still this
// transaction's: every claimed key is WATCHed, and another transaction
// can only have taken one over by writing it (a marker) or will only use
// it by writing it (a sequence), which aborts this EXEC or that one.
func (d *Driver) Commit(ctx context.Context, tx *Tx) error {
	if tx == nil || tx.done {
		return errors.New("redisstore: commit of a finished transaction")
	}
	if tx.at != nil {
		return d.commitAt(ctx, tx)
	}
	var dels []string
	var mset []any // markers, when they do not expire
	for _, c := range tx.held() {
		switch {
		case c.marker() && c.hasWrite:
			v := append([]byte(appliedPrefix), c.write...)
			if d.markerTTL > 0 {
				tx.queue.Set(ctx, c.key, v, d.markerTTL)
			} else {
				mset = append(mset, c.key, v)
			}
		case c.marker():
			dels = append(dels, c.key)
		case c.hasWrite:
			tx.queue.Set(ctx, c.key, c.write, 0)
			dels = append(dels, c.lock)
		default:
			dels = append(dels, c.lock)
		}
	}
	if len(mset) > 0 {
		tx.queue.MSet(ctx, mset...)
	}
	if len(dels) > 0 {
		tx.queue.Del(ctx, dels...)
	}
	if tx.queue.Len() == 0 {
		return d.finish(ctx, tx, false)
	}
	if tx.foreign {
		if err := tx.rewatch(ctx); err != nil {
			return errors.Join(fmt.Errorf("redisstore: commit: %w", err), d.finish(ctx, tx, true))
		}
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
	if redis.HasErrorPrefix(err, "EXECABORT") {
		// The server refused a command as it was queued (out of memory,
		// a replica's READONLY) and discarded the transaction: nothing
		// ran. That command's error says why, and whether it is an
		// outage.
		for _, c := range cmds {
			if cerr := c.Err(); cerr != nil && !errors.Is(cerr, redis.Nil) && !redis.HasErrorPrefix(cerr, "EXECABORT") {
				err = fmt.Errorf("%s: %w", c.Name(), cerr)
				break
			}
		}
	}
	// The connection failed, or the server discarded the transaction:
	// the EXEC may or may not have run. Let go of what is still this
	// transaction's (nothing, if it ran), so that a redelivery need not
	// wait for the holds to expire.
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

// Rollback implements driver.Driver: it discards the queued writes, lets
// go of what the transaction holds and returns its connection.
func (d *Driver) Rollback(ctx context.Context, tx *Tx) error {
	if tx == nil || tx.done {
		return nil
	}
	return d.finish(ctx, tx, true)
}

// finish ends tx: it lets go of its claims if asked (each only if still
// its own), drops its watches and returns its connection to the pool.
func (d *Driver) finish(ctx context.Context, tx *Tx, release bool) error {
	tx.done = true
	tx.queue.Discard()
	ctx = context.WithoutCancel(ctx)
	var errs []error
	held := tx.held()
	release = release && len(held)+len(tx.unsure) > 0
	// A transaction of the write-only path has no connection unless its
	// handler asked for one, and then holds and watches nothing.
	if tx.conn != nil && (release || tx.watching) {
		pipe := tx.conn.Pipeline()
		var (
			keys []string
			vals []any
		)
		if release {
			keys = make([]string, len(held))
			vals = make([]any, len(held))
			for i, c := range held {
				if c.marker() {
					keys[i], vals[i] = c.key, tx.pending
				} else {
					keys[i], vals[i] = c.lock, tx.token
				}
			}
			for _, u := range tx.unsure {
				keys, vals = append(keys, u.key), append(vals, u.val)
			}
			// EVAL, not EVALSHA: letting go must not depend on the
			// script cache.
			releaseScript.Eval(ctx, pipe, keys, vals...)
		}
		if tx.watching {
			pipe.Do(ctx, "unwatch")
		}
		if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
			errs = append(errs, fmt.Errorf("redisstore: release: %w", err))
			if release {
				d.orphans.add(keys, vals)
			}
		}
	}
	if tx.conn != nil {
		if err := tx.conn.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// orphanHolds are holds (keys, each with the value that says it is still
// the finished transaction's) that could not be let go of when their
// transaction ended: the server did not answer, as when it went down
// mid-commit. Left alone, a redelivery of their messages would wait for
// them to expire, LockTTL after they were taken.
type orphanHolds struct {
	n    atomic.Int32 // len(keys), read without the lock
	mu   sync.Mutex
	keys []string
	vals []any
}

// maxOrphanHolds bounds orphanHolds: past it, holds are left to expire
// (after LockTTL).
const maxOrphanHolds = 4096

func (o *orphanHolds) add(keys []string, vals []any) {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := min(len(keys), maxOrphanHolds-len(o.keys))
	if n <= 0 {
		return
	}
	o.keys = append(o.keys, keys[:n]...)
	o.vals = append(o.vals, vals[:n]...)
	o.n.Store(int32(len(o.keys)))
}

// releaseOrphans lets go of the orphan holds, each only if it is still
// the finished transaction's (the release script compares), and keeps
// them for the next transaction if the server does not answer yet. The
// first transaction after an outage runs it, so the redeliveries of the
// messages whose commits the outage cut off go ahead at once.
func (d *Driver) releaseOrphans(ctx context.Context) {
	if d.orphans.n.Load() == 0 {
		return
	}
	o := &d.orphans
	o.mu.Lock()
	keys, vals := o.keys, o.vals
	o.keys, o.vals = nil, nil
	o.n.Store(0)
	o.mu.Unlock()
	if len(keys) == 0 {
		return
	}
	if err := releaseScript.Eval(ctx, d.client, keys, vals...).Err(); err != nil && !errors.Is(err, redis.Nil) {
		o.add(keys, vals)
	}
}

// plural returns "n word" or "n words".
func plural(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return fmt.Sprintf("%d %ss", n, word)
}
