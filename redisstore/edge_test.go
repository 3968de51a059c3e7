package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// TestGapSightingsStayBounded: the ordering guard's gap sightings
// (GapWait) are kept in one hash per aggregate, a field per sequence seen
// behind a gap; each sighting forgets the sequences the aggregate has
// reached. They used to stay for good (the SQL stores' Pruner deletes
// them, Redis has none, and MarkerTTL expires the hash only once the
// aggregate is quiet), so an aggregate meeting brief reorderings grew its
// hash without bound, version-only mode included.
func TestGapSightingsStayBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c, prefix, _, proc := openProc(t, &redisstore.Config{MarkerTTL: time.Hour})
	h := &idem.Handler[*redisstore.Tx]{Name: "gw",
		Ordering: &idem.Ordering{Gap: idem.GapWait, VersionOnly: true},
		Apply:    func(context.Context, *redisstore.Tx, *idem.Message) error { return nil }}
	msg := func(seq int64) *idem.Message {
		return &idem.Message{ID: fmt.Sprintf("e-%d", seq), AggregateID: "agg", Seq: seq}
	}
	const rounds = 50
	for k := int64(1); k < 2*rounds; k += 2 {
		// k+1 arrives first (a brief reordering), then k, then k+1 again.
		if _, err := proc.Process(ctx, h, msg(k+1)); !errors.Is(err, idem.ErrGap) {
			t.Fatalf("seq %d first: %v; want a gap", k+1, err)
		}
		for _, s := range []int64{k, k + 1} {
			if out, err := proc.Process(ctx, h, msg(s)); err != nil || out != idem.Applied {
				t.Fatalf("seq %d: %v, %v; want applied", s, out, err)
			}
		}
	}
	// Every gap closed; the aggregate stands at 2*rounds.
	n, err := c.HLen(ctx, prefix+"g:gw|agg").Result()
	if err != nil {
		t.Fatal(err)
	}
	if n > 1 {
		t.Fatalf("gap sightings of one aggregate: %d fields, all for sequences the aggregate has passed; want at most 1 (bounded)", n)
	}
}

// TestNilTxIsAnError: a nil *Tx is an error, never a panic, whatever
// the call (a version-only handler's guard and Versions.Next panicked).
func TestNilTxIsAnError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, _, drv, proc := openProc(t, nil)
	plain := &idem.Handler[*redisstore.Tx]{Name: "plain", Apply: func(context.Context, *redisstore.Tx, *idem.Message) error { return nil }}
	vonly := &idem.Handler[*redisstore.Tx]{Name: "vonly", Ordering: &idem.Ordering{VersionOnly: true},
		Apply: func(context.Context, *redisstore.Tx, *idem.Message) error { return nil }}
	vs, err := idem.NewVersions[*redisstore.Tx](drv)
	if err != nil {
		t.Fatal(err)
	}
	msg := &idem.Message{ID: "m-1", AggregateID: "a", Seq: 1}
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"ProcessTx plain", func() error { _, err := proc.ProcessTx(ctx, nil, plain, msg); return err }},
		{"ProcessTx version-only", func() error { _, err := proc.ProcessTx(ctx, nil, vonly, msg); return err }},
		{"Versions.Next", func() error { _, err := vs.Next(ctx, nil, "s", "a"); return err }},
	} {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("%s with a nil *Tx panicked: %v; want an error", tc.name, strings.SplitN(fmt.Sprint(r), "\n", 2)[0])
				}
			}()
			if err := tc.call(); err == nil {
				t.Errorf("%s with a nil *Tx: no error", tc.name)
			}
		}()
	}
}

// TestSlowTransactionAloneAborts: a transaction that outlives LockTTL
// cannot commit, even with no competitor (Redis 7 aborts EXEC on a watched
// key that expired), as Config.LockTTL documents.
func TestSlowTransactionAloneAborts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, _, _, proc := openProc(t, &redisstore.Config{LockTTL: 50 * time.Millisecond})
	h := &idem.Handler[*redisstore.Tx]{Name: "slow", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		time.Sleep(200 * time.Millisecond)
		return nil
	}}
	if out, err := proc.Process(ctx, h, &idem.Message{ID: "m"}); !errors.Is(err, redisstore.ErrAborted) {
		t.Fatalf("slow alone: %v, %v; want ErrAborted", out, err)
	}
}

// TestCancelledWaitReleasesMarkers: a batch whose context ends while it
// waits for a marker another transaction holds lets go of the markers it
// took.
func TestCancelledWaitReleasesMarkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c, _, drv, proc := openProc(t, nil)
	holder, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Rollback(ctx, holder)
	if _, err := proc.ProcessTx(ctx, holder, &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(context.Context, *redisstore.Tx, *idem.Message) error { return nil }}, &idem.Message{ID: "b"}); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
	defer cancel()
	h := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(context.Context, *redisstore.Tx, *idem.Message) error { return nil }}
	_, err = proc.ProcessBatch(cctx, h, []*idem.Message{{ID: "a"}, {ID: "b"}, {ID: "c"}})
	if err == nil {
		t.Fatal("batch waiting on a held marker past its context: no error")
	}
	for _, id := range []string{"a", "c"} {
		v, err := c.Get(ctx, drv.MarkerKey("h", id)).Result()
		if err == nil {
			t.Errorf("marker %s left behind: %q", id, v)
		}
	}
}

// TestCancelledDuringHandler: the context ends while the handler runs:
// the outcome reported and the state agree (applied with marker and
// effect, or neither).
func TestCancelledDuringHandler(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c, prefix, drv, proc := openProc(t, nil)
	cctx, cancel := context.WithCancel(ctx)
	h := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		cancel()
		return tx.Queue().Incr(ctx, prefix+"n").Err()
	}}
	out, err := proc.Process(cctx, h, &idem.Message{ID: "a"})
	v, gerr := c.Get(ctx, drv.MarkerKey("h", "a")).Result()
	n, _ := c.Get(ctx, prefix+"n").Result()
	if applied := gerr == nil && strings.HasPrefix(v, "d:"); (err == nil && out == idem.Applied) != applied || applied != (n == "1") {
		t.Fatalf("out %v err %v; marker %q %v; n=%q", out, err, v, gerr, n)
	}
}

// TestHoldsCutOffByAnOutageAreLetGo kills the server while a transaction
// holds a message's marker and an aggregate's version lock, so that the
// transaction cannot let go of them, and starts the server again (its
// append-only file kept both). The redelivery must not wait out their
// LockTTL (an hour here): the driver lets go of the orphaned holds at its
// next transaction.
func TestHoldsCutOffByAnOutageAreLetGo(t *testing.T) {
	t.Parallel()
	srv := testenv.NewRedisServer(t)
	ctx := context.Background()
	client := srv.Client(redis.Options{MaxRetries: -1})
	drv, err := redisstore.New(client, &redisstore.Config{LockTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	versions, err := idem.NewVersions(drv)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*redisstore.Tx]{Name: "credit", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		if _, err := versions.Next(ctx, tx, "orders", "o-1"); err != nil {
			return err
		}
		if string(m.Payload) == "crash" {
			srv.Crash() // the marker is held; the commit will not answer
		}
		return tx.Queue().IncrBy(ctx, "balance", 1).Err()
	}}
	msg := &idem.Message{ID: "m-1", Payload: []byte("crash")}
	if _, err := proc.Process(ctx, h, msg); err == nil {
		t.Fatal("Process succeeded with the server killed mid-transaction")
	}
	srv.Start()
	msg.Payload = []byte("again")
	// Not the same payload: the first attempt's marker was a hold, never
	// applied, so this is no conflict. A hold left to its LockTTL would
	// block this call past the deadline.
	dctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	out, err := proc.Process(dctx, h, msg)
	if err != nil || out != idem.Applied {
		t.Fatalf("redelivery after the outage: %v, %v; want Applied at once", out, err)
	}
	if n, err := client.Get(ctx, "balance").Int64(); err != nil || n != 1 {
		t.Fatalf("balance %d (%v), want 1", n, err)
	}
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Rollback(ctx, tx)
	if v, err := versions.Current(ctx, tx, "orders", "o-1"); err != nil || v != 1 {
		t.Fatalf("version %d (%v), want 1: the cut-off transaction's number is given back", v, err)
	}
}
