package kafka_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/sqlite"
)

// A consumer-group member applies credits to a balance through
// idem.Consumer: the producer's retry (the same idem-id sent twice) is a
// Duplicate, and an offset is committed only once its record's outcome is
// durable. An in-process broker stands in for your cluster here.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "credits"))
	if err != nil {
		log.Fatal(err)
	}
	defer cluster.Close()

	dir, err := os.MkdirTemp("", "idem-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := sqlite.Open(filepath.Join(dir, "app.db"), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	drv, err := sqlite.New(db, nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE balance (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL); INSERT INTO balance VALUES (1, 0)`); err != nil {
		log.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	credit := &idem.Handler[*sql.Tx]{Name: "balance", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		amount, err := strconv.ParseInt(string(m.Payload), 10, 64)
		if err != nil {
			return idem.Permanent(err) // dead-lettered, never retried
		}
		_, err = tx.ExecContext(ctx, `UPDATE balance SET amount = amount + ? WHERE id = 1`, amount)
		return err
	}}
	consumer, err := idem.NewConsumer(proc, credit, drv, nil)
	if err != nil {
		log.Fatal(err)
	}

	// Count settled records so that the example knows when to stop.
	var settled atomic.Int64
	counting := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		v := consumer.HandleDelivery(ctx, d)
		if v.Ack {
			fmt.Println(d.Msg.ID, v.Outcome)
			settled.Add(1)
		}
		return v
	})
	member, err := kafka.New(&kafka.Config{Brokers: cluster.ListenAddrs(), Group: "balance", Topics: []string{"credits"}, Handler: counting})
	if err != nil {
		log.Fatal(err)
	}

	producer, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.DefaultProduceTopic("credits"))
	if err != nil {
		log.Fatal(err)
	}
	defer producer.Close()
	record := func(id, amount string) *kgo.Record {
		return &kgo.Record{Key: []byte("acct-1"), Value: []byte(amount), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(id)}}}
	}
	recs := []*kgo.Record{record("evt-1", "10"), record("evt-2", "20"), record("evt-1", "10")}
	if err := producer.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		log.Fatal(err)
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- member.Run(runCtx) }()
	for settled.Load() < int64(len(recs)) && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	<-done

	var balance int64
	if err := db.QueryRow(`SELECT amount FROM balance`).Scan(&balance); err != nil {
		log.Fatal(err)
	}
	fmt.Println("balance:", balance)
	// Output:
	// evt-1 applied
	// evt-2 applied
	// evt-1 duplicate
	// balance: 30
}
