package kafka_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
)

// TestDeadLetterHeldByOutageIsNoAttempt: records that do not decode (no
// idem-id) come while the store is down, so their dead letters wait for
// it. A member joins the group (on another topic: the first member keeps
// every partition), which ends the wait. That wait was no attempt of the
// records: once the store is back each is dead-lettered once, at attempt
// 1, as a delivery held by an outage is.
func TestDeadLetterHeldByOutageIsNoAttempt(t *testing.T) {
	t.Parallel()
	const other = "other"
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, topic), kfake.SeedTopics(1, other))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	b := &broker{addrs: cluster.ListenAddrs(), concurrency: 4}

	path, _, drv, consumer := outageConsumer(t, &idem.Handler[*sql.Tx]{Name: "proj", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }})
	var (
		mu         sync.Mutex
		deliveries []string // source@attempt: verdict
	)
	first := make(chan struct{})
	var once sync.Once
	dh := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		once.Do(func() { close(first) })
		v := consumer.HandleDelivery(ctx, d)
		mu.Lock()
		deliveries = append(deliveries, fmt.Sprintf("%s attempt %d: ack=%v err=%v", d.Source, d.Attempt, v.Ack, v.Err))
		mu.Unlock()
		return v
	})

	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	var recs []*kgo.Record
	for p := range int32(4) {
		recs = append(recs, &kgo.Record{Partition: p, Key: []byte(fmt.Sprint(p)), Value: []byte("no idem-id")})
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	cl.Close()

	release := testenv.HoldSQLite(t, path) // the store is down
	slow := kgo.RebalanceTimeout(30 * time.Second)
	b.start(t, b.consumer(t, dh, nil, 1, slow))
	select {
	case <-first:
	case <-time.After(15 * time.Second):
		t.Fatal("no record delivered in 15 s")
	}
	time.Sleep(time.Second) // the dead letters wait for the store

	// A member of the group on another topic: a rebalance that takes no
	// partition of topic from the first member.
	assigned := make(chan struct{})
	var aonce sync.Once
	j, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "idem", Topics: []string{other}, Handler: dh, Logger: testenv.Logger(t),
		Options: []kgo.Opt{kgo.SessionTimeout(6 * time.Second), slow, kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, got map[string][]int32) {
			if len(got[other]) > 0 {
				aonce.Do(func() { close(assigned) })
			}
		})}})
	if err != nil {
		t.Fatal(err)
	}
	b.start(t, j)
	select {
	case <-assigned:
	case <-time.After(15 * time.Second):
		t.Fatal("the joining member got no partition in 15 s")
	}
	time.Sleep(2 * time.Second) // the first member polls its partitions again, the store still down
	release()

	var dls []struct {
		source   string
		attempts int
	}
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		list, err := drv.DeadLetterList(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(list) >= 4 {
			dls = dls[:0]
			for _, d := range list {
				dls = append(dls, struct {
					source   string
					attempts int
				}{d.Source, d.Attempts})
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters 15 s after the store came back, want 4", len(list))
		}
	}
	time.Sleep(500 * time.Millisecond) // a second dead letter would show by now
	list, err := drv.DeadLetterList(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, d := range deliveries {
		t.Log(d)
	}
	if len(list) != 4 {
		t.Fatalf("%d dead letters, want 4 (one per record)", len(list))
	}
	for _, d := range dls {
		if d.attempts != 1 {
			t.Errorf("dead letter of %s at attempt %d, want 1: a wait for the store counted as an attempt", d.source, d.attempts)
		}
	}
}
