package redisstore_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/redisstore"
)

// inRowStore adds to s the guarded writes of the in-row conformance
// tests: each aggregate's state in the string prefix+"row:<agg>", its last
// applied sequence in prefix+"rowseq:<agg>".
//
// Redis has no conditional write inside MULTI/EXEC, so the guard is a
// WATCH: the handler watches the sequence key, reads it, and queues its
// writes only if g admits it. A concurrent writer of the key makes the
// commit fail with ErrAborted (retried), so the read stays true.
func inRowStore(c *redis.Client, prefix string, s *idemtest.Store[*redisstore.Tx]) *idemtest.Store[*redisstore.Tx] {
	seqKey := func(agg string) string { return prefix + "rowseq:" + agg }
	rowKey := func(agg string) string { return prefix + "row:" + agg }
	s.RowAppendMany = func(ctx context.Context, tx *redisstore.Tx, gs []*idem.RowGuard, values []string) ([]idem.RowWrite, error) {
		keys := make([]string, len(gs))
		for i, g := range gs {
			keys[i] = seqKey(g.AggregateID)
		}
		if err := tx.Watch(ctx, keys...); err != nil {
			return nil, err
		}
		vals, err := tx.Conn().MGet(ctx, keys...).Result()
		if err != nil {
			return nil, err
		}
		ws := make([]idem.RowWrite, len(gs))
		for i, g := range gs {
			if v, ok := vals[i].(string); ok {
				if ws[i].Prev, err = strconv.ParseInt(v, 10, 64); err != nil {
					return nil, err
				}
			}
			if g.Admits(ws[i].Prev) {
				tx.Queue().Append(ctx, rowKey(g.AggregateID), values[i])
				tx.Queue().Set(ctx, keys[i], g.To(), 0)
				ws[i].Advanced = true
			}
		}
		return ws, nil
	}
	s.RowAppend = func(ctx context.Context, tx *redisstore.Tx, g *idem.RowGuard, value string) (idem.RowWrite, error) {
		ws, err := s.RowAppendMany(ctx, tx, []*idem.RowGuard{g}, []string{value})
		if err != nil {
			return idem.RowWrite{}, err
		}
		return ws[0], nil
	}
	s.Rows = func(ctx context.Context) (map[string]idemtest.Row, error) {
		keys, err := scan(ctx, c, prefix+"rowseq:*")
		if err != nil {
			return nil, err
		}
		m := make(map[string]idemtest.Row, len(keys))
		for _, k := range keys {
			agg := strings.TrimPrefix(k, prefix+"rowseq:")
			var r idemtest.Row
			if r.Last, err = c.Get(ctx, k).Int64(); err != nil {
				return nil, err
			}
			if r.Value, err = c.Get(ctx, rowKey(agg)).Result(); err != nil && !errors.Is(err, redis.Nil) {
				return nil, err
			}
			m[agg] = r
		}
		return m, nil
	}
	return s
}

func TestInRow(t *testing.T) {
	t.Parallel()
	idemtest.RunInRow(t, &idemtest.Harness[*redisstore.Tx]{Open: func(t testing.TB) *idemtest.Store[*redisstore.Tx] {
		s, c, prefix := openStore(t, nil)
		return inRowStore(c, prefix, s)
	}})
}
