package outbox_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/sqlite"
)

// An event sent to a subject no JetStream stream covers fails at every
// attempt. The operator finds it, parks it, and discards it once the
// owners of the subject agree it was a mistake; the other aggregates'
// events go out meanwhile.
func ExampleAdmin() {
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
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	for _, subject := range []string{"orders.placed", "ordres.placed"} { // a typo
		if _, err := ob.AddNext(ctx, tx, subject, "order-"+subject[:5], "OrderPlaced", []byte(`{}`)); err != nil {
			log.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	js, stop := startJetStream(dir) // a stream covering "orders.>"
	defer stop()
	pub, err := jetstream.NewPublisher(js)
	if err != nil {
		log.Fatal(err)
	}
	quiet := slog.New(slog.DiscardHandler)
	relay, err := outbox.NewRelay(drv, pub, &outbox.RelayConfig{Logger: quiet})
	if err != nil {
		log.Fatal(err)
	}
	res, _ := relay.RunOnce(ctx) // the typo fails
	fmt.Println("published", res.Published, "failed", res.Failed)

	adm, err := outbox.NewAdmin(drv, quiet)
	if err != nil {
		log.Fatal(err)
	}
	page, err := adm.List(ctx, driver.OutboxFilter{State: driver.OutboxFailing})
	if err != nil {
		log.Fatal(err)
	}
	stuck := page.Rows[0]
	fmt.Println(stuck.State, stuck.Destination, stuck.OrderingKey, "attempts", stuck.Attempts)
	if _, err := adm.Park(ctx, []int64{stuck.ID}, "alice", "no stream covers ordres.>"); err != nil {
		log.Fatal(err)
	}
	page, err = adm.List(ctx, driver.OutboxFilter{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(page.Rows[0].State, "by", page.Rows[0].ParkedBy, "; counts", page.Counts.Pending, page.Counts.Failing, page.Counts.Parked)
	done, err := adm.Discard(ctx, []int64{stuck.ID}, "alice", "typo; the order was re-sent")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("discarded", done.Done)
	page, err = adm.List(ctx, driver.OutboxFilter{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("unpublished", len(page.Rows))
	// Output:
	// published 1 failed 1
	// failing ordres.placed order-ordre attempts 1
	// parked by alice ; counts 0 0 1
	// discarded [2]
	// unpublished 0
}

// startJetStream starts an embedded NATS server storing in dir, with a
// stream ORDERS covering "orders.>", and returns a JetStream client and
// the function that stops both.
func startJetStream(dir string) (natsjs.JetStream, func()) {
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		log.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		log.Fatal("NATS did not start")
	}
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		log.Fatal(err)
	}
	js, err := natsjs.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := js.CreateStream(context.Background(), natsjs.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		log.Fatal(err)
	}
	return js, func() { nc.Close(); ns.Shutdown() }
}
