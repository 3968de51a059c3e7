package kafka_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/postgres"
)

// TestStopWhileTheStoreHangs: the path to Postgres dies without a reset
// while a record is applied (a frozen server, a dropped route: no error
// comes for as long as TCP keeps trying). Cancelling Run used to wait as
// long. Now Run returns StopGrace after its stop, the record not
// committed and counted as no attempt; once the path is back, the next
// member applies it, once.
func TestStopWhileTheStoreHangs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, hole := testenv.PostgresPoolThrough(t, 4)
	direct := testenv.PostgresPool(t, 1)
	schema := testenv.FreshSchema(t, direct)
	t.Cleanup(hole.Close) // before the schema's drop, which the hung session's locks would hold
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	events := pgx.Identifier{schema, "events"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+events+` (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	entered := make(chan struct{})
	h := &idem.Handler[postgres.Tx]{Name: "proj", Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
		if calls.Add(1) == 1 {
			hole.Cut()
			close(entered)
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+events+` (id) VALUES ($1)`, m.ID)
		return err
	}}
	const grace = time.Second
	consumer, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{StopGrace: grace, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b := newBroker(t).(*broker)
	b.produce(t, []*kgo.Record{{Key: []byte("k"), Value: []byte("v"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("m1")}}}})
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- b.consumer(t, consumer, nil, 1).Run(rctx) }()
	<-entered
	time.Sleep(100 * time.Millisecond) // the insert is on the dead path
	cancel()
	stopped := time.Now()
	select {
	case <-done:
	case <-time.After(grace + 10*time.Second):
		hole.Close()
		<-done
		t.Fatalf("Run went on for %s after its context ended (StopGrace %s), waiting for a store that does not answer", (grace + 10*time.Second), grace)
	}
	if took := time.Since(stopped); took < grace-50*time.Millisecond {
		t.Fatalf("Run returned %s after its stop: StopGrace %s is what a delivery under way may still take", took, grace)
	}

	hole.Reset() // the path is back
	kill := b.start(t, b.consumer(t, consumer, nil, 1))
	defer kill()
	var n int
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if err := direct.QueryRow(ctx, `SELECT count(*) FROM `+events).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 || time.Now().After(deadline) {
			break
		}
	}
	time.Sleep(200 * time.Millisecond) // a second application would show by now
	kill()
	if err := direct.QueryRow(ctx, `SELECT count(*) FROM `+events).Scan(&n); err != nil {
		t.Fatal(err)
	}
	dls, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 || len(dls) != 0 || calls.Load() != 2 {
		t.Fatalf("%d rows applied, %d dead letters, %d calls; want 1, 0 and 2 (the cut one rolled back)", n, len(dls), calls.Load())
	}
}
