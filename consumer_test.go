package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
)

// A Consumer tells adapters the aggregate as its ordering guard sees it:
// normalized by Ordering.Normalize, unchanged without one.
func TestConsumerAggregateKey(t *testing.T) {
	t.Parallel()
	l := newLedger(t)
	for _, c := range []struct {
		ordering *idem.Ordering
		want     string
	}{
		{nil, " ACC"},
		{&idem.Ordering{}, " ACC"},
		{&idem.Ordering{Normalize: idem.FoldAggregateID}, "acc"},
	} {
		h := &idem.Handler[*sql.Tx]{Name: "accounts", Ordering: c.ordering, Apply: idem.Ignore[*sql.Tx]}
		cons, err := idem.NewConsumer(l.proc, h, l.dl, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		var k idem.AggregateKeyer = cons
		if got := k.AggregateKey(" ACC"); got != c.want {
			t.Errorf("ordering %+v: AggregateKey(\" ACC\") = %q, want %q", c.ordering, got, c.want)
		}
	}
}

// TestNewConsumerRefusesSetupNoMessagePasses: a handler whose setup fails
// every message (an in-row handler without Ordering or with Apply too, an
// unknown gap policy, Ordering on a driver without a sequence guard) is
// refused by NewConsumer with ErrInvalidConfig. It was accepted, and every
// delivery then failed with ErrInvalidConfig as a retriable error: retried
// for good, or with MaxAttempts dead-lettered as the message's failure.
func TestNewConsumerRefusesSetupNoMessagePasses(t *testing.T) {
	t.Parallel()
	l := newLedger(t)
	write := func(context.Context, *sql.Tx, *idem.RowGuard) (idem.RowWrite, error) {
		return idem.RowWrite{Advanced: true}, nil
	}
	for name, h := range map[string]*idem.Handler[*sql.Tx]{
		"in-row without Ordering":   {Name: "h", ApplyInRow: write},
		"in-row with Apply":         {Name: "h", ApplyInRow: write, Apply: idem.Ignore[*sql.Tx], Ordering: &idem.Ordering{}},
		"unknown gap policy":        {Name: "h", Apply: idem.Ignore[*sql.Tx], Ordering: &idem.Ordering{Gap: 9}},
		"in-row unknown gap policy": {Name: "h", ApplyInRow: write, Ordering: &idem.Ordering{Gap: 9}},
	} {
		if _, err := idem.NewConsumer(l.proc, h, l.dl, nil); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: NewConsumer: %v; want ErrInvalidConfig", name, err)
		}
	}
	_, drv := testenv.SQLite(t, ":memory:", nil)
	noGuard, err := idem.NewProcessor(struct{ driver.Driver[*sql.Tx] }{drv}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ordered := &idem.Handler[*sql.Tx]{Name: "h", Apply: idem.Ignore[*sql.Tx], Ordering: &idem.Ordering{}}
	if _, err := idem.NewConsumer(noGuard, ordered, drv, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("Ordering on a driver without a sequence guard: NewConsumer: %v; want ErrInvalidConfig", err)
	}
	inRow := &idem.Handler[*sql.Tx]{Name: "h", ApplyInRow: write, Ordering: &idem.Ordering{Gap: idem.GapFail}}
	if _, err := idem.NewConsumer(noGuard, inRow, drv, nil); err != nil {
		t.Errorf("in-row handler under GapFail on a driver without a sequence guard: %v; it needs none", err)
	}
}

// TestDeadLetterOfInvalidMessageKeepsItsValidID: a message whose ID is
// valid but another field is not (a Seq without an AggregateID) is
// dead-lettered under its ID, with its envelope, once however often it is
// delivered. Its dead letter had no message ID and no envelope, as if the
// delivery had not decoded: an operator could not tell which message it
// was, nor which aggregate and sequence it claimed, and, without a Source
// to key it by, each redelivery added another dead letter.
func TestDeadLetterOfInvalidMessageKeepsItsValidID(t *testing.T) {
	t.Parallel()
	l := newLedger(t)
	ctx := context.Background()
	c, err := idem.NewConsumer(l.proc, noop(), l.dl, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		v := c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: "m-1", Seq: 3, Payload: []byte("p")}, Attempt: 1})
		if !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterPermanent || !errors.Is(v.Err, idem.ErrInvalidMessage) {
			t.Fatalf("%+v, want a permanent dead letter for the invalid message", v)
		}
	}
	dls, err := l.dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "noop"})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 || dls[0].MessageID != "m-1" || !strings.Contains(string(dls[0].Envelope), `"Seq":3`) {
		t.Fatalf("dead letters %+v; want one, of message m-1, with its envelope", dls)
	}
}

// TestHandlerReturningWaitsForAggregateIsDeadLettered: ErrWaitsForAggregate
// is the Consumer's own, for deliveries a batch did not try, and adapters
// that count attempts themselves (Kafka, RabbitMQ) count none for it. A
// handler that returned it had its message retried for ever; it is now
// dead-lettered as permanent, with the reason, alone or in a batch.
func TestHandlerReturningWaitsForAggregateIsDeadLettered(t *testing.T) {
	t.Parallel()
	l := newLedger(t)
	ctx := context.Background()
	h := &idem.Handler[*sql.Tx]{Name: "waits", Apply: func(context.Context, *sql.Tx, *idem.Message) error {
		return fmt.Errorf("upstream said: %w", idem.ErrWaitsForAggregate)
	}}
	c, err := idem.NewConsumer(l.proc, h, l.dl, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	check := func(what string, v idem.Verdict) {
		t.Helper()
		if !v.Ack || !v.DeadLettered || v.DeadLetterClass != idem.DeadLetterPermanent {
			t.Errorf("%s: %+v; want a permanent dead letter", what, v)
		}
	}
	check("alone", c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: "m-1", Payload: []byte("p")}, Attempt: 1}))
	for i, v := range c.HandleDeliveries(ctx, []*idem.Delivery{
		{Msg: &idem.Message{ID: "m-2", AggregateID: "a", Seq: 1, Payload: []byte("p")}, Attempt: 1},
		{Msg: &idem.Message{ID: "m-3", AggregateID: "b", Seq: 1, Payload: []byte("p")}, Attempt: 1},
	}) {
		check(fmt.Sprint("in a batch, delivery ", i), v)
	}
	dls, err := l.dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "waits"})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 3 {
		t.Fatalf("%d dead letters, want 3", len(dls))
	}
	for _, dl := range dls {
		if !strings.Contains(dl.Error, "only the Consumer may set") || !strings.Contains(dl.Error, "upstream said") {
			t.Errorf("dead letter of %s: %q; want the reason and the handler's error", dl.MessageID, dl.Error)
		}
	}
}
