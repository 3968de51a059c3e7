package adaptertest

import (
	"context"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/sqlident"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// BenchEndToEnd runs EndToEnd one message at a time and in batches of 100
// (the handler summing a batch's credits per account, or applying each
// credit with its own upsert, or summing them behind the ordering guard),
// on three stores: SQLite at synchronous=FULL (sqlite.Open's default:
// every commit waits for fsync), SQLite at synchronous=NORMAL (no fsync per
// commit, so CPU-bound: idem's own work shows undiluted) and the Postgres
// server testenv finds.
func BenchEndToEnd(b *testing.B, newBroker func(testing.TB) Broker) {
	for _, store := range []string{StoreSQLiteFull, StoreSQLiteNormal, StorePostgres} {
		for _, c := range []struct {
			name string
			Shape
		}{
			{"per-message", Shape{Batch: 1}},
			{"batch-100", Shape{Batch: 100}},
			{"batch-100-per-event", Shape{Batch: 100, PerEvent: true}},
			{"batch-100-ordered", Shape{Batch: 100, Ordered: true}},
		} {
			b.Run(store+"/"+c.name, func(b *testing.B) {
				EndToEnd(b, newBroker, store, c.Shape)
			})
		}
	}
}

// BenchConcurrency runs EndToEnd's Postgres cases one message at a time
// and in batches of 100 applied per message, for brokers whose consumers
// handle several keys at once: compare its msgs/s with BenchEndToEnd's.
func BenchConcurrency(b *testing.B, newBroker func(testing.TB) Broker) {
	for _, c := range []struct {
		name string
		Shape
	}{
		{"per-message", Shape{Batch: 1}},
		{"batch-100-per-event", Shape{Batch: 100, PerEvent: true}},
	} {
		b.Run(StorePostgres+"/"+c.name, func(b *testing.B) {
			EndToEnd(b, newBroker, StorePostgres, c.Shape)
		})
	}
}

// Shape is how EndToEnd consumes.
type Shape struct {
	// Batch 1 decides one message at a time; above 1 the adapter hands
	// over batches of up to Batch and both handlers commit a batch's
	// upserts in one transaction (idem adds its markers to it).
	Batch int
	// PerEvent applies one upsert per message instead of one per account.
	PerEvent bool
	// Ordered gives every account's messages a sequence (1, 2, … in
	// publishing order) and idem's handler the ordering guard (GapFail):
	// each batch also advances its accounts' sequences.
	Ordered bool
}

// The stores EndToEnd consumes into.
const (
	StoreSQLiteFull   = "full"     // SQLite, synchronous=FULL
	StoreSQLiteNormal = "normal"   // SQLite, synchronous=NORMAL
	StorePostgres     = "postgres" // Postgres, synchronous_commit as the server has it
)

// endToEndRounds is how many times EndToEnd measures each handler,
// plain and idem back to back in each round (in flipped order every other
// round), so that a slow spell of the disk or the machine falls on both.
const endToEndRounds = 5

// EndToEnd publishes max(b.N, 500) new messages and consumes them into the
// store on a fresh broker, with a plain handler (the balance upserts in a
// transaction, then the ack) and through idem.Consumer, alternating the two
// for endToEndRounds rounds each, in the given shape. It reports the median
// rate of each and, as the ratio, the median of the rounds' idem/plain
// ratios (as bench.Compare does).
func EndToEnd(b *testing.B, newBroker func(testing.TB) Broker, store string, shape Shape) {
	batch, perEvent := shape.Batch, shape.PerEvent
	n := max(b.N, 500)
	var pool *pgxpool.Pool
	if store == StorePostgres {
		pool = testenv.PostgresPool(b, 4)
	}
	rate := func(withIdem bool) float64 {
		br := newBroker(b)
		var h idem.BatchDeliveryHandler
		switch store {
		case StorePostgres:
			h = newPostgresStore(b, pool).handler(b, withIdem, shape)
		case StoreSQLiteFull, StoreSQLiteNormal:
			e := newEnv(b, strings.ToUpper(store))
			h = plainSQLite(e, perEvent)
			if withIdem {
				h = e.batchConsumer(perEvent, shape.Ordered)
			}
		default:
			b.Fatalf("unknown store %q", store)
		}
		events := idemtest.Events(n)
		msgs := Messages(events)
		if shape.Ordered {
			next := map[string]int64{}
			for _, m := range msgs {
				next[m.AggregateID]++
				m.Seq = next[m.AggregateID]
			}
		}
		br.Publish(b, msgs, 0)
		var handled atomic.Int64
		counted := &countedBatch{next: h, n: &handled}
		start := time.Now()
		var kill func()
		if batch > 1 {
			kill = br.StartBatched(b, counted, batch)
		} else {
			kill = br.Start(b, idem.DeliveryHandlerFunc(counted.HandleDelivery))
		}
		for handled.Load() < int64(n) {
			time.Sleep(time.Millisecond)
		}
		r := float64(n) / time.Since(start).Seconds()
		kill()
		return r
	}
	b.ResetTimer()
	var plain, withIdem, ratios []float64
	for r := range endToEndRounds {
		var p, i float64
		if r%2 == 0 {
			p = rate(false)
			i = rate(true)
		} else {
			i = rate(true)
			p = rate(false)
		}
		plain = append(plain, p)
		withIdem = append(withIdem, i)
		ratios = append(ratios, i/p)
	}
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(median(plain), "plain-msgs/s")
	b.ReportMetric(median(withIdem), "idem-msgs/s")
	b.ReportMetric(median(ratios), "ratio")
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// plainHandler is the baseline: it applies a batch's payloads without idem
// and acknowledges them all, or retries them all when that fails.
type plainHandler func(ctx context.Context, payloads [][]byte) error

func (p plainHandler) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	return p.HandleDeliveries(ctx, []*idem.Delivery{d})[0]
}

func (p plainHandler) HandleDeliveries(ctx context.Context, ds []*idem.Delivery) []idem.Verdict {
	vs := make([]idem.Verdict, len(ds))
	payloads := make([][]byte, 0, len(ds))
	for i, d := range ds {
		vs[i] = idem.Verdict{Ack: true, Outcome: idem.Applied}
		if d.Msg != nil {
			payloads = append(payloads, d.Msg.Payload)
		}
	}
	if err := p(ctx, payloads); err != nil {
		for i := range vs {
			vs[i] = idem.Verdict{RetryAfter: time.Millisecond, Err: err}
		}
	}
	return vs
}

// plainSQLite is the baseline on e's SQLite store.
func plainSQLite(e *Env, perEvent bool) plainHandler {
	return func(ctx context.Context, payloads [][]byte) error {
		tx, err := e.DB.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if err := applyCreditsTx(ctx, tx, payloads, perEvent); err != nil {
			return err
		}
		return tx.Commit()
	}
}

// countedBatch counts the deliveries its handler settled.
type countedBatch struct {
	next idem.BatchDeliveryHandler
	n    *atomic.Int64
}

func (c *countedBatch) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	v := c.next.HandleDelivery(ctx, d)
	if v.Ack {
		c.n.Add(1)
	}
	return v
}

func (c *countedBatch) HandleDeliveries(ctx context.Context, ds []*idem.Delivery) []idem.Verdict {
	vs := c.next.HandleDeliveries(ctx, ds)
	for _, v := range vs {
		if v.Ack {
			c.n.Add(1)
		}
	}
	return vs
}

// postgresStore is a fresh schema holding idem's tables and a balances
// table.
type postgresStore struct {
	pool   *pgxpool.Pool
	drv    *postgres.Driver
	upsert string
}

func newPostgresStore(b testing.TB, pool *pgxpool.Pool) *postgresStore {
	b.Helper()
	ctx := context.Background()
	schema := testenv.FreshSchema(b, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		b.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	balances := sqlident.Qualified(schema, "balances")
	if _, err := pool.Exec(ctx, `CREATE TABLE `+balances+` (account text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	return &postgresStore{pool: pool, drv: drv, upsert: `INSERT INTO ` + balances +
		` AS b VALUES ($1, $2) ON CONFLICT (account) DO UPDATE SET amount = b.amount + excluded.amount`}
}

// handler returns the plain handler or idem's consumer over the same
// credits.
func (s *postgresStore) handler(b testing.TB, withIdem bool, shape Shape) idem.BatchDeliveryHandler {
	perEvent := shape.PerEvent
	apply := func(ctx context.Context, tx postgres.Tx, payloads [][]byte) error {
		return applyCredits(payloads, perEvent, func(acct string, amt int64) error {
			_, err := tx.Exec(ctx, s.upsert, acct, amt)
			return err
		})
	}
	if !withIdem {
		return plainHandler(func(ctx context.Context, payloads [][]byte) error {
			tx, err := s.pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			if err := apply(ctx, tx, payloads); err != nil {
				return err
			}
			return tx.Commit(ctx)
		})
	}
	proc, err := idem.NewProcessor(s.drv, nil)
	if err != nil {
		b.Fatal(err)
	}
	h := &idem.Handler[postgres.Tx]{Name: "balances", ApplyBatch: func(ctx context.Context, tx postgres.Tx, msgs []*idem.Message) error {
		return apply(ctx, tx, payloadsOf(msgs))
	}}
	if shape.Ordered {
		h.Ordering = &idem.Ordering{}
	}
	c, err := idem.NewConsumer(proc, h, s.drv, nil)
	if err != nil {
		b.Fatal(err)
	}
	return c
}
