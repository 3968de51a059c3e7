package kafka_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/sqlite"
)

// TestStoreOutageDoesNotBlockRebalance: the store is down and a member
// waits for it with a record in hand. A member joining the group gets its
// partitions at once: the wait ends for the rebalance as it does for a
// stop, the record is not committed and counts no attempt, and once the
// store is back it is applied, once, on its first attempt. Before, the
// rebalance waited for the store (or for the group's rebalance timeout,
// which dropped the waiting member).
func TestStoreOutageDoesNotBlockRebalance(t *testing.T) {
	t.Parallel()
	var applied atomic.Int32
	path, _, _, consumer := outageConsumer(t, &idem.Handler[*sql.Tx]{Name: "proj", Apply: func(context.Context, *sql.Tx, *idem.Message) error {
		applied.Add(1)
		return nil
	}})
	var (
		mu       sync.Mutex
		attempts []int // of the deliveries acknowledged
	)
	held := make(chan struct{})
	var once sync.Once
	dh := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		once.Do(func() { close(held) })
		v := consumer.HandleDelivery(ctx, d)
		if v.Ack {
			mu.Lock()
			attempts = append(attempts, d.Attempt)
			mu.Unlock()
		}
		return v
	})
	release := testenv.HoldSQLite(t, path) // the store is down
	b := newBroker(t).(*broker)
	b.produce(t, []*kgo.Record{{Key: []byte("k"), Value: []byte("v"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("m1")}}}})
	slow := kgo.RebalanceTimeout(30 * time.Second)
	b.start(t, b.consumer(t, dh, nil, 1, slow))
	select {
	case <-held:
	case <-time.After(15 * time.Second):
		t.Fatal("the record was not delivered in 15 s")
	}
	time.Sleep(500 * time.Millisecond) // waiting for the store
	b.join(t, dh, 10*time.Second, "the store", slow)
	release()
	for deadline := time.Now().Add(15 * time.Second); applied.Load() == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the record was not applied once the store was back")
		}
	}
	time.Sleep(500 * time.Millisecond) // a second application would show by now
	if n := applied.Load(); n != 1 {
		t.Fatalf("applied %d times, want once", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) == 0 || attempts[0] != 1 {
		t.Fatalf("acknowledged at attempts %v; want the first at attempt 1 (a wait for the store is no attempt)", attempts)
	}
}

// outageConsumer opens a SQLite store in a file of its own, which the
// test takes down with testenv.HoldSQLite(t, path), and returns it with a
// consumer applying h through it that probes the store every 20 to 100 ms.
func outageConsumer(t *testing.T, h *idem.Handler[*sql.Tx], hooks ...idem.Hook) (path string, db *sql.DB, drv *sqlite.Driver, c *idem.Consumer[*sql.Tx]) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "idem.db")
	db, drv = testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err = idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t), Hooks: hooks,
		ProbeBackoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	return path, db, drv, c
}
