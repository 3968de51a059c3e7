package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/driver"
)

var (
	_ driver.SequenceGuard[*Tx]      = (*Driver)(nil)
	_ driver.SequenceBatchStore[*Tx] = (*Driver)(nil)
	_ driver.MarkerDeleter[*Tx]      = (*Driver)(nil)
)

// SequenceKey returns the key holding the last applied sequence of
// (handler, aggregateID) for the ordering guard: the prefix, "s:", the
// handler name, "|" and the aggregate ID. Like a marker, it is written at
// commit, under a lock the transaction takes when it first reads it.
func (d *Driver) SequenceKey(handler, aggregateID string) string {
	return d.prefix + "s:" + handler + "|" + aggregateID
}

func (d *Driver) sequenceLockKey(handler, aggregateID string) string {
	return d.prefix + "ls:" + handler + "|" + aggregateID
}

// lastSeqs returns the last applied sequence of each aggregate as this
// transaction sees it (its own advances included), locking the ones it
// has not read yet, in the order given.
func (d *Driver) lastSeqs(ctx context.Context, tx *Tx, handler string, aggs []string) ([]*claim, error) {
	if tx == nil {
		return nil, errNilTx
	}
	out := make([]*claim, len(aggs))
	var keys, locks []string
	var idx []int
	for i, a := range aggs {
		k := d.SequenceKey(handler, a)
		if c, ok := tx.claims[k]; ok {
			out[i] = c
			continue
		}
		keys = append(keys, k)
		locks = append(locks, d.sequenceLockKey(handler, a))
		idx = append(idx, i)
	}
	if len(keys) > 0 {
		if err := tx.lockValues(ctx, keys, locks); err != nil {
			return nil, fmt.Errorf("redisstore: lock sequences of %q: %w", handler, err)
		}
		for k, i := range idx {
			out[i] = tx.claims[keys[k]]
		}
	}
	return out, nil
}

// current returns the sequence a claim stands at in this transaction.
func (c *claim) current() (int64, error) {
	v := c.seen
	if c.hasWrite {
		v = string(c.write)
	}
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("redisstore: sequence %s holds %q, not a number", c.key, v)
	}
	return n, nil
}

func (c *claim) set(seq int64) {
	c.write, c.hasWrite = strconv.AppendInt(nil, seq, 10), true
}

// SequenceAdvance implements driver.SequenceGuard. The first read of an
// aggregate's sequence in a transaction takes its lock (waiting for a
// concurrent transaction that holds it), so concurrent advances of one
// aggregate serialize as on a locked row.
func (d *Driver) SequenceAdvance(ctx context.Context, tx *Tx, p *driver.SequenceAdvanceParams) (driver.SequenceAdvanceResult, error) {
	cs, err := d.lastSeqs(ctx, tx, p.Handler, []string{p.AggregateID})
	if err != nil {
		return driver.SequenceAdvanceResult{}, err
	}
	last, err := cs[0].current()
	if err != nil {
		return driver.SequenceAdvanceResult{}, err
	}
	if p.Seq == last+1 || (p.AllowGap && p.Seq > last) {
		cs[0].set(p.Seq)
		return driver.SequenceAdvanceResult{Advanced: true}, nil
	}
	return driver.SequenceAdvanceResult{Last: last}, nil
}

// SequenceLockMany implements driver.SequenceBatchStore: one round trip
// takes the locks in the order given and reads the sequences.
func (d *Driver) SequenceLockMany(ctx context.Context, tx *Tx, p *driver.SequenceLockManyParams) ([]int64, error) {
	cs, err := d.lastSeqs(ctx, tx, p.Handler, p.AggregateIDs)
	if err != nil {
		return nil, err
	}
	out := make([]int64, len(cs))
	for i, c := range cs {
		if out[i], err = c.current(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// SequenceSetMany implements driver.SequenceBatchStore: the new sequences
// are written at commit.
func (d *Driver) SequenceSetMany(ctx context.Context, tx *Tx, p *driver.SequenceSetManyParams) error {
	if len(p.AggregateIDs) != len(p.Seqs) {
		return fmt.Errorf("redisstore: %d aggregate IDs for %d sequences", len(p.AggregateIDs), len(p.Seqs))
	}
	for i, a := range p.AggregateIDs {
		c, ok := tx.claims[d.SequenceKey(p.Handler, a)]
		if !ok {
			return fmt.Errorf("redisstore: sequence of %q / %q set without SequenceLockMany", p.Handler, a)
		}
		c.set(p.Seqs[i])
	}
	return nil
}

// gapScript records the first sighting of a sequence behind a gap, and
// forgets the sightings of sequences the aggregate has reached, so the
// hash holds only gaps still open. KEYS: the aggregate's gap hash, its
// sequence key. ARGV: the sequence, and the hash's lifetime in ms after
// its latest sighting (0: kept). It returns the first sighting and now,
// in µs on the server's clock.
var gapScript = redis.NewScript(`
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local last = redis.call('GET', KEYS[2]) or '0'
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  -- Decimal strings compared as such: a Lua number (a double) would
  -- round sequences above 2^53.
  if #f < #last or (#f == #last and f <= last) then
    redis.call('HDEL', KEYS[1], f)
  end
end
redis.call('HSETNX', KEYS[1], ARGV[1], now)
if tonumber(ARGV[2]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return {tonumber(redis.call('HGET', KEYS[1], ARGV[1])), now}
`)

// GapSighting implements driver.SequenceGuard on the Redis server's clock.
// Sightings are kept in the hash Prefix+"g:<handler>|<aggregate>", one
// field per sequence still ahead of the aggregate (each sighting forgets
// those it has reached); with a MarkerTTL the hash expires that long
// after the aggregate's latest sighting, as markers do.
func (d *Driver) GapSighting(ctx context.Context, p *driver.GapSightingParams) (driver.GapSightingResult, error) {
	v, err := gapScript.Run(ctx, d.client, []string{d.prefix + "g:" + p.Handler + "|" + p.AggregateID, d.SequenceKey(p.Handler, p.AggregateID)},
		p.Seq, d.markerTTL.Milliseconds()).Int64Slice()
	if err != nil {
		return driver.GapSightingResult{}, fmt.Errorf("redisstore: record gap sighting: %w", err)
	}
	if len(v) != 2 {
		return driver.GapSightingResult{}, fmt.Errorf("redisstore: record gap sighting: %d values returned", len(v))
	}
	return driver.GapSightingResult{FirstSeen: time.UnixMicro(v[0]), Now: time.UnixMicro(v[1])}, nil
}
