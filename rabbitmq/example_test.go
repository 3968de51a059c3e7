package rabbitmq_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/rabbitmq"
	"github.com/idemhq/idem/sqlite"
)

// A queue consumer applies credits to a balance through idem.Consumer: a
// producer's retry (the same message-id published again) is a Duplicate,
// and a delivery is acknowledged only once its outcome is committed. It
// runs against the RabbitMQ server at IDEM_RABBITMQ_URL (default
// amqp://guest:guest@127.0.0.1:5672/).
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := os.Getenv("IDEM_RABBITMQ_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	queue := "idem-example-" + hex.EncodeToString(b)

	// The work queue: a durable quorum queue (Run declares it too).
	conn, err := amqp.Dial(url)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": rabbitmq.QueueQuorum}); err != nil {
		log.Fatal(err)
	}
	defer ch.QueueDelete(queue, false, false, false)

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

	// Count settled deliveries so that the example knows when to stop.
	var settled atomic.Int64
	counting := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		v := consumer.HandleDelivery(ctx, d)
		if v.Ack {
			fmt.Println(d.Msg.ID, v.Outcome)
			settled.Add(1)
		}
		return v
	})
	c, err := rabbitmq.New(&rabbitmq.Config{URL: url, Queue: queue, Handler: counting})
	if err != nil {
		log.Fatal(err)
	}

	// The Publisher sends with publisher confirms: the ID in message-id,
	// Stream as the routing key (the default exchange routes it to the
	// queue of that name).
	pub, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: url})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	for _, m := range []*idem.Message{
		{ID: "evt-1", Stream: queue, Payload: []byte("10")},
		{ID: "evt-2", Stream: queue, Payload: []byte("20")},
		{ID: "evt-1", Stream: queue, Payload: []byte("10")}, // the producer's retry
	} {
		if err := pub.Publish(ctx, []*idem.Message{m}); err != nil {
			log.Fatal(err)
		}
	}
	const published = 3

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
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
