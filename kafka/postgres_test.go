package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// postgresEnv is a Consumer crediting balances in Postgres, with its dead
// letters and duplicate counts in the same schema: the adapter suite runs
// on SQLite, and this is the combination most deployments run.
type postgresEnv struct {
	t        *testing.T
	drv      *postgres.Driver
	stats    *idem.StatsRecorder
	balances func(ctx context.Context) (map[string]int64, error)
	consumer *idem.Consumer[postgres.Tx]
}

func newPostgresEnv(t *testing.T) *postgresEnv {
	pool := testenv.PostgresPool(t, 12)
	schema := testenv.FreshSchema(t, pool)
	ctx := context.Background()
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	balances := pgx.Identifier{schema, "balances"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+balances+` (account text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	stats, err := idem.NewStatsRecorder(drv, testenv.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{stats}})
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[postgres.Tx]{Name: "balances", Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
		acct, amt, err := idemtest.DecodeCredit(m.Payload)
		if err != nil {
			return idem.Permanent(err)
		}
		_, err = tx.Exec(ctx, `INSERT INTO `+balances+` AS b (account, amount) VALUES ($1, $2)
ON CONFLICT (account) DO UPDATE SET amount = b.amount + excluded.amount`, acct, amt)
		return err
	}}
	c, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return &postgresEnv{t: t, drv: drv, stats: stats, consumer: c, balances: func(ctx context.Context) (map[string]int64, error) {
		rows, err := pool.Query(ctx, `SELECT account, amount FROM `+balances)
		if err != nil {
			return nil, err
		}
		got := map[string]int64{}
		var (
			a string
			n int64
		)
		_, err = pgx.ForEachRow(rows, []any{&a, &n}, func() error { got[a] = n; return nil })
		return got, err
	}}
}

// waitExact waits until the balances equal those of the unique intended
// events and at least minDups deliveries were counted as duplicates.
func (e *postgresEnv) waitExact(events []idemtest.Event, minDups int64) {
	e.t.Helper()
	adaptertest.WaitExact(e.t, events, minDups, e.balances, adaptertest.StoredDuplicates(e.stats, e.drv, "balances"))
}

// TestPostgresStoreEndToEnd runs a Consumer on Postgres behind the Kafka
// adapter (kfake): a member crashed between its outcomes and its commit,
// then three batched members with one killed mid-stream and 10% of the
// records produced twice. The balances must come out exactly as the unique
// events say, with the redeliveries seen as duplicates.
func TestPostgresStoreEndToEnd(t *testing.T) {
	t.Parallel()
	t.Run("CrashBeforeCommit", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), newPostgresEnv(t)
		events := idemtest.Events(600)
		b.Publish(t, adaptertest.Messages(events), 0)
		<-b.StartCrashing(t, e.consumer)
		b.Start(t, e.consumer)
		e.waitExact(events, 1)
	})
	t.Run("ThreeBatchedMembersOneKilled", func(t *testing.T) {
		t.Parallel()
		b, e := newBroker(t), newPostgresEnv(t)
		events := idemtest.Events(1500)
		b.Publish(t, adaptertest.Messages(events), 10)
		kills := make([]func(), 3)
		for i := range kills {
			kills[i] = b.StartBatched(t, e.consumer, 50)
		}
		// Killed once the group is consuming, so that it leaves work
		// decided but not committed, or assigned but not decided.
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
			if got, err := e.balances(context.Background()); err != nil {
				t.Fatal(err)
			} else if len(got) > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("nothing consumed in 30 s")
			}
		}
		kills[1]()
		e.waitExact(events, 150) // every tenth produced twice
	})
}
