package jetstream_test

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

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/sqlite"
)

// A durable pull consumer applies credits to a balance through
// idem.Consumer: a producer's retry published outside JetStream's
// Nats-Msg-Id window (the same ID, a new stream message) is a Duplicate, and
// a message is acknowledged only once its outcome is durable. An embedded
// server stands in for yours here.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "idem-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		log.Fatal(err)
	}
	go ns.Start()
	defer ns.Shutdown()
	if !ns.ReadyForConnections(10 * time.Second) {
		log.Fatal("NATS did not start")
	}
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := natsjs.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, natsjs.StreamConfig{Name: "CREDITS", Subjects: []string{"credits.>"}}); err != nil {
		log.Fatal(err)
	}
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
	member, err := jetstream.New(js, &jetstream.Config{Stream: "CREDITS", Durable: "balance", Handler: counting})
	if err != nil {
		log.Fatal(err)
	}

	publish := func(id, amount string) {
		m := &nats.Msg{Subject: "credits.acct-1", Data: []byte(amount), Header: nats.Header{}}
		m.Header.Set(jetstream.HeaderID, id)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			log.Fatal(err)
		}
	}
	publish("evt-1", "10")
	publish("evt-2", "20")
	publish("evt-1", "10")
	const published = 3

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- member.Run(runCtx) }()
	for settled.Load() < published && ctx.Err() == nil {
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
