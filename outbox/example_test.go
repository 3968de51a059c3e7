package outbox_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/sqlite"
)

// A service credits an account and emits the event in the same
// transaction; a relay publishes it to JetStream once the transaction has
// committed. An embedded server stands in for yours here.
func Example() {
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
	if err := drv.Migrate(ctx); err != nil { // the outbox tables come with idem's migrations
		log.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		log.Fatal(err)
	}

	// The business transaction: the balance and the event commit together.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO accounts VALUES ('acct-1', 10)`); err != nil {
		log.Fatal(err)
	}
	msg, err := ob.AddNext(ctx, tx, "credits.accounts", "acct-1", "FundsCredited", []byte(`{"amount":10}`))
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("added", msg.ID)

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

	// The relay: in a service, relay.Run(ctx) on its own goroutine.
	pub, err := jetstream.NewPublisher(js)
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.NewRelay(drv, pub, nil)
	if err != nil {
		log.Fatal(err)
	}
	res, err := relay.RunOnce(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("published", res.Published)

	stream, err := js.Stream(ctx, "CREDITS")
	if err != nil {
		log.Fatal(err)
	}
	raw, err := stream.GetMsg(ctx, 1)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(raw.Subject, raw.Header.Get(jetstream.HeaderMsgID), raw.Header.Get(jetstream.HeaderSeq), string(raw.Data))
	// Output:
	// added 16:credits.accounts-acct-1-1
	// published 1
	// credits.accounts 16:credits.accounts-acct-1-1 1 {"amount":10}
}
