package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/redisstore"
)

// TestStressTakeoversNeverDoubleApply delivers every message of a stream
// twice, from 12 goroutines at once, one at a time and in batches, through
// a handler that often outlives the 30 ms lock (so other deliveries take
// messages over while it still runs) and sometimes fails. Each delivery is
// retried until it comes back Applied or Duplicate. Every message must
// then have been applied exactly once: the handler counts applications
// per ID in the same EXEC as the marker.
func TestStressTakeoversNeverDoubleApply(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	_, c, prefix, _, proc := openProc(t, &redisstore.Config{LockTTL: 30 * time.Millisecond})
	counts := prefix + "applied"
	const n = 300
	h := &idem.Handler[*redisstore.Tx]{Name: "stress", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		r := rand.IntN(10)
		switch {
		case r == 0:
			return errors.New("transient failure")
		case r < 4:
			time.Sleep(time.Duration(20+rand.IntN(40)) * time.Millisecond) // often past the lock
		}
		return tx.Queue().HIncrBy(ctx, counts, m.ID, 1).Err()
	}}
	msgs := make([]*idem.Message, n)
	for i := range msgs {
		msgs[i] = &idem.Message{ID: fmt.Sprintf("s-%04d", i), Payload: []byte("x")}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 12)
	for g := range 12 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 7))
			stream := append(append([]*idem.Message{}, msgs...), msgs...)
			r.Shuffle(len(stream), func(i, j int) { stream[i], stream[j] = stream[j], stream[i] })
			for len(stream) > 0 {
				k := 1 + r.IntN(12)
				if g%3 == 0 || k > len(stream) {
					k = 1
				}
				chunk := stream[:k]
				stream = stream[k:]
				for attempt := 0; ; attempt++ {
					if ctx.Err() != nil {
						errs <- ctx.Err()
						return
					}
					var err error
					if k == 1 {
						_, err = proc.Process(ctx, h, chunk[0])
					} else {
						_, err = proc.ProcessBatch(ctx, h, chunk)
					}
					if err == nil {
						break
					}
					if errors.Is(err, redisstore.ErrLockBusy) || errors.Is(err, redisstore.ErrExecPartial) {
						errs <- err // never expected here
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	got, err := c.HGetAll(ctx, counts).Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != n {
		t.Errorf("%d messages applied, want %d", len(got), n)
	}
	for id, v := range got {
		if v != "1" {
			t.Errorf("%s applied %s times", id, v)
		}
	}
}
