package kafka_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// TestStoreOutageRebalanceBatchedConcurrent is
// TestStoreOutageDoesNotBlockRebalance with a member that hands its
// records over in batches, four partitions at once: a member joining while
// the batches wait for the store gets its partitions within seconds; no
// record is committed unapplied, none applied twice or out of order, none
// dead-lettered, and every acknowledgement is at attempt 1.
func TestStoreOutageRebalanceBatchedConcurrent(t *testing.T) {
	t.Parallel()
	const perPart = 20
	h := &idem.Handler[*sql.Tx]{Name: "proj", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO effects (id) VALUES (?)`, m.ID)
		return err
	}}
	var (
		mu  sync.Mutex
		bad []string // acknowledgements at another attempt than 1
	)
	path, db, drv, consumer := outageConsumer(t, h, idem.HookVerdict(verdictFunc(func(ev *idem.VerdictEvent) {
		if ev.Verdict.Ack && ev.Attempt != 1 {
			mu.Lock()
			bad = append(bad, fmt.Sprintf("%s at attempt %d", ev.MessageID, ev.Attempt))
			mu.Unlock()
		}
	})))
	if _, err := db.Exec(`CREATE TABLE effects (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	b := newBroker(t).(*broker)
	b.producePartitioned(t, perPart)
	b.concurrency = 4
	release := testenv.HoldSQLite(t, path) // the store is down
	slow := kgo.RebalanceTimeout(30 * time.Second)
	b.start(t, b.consumer(t, consumer, nil, 25, slow))
	// Batches waiting for the store report no verdict until the wait ends:
	// give the member time to fetch and hand them over.
	time.Sleep(3 * time.Second)
	b.join(t, consumer, 10*time.Second, "the store", slow)
	time.Sleep(time.Second)
	release()
	count := func() int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM effects`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for deadline := time.Now().Add(20 * time.Second); count() < 4*perPart; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d records applied 20 s after the store came back", count(), 4*perPart)
		}
	}
	time.Sleep(500 * time.Millisecond) // a second application would show by now
	checkEffects(t, db, perPart)
	dls, err := drv.DeadLetterList(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) > 0 {
		t.Fatalf("%d dead letters (first: %s, %s): an outage is no failure", len(dls), dls[0].MessageID, dls[0].Error)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("acknowledged after waits for the store counted as attempts: %v", bad)
	}
}
