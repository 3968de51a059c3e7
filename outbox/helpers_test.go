package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
	"github.com/idemhq/idem/rabbitmq"
	"github.com/idemhq/idem/sqlite"
)

// producer is a service that writes business rows and outbox rows in one
// transaction: an account ledger that emits a Credited event per credit.
type producer struct {
	name   string
	schema string // Postgres: the producer's fresh schema
	drv    any    // the driver: OutboxRelayStore for the relay
	// credit adds amount to account and emits the event to stream, in
	// one transaction; fail rolls it back after both writes.
	credit func(ctx context.Context, stream, account string, amount int64, fail bool) (*idem.Message, error)
	// add runs Add with msgs in one transaction.
	add func(ctx context.Context, msgs ...*idem.Message) error
	// plainCredit is credit without the outbox: the benchmark baseline.
	plainCredit func(ctx context.Context, account string, amount int64) error
}

// fill adds n rows over the given number of aggregates, 1,000 per
// transaction.
func (p *producer) fill(ctx context.Context, stream string, n, aggregates int) error {
	seqs := make([]int64, aggregates)
	for lo := 0; lo < n; lo += 1000 {
		var msgs []*idem.Message
		for i := lo; i < min(lo+1000, n); i++ {
			a := i % aggregates
			seqs[a]++
			agg := fmt.Sprintf("acct-%03d", a)
			msgs = append(msgs, &idem.Message{ID: outbox.MessageID(stream, agg, seqs[a]), Stream: stream, AggregateID: agg, Seq: seqs[a], Payload: []byte("1")})
		}
		if err := p.add(ctx, msgs...); err != nil {
			return err
		}
	}
	return nil
}

func sqliteProducer(t testing.TB) *producer {
	t.Helper()
	// synchronous=NORMAL: in WAL mode a commit then survives the process's
	// crash, though not the machine's, which no test here causes; FULL's
	// fsync per commit made the relays' SQLite runs a third slower.
	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "producer.db"), &sqlite.OpenOptions{Synchronous: "NORMAL"})
	if _, err := db.Exec(`CREATE TABLE ledger (account TEXT PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	inTx := func(ctx context.Context, fn func(tx *sql.Tx) error) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if err := fn(tx); err != nil {
			tx.Rollback()
			return err
		}
		return tx.Commit()
	}
	return &producer{
		name: "sqlite", drv: drv,
		credit: func(ctx context.Context, stream, account string, amount int64, fail bool) (m *idem.Message, err error) {
			err = inTx(ctx, func(tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES (?, ?) ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, account, amount); err != nil {
					return err
				}
				if m, err = ob.AddNext(ctx, tx, stream, account, "Credited", []byte(strconv.FormatInt(amount, 10))); err != nil {
					return err
				}
				if fail {
					return errRollback
				}
				return nil
			})
			return m, err
		},
		add: func(ctx context.Context, msgs ...*idem.Message) error {
			return inTx(ctx, func(tx *sql.Tx) error { return ob.Add(ctx, tx, msgs...) })
		},
		plainCredit: func(ctx context.Context, account string, amount int64) error {
			return inTx(ctx, func(tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES (?, ?) ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, account, amount)
				return err
			})
		},
	}
}

func postgresProducer(t testing.TB) *producer {
	t.Helper()
	pool := testenv.PostgresPool(t, 20)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	ledger := pgx.Identifier{schema, "ledger"}.Sanitize()
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+ledger+` (account text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	inTx := func(ctx context.Context, fn func(tx postgres.Tx) error) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		if err := fn(tx); err != nil {
			tx.Rollback(ctx)
			return err
		}
		return tx.Commit(ctx)
	}
	return &producer{
		name: "postgres", schema: schema, drv: drv,
		credit: func(ctx context.Context, stream, account string, amount int64, fail bool) (m *idem.Message, err error) {
			err = inTx(ctx, func(tx postgres.Tx) error {
				if _, err := tx.Exec(ctx, `INSERT INTO `+ledger+` VALUES ($1, $2) ON CONFLICT (account) DO UPDATE SET amount = `+ledger+`.amount + excluded.amount`, account, amount); err != nil {
					return err
				}
				if m, err = ob.AddNext(ctx, tx, stream, account, "Credited", []byte(strconv.FormatInt(amount, 10))); err != nil {
					return err
				}
				if fail {
					return errRollback
				}
				return nil
			})
			return m, err
		},
		add: func(ctx context.Context, msgs ...*idem.Message) error {
			return inTx(ctx, func(tx postgres.Tx) error { return ob.Add(ctx, tx, msgs...) })
		},
		plainCredit: func(ctx context.Context, account string, amount int64) error {
			return inTx(ctx, func(tx postgres.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO `+ledger+` VALUES ($1, $2) ON CONFLICT (account) DO UPDATE SET amount = `+ledger+`.amount + excluded.amount`, account, amount)
				return err
			})
		},
	}
}

// mysqlProducer is the producer on MySQL/MariaDB, in a fresh database.
func mysqlProducer(t testing.TB) *producer {
	t.Helper()
	db := testenv.MySQL(t, testenv.MySQLDatabase(t), 20)
	drv, err := mysql.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE ledger (account VARBINARY(255) PRIMARY KEY, amount BIGINT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	inTx := func(ctx context.Context, fn func(tx *sql.Tx) error) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if err := fn(tx); err != nil {
			tx.Rollback()
			return err
		}
		return tx.Commit()
	}
	const credit = `INSERT INTO ledger VALUES (?, ?) ON DUPLICATE KEY UPDATE amount = amount + VALUES(amount)`
	return &producer{
		name: "mysql", drv: drv,
		credit: func(ctx context.Context, stream, account string, amount int64, fail bool) (m *idem.Message, err error) {
			err = inTx(ctx, func(tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, credit, account, amount); err != nil {
					return err
				}
				if m, err = ob.AddNext(ctx, tx, stream, account, "Credited", []byte(strconv.FormatInt(amount, 10))); err != nil {
					return err
				}
				if fail {
					return errRollback
				}
				return nil
			})
			return m, err
		},
		add: func(ctx context.Context, msgs ...*idem.Message) error {
			return inTx(ctx, func(tx *sql.Tx) error { return ob.Add(ctx, tx, msgs...) })
		},
		plainCredit: func(ctx context.Context, account string, amount int64) error {
			return inTx(ctx, func(tx *sql.Tx) error {
				_, err := tx.ExecContext(ctx, credit, account, amount)
				return err
			})
		},
	}
}

var errRollback = fmt.Errorf("roll back on purpose")

func producers() map[string]func(testing.TB) *producer {
	return map[string]func(testing.TB) *producer{"sqlite": sqliteProducer, "postgres": postgresProducer, "mysql": mysqlProducer}
}

func outboxStats(t testing.TB, p *producer) driver.OutboxStats {
	t.Helper()
	s, err := p.drv.(driver.OutboxRelayStore).OutboxStats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// broker is a real in-process broker the relay publishes to and a
// consumer reads from.
type broker interface {
	publisher(t testing.TB) outbox.Publisher
	// consume runs an idem consumer of the topic/subject until ctx ends.
	consume(t testing.TB, ctx context.Context, h idem.DeliveryHandler) (wait func())
	stream() string
}

// natsBroker is an embedded JetStream server with one stream.
type natsBroker struct {
	js natsjs.JetStream
}

const natsStream = "CREDITS"

func newNATSBroker(t testing.TB) *natsBroker {
	t.Helper()
	return &natsBroker{js: creditsStream(t, testenv.EmbeddedNATS(t))}
}

// creditsStream connects to the NATS server at url with opts and creates
// the stream of credits.>; the connection closes when t ends.
func creditsStream(t testing.TB, url string, opts ...nats.Option) natsjs.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := natsjs.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(context.Background(), natsjs.StreamConfig{Name: natsStream, Subjects: []string{"credits.>"}}); err != nil {
		t.Fatal(err)
	}
	return js
}

func (b *natsBroker) stream() string { return "credits.ledger" }

func (b *natsBroker) publisher(t testing.TB) outbox.Publisher {
	p, err := jetstream.NewPublisher(b.js)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func (b *natsBroker) consume(t testing.TB, ctx context.Context, h idem.DeliveryHandler) func() {
	c, err := jetstream.New(b.js, &jetstream.Config{Stream: natsStream, Durable: "ledger-view", Handler: h, AckWait: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return runBackground(ctx, c.Run)
}

// messages reads the whole stream in order.
func (b *natsBroker) messages(t testing.TB) []*idem.Message {
	t.Helper()
	ctx := context.Background()
	s, err := b.js.Stream(ctx, natsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []*idem.Message
	for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
		raw, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		m := &idem.Message{ID: raw.Header.Get(jetstream.HeaderMsgID), AggregateID: raw.Header.Get(jetstream.HeaderAggregate)}
		m.Seq, _ = strconv.ParseInt(raw.Header.Get(jetstream.HeaderSeq), 10, 64)
		out = append(out, m)
	}
	return out
}

// kafkaBroker is an in-process kfake cluster with one topic.
type kafkaBroker struct {
	addrs []string
}

const kafkaTopic = "credits"

func newKafkaBroker(t testing.TB) *kafkaBroker {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, kafkaTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return &kafkaBroker{addrs: c.ListenAddrs()}
}

func (b *kafkaBroker) stream() string { return kafkaTopic }

func (b *kafkaBroker) publisher(t testing.TB) outbox.Publisher {
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.addrs...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	p, err := kafka.NewPublisher(cl)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func (b *kafkaBroker) consume(t testing.TB, ctx context.Context, h idem.DeliveryHandler) func() {
	c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "ledger-view", Topics: []string{kafkaTopic}, Handler: h,
		Options: []kgo.Opt{kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(6 * time.Second)}})
	if err != nil {
		t.Fatal(err)
	}
	return runBackground(ctx, c.Run)
}

// rabbitBroker is a fresh quorum queue on the RabbitMQ server at
// IDEM_RABBITMQ_URL, fed through the default exchange: Stream is the
// queue's name.
type rabbitBroker struct {
	queue string
}

func newRabbitBroker(t testing.TB) *rabbitBroker {
	t.Helper()
	conn, name := testenv.RabbitMQ(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, amqp.Table{"x-queue-type": rabbitmq.QueueQuorum}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn, err := amqp.Dial(testenv.RabbitMQURL())
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			t.Error(err)
			return
		}
		for _, q := range append([]string{name}, retryQueues(name)...) {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				t.Error(err)
				return
			}
		}
	})
	return &rabbitBroker{queue: name}
}

// retryQueues names every retry queue of queue.
func retryQueues(queue string) []string {
	var out []string
	for _, tier := range rabbitmq.RetryTiers() {
		out = append(out, rabbitmq.RetryQueueName(queue, tier))
	}
	return out
}

func (b *rabbitBroker) stream() string { return b.queue }

func (b *rabbitBroker) publisher(t testing.TB) outbox.Publisher {
	p, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: testenv.RabbitMQURL()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func (b *rabbitBroker) consume(t testing.TB, ctx context.Context, h idem.DeliveryHandler) func() {
	c, err := rabbitmq.New(&rabbitmq.Config{URL: testenv.RabbitMQURL(), Queue: b.queue, Handler: h, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return runBackground(ctx, c.Run)
}

func runBackground(ctx context.Context, run func(context.Context) error) func() {
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = run(ctx)
	}()
	return func() { <-done }
}

// view is the consuming service: a balance projection behind idem, on its
// own SQLite database.
type view struct {
	db         *sql.DB
	consumer   *idem.Consumer[*sql.Tx]
	applied    atomic.Int64
	duplicates atomic.Int64
}

func newView(t testing.TB) *view {
	t.Helper()
	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "view.db"), &sqlite.OpenOptions{Synchronous: "OFF"})
	if _, err := db.Exec(`CREATE TABLE balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL, last_seq INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "balances", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Minute},
		Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
			amount, err := strconv.ParseInt(string(m.Payload), 10, 64)
			if err != nil {
				return idem.Permanent(err)
			}
			_, err = tx.ExecContext(ctx, `INSERT INTO balances VALUES (?, ?, ?) ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount, last_seq = excluded.last_seq`,
				m.AggregateID, amount, m.Seq)
			return err
		}}
	c, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{Backoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	return &view{db: db, consumer: c}
}

// HandleDelivery counts outcomes on the way.
func (v *view) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	r := v.consumer.HandleDelivery(ctx, d)
	if r.Ack {
		switch r.Outcome {
		case idem.Applied:
			v.applied.Add(1)
		case idem.Duplicate, idem.Stale:
			v.duplicates.Add(1)
		}
	}
	return r
}

func (v *view) balances(t testing.TB) map[string][2]int64 {
	t.Helper()
	rows, err := v.db.Query(`SELECT account, amount, last_seq FROM balances`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string][2]int64{}
	for rows.Next() {
		var (
			a    string
			n, q int64
		)
		if err := rows.Scan(&a, &n, &q); err != nil {
			t.Fatal(err)
		}
		out[a] = [2]int64{n, q}
	}
	return out
}

// countingPublisher counts the messages the broker acknowledged and
// checks that no ordering key is being published by two relays at once.
type countingPublisher struct {
	next     outbox.Publisher
	acked    atomic.Int64
	mu       sync.Mutex
	inFlight map[string]int
	overlaps atomic.Int64
}

func newCountingPublisher(next outbox.Publisher) *countingPublisher {
	return &countingPublisher{next: next, inFlight: map[string]int{}}
}

func (p *countingPublisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	key := msgs[0].AggregateID
	p.mu.Lock()
	p.inFlight[key]++
	if p.inFlight[key] > 1 {
		p.overlaps.Add(1)
	}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.inFlight[key]--
		p.mu.Unlock()
	}()
	time.Sleep(time.Millisecond) // widen the window an overlap would need
	if err := p.next.Publish(ctx, msgs); err != nil {
		return err
	}
	p.acked.Add(int64(len(msgs)))
	return nil
}

func waitFor(t testing.TB, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func natsStreamConfig(name string, subjects ...string) natsjs.StreamConfig {
	return natsjs.StreamConfig{Name: name, Subjects: subjects}
}

// unpublished lists p's unpublished rows in ID order, through the admin
// API an operator uses.
func unpublished(t testing.TB, p *producer) []driver.OutboxEntry {
	t.Helper()
	adm, err := outbox.NewAdmin(p.drv, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	page, err := adm.List(context.Background(), driver.OutboxFilter{})
	if err != nil {
		t.Fatal(err)
	}
	return page.Rows
}
