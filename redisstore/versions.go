package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/driver"
)

var _ driver.VersionStore[*Tx] = (*Driver)(nil)

// versionKey returns the key of an aggregate's write-side version. Stream
// names are free text, so the stream's length goes first and the key
// cannot be read two ways.
func (d *Driver) versionKey(p *driver.VersionParams) string {
	return d.prefix + "v:" + strconv.Itoa(len(p.Stream)) + ":" + p.Stream + "|" + p.AggregateID
}

func (d *Driver) versionLockKey(p *driver.VersionParams) string {
	return d.prefix + "lv:" + strconv.Itoa(len(p.Stream)) + ":" + p.Stream + "|" + p.AggregateID
}

// versionClaim locks the aggregate's version for tx (waiting for a
// transaction that holds it) and returns its claim.
func (d *Driver) versionClaim(ctx context.Context, tx *Tx, p *driver.VersionParams) (*claim, error) {
	if tx == nil {
		return nil, errNilTx
	}
	k := d.versionKey(p)
	if c, ok := tx.claims[k]; ok {
		return c, nil
	}
	if err := tx.lockValues(ctx, []string{k}, []string{d.versionLockKey(p)}); err != nil {
		return nil, fmt.Errorf("redisstore: lock version of %q/%q: %w", p.Stream, p.AggregateID, err)
	}
	return tx.claims[k], nil
}

// VersionNext implements driver.VersionStore. The version's lock is held
// until tx ends, so a rolled-back transaction gives its number back.
func (d *Driver) VersionNext(ctx context.Context, tx *Tx, p *driver.VersionParams) (int64, error) {
	c, err := d.versionClaim(ctx, tx, p)
	if err != nil {
		return 0, err
	}
	v, err := c.current()
	if err != nil {
		return 0, err
	}
	c.set(v + 1)
	return v + 1, nil
}

// VersionAdvance implements driver.VersionStore. On success it returns
// the new version.
func (d *Driver) VersionAdvance(ctx context.Context, tx *Tx, p *driver.VersionParams) (bool, int64, error) {
	c, err := d.versionClaim(ctx, tx, p)
	if err != nil {
		return false, 0, err
	}
	v, err := c.current()
	if err != nil {
		return false, 0, err
	}
	if v != p.Expected {
		return false, v, nil
	}
	c.set(v + 1)
	return true, v + 1, nil
}

// VersionCurrent implements driver.VersionStore: this transaction's own
// allocation if it made one, else the committed version, read without a
// lock.
func (d *Driver) VersionCurrent(ctx context.Context, tx *Tx, p *driver.VersionParams) (int64, error) {
	if tx == nil {
		return 0, errNilTx
	}
	if c, ok := tx.claims[d.versionKey(p)]; ok {
		return c.current()
	}
	if err := tx.readable(); err != nil {
		return 0, fmt.Errorf("redisstore: read version: %w", err)
	}
	v, err := tx.conn.Get(ctx, d.versionKey(p)).Int64()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("redisstore: read version: %w", err)
	}
	return v, nil
}
