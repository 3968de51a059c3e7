package idem_test

import (
	"database/sql"
	"testing"

	"github.com/idemhq/idem"
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
