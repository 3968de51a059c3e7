package jetstream

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// keyed is a handler whose ordering guard folds aggregate IDs to lower
// case.
type keyed struct{ idem.DeliveryHandlerFunc }

func (keyed) AggregateKey(id string) string { return idem.FoldAggregateID(id) }

// Lanes key messages by the aggregate as the Handler's ordering guard sees
// it: "ACC" and " acc" are one aggregate under FoldAggregateID, so they
// share a lane and are never decided at once.
func TestLanesFollowTheGuardsAggregate(t *testing.T) {
	h := keyed{func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} }}
	c, err := New(struct{ jetstream.JetStream }{}, &Config{Stream: "s", Durable: "d", Handler: h, Concurrency: 64})
	if err != nil {
		t.Fatal(err)
	}
	d := func(agg string) *idem.Delivery { return &idem.Delivery{Msg: &idem.Message{ID: "m", AggregateID: agg}} }
	if k1, k2 := c.key(nil, d("ACC")), c.key(nil, d(" acc")); k1 != "acc" || k2 != "acc" {
		t.Fatalf("keys %q, %q, want both acc", k1, k2)
	}
	for _, id := range []string{"Straße", "STRASSE", "ACC-1", "Acc-2"} {
		if c.lane(nil, d(id)) != c.lane(nil, d(idem.FoldAggregateID(id))) {
			t.Fatalf("%q and its folded form are on different lanes", id)
		}
	}
}

// The core's consumers pass their guard's view on.
var (
	_ idem.AggregateKeyer = (*idem.Consumer[*sql.Tx])(nil)
	_ idem.AggregateKeyer = (*idem.LeaseConsumer)(nil)
)

// Run's watch keeps the durable's limits current while no message comes,
// and reports a durable that was deleted, which the subscription's
// iterator hears of only through a pull request pending at that moment.
func TestWatchDurable(t *testing.T) {
	nc, err := nats.Connect(testenv.EmbeddedNATS(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "WATCH", Subjects: []string{"watch.>"}}); err != nil {
		t.Fatal(err)
	}
	cfg := jetstream.ConsumerConfig{Durable: "d", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second, MaxDeliver: 20}
	cons, err := js.CreateOrUpdateConsumer(ctx, "WATCH", cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	c, err := New(js, &Config{Stream: "WATCH", Durable: "d", Handler: h, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	c.watchEvery = 20 * time.Millisecond
	c.dur.set(cons, cons.CachedInfo())
	gone := make(chan error, 1)
	stop := c.watchDurable(ctx, cons, func(err error) { gone <- err })
	defer stop()

	cfg.MaxDeliver, cfg.AckWait = 4, 10*time.Second // another consumer's settings
	if _, err := js.CreateOrUpdateConsumer(ctx, "WATCH", cfg); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); c.maxDeliver(false) != 4 || c.dur.ackWait(c.cfg.AckWait) != 10*time.Second; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("limits %d, %s after 5 s, want the durable's 4, 10s", c.maxDeliver(false), c.dur.ackWait(c.cfg.AckWait))
		}
	}

	if err := js.DeleteConsumer(ctx, "WATCH", "d"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-gone:
		if !errors.Is(err, jetstream.ErrConsumerNotFound) {
			t.Fatalf("gone with %v, want ErrConsumerNotFound", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the deleted durable was not reported within 5 s")
	}
	if !stop() {
		t.Fatal("stop reports no gone durable")
	}
}
