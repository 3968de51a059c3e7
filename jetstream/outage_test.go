package jetstream_test

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/sqlite"
)

// TestStoreOutageLongerThanAckWait takes the store down for six AckWaits
// while a consumer with a delivery limit of 3 holds one message and has
// more pulled ahead. Those pulled ahead may come twice (JetStream
// redelivers them once the consumer pulls again); each message is applied
// exactly once and none is dead-lettered.
func TestStoreOutageLongerThanAckWait(t *testing.T) {
	b := newBroker(t, testenv.EmbeddedNATS(t))
	path, db, drv, p, h := outageStore(t)
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{MaxAttempts: 3, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu       sync.Mutex
		attempts = map[string][]int{}
	)
	rec := idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		mu.Lock()
		if d.Msg != nil {
			attempts[d.Msg.ID] = append(attempts[d.Msg.ID], d.Attempt)
		}
		mu.Unlock()
		return c.HandleDelivery(ctx, d)
	})
	nc, js := b.connect(t)
	defer nc.Close()
	const ackWait = time.Second
	jc, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: rec, AckWait: ackWait, MaxDeliver: 3, Prefetch: 8, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}

	release := testenv.HoldSQLite(t, path)
	const n = 20
	var msgs []*idem.Message
	for i := range n {
		msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("m-%02d", i), AggregateID: "a", Payload: []byte("x")})
	}
	b.Publish(t, msgs, 0)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = jc.Run(ctx) }()
	defer func() { cancel(); <-done }()
	time.Sleep(6 * ackWait)
	release()

	count := func() (rows, ids int) {
		if err := db.QueryRow(`SELECT count(*), count(DISTINCT id) FROM applied`).Scan(&rows, &ids); err != nil {
			t.Fatal(err)
		}
		return rows, ids
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, ids := count(); ids == n {
			break
		}
		if time.Now().After(deadline) {
			_, ids := count()
			t.Fatalf("%d of %d messages applied 20 s after the store came back", ids, n)
		}
	}
	b.waitAckPending(t, 0)
	if rows, _ := count(); rows != n {
		t.Errorf("%d effects for %d messages", rows, n)
	}
	dls, err := drv.DeadLetterList(context.Background(), &driver.DeadLetterFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 0 {
		t.Errorf("%d dead letters, want none: %+v", len(dls), dls[0])
	}
	mu.Lock()
	defer mu.Unlock()
	for id, as := range attempts {
		t.Logf("%s: deliveries %v", id, as)
	}
}

// outageStore opens a SQLite store in a file of its own, which the test
// can take down (testenv.HoldSQLite on path), and a processor and a
// handler that records each applied message ID in the table applied.
func outageStore(t *testing.T) (path string, db *sql.DB, drv *sqlite.Driver, p *idem.Processor[*sql.Tx], h *idem.Handler[*sql.Tx]) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "store.db")
	db, drv = testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 50 * time.Millisecond})
	if _, err := db.Exec(`CREATE TABLE applied (id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h = &idem.Handler[*sql.Tx]{Name: "h", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO applied (id) VALUES (?)`, m.ID)
		return err
	}}
	return path, db, drv, p, h
}
