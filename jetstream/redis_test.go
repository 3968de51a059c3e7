package jetstream_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// redisEnv is a Consumer crediting balances in a Redis hash through
// redisstore, with its dead letters and counters in the same Redis.
type redisEnv struct {
	t        *testing.T
	drv      *redisstore.Driver
	stats    *idem.StatsRecorder // counts duplicates into the same Redis
	balances func(ctx context.Context) (map[string]int64, error)
	consumer *idem.Consumer[*redisstore.Tx]
}

func newRedisEnv(t *testing.T) *redisEnv {
	client, prefix := testenv.Redis(t)
	drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix, LockTTL: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	stats, err := idem.NewStatsRecorder(drv, testenv.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{stats}})
	if err != nil {
		t.Fatal(err)
	}
	key := prefix + "balances"
	h := &idem.Handler[*redisstore.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
		acct, amt, err := idemtest.DecodeCredit(m.Payload)
		if err != nil {
			return idem.Permanent(err)
		}
		return tx.Queue().HIncrBy(ctx, key, acct, amt).Err()
	}}
	c, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return &redisEnv{t: t, drv: drv, stats: stats, consumer: c, balances: func(ctx context.Context) (map[string]int64, error) {
		return testenv.RedisInts(ctx, client, key)
	}}
}

// waitExact waits until the balances equal those of the unique intended
// events and at least minDups deliveries were counted as duplicates.
func (e *redisEnv) waitExact(events []idemtest.Event, minDups int64) {
	e.t.Helper()
	adaptertest.WaitExact(e.t, events, minDups, e.balances, adaptertest.StoredDuplicates(e.stats, e.drv, "balances"))
}

// TestRedisStoreEndToEnd runs a Consumer on redisstore behind the
// JetStream adapter, on an embedded server: a consumer killed before its
// ack, then three consumers on one durable with one killed mid-stream and
// 10% of the messages published twice. The balances must come out exactly
// as the unique events say, with the redeliveries seen as duplicates.
func TestRedisStoreEndToEnd(t *testing.T) {
	t.Parallel()
	t.Run("CrashBeforeAck", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t, testenv.EmbeddedNATS(t)), newRedisEnv(t)
		events := idemtest.Events(600)
		b.Publish(t, adaptertest.Messages(events), 0)
		<-b.StartCrashing(t, e.consumer)
		b.Start(t, e.consumer)
		e.waitExact(events, 1)
	})
	t.Run("ThreeConsumersOneKilled", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t, testenv.EmbeddedNATS(t)), newRedisEnv(t)
		events := idemtest.Events(1500)
		b.Publish(t, adaptertest.Messages(events), 10)
		kills := make([]func(), 3)
		for i := range kills {
			kills[i] = b.Start(t, e.consumer)
		}
		time.Sleep(50 * time.Millisecond)
		kills[1]()
		e.waitExact(events, 150) // every tenth published twice
	})
}

// TestBrokerRestartMidStream stops the NATS server (file store) for three
// seconds while a consumer on redisstore works through 1,500 events, a
// tenth published twice, and starts it again on the same port and store.
// The consumer must ride it out: its Run still running, no dead letter,
// and the balances exactly those of the unique events.
func TestBrokerRestartMidStream(t *testing.T) {
	t.Parallel()
	srv := testenv.NewNATSServer(t)
	b, e := newBroker(t, srv.URL()), newRedisEnv(t)
	events := idemtest.Events(1500)
	b.Publish(t, adaptertest.Messages(events), 10)
	var decided atomic.Int64
	nc, c := b.consumer(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		defer decided.Add(1)
		return e.consumer.HandleDelivery(ctx, d)
	}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; nc.Close() })
	for deadline := time.Now().Add(30 * time.Second); decided.Load() < 100; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("not 100 deliveries decided within 30 s")
		}
	}
	srv.Stop()
	if n := decided.Load(); n >= int64(len(events)) {
		t.Fatalf("%d deliveries decided before the broker stopped: not mid-stream", n)
	} else {
		t.Logf("broker stopped after %d of %d+ deliveries", n, len(events))
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned when the broker went away: %v", err)
	case <-time.After(3 * time.Second):
	}
	srv.Start()
	e.waitExact(events, 150)
	select {
	case err := <-done:
		t.Fatalf("Run returned: %v", err)
	default:
	}
	dls, err := e.drv.DeadLetterList(ctx, &driver.DeadLetterFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) > 0 {
		t.Fatalf("%d dead letters, the first %s: %s", len(dls), dls[0].Class, dls[0].Error)
	}
}
