package postgres_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
)

// TestDatabaseOutage crashes the database while four workers process a
// stream with redeliveries, then restarts it. A worker acknowledges a
// delivery only after Process returned an outcome; an error leaves it
// unacknowledged and it is delivered again later, as a broker would. No
// acknowledged delivery may lack its marker after the restart, processing
// resumes without intervention, and the final balances equal the unique
// intended events.
func TestDatabaseOutage(t *testing.T) {
	c := testenv.NewPostgresCluster(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, c.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s := storeIn(t, pool, "app")
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	var calls sync.Map
	h := idemtest.CreditHandler(s, "balances", &calls)

	events := idemtest.Events(3000)
	queue := make(chan int, 2*len(events))
	for i := range events {
		queue <- i
	}
	var (
		acked     sync.Map // message ID → true once acknowledged
		nacked    atomic.Int64
		ackCount  atomic.Int64
		redeliver atomic.Int64
		wg        sync.WaitGroup
	)
	done := make(chan struct{})
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var i int
				select {
				case <-done:
					return
				case i = <-queue:
				}
				e := events[i]
				out, err := p.Process(ctx, h, e.Message())
				if err != nil {
					nacked.Add(1)
					time.Sleep(20 * time.Millisecond) // the broker's redelivery delay
					queue <- i
					continue
				}
				if out != idem.Applied && out != idem.Duplicate {
					t.Errorf("worker %d: %s: outcome %v", w, e.ID, out)
				}
				if _, again := acked.LoadOrStore(e.ID, true); !again {
					if ackCount.Add(1) == int64(len(events)) {
						close(done)
					}
					if i%10 == 0 {
						redeliver.Add(1)
						queue <- i // an at-least-once broker redelivers some acknowledged messages
					}
				}
			}
		}()
	}

	for ackCount.Load() < int64(len(events))/3 {
		time.Sleep(5 * time.Millisecond)
	}
	c.Crash()
	ackedAtCrash := ackCount.Load()
	time.Sleep(1500 * time.Millisecond)
	errorsDuringOutage := nacked.Load()
	c.Start()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("processing did not resume: %d of %d acknowledged", ackCount.Load(), len(events))
	}
	wg.Wait()
	t.Logf("crash after %d acknowledgements; %d deliveries failed and were redelivered; %d acknowledged messages redelivered",
		ackedAtCrash, nacked.Load(), redeliver.Load())
	if errorsDuringOutage == 0 {
		t.Fatal("no delivery failed while the database was down: the outage was not exercised")
	}
	n, err := s.Markers(ctx, "balances")
	if err != nil {
		t.Fatal(err)
	}
	if n != len(events) {
		t.Fatalf("%d markers after the restart, want %d: an acknowledged delivery lost its outcome", n, len(events))
	}
	balances, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for acct, want := range idemtest.Expected(events) {
		if balances[acct] != want {
			t.Fatalf("%s = %d, want %d", acct, balances[acct], want)
		}
	}
}
