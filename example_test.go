package idem_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/sqlite"
)

// A projection that credits account balances. However often the broker
// redelivers FundsCredited, the balance moves once.
func Example() {
	ctx := context.Background()
	db, err := sqlite.Open(":memory:", nil)
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
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}

	credit := &idem.Handler[*sql.Tx]{
		Name: "balances", // stable: stored with every marker
		Apply: func(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
			var ev struct {
				Account string `json:"account"`
				Amount  int64  `json:"amount"`
			}
			if err := json.Unmarshal(msg.Payload, &ev); err != nil {
				return idem.Permanent(err) // retrying cannot fix a bad payload
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES (?, ?)
				ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, ev.Account, ev.Amount)
			return err
		},
	}

	msg := &idem.Message{ID: "evt-1", Type: "FundsCredited", Payload: []byte(`{"account":"alice","amount":100}`)}
	for range 3 { // the broker delivers it three times
		out, err := proc.Process(ctx, credit, msg)
		fmt.Println(out, err)
	}

	var balance int64
	if err := db.QueryRow(`SELECT amount FROM balances WHERE account = 'alice'`).Scan(&balance); err != nil {
		log.Fatal(err)
	}
	fmt.Println("alice:", balance)
	// Output:
	// applied <nil>
	// duplicate <nil>
	// duplicate <nil>
	// alice: 100
}

// The same message ID with a different payload is a producer bug: it is
// reported as a Conflict and never applied.
func ExampleConflictError() {
	ctx := context.Background()
	db, _ := sqlite.Open(":memory:", nil)
	defer db.Close()
	drv, _ := sqlite.New(db, nil)
	_ = drv.Migrate(ctx)
	proc, _ := idem.NewProcessor(drv, nil)
	h := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}

	_, _ = proc.Process(ctx, h, &idem.Message{ID: "order-7", Payload: []byte("v1")})
	out, err := proc.Process(ctx, h, &idem.Message{ID: "order-7", Payload: []byte("v2")})

	var ce *idem.ConflictError
	fmt.Println(out, errors.As(err, &ce), ce.MessageID, idem.IsPermanent(err))
	// Output: conflict true order-7 true
}

// Invalid envelopes are refused with a typed error before anything is
// written.
func ExampleMessage_Validate() {
	err := (&idem.Message{ID: "bad\x00id"}).Validate()
	var ve *idem.ValidationError
	fmt.Println(errors.Is(err, idem.ErrInvalidMessage), errors.As(err, &ve), ve.Field)
	fmt.Println(err)
	// Output:
	// true true ID
	// idem: invalid message: ID contains a NUL byte at offset 3 ("bad\x00id")
}

// ProcessBatch hands the handler only the messages it has not seen, so it
// can write them with one set-based statement.
func ExampleProcessor_ProcessBatch() {
	ctx := context.Background()
	db, _ := sqlite.Open(":memory:", nil)
	defer db.Close()
	drv, _ := sqlite.New(db, nil)
	_ = drv.Migrate(ctx)
	proc, _ := idem.NewProcessor(drv, nil)
	h := &idem.Handler[*sql.Tx]{
		Name: "indexer",
		ApplyBatch: func(ctx context.Context, tx *sql.Tx, msgs []*idem.Message) error {
			ids := make([]string, len(msgs))
			for i, m := range msgs {
				ids[i] = m.ID
			}
			fmt.Println("new:", ids)
			return nil
		},
	}
	msgs := func(ids ...string) []*idem.Message {
		out := make([]*idem.Message, len(ids))
		for i, id := range ids {
			out[i] = &idem.Message{ID: id}
		}
		return out
	}
	outs, _ := proc.ProcessBatch(ctx, h, msgs("a", "b", "c"))
	fmt.Println(outs)
	outs, _ = proc.ProcessBatch(ctx, h, msgs("b", "d", "d"))
	fmt.Println(outs)
	// Output:
	// new: [a b c]
	// [applied applied applied]
	// new: [d]
	// [duplicate applied duplicate]
}

// With an ordering guard a batch applies each aggregate's events in
// sequence order, whatever order they arrive in. An event behind a gap is
// left undecided (none) while the rest of the batch commits; once the
// missing event arrives, it applies.
func ExampleProcessor_ProcessBatch_ordering() {
	ctx := context.Background()
	db, _ := sqlite.Open(":memory:", nil)
	defer db.Close()
	drv, _ := sqlite.New(db, nil)
	_ = drv.Migrate(ctx)
	proc, _ := idem.NewProcessor(drv, nil)
	h := &idem.Handler[*sql.Tx]{
		Name:     "ledger",
		Ordering: &idem.Ordering{Gap: idem.GapWait},
		Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
			fmt.Printf("apply %s\n", m.ID)
			return nil
		},
	}
	ev := func(agg string, seqs ...int64) []*idem.Message {
		out := make([]*idem.Message, len(seqs))
		for i, q := range seqs {
			out[i] = &idem.Message{ID: fmt.Sprintf("%s-%d", agg, q), AggregateID: agg, Seq: q}
		}
		return out
	}
	outs, _ := proc.ProcessBatch(ctx, h, ev("acct", 2, 1, 4))
	fmt.Println(outs)
	outs, _ = proc.ProcessBatch(ctx, h, ev("acct", 4, 3))
	fmt.Println(outs)
	// Output:
	// apply acct-1
	// apply acct-2
	// [applied applied none]
	// apply acct-3
	// apply acct-4
	// [applied applied]
}

// One handler for a stream of several event types. A type without a route
// is bad input: a permanent error that a Consumer dead-letters with the
// type in the reason, never a silent drop.
func ExampleByType() {
	ctx := context.Background()
	db, _ := sqlite.Open(":memory:", nil)
	defer db.Close()
	drv, _ := sqlite.New(db, nil)
	_ = drv.Migrate(ctx)
	_, _ = db.Exec(`CREATE TABLE balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL)`)
	proc, _ := idem.NewProcessor(drv, nil)

	add := func(sign int64) func(context.Context, *sql.Tx, *idem.Message) error {
		return func(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
			var amount int64
			if _, err := fmt.Sscan(string(msg.Payload), &amount); err != nil {
				return idem.Permanent(err)
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?)
				ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, msg.AggregateID, sign*amount)
			return err
		}
	}
	accounts := &idem.Handler[*sql.Tx]{
		Name: "accounts",
		Apply: idem.ByType(idem.Routes[*sql.Tx]{
			"FundsCredited": add(+1),
			"FundsDebited":  add(-1),
			"StatementSent": idem.Ignore[*sql.Tx], // consumed on purpose, no effect
		}),
	}

	for _, msg := range []*idem.Message{
		{ID: "evt-1", Type: "FundsCredited", AggregateID: "alice", Payload: []byte("100")},
		{ID: "evt-2", Type: "FundsDebited", AggregateID: "alice", Payload: []byte("30")},
		{ID: "evt-3", Type: "StatementSent", AggregateID: "alice"},
		{ID: "evt-4", Type: "AccountFrozen", AggregateID: "alice"},
	} {
		out, err := proc.Process(ctx, accounts, msg)
		fmt.Println(msg.Type, out, errors.Is(err, idem.ErrUnknownType), idem.IsPermanent(err))
	}
	var balance int64
	_ = db.QueryRow(`SELECT amount FROM balances WHERE account = 'alice'`).Scan(&balance)
	fmt.Println("alice:", balance)
	// Output:
	// FundsCredited applied false false
	// FundsDebited applied false false
	// StatementSent applied false false
	// AccountFrozen none true true
	// alice: 70
}

// Moving to idem from a hand-rolled processed-events table: import its IDs
// as markers first, and the messages the old code processed stay processed.
func ExampleImportMarkers() {
	ctx := context.Background()
	db, err := sqlite.Open(":memory:", nil)
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
	// What the old code kept.
	if _, err := db.Exec(`CREATE TABLE processed_events (event_id TEXT PRIMARY KEY);
		INSERT INTO processed_events VALUES ('evt-1'), ('evt-2')`); err != nil {
		log.Fatal(err)
	}

	res, err := idem.ImportMarkers(ctx, drv, "mailer", &driver.ImportSource{Table: "processed_events", Column: "event_id"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("imported %d of %d\n", res.Imported, res.Read)

	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	send := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(_ context.Context, _ *sql.Tx, msg *idem.Message) error {
		fmt.Println("sending", msg.ID)
		return nil
	}}
	for _, id := range []string{"evt-2", "evt-3"} { // a redelivery, then a new message
		out, err := proc.Process(ctx, send, &idem.Message{ID: id, Payload: []byte("welcome")})
		fmt.Println(id, out, err)
	}
	// Output:
	// imported 2 of 2
	// evt-2 duplicate <nil>
	// sending evt-3
	// evt-3 applied <nil>
}
