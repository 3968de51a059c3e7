package outage_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
	"github.com/idemhq/idem/redisstore"
	"github.com/idemhq/idem/sqlite"
)

// The outage tests stop a store for outageFor while a JetStream consumer,
// a Kafka consumer, a LeaseConsumer and an outbox relay run over it, each
// allowed 3 deliveries or attempts of a message, and check what the
// operations guide promises ("When the store is down"):
//
//   - deliveries begun during the outage are at most those in flight when
//     it began plus one per lane (a lane that finished its message takes
//     the next and holds it unprocessed): maxNewPerLane;
//   - no delivery is refused (no retry verdict) and none dead-lettered;
//   - each resumes within resumeWithin of the store answering;
//   - at most maxWarnLines WARN lines in all;
//   - the final state equals the unique intended events'.
const (
	outageFor     = 5 * time.Second
	resumeWithin  = 2 * time.Second
	maxWarnLines  = 10
	maxNewPerLane = 1
	lanes         = 4
	// events is how many messages each source carries on Postgres;
	// SQLite, one writer at a time, gets a third of them (smallEvents).
	events      = 1500
	smallEvents = 500
	// leaseTTL outlasts the outage, so a mark of done that fails meanwhile
	// is written once it ends and no effect repeats; and it is short, so
	// a claim whose answer the outage cut off (the row is held, by whom
	// the worker cannot know) is claimed again soon.
	leaseTTL = 20 * time.Second
)

// store is what the test needs of the store under test.
type store struct {
	drv  any          // driver.Driver, LeaseDriver, DeadLetterStore, OutboxRelayStore
	logs *logRecorder // every component logs here
	// events is how many intended events each source carries; the
	// outbox gets events*2/5 rows.
	events int
	dl     driver.DeadLetterStore
	down   func() // starts the outage
	up     func() // ends it, returning once the store answers
	// consumer builds the consumers' handlers; lease, when the store
	// has lease mode, the lease consumer's processor (nil: no lease
	// consumer runs).
	consumer func(t *testing.T, name string, cfg *idem.ConsumerConfig) idem.DeliveryHandler
	lease    *idem.LeaseProcessor
	// balances reads handler's balances; markers counts its markers.
	balances func(ctx context.Context, handler string) (map[string]int64, error)
	markers  func(ctx context.Context, handler string) (int, error)
	// resumeWithin overrides the package's resumeWithin for the store.
	resumeWithin time.Duration
	// addOutbox adds msgs to the outbox in one transaction; nil when the
	// store has no outbox (no relay runs).
	addOutbox func(ctx context.Context, msgs []*idem.Message) error
}

// TestOutagePostgres stops a private PostgreSQL server for five seconds
// (pg_ctl stop -m immediate, then start) mid-stream.
func TestOutagePostgres(t *testing.T) {
	t.Parallel()
	c := testenv.NewPostgresCluster(t)
	ctx := context.Background()
	logs := &logRecorder{}
	logger := slog.New(logs)
	cfg, err := pgxpool.ParseConfig(c.DSN())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 24
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	drv, err := postgres.New(pool, &postgres.Config{Schema: "app"})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE app.balances (handler text, account text, amount bigint NOT NULL, PRIMARY KEY (handler, account))`); err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, &idem.Config{Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "outage-test", Logger: logger, TTL: leaseTTL})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	s := &store{
		drv: drv, dl: drv, down: c.Crash, up: c.Start, logs: logs, events: events,
		consumer: func(t *testing.T, name string, cfg *idem.ConsumerConfig) idem.DeliveryHandler {
			h := &idem.Handler[postgres.Tx]{Name: name, Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
				acct, amt, err := idemtest.DecodeCredit(m.Payload)
				if err != nil {
					return idem.Permanent(err)
				}
				_, err = tx.Exec(ctx, `INSERT INTO app.balances VALUES ($1, $2, $3) ON CONFLICT (handler, account) DO UPDATE SET amount = balances.amount + excluded.amount`, name, acct, amt)
				return err
			}}
			cons, err := idem.NewConsumer(proc, h, drv, cfg)
			if err != nil {
				t.Fatal(err)
			}
			return cons
		},
		lease: lp,
		balances: func(ctx context.Context, handler string) (map[string]int64, error) {
			rows, err := pool.Query(ctx, `SELECT account, amount FROM app.balances WHERE handler = $1`, handler)
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			return scanBalances(rows)
		},
		markers: func(ctx context.Context, handler string) (n int, err error) {
			// Atomic markers have their own table since migration 11.
			err = pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM app.idem_markers m JOIN app.idem_handlers h ON h.id = m.handler_id WHERE h.name = $1)
  + (SELECT count(*) FROM app.idem_processed WHERE handler = $1)`, handler).Scan(&n)
			return n, err
		},
		addOutbox: func(ctx context.Context, msgs []*idem.Message) error {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			if err := ob.Add(ctx, tx, msgs...); err != nil {
				return err
			}
			return tx.Commit(ctx)
		},
	}
	runOutage(t, s, true)
}

// TestOutageMySQL kills a MariaDB server of the test's own (SIGKILL) for
// five seconds while the components run over it, then starts it again:
// InnoDB recovers from its redo log, as after a crash.
func TestOutageMySQL(t *testing.T) {
	t.Parallel()
	srv := testenv.NewMySQLServer(t)
	ctx := context.Background()
	logs := &logRecorder{}
	cfg, err := gomysql.ParseDSN(srv.DSN())
	if err != nil {
		t.Fatal(err)
	}
	db, err := mysql.Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(24)
	t.Cleanup(func() { db.Close() })
	drv, err := mysql.New(db, &mysql.Config{SessionIsolation: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE balances (handler VARBINARY(64), account VARBINARY(64), amount BIGINT NOT NULL, PRIMARY KEY (handler, account))`); err != nil {
		t.Fatal(err)
	}
	s := sqlStore(t, db, drv, logs, `INSERT INTO balances VALUES (?, ?, ?) ON DUPLICATE KEY UPDATE amount = amount + VALUES(amount)`)
	s.down, s.up, s.events = srv.Crash, srv.Start, events
	s.markers = func(ctx context.Context, handler string) (n int, err error) {
		err = db.QueryRowContext(ctx, `SELECT count(*) FROM idem_markers m JOIN idem_handlers h ON h.id = m.handler_id WHERE h.name = ?`, handler).Scan(&n)
		return n, err
	}
	runOutage(t, s, true)
}

// TestOutageRedis kills a Redis server of the test's own (SIGKILL) for five
// seconds and starts it again; its append-only file, fsynced at every
// write, keeps what it acknowledged. Redis has no lease mode and no
// outbox: the JetStream and Kafka consumers run.
func TestOutageRedis(t *testing.T) {
	t.Parallel()
	srv := testenv.NewRedisServer(t)
	ctx := context.Background()
	logs := &logRecorder{}
	logger := slog.New(logs)
	client := srv.Client(redis.Options{PoolSize: 24})
	const prefix = "idem:"
	drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, &idem.Config{Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	s := &store{
		drv: drv, dl: drv, down: srv.Crash, up: srv.Start, logs: logs, events: events,
		// Once its failed dials reach the pool's size, go-redis stops
		// dialing and retries in the background once a second: up to a
		// second more than the probes' own pace.
		resumeWithin: resumeWithin + time.Second,
		consumer: func(t *testing.T, name string, cfg *idem.ConsumerConfig) idem.DeliveryHandler {
			h := &idem.Handler[*redisstore.Tx]{Name: name, Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
				acct, amt, err := idemtest.DecodeCredit(m.Payload)
				if err != nil {
					return idem.Permanent(err)
				}
				return tx.Queue().HIncrBy(ctx, "balances:"+name, acct, amt).Err()
			}}
			cons, err := idem.NewConsumer(proc, h, drv, cfg)
			if err != nil {
				t.Fatal(err)
			}
			return cons
		},
		balances: func(ctx context.Context, handler string) (map[string]int64, error) {
			return testenv.RedisInts(ctx, client, "balances:"+handler)
		},
		markers: func(ctx context.Context, handler string) (int, error) {
			n := 0
			iter := client.Scan(ctx, 0, prefix+"m:"+handler+"|*", 1000).Iterator()
			for iter.Next(ctx) {
				n++
			}
			return n, iter.Err()
		},
	}
	runOutage(t, s, true)
}

// TestOutageSQLite makes a SQLite store unwritable for five seconds:
// another connection holds its write lock (BEGIN EXCLUSIVE) far past the
// busy timeout. A file made read-only would do as well, but not for root,
// whom CI runs as.
func TestOutageSQLite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	logs := &logRecorder{}
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := sqlite.Open(path, &sqlite.OpenOptions{BusyTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	drv, err := sqlite.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE balances (handler TEXT, account TEXT, amount INTEGER NOT NULL, PRIMARY KEY (handler, account))`); err != nil {
		t.Fatal(err)
	}
	locker, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { locker.Close() })
	var lock *sql.Conn
	s := sqlStore(t, db, drv, logs, `INSERT INTO balances VALUES (?, ?, ?) ON CONFLICT (handler, account) DO UPDATE SET amount = amount + excluded.amount`)
	s.events = smallEvents
	s.down = func() {
		var err error
		if lock, err = locker.Conn(ctx); err != nil {
			t.Error(err)
			return
		}
		// Wait out the busy timeout of a writer that holds the lock
		// now: the exclusive lock is then ours.
		for {
			if _, err = lock.ExecContext(ctx, "BEGIN EXCLUSIVE"); err == nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	s.up = func() {
		if _, err := lock.ExecContext(ctx, "ROLLBACK"); err != nil {
			t.Error(err)
		}
		lock.Close()
	}
	s.markers = func(ctx context.Context, handler string) (n int, err error) {
		err = db.QueryRowContext(ctx, `SELECT count(*) FROM idem_processed WHERE handler = ?`, handler).Scan(&n)
		return n, err
	}
	runOutage(t, s, false)
}

// sqlStore is what TestOutageMySQL and TestOutageSQLite share: a store
// over db whose consumers credit balances (handler, account, amount) with
// upsert, with a lease consumer and an outbox over drv. The caller sets
// down, up, events and markers.
func sqlStore(t *testing.T, db *sql.DB, drv sqlDriver, logs *logRecorder, upsert string) *store {
	t.Helper()
	logger := slog.New(logs)
	proc, err := idem.NewProcessor(drv, &idem.Config{Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "outage-test", Logger: logger, TTL: leaseTTL})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	return &store{
		drv: drv, dl: drv, logs: logs,
		consumer: func(t *testing.T, name string, cfg *idem.ConsumerConfig) idem.DeliveryHandler {
			h := &idem.Handler[*sql.Tx]{Name: name, Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
				acct, amt, err := idemtest.DecodeCredit(m.Payload)
				if err != nil {
					return idem.Permanent(err)
				}
				_, err = tx.ExecContext(ctx, upsert, name, acct, amt)
				return err
			}}
			cons, err := idem.NewConsumer(proc, h, drv, cfg)
			if err != nil {
				t.Fatal(err)
			}
			return cons
		},
		lease: lp,
		balances: func(ctx context.Context, handler string) (map[string]int64, error) {
			rows, err := db.QueryContext(ctx, `SELECT account, amount FROM balances WHERE handler = ?`, handler)
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			return scanBalances(rows)
		},
		addOutbox: func(ctx context.Context, msgs []*idem.Message) error {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			defer tx.Rollback()
			if err := ob.Add(ctx, tx, msgs...); err != nil {
				return err
			}
			return tx.Commit()
		},
	}
}

// sqlDriver is what sqlStore needs of a database/sql store's driver.
type sqlDriver interface {
	driver.Driver[*sql.Tx]
	driver.LeaseDriver
	driver.DeadLetterStore
}

// runOutage runs the components over s, stops s mid-stream for outageFor,
// and checks the promises. withKafka adds the Kafka consumer.
func runOutage(t *testing.T, s *store, withKafka bool) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logs := s.logs
	logger := slog.New(logs)
	events, outboxRows := s.events, s.events*2/5
	evs := idemtest.Events(events)

	// JetStream: one stream, two durables (atomic and lease), every
	// seventh event published twice (no Nats-Msg-Id: both copies stay).
	nc, err := nats.Connect(testenv.EmbeddedNATS(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := natsjs.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	for name, subj := range map[string]string{"CREDITS": "credits.>", "ORDERS": "orders"} {
		if _, err := js.CreateStream(ctx, natsjs.StreamConfig{Name: name, Subjects: []string{subj}}); err != nil {
			t.Fatal(err)
		}
	}
	var comps []*component
	var wg sync.WaitGroup
	run := func(c *component, fn func(context.Context) error) {
		comps = append(comps, c)
		wg.Go(func() {
			if err := fn(ctx); err != nil && ctx.Err() == nil {
				t.Errorf("%s: Run: %v", c.name, err)
			}
		})
	}
	consumerCfg := func(c *component) *idem.ConsumerConfig {
		return &idem.ConsumerConfig{MaxAttempts: 3, Logger: logger, Hooks: []idem.Hook{c}}
	}

	jsAtomic := &component{name: "jetstream"}
	jsAtomic.next = s.consumer(t, "js-balances", consumerCfg(jsAtomic))
	jsc, err := jetstream.New(js, &jetstream.Config{Stream: "CREDITS", Durable: "balances", Handler: jsAtomic, MaxDeliver: 3, Concurrency: lanes, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	run(jsAtomic, jsc.Run)

	var effects sync.Map // idempotency key → *atomic.Int64
	if s.lease != nil {
		lease := &component{name: "lease"}
		notify := &idem.LeaseHandler{Name: "notify", Call: func(_ context.Context, l *idem.Lease, _ *idem.Message) error {
			n, _ := effects.LoadOrStore(l.IdempotencyKey, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			return nil
		}}
		if lease.next, err = idem.NewLeaseConsumer(s.lease, notify, s.dl, consumerCfg(lease)); err != nil {
			t.Fatal(err)
		}
		jsl, err := jetstream.New(js, &jetstream.Config{Stream: "CREDITS", Durable: "notify", Handler: lease, MaxDeliver: 3, Concurrency: lanes, Logger: logger})
		if err != nil {
			t.Fatal(err)
		}
		run(lease, jsl.Run)
	}

	// Producers send two fifths of their messages, wait for the outage to
	// begin, send two fifths more, and wait for it to end before the
	// rest: every component has work arriving while the store is down,
	// however fast it kept up before, and more when it answers again.
	downCh, upCh := make(chan struct{}), make(chan struct{})
	half := func(i, n int) {
		var wait chan struct{}
		switch i {
		case n * 2 / 5:
			wait = downCh
		case n * 4 / 5:
			wait = upCh
		default:
			return
		}
		select {
		case <-wait:
		case <-ctx.Done():
		}
	}
	var produce []func()
	produce = append(produce, func() {
		for i, e := range evs {
			half(i, len(evs))
			m := e.Message()
			msg := &nats.Msg{Subject: "credits." + e.Account, Data: m.Payload, Header: nats.Header{jetstream.HeaderID: {e.ID}, jetstream.HeaderAggregate: {e.Account}}}
			for range 1 + btoi(i%7 == 0) {
				if _, err := js.PublishMsg(ctx, msg); err != nil {
					t.Errorf("publish %s: %v", e.ID, err)
					return
				}
			}
			pace(ctx, i)
		}
	})

	if withKafka {
		kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(lanes, "credits"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(kc.Close)
		kafkaC := &component{name: "kafka"}
		kafkaC.next = s.consumer(t, "kafka-balances", consumerCfg(kafkaC))
		kcons, err := kafka.New(&kafka.Config{Brokers: kc.ListenAddrs(), Group: "balances", Topics: []string{"credits"}, Handler: kafkaC, Concurrency: lanes, Logger: logger})
		if err != nil {
			t.Fatal(err)
		}
		run(kafkaC, kcons.Run)
		cl, err := kgo.NewClient(kgo.SeedBrokers(kc.ListenAddrs()...), kgo.DefaultProduceTopic("credits"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		produce = append(produce, func() {
			for i, e := range evs {
				half(i, len(evs))
				rec := &kgo.Record{Key: []byte(e.Account), Value: e.Message().Payload, Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte(e.ID)}}}
				for range 1 + btoi(i%7 == 0) {
					if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
						t.Errorf("produce %s: %v", e.ID, err)
						return
					}
				}
				pace(ctx, i)
			}
		})
	}

	// The outbox: a producer adds rows (retrying its own transactions
	// through the outage, as an application would) and a relay publishes
	// them to the ORDERS stream.
	relayC := &component{name: "relay", relay: true}
	if s.addOutbox != nil {
		pub, err := jetstream.NewPublisher(js)
		if err != nil {
			t.Fatal(err)
		}
		relay, err := outbox.NewRelay(s.drv, relayC.publisher(pub), &outbox.RelayConfig{Logger: logger, PollInterval: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		run(relayC, relay.Run)
		produce = append(produce, func() {
			for lo := 0; lo < outboxRows; lo += 10 {
				half(lo/10, outboxRows/10)
				var msgs []*idem.Message
				for i := lo; i < lo+10; i++ {
					agg := fmt.Sprintf("order-%02d", i%20)
					seq := int64(i/20 + 1)
					msgs = append(msgs, &idem.Message{ID: outbox.MessageID("orders", agg, seq), Stream: "orders", AggregateID: agg, Seq: seq, Payload: []byte("placed")})
				}
				for s.addOutbox(ctx, msgs) != nil {
					if ctx.Err() != nil {
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
				pace(ctx, 24) // 10 rows every 50 ms
				pace(ctx, 24)
			}
		})
	}
	for _, p := range produce {
		wg.Go(p)
	}

	// Mid-stream: every consumer has applied a third of its messages.
	waitFor(t, "a third of the stream", 120*time.Second, func() bool {
		for _, c := range comps {
			if c.acks() < events/3 && !c.relay || c.relay && c.acks() < outboxRows/3 {
				return false
			}
		}
		return true
	})
	s.down()
	downAt := time.Now()
	close(downCh)
	time.Sleep(outageFor)
	// The store may answer, and the components resume, before up
	// returns (pg_ctl start -w polls): the outage is over from the call
	// on, and resuming is measured from its return.
	upFrom := time.Now()
	s.up()
	upAt := time.Now()
	close(upCh)
	t.Logf("store down for %s", upAt.Sub(downAt).Round(time.Millisecond))

	// Everything reaches its end state.
	waitFor(t, "every message applied", 180*time.Second, func() bool {
		if n, err := s.markers(ctx, "js-balances"); err != nil || n < events {
			return false
		}
		if n := countEffects(&effects); s.lease != nil && n < events {
			return false
		}
		if withKafka {
			if n, err := s.markers(ctx, "kafka-balances"); err != nil || n < events {
				return false
			}
		}
		// Distinct messages: rows published but not marked before the
		// outage go out again, and count twice in acks.
		relayC.mu.Lock()
		defer relayC.mu.Unlock()
		return s.addOutbox == nil || len(relayC.sent) >= outboxRows
	})
	cancel()
	wg.Wait()

	within := resumeWithin
	if s.resumeWithin > 0 {
		within = s.resumeWithin
	}
	for _, c := range comps {
		st := c.stats(downAt, upFrom, upAt)
		t.Logf("%-9s in flight at the outage %d, deliveries begun during it %d (held through it %d), refused during it %d, outages seen %d, resumed %s after the store answered",
			c.name, st.inFlight, st.begunDuring, st.heldThrough, st.refusedDuring, c.outages.Load(), st.resumedAfter.Round(time.Millisecond))
		if !c.relay && st.begunDuring > st.inFlight+maxNewPerLane*lanes {
			t.Errorf("%s: %d deliveries begun during the outage, want at most %d in flight + %d; the first:\n\t%s",
				c.name, st.begunDuring, st.inFlight, maxNewPerLane*lanes, strings.Join(st.begun, "\n\t"))
		}
		if st.refusedDuring > 0 {
			t.Errorf("%s: %d deliveries refused (to be retried) during the outage, want 0", c.name, st.refusedDuring)
		}
		if st.resumedAfter < 0 || st.resumedAfter > within {
			t.Errorf("%s: resumed %s after the store answered, want within %s", c.name, st.resumedAfter, within)
		}
		if !c.relay && c.outages.Load() == 0 && st.inFlight == 0 && st.heldThrough == 0 {
			// A lease worker marking done waits the outage out in its
			// own loop: it holds its delivery, and its consumer sees no
			// outage; so does a delivery whose store client retried
			// through the outage. Either way it must have been busy.
			t.Errorf("%s: saw no outage and had nothing in flight: the outage was not exercised", c.name)
		}
		if st.maxAttempt >= 3 {
			t.Errorf("%s: a delivery reached attempt %d: the outage spent the broker's attempts", c.name, st.maxAttempt)
		}
	}
	warns := logs.warnings()
	t.Logf("WARN lines: %d\n%s", len(warns), strings.Join(warns, "\n"))
	if len(warns) > maxWarnLines {
		t.Errorf("%d WARN lines, want at most %d:\n%s", len(warns), maxWarnLines, strings.Join(warns, "\n"))
	}
	if s.addOutbox != nil && !slices.ContainsFunc(warns, func(l string) bool { return strings.Contains(l, "outbox relay") }) {
		t.Errorf("the relay did not report the outage:\n%s", strings.Join(warns, "\n"))
	}

	// The end state, from the unique intended events.
	check := context.Background()
	dls, err := s.dl.DeadLetterList(check, &driver.DeadLetterFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) > 0 {
		t.Errorf("%d dead letters, want none; the first: %s %s: %s", len(dls), dls[0].Handler, dls[0].Class, dls[0].Error)
	}
	want := idemtest.Expected(evs)
	handlers := []string{"js-balances"}
	if withKafka {
		handlers = append(handlers, "kafka-balances")
	}
	for _, h := range handlers {
		got, err := s.balances(check, h)
		if err != nil {
			t.Fatal(err)
		}
		for acct, w := range want {
			if got[acct] != w {
				t.Errorf("%s: %s = %d, want %d", h, acct, got[acct], w)
			}
		}
		if n, _ := s.markers(check, h); n != events {
			t.Errorf("%s: %d markers, want %d", h, n, events)
		}
	}
	if s.lease != nil {
		for _, e := range evs {
			n, ok := effects.Load(idem.IdempotencyKey("notify", e.ID))
			if !ok || n.(*atomic.Int64).Load() != 1 {
				got := int64(0)
				if ok {
					got = n.(*atomic.Int64).Load()
				}
				t.Errorf("notify: %s called %d times, want once", e.ID, got)
			}
		}
	}
	if s.addOutbox != nil {
		published := map[string]bool{}
		cons, err := js.OrderedConsumer(check, "ORDERS", natsjs.OrderedConsumerConfig{})
		if err != nil {
			t.Fatal(err)
		}
		for {
			batch, err := cons.FetchNoWait(500)
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for m := range batch.Messages() {
				published[m.Headers().Get(jetstream.HeaderMsgID)] = true
				n++
			}
			if n == 0 {
				break
			}
		}
		if len(published) != outboxRows {
			t.Errorf("%d distinct outbox messages on the stream, want %d", len(published), outboxRows)
		}
	}
}

// scanBalances reads (account, amount) rows.
func scanBalances(rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
}) (map[string]int64, error) {
	m := map[string]int64{}
	for rows.Next() {
		var (
			a string
			n int64
		)
		if err := rows.Scan(&a, &n); err != nil {
			return nil, err
		}
		m[a] = n
	}
	return m, rows.Err()
}

// countEffects counts the keys called at least once.
func countEffects(effects *sync.Map) int {
	n := 0
	effects.Range(func(any, any) bool { n++; return true })
	return n
}

// pace spreads a producer's messages over a few seconds, so that the
// outage falls mid-stream.
func pace(ctx context.Context, i int) {
	if i%25 == 24 {
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// component wraps a consumer's DeliveryHandler (or a relay's Publisher)
// and records when each delivery began and ended, and how.
type component struct {
	name    string
	relay   bool
	next    idem.DeliveryHandler
	outages atomic.Int64

	mu   sync.Mutex
	recs []rec
	sent map[string]bool // a relay's messages the broker acknowledged
}

type rec struct {
	in, out time.Time
	ack     bool
	attempt int
	id      string // the message's ID, "" when it had none
	err     error  // the verdict's error
}

// HandleDelivery implements idem.DeliveryHandler.
func (c *component) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	in := time.Now()
	v := c.next.HandleDelivery(ctx, d)
	id := ""
	if d.Msg != nil {
		id = d.Msg.ID
	}
	c.mu.Lock()
	c.recs = append(c.recs, rec{in: in, out: time.Now(), ack: v.Ack || errors.Is(v.Err, idem.ErrStoreUnavailable), attempt: d.Attempt, id: id, err: v.Err})
	c.mu.Unlock()
	return v
}

// AggregateKey passes the lanes' key on.
func (c *component) AggregateKey(id string) string {
	if k, ok := c.next.(idem.AggregateKeyer); ok {
		return k.AggregateKey(id)
	}
	return id
}

// OnOutage implements idem.HookOutage.
func (c *component) OnOutage(_ context.Context, ev *idem.OutageEvent) {
	if ev.Down {
		c.outages.Add(1)
	}
}

// publisher records a relay's publishes as deliveries.
func (c *component) publisher(next outbox.Publisher) outbox.Publisher {
	return publishFunc(func(ctx context.Context, msgs []*idem.Message) error {
		in := time.Now()
		err := next.Publish(ctx, msgs)
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.sent == nil {
			c.sent = map[string]bool{}
		}
		for _, m := range msgs {
			c.recs = append(c.recs, rec{in: in, out: time.Now(), ack: err == nil, id: m.ID, err: err})
			if err == nil {
				c.sent[m.ID] = true
			}
		}
		return err
	})
}

// publishFunc adapts a function to outbox.Publisher.
type publishFunc func(ctx context.Context, msgs []*idem.Message) error

func (f publishFunc) Publish(ctx context.Context, msgs []*idem.Message) error { return f(ctx, msgs) }

// acks counts the acknowledged deliveries.
func (c *component) acks() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, r := range c.recs {
		if r.ack {
			n++
		}
	}
	return n
}

type stats struct {
	inFlight, begunDuring, refusedDuring, maxAttempt int
	// heldThrough counts deliveries begun during the outage that ended
	// after it without a refusal: they waited it out (go-redis, say,
	// retries a command past a short outage).
	heldThrough  int
	resumedAfter time.Duration
	// begun describes the first deliveries begun during the outage, for
	// a failure's message.
	begun []string
}

// stats measures the outage from down to upFrom, when the store was told
// to start, and the resumption from up, when it answered.
func (c *component) stats(down, upFrom, up time.Time) stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	var st stats
	first := time.Time{}
	for _, r := range c.recs {
		st.maxAttempt = max(st.maxAttempt, r.attempt)
		if r.in.Before(down) && r.out.After(down) {
			st.inFlight++
		}
		if !r.in.Before(down) && r.in.Before(upFrom) {
			st.begunDuring++
			if !r.out.Before(upFrom) && r.ack {
				st.heldThrough++
			}
			if len(st.begun) < 20 {
				st.begun = append(st.begun, fmt.Sprintf("%s attempt %d from +%s to +%s ack %t err %v",
					r.id, r.attempt, r.in.Sub(down).Round(time.Millisecond), r.out.Sub(down).Round(time.Millisecond), r.ack, r.err))
			}
		}
		if !r.ack && !r.out.Before(down) && r.out.Before(upFrom) {
			st.refusedDuring++
		}
		if r.ack && !r.out.Before(up) && (first.IsZero() || r.out.Before(first)) {
			first = r.out
		}
	}
	st.resumedAfter = -1
	if !first.IsZero() {
		st.resumedAfter = first.Sub(up)
	}
	return st
}

// logRecorder keeps every log line.
type logRecorder struct {
	mu    sync.Mutex
	lines []string
	warns []string
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Level.String() + " " + r.Message)
	r.Attrs(func(a slog.Attr) bool {
		b.WriteString(" " + a.String())
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, b.String())
	if r.Level >= slog.LevelWarn {
		l.warns = append(l.warns, b.String())
	}
	return nil
}

func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

func (l *logRecorder) warnings() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.warns)
}

func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
