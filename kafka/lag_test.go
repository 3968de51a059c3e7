package kafka_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
)

// TestLagCountsUncommittedRecords: records produced and not consumed are
// the group's lag, all of them; once a member has handled and committed
// them the lag is 0.
func TestLagCountsUncommittedRecords(t *testing.T) {
	t.Parallel()
	b := newBroker(t).(*broker)
	ctx := context.Background()
	const n = 37
	var recs []*kgo.Record
	for i := range n {
		recs = append(recs, &kgo.Record{Key: fmt.Appendf(nil, "k%d", i), Value: []byte("v")})
	}
	b.produce(t, recs)
	c := b.consumer(t, idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} }), nil, 1)
	if lag, err := c.Lag(ctx); err != nil || lag != n {
		t.Fatalf("lag before consuming: %d, %v; want %d", lag, err, n)
	}
	if c.LagSource() != "idem" {
		t.Fatalf("lag source %q, want the group", c.LagSource())
	}
	b.start(t, c)
	deadline := time.Now().Add(30 * time.Second)
	for {
		lag, err := c.Lag(ctx)
		if err == nil && lag == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("lag after consuming: %d, %v; want 0", lag, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
