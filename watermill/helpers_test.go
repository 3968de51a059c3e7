package watermill_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
	idemwm "github.com/idemhq/idem/watermill"
)

// pgEnv is a Postgres store (a fresh schema) with a balances projection
// credited by an idem.Consumer, as most deployments run it.
type pgEnv struct {
	t        testing.TB
	pool     *pgxpool.Pool
	schema   string
	drv      *postgres.Driver
	proc     *idem.Processor[postgres.Tx]
	stats    *idem.StatsRecorder
	consumer *idem.Consumer[postgres.Tx]
	table    string // the balances table, quoted
}

// newPGEnv opens a fresh schema; cfg configures the consumer (nil: fast
// retries, the test's logger).
func newPGEnv(t testing.TB, cfg *idem.ConsumerConfig) *pgEnv {
	t.Helper()
	pool := testenv.PostgresPool(t, 12)
	e := &pgEnv{t: t, pool: pool, schema: testenv.FreshSchema(t, pool)}
	e.open(cfg)
	return e
}

// attachPGEnv opens the store of an existing schema (a child process's).
func attachPGEnv(t testing.TB, schema string) *pgEnv {
	t.Helper()
	e := &pgEnv{t: t, pool: testenv.PostgresPool(t, 12), schema: schema}
	e.open(nil)
	return e
}

func (e *pgEnv) open(cfg *idem.ConsumerConfig) {
	t, ctx := e.t, context.Background()
	var err error
	if e.drv, err = postgres.New(e.pool, &postgres.Config{Schema: e.schema}); err != nil {
		t.Fatal(err)
	}
	if err := e.drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	e.table = pgx.Identifier{e.schema, "balances"}.Sanitize()
	if _, err := e.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+e.table+` (account text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if e.stats, err = idem.NewStatsRecorder(e.drv, testenv.Logger(t)); err != nil {
		t.Fatal(err)
	}
	if e.proc, err = idem.NewProcessor(e.drv, &idem.Config{Hooks: []idem.Hook{e.stats}}); err != nil {
		t.Fatal(err)
	}
	if cfg == nil {
		cfg = &idem.ConsumerConfig{Backoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}}
	}
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	if e.consumer, err = idem.NewConsumer(e.proc, e.handler(), e.drv, cfg); err != nil {
		t.Fatal(err)
	}
}

// handler credits each message's account.
func (e *pgEnv) handler() *idem.Handler[postgres.Tx] {
	return &idem.Handler[postgres.Tx]{Name: "balances", Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
		acct, amt, err := idemtest.DecodeCredit(m.Payload)
		if err != nil {
			return idem.Permanent(err)
		}
		return e.credit(ctx, tx, acct, amt)
	}}
}

// proc0 returns a processor on e's store without hooks.
func (e *pgEnv) proc0() *idem.Processor[postgres.Tx] {
	p, err := idem.NewProcessor(e.drv, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return p
}

// credit adds amt to acct's balance in tx: the handler's own write, the
// same in the idem-wrapped and the plain handler.
func (e *pgEnv) credit(ctx context.Context, tx interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, acct string, amt int64) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+e.table+` AS b (account, amount) VALUES ($1, $2)
ON CONFLICT (account) DO UPDATE SET amount = b.amount + excluded.amount`, acct, amt)
	return err
}

// balances reads the projection.
func (e *pgEnv) balances(ctx context.Context) (map[string]int64, error) {
	rows, err := e.pool.Query(ctx, `SELECT account, amount FROM `+e.table)
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
}

// waitExact waits until the balances equal those of the unique intended
// events, with at least minDups deliveries counted as duplicates; a
// balance above its expected value (a double apply) fails at once.
func (e *pgEnv) waitExact(events []idemtest.Event, minDups int64) {
	e.t.Helper()
	adaptertest.WaitExact(e.t, events, minDups, e.balances, adaptertest.StoredDuplicates(e.stats, e.drv, "balances"))
}

// markers counts the applied messages.
func (e *pgEnv) markers() int {
	var n int
	// Atomic markers live in idem_markers on Postgres (migration 011);
	// leases, in idem_processed.
	if err := e.pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM `+pgx.Identifier{e.schema, "idem_processed"}.Sanitize()+`) + (SELECT count(*) FROM `+pgx.Identifier{e.schema, "idem_markers"}.Sanitize()+`)`).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// wmLogger bridges Watermill's logger to the test's slog logger, at WARN
// and above: the router's INFO lines would drown the test's output.
func wmLogger(t testing.TB) watermill.LoggerAdapter {
	return watermill.NewSlogLogger(slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}

// unique returns a name no other test uses: prefix plus random hex.
func unique(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// runRouter runs a router consuming topic from sub with h, the given
// middlewares outside it; stop closes the router (also when t ends).
func runRouter(t testing.TB, sub message.Subscriber, topic string, h message.NoPublishHandlerFunc, mws ...message.HandlerMiddleware) (stop func()) {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, wmLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mws...)
	r.AddConsumerHandler("balances", topic, sub, h)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped at start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("router not running after 30 s")
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			if err := r.Close(); err != nil {
				t.Errorf("router close: %v", err)
			}
			<-done
		})
	}
	t.Cleanup(stop)
	return stop
}

// publishEvents publishes events to topic as Publisher would, every
// dupEvery-th (when > 0) a second time, as a producer's retry would.
func publishEvents(t testing.TB, pub message.Publisher, topic string, events []idemtest.Event, dupEvery int) {
	t.Helper()
	for i, ev := range events {
		m := ev.Message()
		m.Stream = topic
		if err := pub.Publish(topic, idemwm.ToMessage(context.Background(), m)); err != nil {
			t.Fatal(err)
		}
		if dupEvery > 0 && i%dupEvery == 0 {
			if err := pub.Publish(topic, idemwm.ToMessage(context.Background(), m)); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// dupCount is how many extra copies publishEvents sends for n events.
func dupCount(n, dupEvery int) int64 {
	if dupEvery <= 0 {
		return 0
	}
	return int64((n + dupEvery - 1) / dupEvery)
}

// attempts records the Delivery.Attempt of every delivery handed to the
// wrapped DeliveryHandler, per message ID.
type attempts struct {
	next idem.DeliveryHandler
	mu   sync.Mutex
	seen map[string][]int
	n    atomic.Int64
}

func (a *attempts) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	a.mu.Lock()
	if a.seen == nil {
		a.seen = map[string][]int{}
	}
	id := ""
	if d.Msg != nil {
		id = d.Msg.ID
	}
	a.seen[id] = append(a.seen[id], d.Attempt)
	a.mu.Unlock()
	a.n.Add(1)
	return a.next.HandleDelivery(ctx, d)
}

func (a *attempts) of(id string) []int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]int(nil), a.seen[id]...)
}

// waitFor polls cond every 10 ms until it holds, failing after limit.
func waitFor(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(limit); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %s", limit, what)
		}
	}
}
