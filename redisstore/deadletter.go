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
	"github.com/idemhq/idem/internal/errtext"
)

var (
	_ driver.DeadLetterStore = (*Driver)(nil)
	_ driver.StatsStore      = (*Driver)(nil)
)

// Dead letters live under Prefix+"dl:": a counter "dl:seq" hands out IDs,
// each dead letter is the hash "dl:<id>", the sorted set "dl:ids" lists
// the IDs in order, the hash "dl:keys" maps "handler|message ID NUL
// payload hash" to the ID (so a second failure of a message with the same
// payload updates its dead letter, and one with another payload is a dead
// letter of its own; a key without the hash, written before, is taken over
// by the same payload; a delivery that did not decode is keyed by its
// source and a hash of its payload and error), and the list "dl:log:<id>" is a dead letter's history. Scripts keep each
// change atomic. Listing reads the dead letters in chunks and filters in
// the client (a summary without their bodies): meant for the thousands a
// store holds, not for millions.

func (d *Driver) dlKey(suffix string) string { return d.prefix + "dl:" + suffix }

// putScript stores a dead letter. KEYS: seq, ids, keys. ARGV: prefix of
// the dead-letter hashes, key field ("" when the message ID is unknown),
// now in µs, the log entry to add if it parks again a dead letter in
// another state (or always, for a repeat), the key field written before
// payload hashes were stored ("" if none), the raw payload, "1" for a
// repeat, the error, class and fingerprint, then the other fields as
// name/value pairs.
var putScript = redis.NewScript(`
local id = false
if ARGV[2] ~= '' then id = redis.call('HGET', KEYS[3], ARGV[2]) end
if not id and ARGV[5] ~= '' then
  -- A dead letter keyed without its payload hash: the same one when it
  -- holds the same payload, which takes the new key.
  local old = redis.call('HGET', KEYS[3], ARGV[5])
  if old and (redis.call('HGET', ARGV[1] .. old, 'raw') or '') == ARGV[6] then
    id = old
    redis.call('HDEL', KEYS[3], ARGV[5])
    redis.call('HSET', KEYS[3], ARGV[2], id)
  end
end
local repeat_ = ARGV[7] == '1'
local h
local keep = false
if id then
  h = ARGV[1] .. id
  local was = redis.call('HGET', h, 'state')
  if was and (was ~= 'parked' or repeat_) then
    redis.call('RPUSH', ARGV[1] .. 'log:' .. id, ARGV[4])
  end
  keep = repeat_
else
  id = redis.call('INCR', KEYS[1])
  h = ARGV[1] .. id
  redis.call('ZADD', KEYS[2], id, id)
  if ARGV[2] ~= '' then redis.call('HSET', KEYS[3], ARGV[2], id) end
  redis.call('HSET', h, 'first', ARGV[3])
end
if not keep then redis.call('HSET', h, 'error', ARGV[8], 'class', ARGV[9], 'fingerprint', ARGV[10]) end
redis.call('HSET', h, 'last', ARGV[3], 'state', 'parked', 'raw', ARGV[6], unpack(ARGV, 11))
return tonumber(id)
`)

// DeadLetterPut implements driver.DeadLetterStore.
func (d *Driver) DeadLetterPut(ctx context.Context, dl *driver.DeadLetter) (int64, error) {
	field, legacy := "", ""
	hash := hex.EncodeToString(dl.PayloadHash)
	switch {
	case dl.MessageID != "":
		// A NUL never appears in a message ID.
		legacy = dl.Handler + "|" + dl.MessageID
		field = legacy + "\x00" + hash
	case dl.Source != "":
		// No ID to key on: the same failure of the same delivery again
		// (its location, payload and error), redelivered after a crash
		// before the ack, updates the dead letter it wrote.
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
	repeat := ""
	if dl.Repeat {
		repeat = "1"
	}
	args := []any{d.dlKey(""), field, now, entry, legacy, dl.Raw, repeat, dl.Error, dl.Class, dl.Fingerprint,
		"handler", dl.Handler, "message_id", dl.MessageID, "payload_hash", hash, "envelope", dl.Envelope,
		"source", dl.Source, "attempts", dl.Attempts}
	id, err := putScript.Run(ctx, d.client, []string{d.dlKey("seq"), d.dlKey("ids"), d.dlKey("keys")}, args...).Int64()
	if err != nil {
		return 0, fmt.Errorf("redisstore: store dead letter: %w", err)
	}
	return id, nil
}

// deadLetterSummaryFields are the fields of a dead letter's hash but its
// bodies, for a DeadLetterFilter.Summary.
var deadLetterSummaryFields = []string{"handler", "message_id", "payload_hash", "source", "error", "class", "fingerprint", "attempts", "first", "last", "state"}

// DeadLetterList implements driver.DeadLetterStore.
func (d *Driver) DeadLetterList(ctx context.Context, f *driver.DeadLetterFilter) ([]driver.DeadLetter, error) {
	if f == nil {
		f = &driver.DeadLetterFilter{}
	}
	// In chunks, so that a Limit stops the reading early: the ID index
	// is read a page at a time too, never whole.
	next := func() ([]int64, error) { return nil, nil }
	if f.IDs != nil {
		ids := slices.Clone(f.IDs)
		slices.Sort(ids)
		ids = slices.Compact(ids)
		ids = slices.DeleteFunc(ids, func(id int64) bool { return id <= f.AfterID })
		next = func() ([]int64, error) {
			chunk := ids[:min(len(ids), dlChunk)]
			ids = ids[len(chunk):]
			return chunk, nil
		}
	} else {
		after := f.AfterID
		next = func() ([]int64, error) {
			page, err := d.client.ZRangeByScore(ctx, d.dlKey("ids"), &redis.ZRangeBy{
				Min: "(" + strconv.FormatInt(after, 10), Max: "+inf", Count: dlChunk,
			}).Result()
			if err != nil {
				return nil, err
			}
			chunk := make([]int64, 0, len(page))
			for _, s := range page {
				id, err := strconv.ParseInt(s, 10, 64)
				if err != nil {
					return nil, fmt.Errorf("bad ID %s in %s", errtext.Quote(s), d.dlKey("ids"))
				}
				chunk = append(chunk, id)
				after = max(after, id)
			}
			return chunk, nil
		}
	}
	var out []driver.DeadLetter
	for {
		chunk, err := next()
		if err != nil {
			return nil, fmt.Errorf("redisstore: list dead letters: %w", err)
		}
		if len(chunk) == 0 {
			break
		}
		ms, err := d.readDeadLetters(ctx, chunk, f.Summary)
		if err != nil {
			return nil, fmt.Errorf("redisstore: list dead letters: %w", err)
		}
		for i, id := range chunk {
			if len(ms[i]) == 0 {
				continue // asked for by ID, and there is none
			}
			dl, err := decodeDeadLetter(id, ms[i])
			if err != nil {
				return nil, fmt.Errorf("redisstore: list dead letters: %w", err)
			}
			if !matches(f, &dl) {
				continue
			}
			out = append(out, dl)
			if f.Limit > 0 && len(out) == f.Limit {
				return out, nil
			}
		}
	}
	return out, nil
}

// dlChunk is how many dead letters DeadLetterList reads at a time.
const dlChunk = 256

// readDeadLetters reads the hashes of ids in one round trip: every field,
// or without the bodies when summary is set. A missing one is empty.
func (d *Driver) readDeadLetters(ctx context.Context, ids []int64, summary bool) ([]map[string]string, error) {
	pipe := d.client.Pipeline()
	all := make([]*redis.MapStringStringCmd, len(ids))
	some := make([]*redis.SliceCmd, len(ids))
	for i, id := range ids {
		key := d.dlKey(strconv.FormatInt(id, 10))
		if summary {
			some[i] = pipe.HMGet(ctx, key, deadLetterSummaryFields...)
		} else {
			all[i] = pipe.HGetAll(ctx, key)
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, err
	}
	out := make([]map[string]string, len(ids))
	for i := range ids {
		if !summary {
			out[i] = all[i].Val()
			continue
		}
		m := map[string]string{}
		for j, v := range some[i].Val() {
			if s, ok := v.(string); ok {
				m[deadLetterSummaryFields[j]] = s
			}
		}
		out[i] = m
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
	if v := m["payload_hash"]; v != "" {
		h, err := hex.DecodeString(v)
		if err != nil {
			return dl, fmt.Errorf("dead letter %d: payload hash %s is not hex", id, errtext.Quote(v))
		}
		dl.PayloadHash = h
	}
	if v := m["envelope"]; v != "" {
		dl.Envelope = []byte(v)
	}
	if v := m["raw"]; v != "" {
		dl.Raw = []byte(v)
	}
	var err error
	if dl.Attempts, err = strconv.Atoi(m["attempts"]); err != nil {
		return dl, fmt.Errorf("dead letter %d: attempts %s is not a number", id, errtext.Quote(m["attempts"]))
	}
	for _, t := range []struct {
		field string
		dst   *time.Time
	}{{"first", &dl.FirstFailed}, {"last", &dl.LastFailed}} {
		us, err := strconv.ParseInt(m[t.field], 10, 64)
		if err != nil {
			return dl, fmt.Errorf("dead letter %d: %s %s is not a time in microseconds", id, t.field, errtext.Quote(m[t.field]))
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
