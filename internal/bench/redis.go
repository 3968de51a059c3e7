package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/redisstore"
)

// RedisTarget is a Target on a Redis server: the balances are fields of a
// hash, and every variant's writes run in one MULTI/EXEC (the plain ones
// without a marker).
type RedisTarget struct {
	client   *redis.Client
	prefix   string
	balances string
	idemVariants[*redisstore.Tx]
	handScript *redis.Script
	inRowProc  *idem.Processor[*redisstore.Tx]
	inRowH     *idem.Handler[*redisstore.Tx]
	// writeOnly is a processor over a driver with Config.WriteOnly.
	writeOnly *idem.Processor[*redisstore.Tx]
}

// handScript is the hand-rolled dedupe on Redis: the ID's key set if
// absent and, only then, the balance incremented, atomically.
const handScript = `if redis.call('SET', KEYS[1], '1', 'NX') then
	redis.call('HINCRBY', KEYS[2], ARGV[1], ARGV[2])
	return 1
end
return 0`

// OpenRedis returns a target whose keys all start with prefix (empty:
// "idem_bench:"). Close deletes them. The client's pool should allow at
// least as many connections as the workload has workers.
func OpenRedis(ctx context.Context, client *redis.Client, prefix string) (*RedisTarget, error) {
	if client == nil {
		return nil, errors.New("bench: nil Redis client")
	}
	if prefix == "" {
		prefix = "idem_bench:"
	}
	drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		return nil, fmt.Errorf("bench: redis driver: %w", err)
	}
	if err := drv.Migrate(ctx); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	t := &RedisTarget{client: client, prefix: prefix, balances: prefix + "balances", handScript: redis.NewScript(handScript)}
	if err := t.handScript.Load(ctx, client).Err(); err != nil {
		return nil, fmt.Errorf("bench: load the hand-rolled dedupe script: %w", err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		return nil, fmt.Errorf("bench: processor: %w", err)
	}
	h := &idem.Handler[*redisstore.Tx]{
		Name: handlerName,
		Apply: func(ctx context.Context, tx *redisstore.Tx, msg *idem.Message) error {
			return t.applyOne(ctx, tx.Queue(), msg)
		},
		ApplyBatch: func(ctx context.Context, tx *redisstore.Tx, msgs []*idem.Message) error {
			return t.applyBatch(ctx, tx.Queue(), msgs)
		},
	}
	t.idemVariants = newIdemVariants(proc, h)
	wdrv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix, WriteOnly: true})
	if err != nil {
		return nil, fmt.Errorf("bench: redis driver: %w", err)
	}
	if t.writeOnly, err = idem.NewProcessor(wdrv, nil); err != nil {
		return nil, fmt.Errorf("bench: processor: %w", err)
	}
	t.inRowProc = proc
	t.inRowH = inRowHandler(func(ctx context.Context, tx *redisstore.Tx, gs []*idem.RowGuard) ([]idem.RowWrite, error) {
		keys := t.rowSeqKeys(gs)
		if err := tx.Watch(ctx, keys...); err != nil {
			return nil, err
		}
		return t.writeRows(ctx, tx.Conn(), tx.Queue(), keys, gs)
	})
	return t, nil
}

// Name returns "redis".
func (t *RedisTarget) Name() string { return "redis" }

func (t *RedisTarget) applyOne(ctx context.Context, q redis.Cmdable, msg *idem.Message) error {
	account, amount, err := Decode(msg)
	if err != nil {
		return err
	}
	q.HIncrBy(ctx, t.balances, account, amount)
	return nil
}

// applyBatch queues one increment per account, of the batch's sum.
func (t *RedisTarget) applyBatch(ctx context.Context, q redis.Cmdable, msgs []*idem.Message) error {
	accounts, amounts, err := Aggregate(msgs)
	if err != nil {
		return err
	}
	for i, a := range accounts {
		q.HIncrBy(ctx, t.balances, a, amounts[i])
	}
	return nil
}

// inMulti runs fn's queued commands in one MULTI/EXEC.
func (t *RedisTarget) inMulti(ctx context.Context, fn func(redis.Pipeliner) error) error {
	if _, err := t.client.TxPipelined(ctx, fn); err != nil {
		return fmt.Errorf("bench: exec: %w", err)
	}
	return nil
}

// PlainOne implements Target.
func (t *RedisTarget) PlainOne(ctx context.Context, msg *idem.Message) error {
	return t.inMulti(ctx, func(p redis.Pipeliner) error { return t.applyOne(ctx, p, msg) })
}

// PlainBatch implements Target.
func (t *RedisTarget) PlainBatch(ctx context.Context, msgs []*idem.Message) error {
	return t.inMulti(ctx, func(p redis.Pipeliner) error { return t.applyBatch(ctx, p, msgs) })
}

// PlainBatchPerEvent implements PerEventTarget.
func (t *RedisTarget) PlainBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	return t.inMulti(ctx, func(p redis.Pipeliner) error {
		for _, m := range msgs {
			if err := t.applyOne(ctx, p, m); err != nil {
				return err
			}
		}
		return nil
	})
}

// IdemOneWriteOnly implements WriteOnlyTarget: the handler only queues its
// increment, so its marker and its write go in one script call.
func (t *RedisTarget) IdemOneWriteOnly(ctx context.Context, msg *idem.Message) error {
	out, err := t.writeOnly.Process(ctx, t.h, msg)
	return checkApplied1(msg, out, err)
}

// Close deletes every key under the target's prefix. It does not close
// the client.
func (t *RedisTarget) Close(ctx context.Context) error {
	iter := t.client.Scan(ctx, 0, t.prefix+"*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
		if len(keys) == 1000 {
			if err := t.client.Unlink(ctx, keys...).Err(); err != nil {
				return fmt.Errorf("bench: delete keys: %w", err)
			}
			keys = keys[:0]
		}
	}
	if err := iter.Err(); err != nil {
		return fmt.Errorf("bench: scan keys: %w", err)
	}
	if len(keys) > 0 {
		if err := t.client.Unlink(ctx, keys...).Err(); err != nil {
			return fmt.Errorf("bench: delete keys: %w", err)
		}
	}
	return nil
}

// hand queues the hand-rolled dedupe of msg on q.
func (t *RedisTarget) hand(ctx context.Context, q redis.Scripter, msg *idem.Message) (*redis.Cmd, error) {
	account, amount, err := Decode(msg)
	if err != nil {
		return nil, err
	}
	return t.handScript.EvalSha(ctx, q, []string{t.prefix + handTable + ":" + msg.ID, t.balances}, account, amount), nil
}

// checkHand reports an error unless the script applied the message: every
// benchmark message is new, so a skip is a bug.
func checkHand(msg *idem.Message, c *redis.Cmd) error {
	n, err := c.Int()
	if err != nil {
		return fmt.Errorf("bench: hand-rolled dedupe: %w", err)
	}
	if n != 1 {
		return fmt.Errorf("bench: message %q already processed", msg.ID)
	}
	return nil
}

// HandOne implements HandRolledTarget: one script call, as a team would
// write it for Redis.
func (t *RedisTarget) HandOne(ctx context.Context, msg *idem.Message) error {
	c, err := t.hand(ctx, t.client, msg)
	if err != nil {
		return err
	}
	if redis.HasErrorPrefix(c.Err(), "NOSCRIPT") {
		// The server lost its script cache (another test flushed it):
		// the script did not run.
		if err := t.handScript.Load(ctx, t.client).Err(); err != nil {
			return fmt.Errorf("bench: reload the hand-rolled dedupe script: %w", err)
		}
		if c, err = t.hand(ctx, t.client, msg); err != nil {
			return err
		}
	}
	return checkHand(msg, c)
}

// HandBatchPerEvent implements HandRolledTarget: a script call per
// message, all in one MULTI/EXEC as the plain batches are.
func (t *RedisTarget) HandBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	cmds := make([]*redis.Cmd, len(msgs))
	exec := func() error {
		return t.inMulti(ctx, func(p redis.Pipeliner) error {
			for i, m := range msgs {
				c, err := t.hand(ctx, p, m)
				if err != nil {
					return err
				}
				cmds[i] = c
			}
			return nil
		})
	}
	err := exec()
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		// The server lost its script cache: one EXEC sees one cache, so
		// no script of the batch ran. Load it and run the batch again.
		if err := t.handScript.Load(ctx, t.client).Err(); err != nil {
			return fmt.Errorf("bench: reload the hand-rolled dedupe script: %w", err)
		}
		err = exec()
	}
	if err != nil {
		return err
	}
	for i, m := range msgs {
		if err := checkHand(m, cmds[i]); err != nil {
			return err
		}
	}
	return nil
}

// rowBalances is the in-row balances hash. Each account's last applied
// sequence has a key of its own (rowSeqKey), so that a WATCH covers only
// the accounts a transaction writes.
func (t *RedisTarget) rowBalances() string { return t.prefix + "balances_in_row" }

func (t *RedisTarget) rowSeqKey(account string) string { return t.prefix + "in_row_seq:" + account }

// rowSeqKeys returns the sequence keys of gs's accounts.
func (t *RedisTarget) rowSeqKeys(gs []*idem.RowGuard) []string {
	keys := make([]string, len(gs))
	for i, g := range gs {
		keys[i] = t.rowSeqKey(g.AggregateID)
	}
	return keys
}

// writeRows is the in-row handler's guarded write on Redis: read the
// guards' sequences (WATCHed, keys), and queue the increments and the new
// sequences of the admitted ones on q, to run in the transaction's
// MULTI/EXEC. A concurrent change of a sequence aborts it.
func (t *RedisTarget) writeRows(ctx context.Context, conn redis.Cmdable, q redis.Cmdable, keys []string, gs []*idem.RowGuard) ([]idem.RowWrite, error) {
	vals, err := conn.MGet(ctx, keys...).Result()
	if err != nil {
		return nil, fmt.Errorf("bench: read sequences: %w", err)
	}
	ws := make([]idem.RowWrite, len(gs))
	for i, g := range gs {
		if v, ok := vals[i].(string); ok {
			if ws[i].Prev, err = strconv.ParseInt(v, 10, 64); err != nil {
				return nil, fmt.Errorf("bench: sequence of %q: %w", g.AggregateID, err)
			}
		}
		if !g.Admits(ws[i].Prev) {
			continue
		}
		amount, err := guardAmount(g)
		if err != nil {
			return nil, err
		}
		q.HIncrBy(ctx, t.rowBalances(), g.AggregateID, amount)
		q.Set(ctx, keys[i], g.To(), 0)
		ws[i].Advanced = true
	}
	return ws, nil
}

// plainInRow runs gs's guarded writes without idem: WATCH, read, then
// MULTI/EXEC on one connection.
func (t *RedisTarget) plainInRow(ctx context.Context, gs []*idem.RowGuard) error {
	keys := t.rowSeqKeys(gs)
	return t.client.Watch(ctx, func(rtx *redis.Tx) error {
		var ws []idem.RowWrite
		_, err := rtx.TxPipelined(ctx, func(p redis.Pipeliner) error {
			var err error
			ws, err = t.writeRows(ctx, rtx, p, keys, gs)
			return err
		})
		if err != nil {
			return fmt.Errorf("bench: exec: %w", err)
		}
		return checkAdvanced(gs, ws)
	}, keys...)
}

// PlainOneInRow implements InRowTarget.
func (t *RedisTarget) PlainOneInRow(ctx context.Context, msg *idem.Message) error {
	return t.plainInRow(ctx, oneGuard(msg))
}

// PlainBatchInRow implements InRowTarget.
func (t *RedisTarget) PlainBatchInRow(ctx context.Context, msgs []*idem.Message) error {
	return t.plainInRow(ctx, rowGuards(msgs))
}

// IdemOneInRow implements InRowTarget.
func (t *RedisTarget) IdemOneInRow(ctx context.Context, msg *idem.Message) error {
	out, err := t.inRowProc.Process(ctx, t.inRowH, msg)
	return checkApplied1(msg, out, err)
}

// IdemBatchInRow implements InRowTarget.
func (t *RedisTarget) IdemBatchInRow(ctx context.Context, msgs []*idem.Message) error {
	return processBatch(ctx, t.inRowProc, t.inRowH, msgs)
}
