package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/sqlite"
)

const (
	// natsDemoStream is the demo's JetStream stream and subject prefix.
	natsDemoStream = "IDEMDEMO"
	// natsDemoConsumers is the number of consumers sharing the durable.
	natsDemoConsumers = 3
	// natsDemoAckWait is how soon JetStream redelivers what a killed
	// consumer left unacknowledged.
	natsDemoAckWait = time.Second
)

// demoBroker is the broker side of the demo: an embedded JetStream server
// or an in-process Kafka cluster.
type demoBroker interface {
	describe() string
	killNote() string
	setHandler(h idem.DeliveryHandler)
	publish(ctx context.Context, msgs []*idem.Message) error
	start(ctx context.Context) error
	killOne()
	stopAll()
	close()
}

// consumerSet tracks running consumers and how to kill each.
type consumerSet struct {
	h     idem.DeliveryHandler
	mu    sync.Mutex
	kills []func()
}

func (s *consumerSet) setHandler(h idem.DeliveryHandler) { s.h = h }

func (s *consumerSet) add(kill func()) {
	s.mu.Lock()
	s.kills = append(s.kills, kill)
	s.mu.Unlock()
}

// killOne kills the oldest running consumer.
func (s *consumerSet) killOne() {
	s.mu.Lock()
	kill := s.kills[0]
	s.kills = s.kills[1:]
	s.mu.Unlock()
	kill()
}

func (s *consumerSet) stopAll() {
	s.mu.Lock()
	kills := s.kills
	s.kills = nil
	s.mu.Unlock()
	for _, k := range kills {
		k()
	}
}

// natsDemo runs the demo over an embedded NATS JetStream server.
type natsDemo struct {
	consumerSet
	ns  *server.Server
	url string
}

func newNATSDemo(storeDir string) (*natsDemo, error) {
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: storeDir, NoLog: true, NoSigs: true})
	if err != nil {
		return nil, fmt.Errorf("embedded NATS: %w", err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		ns.Shutdown()
		return nil, errors.New("embedded NATS did not start")
	}
	return &natsDemo{ns: ns, url: ns.ClientURL()}, nil
}

func (d *natsDemo) describe() string {
	return "an embedded NATS JetStream server (" + d.url + "), 3 consumers on one durable"
}

func (d *natsDemo) killNote() string {
	return "connections closed mid-stream; JetStream redelivered what they had not acknowledged"
}

func (d *natsDemo) close() { d.ns.Shutdown() }

// runBrokerDemo publishes the demo stream (redeliveries and conflicts
// included) to an embedded broker (JetStream, or Kafka with --broker
// kafka), consumes it with three consumers sharing it, kills two of them
// mid-stream (what they had not acknowledged or committed comes back to the
// others and to their replacements), and verifies every balance.
func runBrokerDemo(ctx context.Context, e *env, cfg *demoConfig) error {
	s, err := setUpBrokerDemo(ctx, cfg, demoBalancesDDL)
	if err != nil {
		return err
	}
	defer s.close()
	b, db, drv, path := s.b, s.db, s.drv, s.path
	quiet := slog.New(slog.DiscardHandler)
	proc, rec, err := newDemoProcessor(drv, quiet)
	if err != nil {
		return err
	}
	consumer, err := idem.NewConsumer(proc, demoBalanceHandler(), drv, &idem.ConsumerConfig{Logger: quiet})
	if err != nil {
		return err
	}

	names := newDemoNames(cfg)
	events := demoEvents(cfg, names)
	stream := buildDemoStream(cfg, names, events)
	// A conflicting payload must arrive after its original to lose to it,
	// and three consumers do not keep publish order: the conflicts are
	// published once everything else is applied.
	var deliveries, conflicting []*idem.Message
	first := map[string][]byte{}
	for _, b := range stream.batches {
		for _, m := range b.msgs { // bursts are the broker's job here
			if p, seen := first[m.ID]; seen && string(p) != string(m.Payload) {
				conflicting = append(conflicting, m)
				continue
			}
			first[m.ID] = m.Payload
			deliveries = append(deliveries, m)
		}
	}
	fmt.Fprintf(e.stdout, "idem demo: account balances on SQLite (synchronous=FULL) at %s,\n", path)
	fmt.Fprintf(e.stdout, "  fed by %s\n", b.describe())
	fmt.Fprintf(e.stdout, "  %d intended events over %d accounts (seed %d)\n", len(events), cfg.accounts, cfg.seed)
	fmt.Fprintf(e.stdout, "  published: %d first deliveries + %d republished + %d conflicting payloads = %d messages\n",
		stream.firstDelivery, stream.redeliveries, len(conflicting), len(deliveries)+len(conflicting))
	fmt.Fprintf(e.stdout, "  %d consumers sharing the stream; two are killed mid-stream and replaced\n", natsDemoConsumers)

	counts := &demoCounts{conflictIDs: map[string]int{}}
	b.setHandler(&countingHandler{next: consumer, counts: counts})
	start := time.Now()
	if err := b.publish(ctx, deliveries); err != nil {
		return err
	}
	defer b.stopAll()
	prog := newProgress(e.stdout, int64(len(events)), "events applied")
	killed, err := superviseDemo(ctx, b, prog, int64(len(events)), counts.applied.Load, func(n int64) (bool, error) {
		if n >= int64(len(events)) && conflicting != nil {
			if err := b.publish(ctx, conflicting); err != nil {
				return false, err
			}
			conflicting = nil
		}
		return n >= int64(len(events)) && conflicting == nil && counts.conflicts.Load() >= int64(stream.conflicts), nil
	})
	if err != nil {
		return err
	}
	prog.Finish()
	// Let the killed consumers' leftovers come back: they are duplicates.
	time.Sleep(natsDemoAckWait + 200*time.Millisecond)
	b.stopAll()
	elapsed := time.Since(start)
	if err := rec.Flush(ctx); err != nil {
		return err
	}
	stream.deliveries = int(counts.applied.Load() + counts.duplicates.Load() + counts.conflicts.Load())

	rep, err := verifyDemo(ctx, db, cfg, names, events)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "\n  consumers killed %16d  (%s)\n", killed, b.killNote())
	ok := printDemoReport(e.stdout, cfg, stream, counts, rep, elapsed)
	if cfg.db != "" {
		fmt.Fprintf(e.stdout, "database kept at %s (table demo_balances; markers in idem_processed, handler %q)\n", cfg.db, demoHandler)
	}
	if !ok {
		return errors.New("verification failed: see the report above")
	}
	return nil
}

// brokerDemo is what the broker demos start from: a temporary directory,
// the broker --broker names and the SQLite store (at --db if set).
type brokerDemo struct {
	dir, path string
	b         demoBroker
	db        *sql.DB
	drv       *sqlite.Driver
}

// setUpBrokerDemo creates the demo's directory, broker and store, the
// store with ddl run on it. close undoes it all.
func setUpBrokerDemo(ctx context.Context, cfg *demoConfig, ddl string) (*brokerDemo, error) {
	dir, err := os.MkdirTemp("", "idem-demo-")
	if err != nil {
		return nil, fmt.Errorf("create temporary directory: %w", err)
	}
	s := &brokerDemo{dir: dir, path: cfg.db}
	if s.path == "" {
		s.path = filepath.Join(dir, "demo.db")
	}
	switch cfg.broker {
	case "kafka":
		s.b, err = newKafkaDemo()
	case "rabbitmq":
		s.b, err = newRabbitDemo()
	default:
		s.b, err = newNATSDemo(filepath.Join(dir, "jetstream"))
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if s.db, s.drv, err = openDemoDB(ctx, s.path, ddl); err != nil {
		s.b.close()
		os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

func (s *brokerDemo) close() {
	s.db.Close()
	s.b.close()
	os.RemoveAll(s.dir)
}

// superviseDemo starts the demo's consumers on b and, while applied()
// counts towards total, shows progress and kills and replaces one consumer
// at 30% and one at 60%. It returns how many it killed once both kills are
// done and finished, asked with the count at every turn, says so; an error
// if that takes over two minutes.
func superviseDemo(ctx context.Context, b demoBroker, prog *progress, total int64, applied func() int64, finished func(n int64) (bool, error)) (int, error) {
	for range natsDemoConsumers {
		if err := b.start(ctx); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	killAt := []int64{total * 3 / 10, total * 6 / 10}
	var shown int64
	killed := 0
	for {
		n := applied()
		prog.Add(int(n - shown))
		shown = n
		if len(killAt) > 0 && n >= killAt[0] {
			killAt = killAt[1:]
			b.killOne()
			killed++
			if err := b.start(ctx); err != nil {
				return killed, err
			}
		}
		done, err := finished(n)
		if err != nil {
			return killed, err
		}
		if done && len(killAt) == 0 {
			return killed, nil
		}
		if err := ctx.Err(); err != nil {
			return killed, err
		}
		if time.Since(start) > 2*time.Minute {
			return killed, fmt.Errorf("stalled: %d of %d applied after 2 minutes", n, total)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// publish sends every delivery, waiting for JetStream's acknowledgements.
// The ID travels in the idem-id header: a republished copy is a new
// JetStream message with the same ID, as a producer's retry would be.
func (d *natsDemo) publish(ctx context.Context, msgs []*idem.Message) error {
	nc, err := nats.Connect(d.url)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := natsjs.New(nc)
	if err != nil {
		return err
	}
	if _, err := js.CreateOrUpdateStream(ctx, natsjs.StreamConfig{Name: natsDemoStream, Subjects: []string{natsDemoStream + ".>"}}); err != nil {
		return fmt.Errorf("create stream: %w", err)
	}
	for _, m := range msgs {
		nm := &nats.Msg{Subject: natsDemoStream + ".credits", Data: m.Payload, Header: nats.Header{}}
		nm.Header.Set(jetstream.HeaderID, m.ID)
		nm.Header.Set(jetstream.HeaderType, m.Type)
		if _, err := js.PublishMsgAsync(nm); err != nil {
			return fmt.Errorf("publish: %w", err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Minute):
		return errors.New("publish: JetStream did not acknowledge every message within a minute")
	}
	return nil
}

// start runs one more consumer on the durable, with its own connection.
func (d *natsDemo) start(ctx context.Context) error {
	nc, err := nats.Connect(d.url)
	if err != nil {
		return err
	}
	js, err := natsjs.New(nc)
	if err != nil {
		nc.Close()
		return err
	}
	c, err := jetstream.New(js, &jetstream.Config{Stream: natsDemoStream, Durable: "demo", Handler: d.h,
		AckWait: natsDemoAckWait, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		nc.Close()
		return err
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(cctx) }()
	var once sync.Once
	d.add(func() { once.Do(func() { nc.Close(); cancel(); <-done }) })
	return nil
}

// countingHandler counts the verdicts of the consumer it wraps.
type countingHandler struct {
	next   idem.DeliveryHandler
	counts *demoCounts
}

func (c *countingHandler) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	v := c.next.HandleDelivery(ctx, d)
	switch {
	case v.DeadLettered:
		// A killed consumer's lost Term brings a dead letter back; it is
		// stored once (an upsert), so count each ID once.
		first := true
		if d.Msg != nil {
			c.counts.mu.Lock()
			first = c.counts.conflictIDs[d.Msg.ID] == 0
			if first {
				c.counts.conflictIDs[d.Msg.ID]++
			}
			c.counts.mu.Unlock()
		}
		if first {
			c.counts.conflicts.Add(1)
			c.counts.deadLetters.Add(1)
		}
	case v.Outcome == idem.Applied:
		c.counts.applied.Add(1)
	case v.Outcome == idem.Duplicate:
		c.counts.duplicates.Add(1)
	case !v.Ack:
		c.counts.retries.Add(1)
	}
	return v
}
