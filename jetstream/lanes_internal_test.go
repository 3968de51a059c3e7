package jetstream

import (
	"context"
	"database/sql"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
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
