package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
)

// ledger is a SQLite store with a balances table and handlers over it.
type ledger struct {
	db   *sql.DB
	proc *idem.Processor[*sql.Tx]
	dl   driver.DeadLetterStore
}

func newLedger(t *testing.T) *ledger {
	t.Helper()
	db, drv := testenv.SQLite(t, ":memory:", nil)
	if _, err := db.Exec(`CREATE TABLE balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &ledger{db: db, proc: p, dl: drv}
}

// move returns a route that adds sign × the payload's decimal amount to
// the account named by the message's aggregate.
func move(sign int64) func(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
	return func(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
		var n int64
		for _, c := range msg.Payload {
			n = n*10 + int64(c-'0')
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?) ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, msg.AggregateID, sign*n)
		return err
	}
}

func (l *ledger) balances(t *testing.T) map[string]int64 {
	t.Helper()
	rows, err := l.db.Query(`SELECT account, amount FROM balances`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	got := map[string]int64{}
	for rows.Next() {
		var a string
		var n int64
		if err := rows.Scan(&a, &n); err != nil {
			t.Fatal(err)
		}
		got[a] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return got
}

func accountsHandler(routes idem.Routes[*sql.Tx]) *idem.Handler[*sql.Tx] {
	return &idem.Handler[*sql.Tx]{Name: "accounts", Apply: idem.ByType(routes)}
}

// TestByTypeRoutesEachType: credits and debits go to their routes, once
// each however often they are delivered, singly and in batches; the
// balances equal those computed from the intended events.
func TestByTypeRoutesEachType(t *testing.T) {
	t.Parallel()
	l := newLedger(t)
	h := accountsHandler(idem.Routes[*sql.Tx]{"FundsCredited": move(1), "FundsDebited": move(-1), "AccountViewed": idem.Ignore[*sql.Tx]})
	type event struct {
		id, typ, acct string
		amount        int64
	}
	events := []event{
		{"e1", "FundsCredited", "alice", 100}, {"e2", "FundsDebited", "alice", 30},
		{"e3", "AccountViewed", "alice", 7}, {"e4", "FundsCredited", "bob", 5},
		{"e5", "FundsDebited", "bob", 2}, {"e6", "FundsCredited", "alice", 1},
	}
	want := map[string]int64{}
	var msgs []*idem.Message
	for _, e := range events {
		switch e.typ {
		case "FundsCredited":
			want[e.acct] += e.amount
		case "FundsDebited":
			want[e.acct] -= e.amount
		}
		msgs = append(msgs, &idem.Message{ID: e.id, Type: e.typ, AggregateID: e.acct, Payload: []byte(itoa(e.amount))})
	}
	ctx := context.Background()
	for _, m := range msgs[:3] {
		if out, err := l.proc.Process(ctx, h, m); err != nil || out != idem.Applied {
			t.Fatalf("%s: %v, %v; want applied", m.ID, out, err)
		}
	}
	// A batch redelivering the first three with the rest.
	outs, err := l.proc.ProcessBatch(ctx, h, msgs)
	if err != nil {
		t.Fatal(err)
	}
	for i, out := range outs {
		wantOut := idem.Applied
		if i < 3 {
			wantOut = idem.Duplicate
		}
		if out != wantOut {
			t.Errorf("%s: %v, want %v", msgs[i].ID, out, wantOut)
		}
	}
	// The ignored type was marked: its redelivery is a Duplicate.
	if out, err := l.proc.Process(ctx, h, msgs[2]); err != nil || out != idem.Duplicate {
		t.Errorf("ignored type redelivered: %v, %v; want duplicate", out, err)
	}
	got := l.balances(t)
	if len(got) != len(want) {
		t.Errorf("balances %v, want %v", got, want)
	}
	for a, n := range want {
		if got[a] != n {
			t.Errorf("%s: %d, want %d", a, got[a], n)
		}
	}
}

func itoa(n int64) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

// TestByTypeUnknownTypeIsPermanent: a type without a route fails with a
// typed, permanent error and leaves neither effect nor marker, so that
// once the route exists the same message applies.
func TestByTypeUnknownTypeIsPermanent(t *testing.T) {
	t.Parallel()
	l := newLedger(t)
	ctx := context.Background()
	routes := idem.Routes[*sql.Tx]{"FundsCredited": move(1)}
	h := accountsHandler(routes)
	routes["FundsDebited"] = move(-1) // too late: ByType copied the routes
	msg := &idem.Message{ID: "e1", Type: "FundsDebited", AggregateID: "alice", Payload: []byte("5")}
	for range 2 {
		out, err := l.proc.Process(ctx, h, msg)
		var ute *idem.UnknownTypeError
		if out != idem.OutcomeNone || !errors.Is(err, idem.ErrUnknownType) || !errors.As(err, &ute) || ute.Type != "FundsDebited" {
			t.Fatalf("unknown type: %v, %v; want an *UnknownTypeError for FundsDebited", out, err)
		}
		if !idem.IsPermanent(err) {
			t.Errorf("unknown type: IsPermanent false for %v", err)
		}
		if !strings.Contains(err.Error(), "FundsDebited") {
			t.Errorf("error %q does not name the type", err)
		}
	}
	if got := l.balances(t); len(got) != 0 {
		t.Errorf("balances %v after an unknown type, want none", got)
	}
	// The route deployed: the same message applies now.
	h2 := accountsHandler(routes)
	if out, err := l.proc.Process(ctx, h2, msg); err != nil || out != idem.Applied {
		t.Fatalf("after the route exists: %v, %v; want applied", out, err)
	}
	if got := l.balances(t); got["alice"] != -5 {
		t.Errorf("alice %d, want -5", got["alice"])
	}

	// An untyped message needs the "" route.
	untyped := &idem.Message{ID: "e2", AggregateID: "alice", Payload: []byte("1")}
	var ute *idem.UnknownTypeError
	if _, err := l.proc.Process(ctx, h2, untyped); !errors.As(err, &ute) || ute.Type != "" || !strings.Contains(err.Error(), "no type") {
		t.Errorf("untyped message: %v, want an *UnknownTypeError without a type", err)
	}
	routes[""] = move(1)
	if out, err := l.proc.Process(ctx, accountsHandler(routes), untyped); err != nil || out != idem.Applied {
		t.Errorf("untyped message with a \"\" route: %v, %v", out, err)
	}

	// A nil route is a configuration error, and permanent.
	nilRoute := accountsHandler(idem.Routes[*sql.Tx]{"FundsCredited": nil})
	_, err := l.proc.Process(ctx, nilRoute, &idem.Message{ID: "e3", Type: "FundsCredited", AggregateID: "bob", Payload: []byte("1")})
	if !errors.Is(err, idem.ErrInvalidConfig) || !idem.IsPermanent(err) {
		t.Errorf("nil route: %v, want a permanent ErrInvalidConfig", err)
	}

	// A type that cannot be printed as it is gets quoted, never raw.
	_, err = l.proc.Process(ctx, h2, &idem.Message{ID: "e4", Type: "bad \"type\"\n", AggregateID: "bob", Payload: []byte("1")})
	if !errors.Is(err, idem.ErrUnknownType) || !strings.Contains(err.Error(), `"bad \"type\"\n"`) {
		t.Errorf("odd type: %v, want it quoted", err)
	}
}

// TestByTypeUnknownTypeIsDeadLettered: behind a Consumer, a message of an
// unknown type in a batch is dead-lettered at once with the type in its
// reason and acknowledged, and the rest of the batch applies.
func TestByTypeUnknownTypeIsDeadLettered(t *testing.T) {
	t.Parallel()
	l := newLedger(t)
	ctx := context.Background()
	h := accountsHandler(idem.Routes[*sql.Tx]{"FundsCredited": move(1)})
	c, err := idem.NewConsumer(l.proc, h, l.dl, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ds := []*idem.Delivery{
		{Msg: &idem.Message{ID: "e1", Type: "FundsCredited", AggregateID: "alice", Payload: []byte("10")}, Source: "test/0", Attempt: 1},
		{Msg: &idem.Message{ID: "e2", Type: "AccountClosed", AggregateID: "alice", Payload: []byte("0")}, Source: "test/1", Attempt: 1},
		{Msg: &idem.Message{ID: "e3", Type: "FundsCredited", AggregateID: "alice", Payload: []byte("5")}, Source: "test/2", Attempt: 1},
	}
	vs := c.HandleDeliveries(ctx, ds)
	for i, v := range vs {
		if !v.Ack {
			t.Errorf("delivery %d not acknowledged: %+v", i, v)
		}
		if v.DeadLettered != (i == 1) {
			t.Errorf("delivery %d: dead-lettered %v", i, v.DeadLettered)
		}
	}
	if got := l.balances(t); got["alice"] != 15 {
		t.Errorf("alice %d, want 15", got["alice"])
	}
	dls, err := l.dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "accounts"})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dls))
	}
	dl := dls[0]
	if dl.MessageID != "e2" || dl.Class != idem.DeadLetterPermanent || !strings.Contains(dl.Error, "AccountClosed") || !strings.Contains(dl.Fingerprint, "AccountClosed") {
		t.Errorf("dead letter %s: class %q, error %q, fingerprint %q", dl.MessageID, dl.Class, dl.Error, dl.Fingerprint)
	}
}

// TestByTypeRoutesLeaseHandlers: a lease handler routes by type like an
// atomic one. Behind a LeaseConsumer on SQLite, each known type reaches
// its own route once however often it is delivered; a new type reaches
// no route (not the email one) and is dead-lettered at once as permanent,
// naming the type, in one dead letter however often it is delivered; once its route is deployed, the replayed dead letter
// applies.
func TestByTypeRoutesLeaseHandlers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	drv := leaseDriver(t)
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var emails, sms []string // the effects, by route
	routes := idem.Routes[*idem.Lease]{
		"UserSignedUp": func(_ context.Context, l *idem.Lease, msg *idem.Message) error {
			if l.IdempotencyKey != idem.IdempotencyKey("notify", msg.ID) {
				t.Errorf("%s: idempotency key %q", msg.ID, l.IdempotencyKey)
			}
			emails = append(emails, msg.ID)
			return nil
		},
		"ProfileViewed": idem.Ignore[*idem.Lease],
	}
	consumer := func(routes idem.Routes[*idem.Lease]) *idem.LeaseConsumer {
		h := &idem.LeaseHandler{Name: "notify", Call: idem.ByType(routes)}
		c, err := idem.NewLeaseConsumer(p, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	c := consumer(routes)
	msgs := []*idem.Message{
		{ID: "u1", Type: "UserSignedUp", Payload: []byte(`{"email":"ada@example.com"}`)},
		{ID: "u2", Type: "ProfileViewed"},
		{ID: "u3", Type: "PhoneVerified", Payload: []byte(`{"phone":"+4912345"}`)}, // no route yet
		{ID: "u4", Type: "UserSignedUp", Payload: []byte(`{"email":"bob@example.com"}`)},
	}
	for attempt := 1; attempt <= 3; attempt++ { // every message delivered three times
		for i, m := range msgs {
			v := c.HandleDelivery(ctx, &idem.Delivery{Msg: m, Source: "test/" + m.ID, Attempt: attempt})
			if !v.Ack {
				t.Fatalf("delivery %d of %s: not acknowledged: %+v", attempt, m.ID, v)
			}
			// A redelivery of the unknown type updates its one dead letter.
			if v.DeadLettered != (i == 2) {
				t.Errorf("delivery %d of %s: dead-lettered %v", attempt, m.ID, v.DeadLettered)
			}
		}
	}
	if strings.Join(emails, ",") != "u1,u4" {
		t.Errorf("emails sent for %v, want u1,u4 once each", emails)
	}
	dls, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "notify"})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dls))
	}
	if dl := dls[0]; dl.MessageID != "u3" || dl.Class != idem.DeadLetterPermanent ||
		!strings.Contains(dl.Error, "no route for message type PhoneVerified") || !strings.Contains(dl.Fingerprint, "PhoneVerified") {
		t.Errorf("dead letter %s: class %q, error %q, fingerprint %q; want permanent, naming PhoneVerified", dl.MessageID, dl.Class, dl.Error, dl.Fingerprint)
	}

	// The route deployed and the dead letter replayed: the SMS goes once.
	routes["PhoneVerified"] = func(_ context.Context, _ *idem.Lease, msg *idem.Message) error {
		sms = append(sms, msg.ID)
		return nil
	}
	c = consumer(routes)
	if n, err := idem.RequestReplay(ctx, drv, &driver.DeadLetterFilter{Handler: "notify"}, "ops"); err != nil || n != 1 {
		t.Fatalf("RequestReplay: %d, %v", n, err)
	}
	if res, err := c.Replay(ctx); err != nil {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	v := c.HandleDelivery(ctx, &idem.Delivery{Msg: msgs[2], Source: "test/u3", Attempt: 4})
	if !v.Ack || v.Outcome != idem.Duplicate {
		t.Errorf("redelivery of u3 after its replay: %+v, want a duplicate", v)
	}
	if strings.Join(sms, ",") != "u3" || strings.Join(emails, ",") != "u1,u4" {
		t.Errorf("after the replay: sms %v, emails %v; want u3, and u1,u4", sms, emails)
	}
}
