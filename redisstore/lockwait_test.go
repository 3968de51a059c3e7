package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/redisstore"
)

// A caller's transaction that watched a key must abort when that key
// changes before the commit, also when the server lost its script cache
// meanwhile: retrying the script must not drop the caller's watch. Not
// parallel: another test's script call would reload the scripts between
// the flush and this one's.
func TestScriptCacheLostKeepsCallersWatch(t *testing.T) {
	ctx := context.Background()
	_, c, prefix, drv, proc := openProc(t, nil)
	key := prefix + "watched"
	h := &idem.Handler[*redisstore.Tx]{Name: "h", Ordering: &idem.Ordering{Gap: idem.GapAllow},
		Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
			return tx.Queue().Set(ctx, key, "mine", 0).Err()
		}}
	for _, flush := range []bool{false, true} {
		if err := c.Del(ctx, key).Err(); err != nil {
			t.Fatal(err)
		}
		tx, err := drv.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Watch(ctx, key); err != nil {
			t.Fatal(err)
		}
		if err := tx.Conn().Get(ctx, key).Err(); !errors.Is(err, redis.Nil) {
			t.Fatal(err)
		}
		if err := c.Set(ctx, key, "theirs", 0).Err(); err != nil { // a concurrent write
			t.Fatal(err)
		}
		if flush {
			if err := c.ScriptFlush(ctx).Err(); err != nil { // a restart, a failover
				t.Fatal(err)
			}
		}
		msg := &idem.Message{ID: "m", AggregateID: "a", Seq: 1}
		if flush {
			msg.ID, msg.Seq = "m-flushed", 2
		}
		_, err = proc.ProcessTx(ctx, tx, h, msg)
		if err == nil {
			err = drv.Commit(ctx, tx)
		} else {
			_ = drv.Rollback(ctx, tx)
		}
		if v, _ := c.Get(ctx, key).Result(); !errors.Is(err, redisstore.ErrAborted) || v != "theirs" {
			t.Fatalf("flush %v: %v, key %q; want ErrAborted and the concurrent write kept", flush, err, v)
		}
	}
}

// Two transactions that each hold a lock the other waits for (a handler
// taking two aggregates' versions in either order) would wait until their
// contexts end: Redis sees no cycle. A transaction holding locks waits
// LockTTL to 1.5 × LockTTL at most, so one gives up with ErrLockWait, rolls back, and the
// other goes on.
func TestLockCycleEnds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, _, drv, _ := openProc(t, &redisstore.Config{LockTTL: time.Second})
	vs, err := idem.NewVersions[*redisstore.Tx](drv)
	if err != nil {
		t.Fatal(err)
	}
	txs := make([]*redisstore.Tx, 2)
	for i, agg := range []string{"A", "B"} {
		if txs[i], err = drv.Begin(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := vs.Next(ctx, txs[i], "s", agg); err != nil {
			t.Fatal(err)
		}
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, agg := range []string{"B", "A"} {
		wg.Go(func() {
			if _, errs[i] = vs.Next(wctx, txs[i], "s", agg); errs[i] != nil {
				_ = drv.Rollback(ctx, txs[i])
			}
		})
	}
	wg.Wait()
	if errors.Is(errs[0], context.DeadlineExceeded) || errors.Is(errs[1], context.DeadlineExceeded) {
		t.Fatalf("the cycle lasted until the context ended: %v; %v", errs[0], errs[1])
	}
	if !errors.Is(errs[0], redisstore.ErrLockWait) && !errors.Is(errs[1], redisstore.ErrLockWait) {
		t.Fatalf("%v; %v; want one ErrLockWait", errs[0], errs[1])
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("the cycle ended after %s", d)
	}
	for i, err := range errs {
		if err == nil {
			if err := drv.Commit(ctx, txs[i]); err != nil {
				t.Fatalf("the transaction that went on: commit: %v", err)
			}
		}
	}
}

// A batch that trails others through its markers waits for one after
// another, each briefly, as their holders apply them: progress, and no
// lock cycle, however long it adds up to. Five holders take the markers
// after the batch's first one 0.6 s apart and commit each 1.2 s after
// taking it, so the batch, holding its first marker, waits 3.6 s in all
// (more than LockTTL 2 s plus half of it) but at most 1.2 s for any one.
// Counted over the whole call, that wait failed with ErrLockWait.
func TestTrailingBatchWaitsPerKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, _, drv, _ := openProc(t, &redisstore.Config{LockTTL: 2 * time.Second})
	ids := []string{"m0", "m1", "m2", "m3", "m4", "m5"}
	hash := []byte("h")
	start := time.Now()
	var wg sync.WaitGroup
	holderErrs := make([]error, len(ids))
	for i := 1; i < len(ids); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Until(start.Add(time.Duration(i-1) * 600 * time.Millisecond)))
			tx, err := drv.Begin(ctx)
			if err != nil {
				holderErrs[i] = err
				return
			}
			res, err := drv.MarkerInsert(ctx, tx, &driver.MarkerInsertParams{Handler: "h", MessageID: ids[i], PayloadHash: hash})
			if err != nil || !res.Inserted {
				_ = drv.Rollback(ctx, tx)
				holderErrs[i] = fmt.Errorf("holder of %s: %+v, %v; want it inserted", ids[i], res, err)
				return
			}
			time.Sleep(time.Until(start.Add(time.Duration(i-1)*600*time.Millisecond + 1200*time.Millisecond)))
			holderErrs[i] = drv.Commit(ctx, tx)
		}()
	}
	time.Sleep(100 * time.Millisecond) // after the first holder
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	hashes := make([][]byte, len(ids))
	for i := range hashes {
		hashes[i] = hash
	}
	res, err := drv.MarkerInsertMany(ctx, tx, &driver.MarkerInsertManyParams{Handler: "h", MessageIDs: ids, PayloadHashes: hashes})
	waited := time.Since(start)
	if err == nil {
		err = drv.Commit(ctx, tx)
	} else {
		_ = drv.Rollback(ctx, tx)
	}
	wg.Wait()
	if err != nil {
		t.Fatalf("the trailing batch, after %s: %v; want its markers inserted or found", waited.Round(time.Millisecond), err)
	}
	if err := errors.Join(holderErrs...); err != nil {
		t.Fatal(err)
	}
	if !res[0].Inserted {
		t.Fatalf("%s: %+v; want it inserted by the batch", ids[0], res[0])
	}
	for i := 1; i < len(ids); i++ {
		if res[i].Inserted || string(res[i].ExistingHash) != string(hash) {
			t.Fatalf("%s: %+v; want the holder's marker found", ids[i], res[i])
		}
	}
	if waited < 3*time.Second {
		t.Fatalf("the batch was done after %s; want it to have trailed all five holders (3.6 s)", waited.Round(time.Millisecond))
	}
}
