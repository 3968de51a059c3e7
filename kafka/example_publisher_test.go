package kafka_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/sqlite"
)

// The outbox relay publishes through a Publisher: the record key is the
// aggregate, so one aggregate's events share a partition and keep their
// order, and the ID, sequence and type travel in the headers DefaultMap
// reads. An in-process cluster stands in for yours here.
func ExamplePublisher() {
	ctx := context.Background()
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
	ob, err := outbox.New(drv)
	if err != nil {
		log.Fatal(err)
	}
	// The event commits with the business write (none here, for brevity).
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := ob.AddNext(ctx, tx, "orders", "order-7", "OrderPlaced", []byte(`{"total":42}`)); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, "orders")) // the topic: the outbox stream
	if err != nil {
		log.Fatal(err)
	}
	defer cluster.Close()
	cl, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...))
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	pub, err := kafka.NewPublisher(cl)
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.NewRelay(drv, pub, nil)
	if err != nil {
		log.Fatal(err)
	}
	res, err := relay.RunOnce(ctx) // in a service: go relay.Run(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("published", res.Published)

	rd, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.ConsumeTopics("orders"))
	if err != nil {
		log.Fatal(err)
	}
	defer rd.Close()
	rec := rd.PollFetches(ctx).Records()[0]
	msg, err := kafka.DefaultMap(rec)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(rec.Key), msg.ID, msg.Seq, msg.Type, string(msg.Payload))
	// Output:
	// published 1
	// order-7 6:orders-order-7-1 1 OrderPlaced {"total":42}
}
