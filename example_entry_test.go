package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"strconv"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/sqlite"
)

// openLedger opens an in-memory SQLite store with idem's tables and a
// balances table.
func openLedger(ctx context.Context) (*sql.DB, *sqlite.Driver) {
	db, err := sqlite.Open(":memory:", nil)
	if err != nil {
		log.Fatal(err)
	}
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
	return db, drv
}

// credit adds the payload's decimal amount to the message's aggregate.
var credit = &idem.Handler[*sql.Tx]{
	Name: "balances",
	Apply: func(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
		amount, err := strconv.ParseInt(string(msg.Payload), 10, 64)
		if err != nil {
			return idem.Permanent(err) // retrying cannot fix it: a dead letter
		}
		_, err = tx.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?)
			ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, msg.AggregateID, amount)
		return err
	},
}

// A Consumer turns outcomes into broker verdicts: acknowledge what is
// durable, retry what may pass, dead-letter what never will. A broker
// adapter (package jetstream or kafka) calls HandleDelivery for every
// delivery and acknowledges only when the verdict says so.
func ExampleConsumer() {
	ctx := context.Background()
	db, drv := openLedger(ctx)
	defer db.Close()
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	c, err := idem.NewConsumer(proc, credit, drv, nil) // dead letters in the same store
	if err != nil {
		log.Fatal(err)
	}
	// Usually: jetstream.New(js, &jetstream.Config{…, Handler: c}).Run(ctx)
	for i, msg := range []*idem.Message{
		{ID: "evt-1", AggregateID: "alice", Payload: []byte("100")},
		{ID: "evt-1", AggregateID: "alice", Payload: []byte("100")}, // redelivered
		{ID: "evt-2", AggregateID: "alice", Payload: []byte("ten")}, // cannot be applied
	} {
		v := c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Source: "example", Attempt: 1})
		fmt.Printf("delivery %d: ack %v, %v, dead-lettered %v\n", i+1, v.Ack, v.Outcome, v.DeadLettered)
	}
	dls, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	var balance int64
	if err := db.QueryRow(`SELECT amount FROM balances WHERE account = 'alice'`).Scan(&balance); err != nil {
		log.Fatal(err)
	}
	fmt.Println("alice:", balance, "dead letter:", dls[0].MessageID, dls[0].Class)
	// Output:
	// delivery 1: ack true, applied, dead-lettered false
	// delivery 2: ack true, duplicate, dead-lettered false
	// delivery 3: ack true, none, dead-lettered true
	// alice: 100 dead letter: evt-2 permanent
}

// ProcessTx applies a message inside a transaction you own: the marker
// commits or rolls back with your other writes.
func ExampleProcessor_ProcessTx() {
	ctx := context.Background()
	db, drv := openLedger(ctx)
	defer db.Close()
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	msg := &idem.Message{ID: "evt-1", AggregateID: "bob", Payload: []byte("5")}
	for _, commit := range []bool{false, true, true} {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			log.Fatal(err)
		}
		out, err := proc.ProcessTx(ctx, tx, credit, msg)
		if err != nil {
			log.Fatal(err)
		}
		if commit {
			err = tx.Commit()
		} else {
			err = tx.Rollback() // the marker goes with the rest
		}
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(out, "committed:", commit)
	}
	// Output:
	// applied committed: false
	// applied committed: true
	// duplicate committed: true
}

// A Pruner deletes markers older than the retention, in bounded batches.
// It refuses a retention shorter than the broker may still redeliver.
func ExamplePruner() {
	ctx := context.Background()
	db, drv := openLedger(ctx)
	defer db.Close()
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := proc.Process(ctx, credit, &idem.Message{ID: "evt-1", AggregateID: "carol", Payload: []byte("1")}); err != nil {
		log.Fatal(err)
	}

	_, err = idem.NewPruner(drv, &idem.RetentionConfig{Retention: time.Hour, RedeliveryHorizon: 24 * time.Hour})
	var re *idem.RetentionError
	fmt.Println("a retention below the horizon refused:", errors.As(err, &re))

	// Eight days later (Now stands in for the clock), a week's retention
	// deletes the marker. Run it on an interval: go p.Run(ctx, time.Hour).
	p, err := idem.NewPruner(drv, &idem.RetentionConfig{Retention: 7 * 24 * time.Hour, RedeliveryHorizon: 72 * time.Hour,
		Now: func() time.Time { return time.Now().Add(8 * 24 * time.Hour) }})
	if err != nil {
		log.Fatal(err)
	}
	st, err := p.Prune(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("markers deleted:", st.Deleted)
	// Output:
	// a retention below the horizon refused: true
	// markers deleted: 1
}

// Versions allocates gap-free per-aggregate sequences inside the business
// transaction, for events the service emits; Advance is optimistic
// concurrency on the same counter.
func ExampleVersions() {
	ctx := context.Background()
	db, drv := openLedger(ctx)
	defer db.Close()
	vs, err := idem.NewVersions(drv)
	if err != nil {
		log.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback()
	for range 2 {
		seq, err := vs.Next(ctx, tx, "accounts", "alice")
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println("next:", seq)
	}
	_, err = vs.Advance(ctx, tx, "accounts", "alice", 1) // read at version 1: stale
	var ve *idem.ExpectedVersionError
	fmt.Println("advance from 1:", errors.As(err, &ve))
	seq, err := vs.Advance(ctx, tx, "accounts", "alice", 2)
	fmt.Println("advance from 2:", seq, err)
	// Output:
	// next: 1
	// next: 2
	// advance from 1: true
	// advance from 2: 3 <nil>
}
