package idem_test

import (
	"context"
	"database/sql"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// skewedStore is the SQLite driver with a store clock that runs behind
// the host's, as a Postgres server's now() may: GapSighting reports its
// times (first sighting and now) on that clock, consistently.
type skewedStore struct {
	*sqlite.Driver
	skew time.Duration
}

func (s *skewedStore) GapSighting(ctx context.Context, p *driver.GapSightingParams) (driver.GapSightingResult, error) {
	r, err := s.Driver.GapSighting(ctx, p)
	r.FirstSeen, r.Now = r.FirstSeen.Add(s.skew), r.Now.Add(s.skew)
	return r, err
}

// TestGapWaitRetryGoesByTheStoresClock: under GapWait the store decides
// the deadline on its own clock (a minute from the first sighting, so not
// passed), and the Consumer's retry delay goes by that clock too. It used
// the host's: with the store's clock 10 minutes behind, the deadline
// looked long gone and every retry of the minute was asked for at once
// (RetryAfter 0), a hot loop.
func TestGapWaitRetryGoesByTheStoresClock(t *testing.T) {
	ctx := context.Background()
	_, drv := testenv.SQLite(t, ":memory:", nil)
	st := &skewedStore{Driver: drv, skew: -10 * time.Minute}
	p, err := idem.NewProcessor[*sql.Tx](st, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "skew", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Minute},
		Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	m := &idem.Message{ID: "a-2", AggregateID: "a", Seq: 2, Payload: []byte("2")}
	var maxDelay time.Duration
	for attempt := 1; attempt <= 10; attempt++ {
		v := c.HandleDelivery(ctx, &idem.Delivery{Msg: m, Attempt: attempt})
		if v.Ack || v.DeadLettered {
			t.Fatalf("attempt %d: %+v; want a retry (the store's deadline is a minute away)", attempt, v)
		}
		maxDelay = max(maxDelay, v.RetryAfter)
	}
	if maxDelay == 0 {
		t.Fatalf("10 retries behind a gap, each with RetryAfter 0: the host clock judged a deadline the store set on its own clock")
	}
	// And the other way: a store clock ahead does not stretch a retry
	// past the store's deadline.
	st.skew = 10 * time.Minute
	m2 := &idem.Message{ID: "b-2", AggregateID: "b", Seq: 2, Payload: []byte("2")}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: m2, Attempt: 50}); v.Ack || v.RetryAfter > time.Minute || v.RetryAfter <= 0 {
		t.Fatalf("store clock ahead: %+v; want a retry within the minute's wait", v)
	}
}
