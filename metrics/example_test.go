package metrics_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/metrics"
	"github.com/idemhq/idem/sqlite"
)

// Install the metrics as a processor hook; serve reg with promhttp as usual.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idem-metrics")
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

	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		log.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{m}})
	if err != nil {
		log.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
	msg := &idem.Message{ID: "welcome-42", Payload: []byte("hello")}
	for range 3 { // one delivery and two redeliveries
		if _, err := proc.Process(ctx, h, msg); err != nil {
			log.Fatal(err)
		}
	}

	mfs, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "idem_messages_total" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			fmt.Print(mf.GetName(), "{")
			for i, l := range mt.GetLabel() {
				if i > 0 {
					fmt.Print(",")
				}
				fmt.Printf("%s=%q", l.GetName(), l.GetValue())
			}
			fmt.Println("}", mt.GetCounter().GetValue())
		}
	}
	// Output:
	// idem_messages_total{handler="mailer",outcome="applied"} 1
	// idem_messages_total{handler="mailer",outcome="duplicate"} 2
}
