package idem_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"sync"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/sqlite"
)

// A handler that charges a card through a payment API: an external effect,
// so it runs in lease mode. It sends the lease's idempotency key as the
// Idempotency-Key header, which the API uses to charge once however often
// the call is repeated (after a crash between the call and done, say).
func ExampleLeaseProcessor() {
	// The payment API: charges once per Idempotency-Key.
	var (
		mu      sync.Mutex
		charged = map[string]bool{}
		charges int
	)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		defer mu.Unlock()
		fmt.Println("API got Idempotency-Key", key)
		if !charged[key] {
			charged[key] = true
			charges++
		}
	}))
	defer api.Close()

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
	proc, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "worker-1"})
	if err != nil {
		log.Fatal(err)
	}

	charge := &idem.LeaseHandler{
		Name: "payments.charge", // stable: part of every row and of the key
		Call: func(ctx context.Context, l *idem.Lease, msg *idem.Message) error {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, api.URL+"/charges", bytes.NewReader(msg.Payload))
			if err != nil {
				return idem.Permanent(err)
			}
			req.Header.Set("Idempotency-Key", l.IdempotencyKey)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err // retried after the backoff, with the same key
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("payment API: %s", resp.Status)
			}
			fmt.Println("charged on attempt", l.Attempt, "with fencing token", l.Token)
			return nil
		},
	}

	msg := &idem.Message{ID: "order-42", Payload: []byte(`{"amount":1999,"currency":"EUR"}`)}
	for range 2 { // the broker delivers it twice
		out, err := proc.Process(ctx, charge, msg)
		fmt.Println(out, err)
	}
	fmt.Println("charges:", charges)
	// Output:
	// API got Idempotency-Key 2516c16688970d136ea2cbfa2cb3a658b01228d92c7fc7dbde0fabf56dcf0685
	// charged on attempt 1 with fencing token 1
	// applied <nil>
	// duplicate <nil>
	// charges: 1
}

// A LeaseConsumer turns lease mode's outcomes into broker verdicts; a
// broker adapter (package kafka or jetstream) calls HandleDelivery for every
// delivery and acknowledges only when the verdict says so.
func ExampleLeaseConsumer() {
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
	proc, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "worker-1"})
	if err != nil {
		log.Fatal(err)
	}
	welcome := &idem.LeaseHandler{
		Name: "emails.welcome",
		Call: func(ctx context.Context, l *idem.Lease, msg *idem.Message) error {
			fmt.Printf("sending the welcome email for %s\n", msg.ID)
			return nil
		},
	}
	c, err := idem.NewLeaseConsumer(proc, welcome, drv, nil) // the driver keeps the dead letters too
	if err != nil {
		log.Fatal(err)
	}
	// Usually: jetstream.New(js, &jetstream.Config{…, Handler: c}).Run(ctx)
	msg := &idem.Message{ID: "user-7-signed-up", Payload: []byte(`{"email":"ada@example.com"}`)}
	for attempt := 1; attempt <= 2; attempt++ { // delivered twice
		v := c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Attempt: attempt})
		fmt.Printf("delivery %d: ack %v, %v\n", attempt, v.Ack, v.Outcome)
	}
	// Output:
	// sending the welcome email for user-7-signed-up
	// delivery 1: ack true, applied
	// delivery 2: ack true, duplicate
}

// A lease handler for several event types routes them like an atomic one.
// A new type without a route reaches none of the external calls: it is
// dead-lettered with the type in the reason, for replay once its route is
// deployed.
func ExampleByType_lease() {
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
	proc, err := idem.NewLeaseProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	notify := &idem.LeaseHandler{
		Name: "notify",
		Call: idem.ByType(idem.Routes[*idem.Lease]{
			"UserSignedUp": func(ctx context.Context, l *idem.Lease, msg *idem.Message) error {
				fmt.Println("welcome email for", msg.ID)
				return nil
			},
			"ProfileViewed": idem.Ignore[*idem.Lease],
		}),
	}
	c, err := idem.NewLeaseConsumer(proc, notify, drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	for _, msg := range []*idem.Message{
		{ID: "evt-1", Type: "UserSignedUp"},
		{ID: "evt-2", Type: "ProfileViewed"},
		{ID: "evt-3", Type: "PhoneVerified"}, // deployed before its route
	} {
		v := c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Attempt: 1})
		fmt.Println(msg.Type, v.Outcome, "dead-lettered:", v.DeadLettered)
	}
	dls, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(dls[0].Class, dls[0].Error)
	// Output:
	// welcome email for evt-1
	// UserSignedUp applied dead-lettered: false
	// ProfileViewed applied dead-lettered: false
	// PhoneVerified none dead-lettered: true
	// permanent idem: handler "notify": idem: no route for message type PhoneVerified
}
