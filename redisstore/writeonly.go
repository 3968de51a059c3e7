package redisstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

var _ driver.CommitMarkerInserter[*Tx] = (*Driver)(nil)

// ErrReadInWriteOnly matches a read through a transaction of the
// write-only path (Config.WriteOnly): Tx.Watch, a version, or a commit
// after the handler took Tx.Conn. Nothing of the transaction is applied.
// It wraps idem.ErrInvalidConfig: the handler reads, so it needs a driver
// without WriteOnly. It is permanent (idem.IsPermanent): retrying cannot
// help, so a Consumer dead-letters the message at once with this reason
// instead of spending its attempts.
var ErrReadInWriteOnly = idem.Permanent(fmt.Errorf("%w: redisstore: a handler read through its transaction on a WriteOnly driver (Tx.Conn, Tx.Watch or a version); use a driver without WriteOnly for it", idem.ErrInvalidConfig))

// ErrNotScriptable matches a commit on the write-only path whose queued
// commands include one that cannot run inside a script (EVALSHA, MULTI,
// SUBSCRIBE…: Redis flags them noscript) or one the server does not know.
// Nothing was sent. It wraps idem.ErrInvalidConfig: such a handler needs a
// driver without WriteOnly. Like ErrReadInWriteOnly it is permanent.
var ErrNotScriptable = idem.Permanent(fmt.Errorf("%w: redisstore: a queued command cannot run inside a script; use a driver without WriteOnly for this handler", idem.ErrInvalidConfig))

// maxScriptArgs bounds the arguments of one queued command on the
// write-only path, its name included: the script hands them to
// redis.pcall with Lua's unpack, which needs room for them on a stack of
// 8,000 slots (LUAI_MAXCSTACK) that already holds its own 3 arguments.
// One more and unpack fails inside the script, where the marker and the
// commands before it were already written.
const maxScriptArgs = 8000 - 3

// atCommit is the marker of a write-only transaction: the commit's script
// checks it and writes it, with the queued commands.
type atCommit struct {
	key     string
	applied []byte // the marker's value once applied: appliedPrefix, hash
	// read: the handler took Tx.Conn; the commit refuses.
	read bool
}

// BeginMarkerAtCommit implements driver.CommitMarkerInserter. With
// Config.WriteOnly it returns a transaction that holds nothing: its
// writes are only queued, and Commit checks the marker and applies them
// with it in one script call. Without, it declines.
func (d *Driver) BeginMarkerAtCommit(ctx context.Context, p *driver.MarkerInsertParams) (*Tx, bool, error) {
	if !d.writeOnly {
		return nil, false, nil
	}
	applied := make([]byte, 0, len(appliedPrefix)+len(p.PayloadHash))
	applied = append(append(applied, appliedPrefix...), p.PayloadHash...)
	return &Tx{d: d, queue: d.client.Pipeline(), claims: map[string]*claim{},
		at: &atCommit{key: d.MarkerKey(p.Handler, p.MessageID), applied: applied}}, true, nil
}

// readable returns ErrReadInWriteOnly for a transaction of the write-only
// path, and nil for any other.
func (tx *Tx) readable() error {
	if tx.at != nil {
		tx.at.read = true
		return ErrReadInWriteOnly
	}
	return nil
}

// commitScript checks a write-only transaction's marker and, if there is
// none, writes it and runs the queued commands, in one call. KEYS[1]: the
// marker. ARGV: the marker's applied value, its TTL in milliseconds ("0":
// none), then per command its argument count and its arguments. It
// returns {1, hash} for an applied marker, {2} for one a transaction of
// the WATCH path holds, {3, value} for a string that is not a marker's
// value (see pendingValue), {4, type} for a key of another type, and
// otherwise {0} followed by the position and error of each command that
// failed.
//
// The marker is written before the commands, so that nothing the script
// applies can be without it, and only once every command's arguments
// unpacked (a script that fails midway keeps what it wrote). A command
// that fails does not stop the others, as in EXEC (redis.pcall).
var commitScript = redis.NewScript(`
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' and v.err then
  if string.sub(v.err, 1, 10) == 'WRONGTYPE ' then return {4, redis.call('TYPE', KEYS[1])['ok']} end
  return v
end
if v then
  local kind = string.sub(v, 1, 2)
  if kind == 'd:' then return {1, string.sub(v, 3)} end
  if kind == 'p:' and #v > 2 then
    -- Every hold expires: one without an expiry was set by hand.
    if redis.call('PTTL', KEYS[1]) == -1 then return {3, v} end
    return {2}
  end
  return {3, v}
end
-- Every command must unpack before anything is written: an unpack that
-- fails below would leave the marker and the commands before it.
local a = 3
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  select('#', unpack(ARGV, a + 1, a + n))
  a = a + n + 1
end
if ARGV[2] == '0' then
  redis.call('SET', KEYS[1], ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
local out = {0}
local c = 0
a = 3
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  c = c + 1
  local r = redis.pcall(unpack(ARGV, a + 1, a + n))
  if type(r) == 'table' and r.err then
    out[#out + 1] = c
    out[#out + 1] = r.err
  end
  a = a + n + 1
end
return out
`)

// commitAt commits a write-only transaction: one script call, repeated
// while a transaction of the WATCH path holds the marker.
func (d *Driver) commitAt(ctx context.Context, tx *Tx) error {
	defer func() { _ = d.finish(ctx, tx, false) }()
	if tx.at.read {
		return fmt.Errorf("redisstore: commit: the handler took Tx.Conn: %w", ErrReadInWriteOnly)
	}
	cmds := tx.queue.Cmds()
	if err := d.scriptable(ctx, cmds); err != nil {
		return fmt.Errorf("redisstore: commit: %w", err)
	}
	args := []any{tx.at.applied, d.markerTTL.Milliseconds()}
	for _, c := range cmds {
		a := c.Args()
		if len(a) > maxScriptArgs {
			return fmt.Errorf("redisstore: commit: %s has %d arguments; a write-only transaction takes at most %d a command: %w",
				c.Name(), len(a), maxScriptArgs, idem.ErrInvalidConfig)
		}
		args = append(args, len(a))
		args = append(args, a...)
	}
	keys := []string{tx.at.key}
	wait := 200 * time.Microsecond
	for {
		res, err := commitScript.Run(ctx, d.client, keys, args...).Slice()
		if err != nil {
			// A failed connection: the script may or may not have
			// run. A redelivery finds the marker if it did.
			return fmt.Errorf("redisstore: commit: %w", err)
		}
		kind, _ := res[0].(int64)
		switch kind {
		case 0:
			return partial(cmds, res[1:])
		case 1:
			h, _ := res[1].(string)
			return &driver.MarkerExistsError{ExistingHash: []byte(h)}
		case 2:
			// A transaction of the WATCH path holds the message: wait
			// until it commits or lets go. This one holds nothing, so
			// no other waits for it.
			t := time.NewTimer(wait/2 + rand.N(wait/2+1))
			select {
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("redisstore: commit: waiting for a concurrent transaction: %w", ctx.Err())
			case <-t.C:
			}
			wait = min(2*wait, 50*time.Millisecond)
		case 3:
			v, _ := res[1].(string)
			return fmt.Errorf("redisstore: commit: key %q holds %q: %w", tx.at.key, v, ErrNotMarker)
		case 4:
			t, _ := res[1].(string)
			return fmt.Errorf("redisstore: commit: key %q holds a %s: %w", tx.at.key, t, ErrNotMarker)
		default:
			return fmt.Errorf("redisstore: commit: key %q: the script answered %v", tx.at.key, res)
		}
	}
}

// partial sets the errors the script reported (position, message) on
// their commands and returns them as ErrExecPartial, or nil if there are
// none.
func partial(cmds []redis.Cmder, fails []any) error {
	var first error
	for i := 0; i+1 < len(fails); i += 2 {
		n, _ := fails[i].(int64)
		msg, _ := fails[i+1].(string)
		if n < 1 || int(n) > len(cmds) {
			return fmt.Errorf("redisstore: commit: the script reported command %d of %d", n, len(cmds))
		}
		c := cmds[n-1]
		err := errors.New(msg)
		c.SetErr(err)
		if first == nil {
			first = fmt.Errorf("%s (command %s of the transaction): %w", c.Name(), strconv.FormatInt(n, 10), err)
		}
	}
	if first != nil {
		return fmt.Errorf("redisstore: commit: %w: %w", ErrExecPartial, first)
	}
	return nil
}

// scriptable returns ErrNotScriptable, naming the command, if one of cmds
// cannot run inside a script. EXEC would refuse the same commands before
// running any (an unknown one) or run them where the script cannot (a
// command flagged noscript); the script would run the others and write the
// marker. The server's command table is read once per driver, on the
// first write-only commit.
func (d *Driver) scriptable(ctx context.Context, cmds []redis.Cmder) error {
	table, err := d.commandTable(ctx)
	if err != nil {
		return err
	}
	for _, c := range cmds {
		info, ok := table[c.Name()]
		switch {
		case !ok:
			return fmt.Errorf("%w: the server has no command %q", ErrNotScriptable, c.Name())
		case slices.Contains(info.Flags, "noscript"):
			return fmt.Errorf("%w: %s is refused inside a script", ErrNotScriptable, c.Name())
		}
	}
	return nil
}

// commandTable returns the server's commands by name, read with COMMAND
// on first use and kept; a failed read is tried again by the next commit.
func (d *Driver) commandTable(ctx context.Context) (map[string]*redis.CommandInfo, error) {
	d.commandsMu.Lock()
	defer d.commandsMu.Unlock()
	if d.commands == nil {
		table, err := d.client.Command(ctx).Result()
		if err != nil {
			return nil, fmt.Errorf("read the server's commands: %w", err)
		}
		d.commands = table
	}
	return d.commands, nil
}
