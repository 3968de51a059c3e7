package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/redisstore"
)

// TestBatchAboveMaxWatchedKeys: a batch that would watch more keys than
// MaxWatchedKeys is refused at once with ErrTooManyKeys (an
// idem.ErrInvalidConfig), before anything is locked or watched: no marker,
// lock or effect is left behind. One at the limit applies. An
// idem.Consumer given the oversized batch decides its deliveries one by
// one, so every message is still applied exactly once.
func TestBatchAboveMaxWatchedKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, prefix, drv, proc := openProc(t, &redisstore.Config{MaxWatchedKeys: 10})
	events := func(from, n int) ([]*idem.Message, map[string]int64) {
		var msgs []*idem.Message
		want := map[string]int64{}
		for i := from; i < from+n; i++ {
			e := idemtest.Event{ID: fmt.Sprintf("evt-%03d", i), Account: fmt.Sprintf("acct-%d", i%3), Amount: int64(i + 1)}
			msgs = append(msgs, e.Message())
			want[e.Account] += e.Amount
		}
		return msgs, want
	}
	h := idemtest.CreditHandler(s, "credits", nil)
	big, _ := events(0, 11)
	start := time.Now()
	_, err := proc.ProcessBatch(ctx, h, big)
	if !errors.Is(err, redisstore.ErrTooManyKeys) || !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("batch of 11 with MaxWatchedKeys 10: %v; want ErrTooManyKeys", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("refusing took %s", el)
	}
	if keys, err := scan(ctx, c, prefix+"*"); err != nil || len(keys) != 0 {
		t.Fatalf("after the refusal: keys %q (%v); want none", keys, err)
	}

	// Ordered: 9 markers and 3 sequences are 12 keys.
	ordered := idemtest.CreditHandler(s, "ordered", nil)
	ordered.Ordering = &idem.Ordering{Gap: idem.GapAllow}
	nine, _ := events(100, 9)
	for i, m := range nine {
		m.AggregateID, m.Seq = fmt.Sprintf("agg-%d", i%3), int64(i/3+1)
	}
	if _, err := proc.ProcessBatch(ctx, ordered, nine); !errors.Is(err, redisstore.ErrTooManyKeys) {
		t.Fatalf("ordered batch of 9 (12 keys): %v; want ErrTooManyKeys", err)
	}

	ten, want := events(200, 10)
	outs, err := proc.ProcessBatch(ctx, h, ten)
	if err != nil {
		t.Fatalf("batch of 10: %v", err)
	}
	for i, o := range outs {
		if o != idem.Applied {
			t.Fatalf("batch of 10: message %d %v", i, o)
		}
	}

	// Through a consumer: the oversized batch falls back to one by one.
	cons, err := idem.NewConsumer(proc, h, drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var ds []*idem.Delivery
	for _, m := range big {
		ds = append(ds, &idem.Delivery{Msg: m, Attempt: 1})
	}
	for i, v := range cons.HandleDeliveries(ctx, ds) {
		if !v.Ack || v.Outcome != idem.Applied {
			t.Fatalf("consumer, delivery %d: %+v; want applied and acknowledged", i, v)
		}
	}
	_, wantBig := events(0, 11)
	for a, w := range wantBig {
		want[a] += w
	}
	got, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for a, w := range want {
		if got[a] != w {
			t.Errorf("balance %s = %d; want %d", a, got[a], w)
		}
	}
	if n, err := s.Markers(ctx, "credits"); err != nil || n != 21 {
		t.Errorf("markers of credits: %d (%v); want 21", n, err)
	}

	// The caller's own watches count too.
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Rollback(ctx, tx)
	keys := make([]string, 11)
	for i := range keys {
		keys[i] = fmt.Sprintf("%sk%d", prefix, i)
	}
	if err := tx.Watch(ctx, keys[:6]...); err != nil {
		t.Fatal(err)
	}
	if err := tx.Watch(ctx, keys[6:]...); !errors.Is(err, redisstore.ErrTooManyKeys) {
		t.Fatalf("watching 11 keys: %v; want ErrTooManyKeys", err)
	}
}

// TestDefaultMaxWatchedKeys: without a setting, the bound is
// DefaultMaxWatchedKeys, and a negative setting is refused.
func TestDefaultMaxWatchedKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, c, prefix, _, proc := openProc(t, nil)
	msgs := make([]*idem.Message, redisstore.DefaultMaxWatchedKeys+1)
	for i := range msgs {
		msgs[i] = idemtest.Event{ID: fmt.Sprintf("m-%05d", i), Account: "a", Amount: 1}.Message()
	}
	if _, err := proc.ProcessBatch(ctx, idemtest.CreditHandler(s, "credits", nil), msgs); !errors.Is(err, redisstore.ErrTooManyKeys) {
		t.Fatalf("batch of %d: %v; want ErrTooManyKeys", len(msgs), err)
	}
	if keys, err := scan(ctx, c, prefix+"*"); err != nil || len(keys) != 0 {
		t.Fatalf("after the refusal: %d keys (%v); want none", len(keys), err)
	}
	if _, err := redisstore.New(c, &redisstore.Config{MaxWatchedKeys: -1}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("MaxWatchedKeys -1: %v; want ErrInvalidConfig", err)
	}
}
