package adaptertest

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// stopWhileTheStoreHangs: the path to the store (Postgres) dies without
// a reset while a message is applied: a frozen server, a dropped route,
// from which no error comes for as long as TCP keeps trying. Stopping the
// consumer used to wait as long. It returns StopGrace after the stop now,
// the message neither acknowledged nor dead-lettered, and once the path
// is back the next consumer applies it, once.
func stopWhileTheStoreHangs(t *testing.T, b Broker) {
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
	applied := pgx.Identifier{schema, "applied"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+applied+` (id text PRIMARY KEY)`); err != nil {
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
		_, err := tx.Exec(ctx, `INSERT INTO `+applied+` (id) VALUES ($1)`, m.ID)
		return err
	}}
	const grace = time.Second
	c, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{StopGrace: grace, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b.Publish(t, []*idem.Message{{ID: "m-1", AggregateID: "a", Payload: []byte("a:1")}}, 0)
	kill := b.Start(t, c)
	<-entered
	time.Sleep(100 * time.Millisecond) // the insert is on the dead path
	stopped := make(chan struct{})
	go func() { kill(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(grace + 10*time.Second):
		hole.Close()
		<-stopped
		t.Fatalf("the consumer went on for %s after its stop (StopGrace %s), waiting for a store that does not answer", grace+10*time.Second, grace)
	}

	hole.Reset() // the path is back
	b.Start(t, c)
	var n int
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if err := direct.QueryRow(ctx, `SELECT count(*) FROM `+applied).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the message was not applied 20 s after the path came back")
		}
	}
	time.Sleep(200 * time.Millisecond) // a second application would show by now
	dls, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := direct.QueryRow(ctx, `SELECT count(*) FROM `+applied).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 || len(dls) != 0 {
		t.Fatalf("%d rows applied, %d dead letters; want 1 and none", n, len(dls))
	}
}
