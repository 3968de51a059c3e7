package watermill_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/sqlite"
	idemwm "github.com/idemhq/idem/watermill"
)

// A Watermill router credits accounts through idem: a republished message
// is a Duplicate, and a payload the handler refuses is dead-lettered in
// idem's store; both are acknowledged.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idem-watermill-")
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
	if _, err := db.Exec(`CREATE TABLE balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	// The idem side: a handler writing in idem's transaction, and the
	// Consumer deciding every delivery.
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	credit := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		amount, err := strconv.Atoi(string(m.Payload))
		if err != nil {
			return idem.Permanent(err) // dead-lettered, not retried
		}
		_, err = tx.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?)
ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, m.AggregateID, amount)
		return err
	}}
	quiet := slog.New(slog.DiscardHandler)
	consumer, err := idem.NewConsumer(proc, credit, drv, &idem.ConsumerConfig{Logger: quiet})
	if err != nil {
		log.Fatal(err)
	}

	// The Watermill side: the bridge is the router's handler.
	handler, err := idemwm.New(consumer, &idemwm.Config{Logger: quiet})
	if err != nil {
		log.Fatal(err)
	}
	pubSub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, nil)
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	if err != nil {
		log.Fatal(err)
	}
	router.AddConsumerHandler("balances", "credits", pubSub, handler.Handle)
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	send := func(id, account, amount string) {
		msg := message.NewMessage(id, []byte(amount)) // the UUID is idem's message ID
		msg.Metadata.Set(idemwm.MetadataAggregate, account)
		if err := pubSub.Publish("credits", msg); err != nil { // returns once acknowledged
			log.Fatal(err)
		}
	}
	send("evt-1", "acct-1", "10")
	send("evt-2", "acct-1", "5")
	send("evt-1", "acct-1", "10") // a producer's retry: a Duplicate
	send("evt-3", "acct-2", "ten")

	var balance int
	if err := db.QueryRow(`SELECT amount FROM balances WHERE account = 'acct-1'`).Scan(&balance); err != nil {
		log.Fatal(err)
	}
	fmt.Println("acct-1:", balance)
	dls, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	for _, dl := range dls {
		fmt.Println("dead letter:", dl.MessageID, dl.Class)
	}
	// Output:
	// acct-1: 15
	// dead letter: evt-3 permanent
}
