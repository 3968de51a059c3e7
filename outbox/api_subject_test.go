package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/outbox"
)

// TestAPISubjectRowIsRefused: an outbox row whose Stream is a
// JetStream API subject must be refused by the Publisher (failing,
// visible), not sent: the server acts on such a publish (here: deletes
// the stream the relay publishes to).
func TestAPISubjectRowIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := sqliteProducer(t)
	b := newNATSBroker(t)
	bad := &idem.Message{ID: "x-1", Stream: "$JS.API.STREAM.DELETE." + natsStream, Payload: []byte("{}")}
	good := &idem.Message{ID: "b-1", Stream: b.stream(), AggregateID: "acct-b", Seq: 1, Payload: []byte("1")}
	if err := p.add(ctx, bad, good); err != nil {
		t.Fatalf("add: %v", err)
	}
	r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r1", Concurrency: 1})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.RunOnce(ctx)
	t.Logf("cycle: %+v, %v", res, err)
	time.Sleep(100 * time.Millisecond)
	if _, serr := b.js.Stream(ctx, natsStream); errors.Is(serr, natsjs.ErrStreamNotFound) {
		t.Fatalf("the relay published a row to a JetStream API subject and the server deleted stream %s", natsStream)
	} else if serr != nil {
		t.Fatal(serr)
	}
	if !errors.Is(err, idem.ErrInvalidMessage) {
		t.Errorf("cycle error %v; want the API-subject row refused as invalid", err)
	}
	if s := outboxStats(t, p); s.Failing != 1 {
		t.Errorf("stats %+v; want the API-subject row failing", s)
	}
}

// TestEventSubjectStillPublished: $JS.EVENT.> is the one $JS namespace
// a stream that acknowledges may cover: a row there still goes out.
func TestEventSubjectStillPublished(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := sqliteProducer(t)
	b := newNATSBroker(t)
	if _, err := b.js.CreateStream(ctx, natsStreamConfig("EVT", "$JS.EVENT.outbox.>")); err != nil {
		t.Fatal(err)
	}
	if err := p.add(ctx, &idem.Message{ID: "e-1", Stream: "$JS.EVENT.outbox.x", Payload: []byte("{}")}); err != nil {
		t.Fatal(err)
	}
	r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := r.RunOnce(ctx); err != nil || res.Published != 1 {
		t.Fatalf("cycle: %+v, %v; want the $JS.EVENT row published", res, err)
	}
}
