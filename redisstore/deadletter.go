package redisstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/driver"
)

var (
	_ driver.DeadLetterStore = (*Driver)(nil)
	_ driver.StatsStore      = (*Driver)(nil)
)

// Dead letters live under Prefix+"dl:": a counter "dl:seq" hands out IDs,
// each dead letter is the hash "dl:<id>", the sorted set "dl:ids" lists
// the IDs in order, the hash "dl:keys" maps "handler|message ID" to the ID
// (so a second failure of a message updates its dead letter; a delivery
// that did not decode is keyed by its source and a hash of its payload and
// error),
// and the list "dl:log:<id>" is a dead letter's history. Scripts keep each
// change atomic. Listing reads every dead letter and filters in the
// client: meant for the hundreds or thousands a store holds, not for
// millions.

func (d *Driver) dlKey(suffix string) string { return d.prefix + "dl:" + suffix }

// putScript stores a dead letter. KEYS: seq, ids, keys. ARGV: prefix of the
// dead-letter hashes, key field ("" when the message ID is unknown), now in
// µs, the log entry to add if it parks again a dead letter in another
// state, then the fields as name/value pairs.
var putScript = redis.NewScript(`
local id = false
if ARGV[2] ~= '' then id = redis.call('HGET', KEYS[3], ARGV[2]) end
local h
if id then
  h = ARGV[1] .. id
  local was = redis.call('HGET', h, 'state')
  if was and was ~= 'parked' then
    redis.call('RPUSH', ARGV[1] .. 'log:' .. id, ARGV[4])
  end
else
  id = redis.call('INCR', KEYS[1])
  h = ARGV[1] .. id
  redis.call('ZADD', KEYS[2], id, id)
  if ARGV[2] ~= '' then redis.call('HSET', KEYS[3], ARGV[2], id) end
  redis.call('HSET', h, 'first', ARGV[3])
end
redis.call('HSET', h, 'last', ARGV[3], 'state', 'parked', unpack(ARGV, 5))
return tonumber(id)
`)

// DeadLetterPut implements driver.DeadLetterStore.
func (d *Driver) DeadLetterPut(ctx context.Context, dl *driver.DeadLetter) (int64, error) {
	field := ""
	switch {
	case dl.MessageID != "":
		field = dl.Handler + "|" + dl.MessageID
	case dl.Source != "":
		// No ID to key on: the same failure of the same delivery again
		// (its location, payload and error), redelivered after a crash
		// before the ack, updates the dead letter it wrote. A NUL never
		// appears in a message ID.
		h := sha256.New()
		h.Write(dl.Raw)
		h.Write([]byte{0})
		h.Write([]byte(dl.Error))
		field = dl.Handler + "|\x00" + dl.Source + "\x00" + hex.EncodeToString(h.Sum(nil))
	}
	now := time.Now().UnixMicro()
	actor, outcome := driver.RefailLog(dl)
	entry, err := json.Marshal(logEntry{At: now, State: driver.DeadLetterParked, Actor: actor, Outcome: outcome})
	if err != nil {
		return 0, fmt.Errorf("redisstore: store dead letter: %w", err)
	}
	args := []any{d.dlKey(""), field, now, entry,
		"handler", dl.Handler, "message_id", dl.MessageID, "envelope", dl.Envelope, "raw", dl.Raw,
		"source", dl.Source, "error", dl.Error, "class", dl.Class, "fingerprint", dl.Fingerprint,
		"attempts", dl.Attempts}
	id, err := putScript.Run(ctx, d.client, []string{d.dlKey("seq"), d.dlKey("ids"), d.dlKey("keys")}, args...).Int64()
	if err != nil {
		return 0, fmt.Errorf("redisstore: store dead letter: %w", err)
	}
	return id, nil
}

// DeadLetterList implements driver.DeadLetterStore.
func (d *Driver) DeadLetterList(ctx context.Context, f *driver.DeadLetterFilter) ([]driver.DeadLetter, error) {
	if f == nil {
		f = &driver.DeadLetterFilter{}
	}
	var ids []int64
	if f.IDs != nil {
		ids = slices.Clone(f.IDs)
		slices.Sort(ids)
		ids = slices.Compact(ids)
	} else {
		all, err := d.client.ZRange(ctx, d.dlKey("ids"), 0, -1).Result()
		if err != nil {
			return nil, fmt.Errorf("redisstore: list dead letters: %w", err)
		}
		for _, s := range all {
			id, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("redisstore: list dead letters: bad ID %q in %s", s, d.dlKey("ids"))
			}
			ids = append(ids, id)
		}
	}
	pipe := d.client.Pipeline()
	cmds := make([]*redis.MapStringStringCmd, len(ids))
	for i, id := range ids {
		cmds[i] = pipe.HGetAll(ctx, d.dlKey(strconv.FormatInt(id, 10)))
	}
	if len(ids) > 0 {
		if _, err := pipe.Exec(ctx); err != nil {
			return nil, fmt.Errorf("redisstore: list dead letters: %w", err)
		}
	}
	var out []driver.DeadLetter
	for i, id := range ids {
		m := cmds[i].Val()
		if len(m) == 0 {
			continue // asked for by ID, and there is none
		}
		dl, err := decodeDeadLetter(id, m)
		if err != nil {
			return nil, fmt.Errorf("redisstore: list dead letters: %w", err)
		}
		if !matches(f, &dl) {
			continue
		}
		out = append(out, dl)
		if f.Limit > 0 && len(out) == f.Limit {
			break
		}
	}
	return out, nil
}

func matches(f *driver.DeadLetterFilter, dl *driver.DeadLetter) bool {
	return (f.Handler == "" || dl.Handler == f.Handler) &&
		(f.Fingerprint == "" || dl.Fingerprint == f.Fingerprint) &&
		(f.State == "" || dl.State == f.State) &&
		// In whole microseconds, as stored and as the SQL stores compare.
		(f.Since.IsZero() || dl.LastFailed.UnixMicro() >= f.Since.UnixMicro()) &&
		(f.Until.IsZero() || dl.LastFailed.UnixMicro() < f.Until.UnixMicro())
}

func decodeDeadLetter(id int64, m map[string]string) (driver.DeadLetter, error) {
	dl := driver.DeadLetter{
		ID: id, Handler: m["handler"], MessageID: m["message_id"], Source: m["source"],
		Error: m["error"], Class: m["class"], Fingerprint: m["fingerprint"], State: m["state"],
	}
	if v := m["envelope"]; v != "" {
		dl.Envelope = []byte(v)
	}
	if v := m["raw"]; v != "" {
		dl.Raw = []byte(v)
	}
	var err error
	if dl.Attempts, err = strconv.Atoi(m["attempts"]); err != nil {
		return dl, fmt.Errorf("dead letter %d: attempts %q", id, m["attempts"])
	}
	for _, t := range []struct {
		field string
		dst   *time.Time
	}{{"first", &dl.FirstFailed}, {"last", &dl.LastFailed}} {
		us, err := strconv.ParseInt(m[t.field], 10, 64)
		if err != nil {
			return dl, fmt.Errorf("dead letter %d: %s %q", id, t.field, m[t.field])
		}
		*t.dst = time.UnixMicro(us)
	}
	return dl, nil
}

// setStateScript moves dead letters. KEYS: the dead-letter hashes, then
// their logs. ARGV: the new state, the log entry, then the From states.
var setStateScript = redis.NewScript(`
local n = #KEYS / 2
local from = {}
for i = 3, #ARGV do from[ARGV[i]] = true end
local moved = 0
for i = 1, n do
  local s = redis.call('HGET', KEYS[i], 'state')
  if s and from[s] then
    redis.call('HSET', KEYS[i], 'state', ARGV[1])
    redis.call('RPUSH', KEYS[n + i], ARGV[2])
    moved = moved + 1
  end
end
return moved
`)

// logEntry is a history entry as stored.
type logEntry struct {
	At      int64  `json:"at"` // µs since the epoch
	State   string `json:"state"`
	Actor   string `json:"actor,omitempty"`
	Outcome string `json:"outcome,omitempty"`
}

// DeadLetterSetState implements driver.DeadLetterStore.
func (d *Driver) DeadLetterSetState(ctx context.Context, c *driver.DeadLetterStateChange) (int, error) {
	if len(c.IDs) == 0 || len(c.From) == 0 {
		return 0, nil
	}
	ids := slices.Clone(c.IDs)
	slices.Sort(ids)
	ids = slices.Compact(ids)
	keys := make([]string, 2*len(ids))
	for i, id := range ids {
		s := strconv.FormatInt(id, 10)
		keys[i], keys[len(ids)+i] = d.dlKey(s), d.dlKey("log:"+s)
	}
	entry, err := json.Marshal(logEntry{At: time.Now().UnixMicro(), State: c.To, Actor: c.Actor, Outcome: c.Outcome})
	if err != nil {
		return 0, fmt.Errorf("redisstore: set dead-letter state: %w", err)
	}
	args := []any{c.To, entry}
	for _, s := range c.From {
		args = append(args, s)
	}
	n, err := setStateScript.Run(ctx, d.client, keys, args...).Int()
	if err != nil {
		return 0, fmt.Errorf("redisstore: set dead-letter state: %w", err)
	}
	return n, nil
}

// DeadLetterHistory implements driver.DeadLetterStore.
func (d *Driver) DeadLetterHistory(ctx context.Context, id int64) ([]driver.DeadLetterEvent, error) {
	raw, err := d.client.LRange(ctx, d.dlKey("log:"+strconv.FormatInt(id, 10)), 0, -1).Result()
	if err != nil {
		return nil, fmt.Errorf("redisstore: dead-letter history: %w", err)
	}
	out := make([]driver.DeadLetterEvent, 0, len(raw))
	for _, r := range raw {
		var e logEntry
		if err := json.Unmarshal([]byte(r), &e); err != nil {
			return nil, fmt.Errorf("redisstore: dead-letter history of %d: %w", id, err)
		}
		out = append(out, driver.DeadLetterEvent{At: time.UnixMicro(e.At), State: e.State, Actor: e.Actor, Outcome: e.Outcome})
	}
	return out, nil
}

// StatsAdd implements driver.StatsStore: the counters are fields
// "<handler>|duplicates" and "<handler>|stale" of the hash Prefix+"stats".
func (d *Driver) StatsAdd(ctx context.Context, handler string, s driver.StatsDelta) error {
	pipe := d.client.TxPipeline()
	pipe.HIncrBy(ctx, d.prefix+"stats", handler+"|duplicates", s.Duplicates)
	pipe.HIncrBy(ctx, d.prefix+"stats", handler+"|stale", s.Stale)
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("redisstore: add handler stats: %w", err)
	}
	return nil
}

// StatsRead implements driver.StatsStore.
func (d *Driver) StatsRead(ctx context.Context) (map[string]driver.StatsDelta, error) {
	m, err := d.client.HGetAll(ctx, d.prefix+"stats").Result()
	if err != nil {
		return nil, fmt.Errorf("redisstore: read handler stats: %w", err)
	}
	out := map[string]driver.StatsDelta{}
	for k, v := range m {
		i := len(k) - 1
		for i >= 0 && k[i] != '|' {
			i--
		}
		if i < 0 {
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("redisstore: read handler stats: %s = %q", k, v)
		}
		s := out[k[:i]]
		switch k[i+1:] {
		case "duplicates":
			s.Duplicates = n
		case "stale":
			s.Stale = n
		default:
			continue
		}
		out[k[:i]] = s
	}
	return out, nil
}
