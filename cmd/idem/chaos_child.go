package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/sqlident"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// The handlers every chaos consumer runs, and their durables or groups.
const (
	chaosBalances    = "chaos.balances"
	chaosOrdered     = "chaos.ordered"
	chaosSinkHandler = "chaos.sink"
)

// chaosHandlers lists the handler names in report order.
var chaosHandlers = []string{chaosBalances, chaosOrdered, chaosSinkHandler}

const (
	// chaosAckWait is how soon JetStream redelivers what a killed consumer
	// had not acknowledged.
	chaosAckWait = 3 * time.Second
	// chaosLeaseTTL is how long a killed consumer's lease holds its
	// message before another consumer may call the sink for it.
	chaosLeaseTTL = 3 * time.Second
	// chaosRelayClaimTTL is how long a killed relay's ordering keys wait
	// before another relay takes them.
	chaosRelayClaimTTL = 3 * time.Second
	// chaosSessionTimeout is how long Kafka waits for a killed member
	// before it moves its partitions.
	chaosSessionTimeout = 6 * time.Second
	// chaosGapWait is how long the ordered handler waits for an earlier
	// sequence before it dead-letters a later one; a run that needs it
	// fails.
	chaosGapWait = 5 * time.Minute
	// chaosReportEvery is how often a consumer reports its counts.
	chaosReportEvery = 250 * time.Millisecond
)

// chaosPayload is the body of a chaos event.
type chaosPayload struct {
	Amount int64 `json:"amount"`
}

// chaosTables are the chaos projections' qualified table names.
type chaosTables struct {
	balances, ordered string
}

func newChaosTables(schema string) chaosTables {
	return chaosTables{
		balances: sqlident.Qualified(schema, "chaos_balances"),
		ordered:  sqlident.Qualified(schema, "chaos_ordered"),
	}
}

// ddl creates the projections.
func (t chaosTables) ddl() []string {
	return []string{
		`CREATE TABLE ` + t.balances + ` (account text PRIMARY KEY, amount bigint NOT NULL, n bigint NOT NULL)`,
		// bad counts the writes whose sequence did not follow the last one.
		`CREATE TABLE ` + t.ordered + ` (account text PRIMARY KEY, last_seq bigint NOT NULL, n bigint NOT NULL, bad bigint NOT NULL)`,
	}
}

// runChaosChild runs the role spec describes until its standard input
// closes.
func runChaosChild(ctx context.Context, e *env, raw string) error {
	var spec chaosChild
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		return fmt.Errorf("chaos: %s: %w", chaosChildEnv, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	exitIfParentGone(cancel)
	logger := slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).With("proc", spec.Name)
	var err error
	switch spec.Role {
	case "node":
		err = runChaosNode(ctx, &spec)
	case "consumer":
		err = runChaosConsumer(ctx, &spec, logger)
	case "relay":
		err = runChaosRelay(ctx, &spec, logger)
	default:
		err = fmt.Errorf("chaos: unknown role %q", spec.Role)
	}
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// chaosPool opens the child's Postgres pool and driver.
func chaosPool(ctx context.Context, spec *chaosChild, maxConns int32, logger *slog.Logger) (*pgxpool.Pool, *postgres.Driver, error) {
	pcfg, err := pgxpool.ParseConfig(spec.DSN)
	if err != nil {
		return nil, nil, err
	}
	pcfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, nil, err
	}
	drv, err := postgres.New(pool, &postgres.Config{Schema: spec.Schema, Logger: logger})
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return pool, drv, nil
}

// chaosConnectNATS connects to every node of the cluster, reconnecting
// for ever.
func chaosConnectNATS(urls []string) (*nats.Conn, natsjs.JetStream, error) {
	nc, err := nats.Connect(strings.Join(urls, ","), nats.MaxReconnects(-1), nats.ReconnectWait(200*time.Millisecond),
		nats.RetryOnFailedConnect(true), nats.Timeout(2*time.Second))
	if err != nil {
		return nil, nil, err
	}
	js, err := natsjs.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// chaosCounts are one handler's verdicts in one consumer process.
type chaosCounts struct {
	Deliveries   atomic.Int64
	Redeliveries atomic.Int64
	Applied      atomic.Int64
	Duplicates   atomic.Int64
	Stale        atomic.Int64
	Retried      atomic.Int64
	Dead         atomic.Int64
}

// chaosCountsJSON is chaosCounts as reported.
type chaosCountsJSON struct {
	Deliveries, Redeliveries, Applied, Duplicates, Stale, Retried, Dead int64
}

func (c *chaosCounts) snapshot() chaosCountsJSON {
	return chaosCountsJSON{c.Deliveries.Load(), c.Redeliveries.Load(), c.Applied.Load(), c.Duplicates.Load(),
		c.Stale.Load(), c.Retried.Load(), c.Dead.Load()}
}

func (c *chaosCountsJSON) add(o chaosCountsJSON) {
	c.Deliveries += o.Deliveries
	c.Redeliveries += o.Redeliveries
	c.Applied += o.Applied
	c.Duplicates += o.Duplicates
	c.Stale += o.Stale
	c.Retried += o.Retried
	c.Dead += o.Dead
}

// chaosReport is what a consumer process posts to the run.
type chaosReport struct {
	// Incarnation tells one start of a process from the next.
	Incarnation string                     `json:"incarnation"`
	Counts      map[string]chaosCountsJSON `json:"counts"`
}

// chaosCounting counts the verdicts of the handler it wraps.
type chaosCounting struct {
	next idem.DeliveryHandler
	c    *chaosCounts
}

func (h *chaosCounting) HandleDelivery(ctx context.Context, d *idem.Delivery) idem.Verdict {
	h.c.Deliveries.Add(1)
	if d.Attempt > 1 {
		h.c.Redeliveries.Add(1)
	}
	v := h.next.HandleDelivery(ctx, d)
	switch {
	case v.DeadLettered:
		h.c.Dead.Add(1)
	case !v.Ack:
		h.c.Retried.Add(1)
	case v.Outcome == idem.Applied:
		h.c.Applied.Add(1)
	case v.Outcome == idem.Duplicate:
		h.c.Duplicates.Add(1)
	case v.Outcome == idem.Stale:
		h.c.Stale.Add(1)
	}
	return v
}

// AggregateKey lets the adapters keep one aggregate's messages in one lane.
func (h *chaosCounting) AggregateKey(aggregateID string) string {
	if k, ok := h.next.(idem.AggregateKeyer); ok {
		return k.AggregateKey(aggregateID)
	}
	return aggregateID
}

// chaosDeliveryHandlers builds the three handlers of a consumer process,
// each wrapped to count its verdicts.
func chaosDeliveryHandlers(spec *chaosChild, drv *postgres.Driver, logger *slog.Logger) (map[string]*chaosCounting, error) {
	t := newChaosTables(spec.Schema)
	proc, err := idem.NewProcessor(drv, &idem.Config{Logger: logger})
	if err != nil {
		return nil, err
	}
	ccfg := &idem.ConsumerConfig{Logger: logger, Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 500 * time.Millisecond}}
	balances := &idem.Handler[postgres.Tx]{Name: chaosBalances, Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
		var p chaosPayload
		if err := json.Unmarshal(m.Payload, &p); err != nil {
			return idem.Permanent(fmt.Errorf("message %q: %w", m.ID, err))
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+t.balances+` (account, amount, n) VALUES ($1, $2, 1)
			ON CONFLICT (account) DO UPDATE SET amount = `+t.balances+`.amount + excluded.amount, n = `+t.balances+`.n + 1`,
			m.AggregateID, p.Amount)
		return err
	}}
	ordered := &idem.Handler[postgres.Tx]{Name: chaosOrdered, Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: chaosGapWait},
		Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+t.ordered+` (account, last_seq, n, bad) VALUES ($1, $2::bigint, 1, CASE WHEN $2::bigint = 1 THEN 0 ELSE 1 END)
				ON CONFLICT (account) DO UPDATE SET last_seq = excluded.last_seq, n = `+t.ordered+`.n + 1,
				bad = `+t.ordered+`.bad + CASE WHEN excluded.last_seq = `+t.ordered+`.last_seq + 1 THEN 0 ELSE 1 END`,
				m.AggregateID, m.Seq)
			return err
		}}
	bc, err := idem.NewConsumer(proc, balances, drv, ccfg)
	if err != nil {
		return nil, err
	}
	oc, err := idem.NewConsumer(proc, ordered, drv, ccfg)
	if err != nil {
		return nil, err
	}
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: spec.Name, TTL: chaosLeaseTTL,
		BackoffBase: 20 * time.Millisecond, BackoffMax: 500 * time.Millisecond, Logger: logger})
	if err != nil {
		return nil, err
	}
	client := &http.Client{Timeout: 5 * time.Second}
	sink := &idem.LeaseHandler{Name: chaosSinkHandler, Call: func(ctx context.Context, l *idem.Lease, m *idem.Message) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, spec.SinkURL+"/effect", bytes.NewReader(m.Payload))
		if err != nil {
			return err
		}
		req.Header.Set("Idempotency-Key", l.IdempotencyKey)
		req.Header.Set("Fencing-Token", strconv.FormatInt(l.Token, 10))
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("sink: %s", resp.Status)
		}
		return nil
	}}
	sc, err := idem.NewLeaseConsumer(lp, sink, drv, ccfg)
	if err != nil {
		return nil, err
	}
	return map[string]*chaosCounting{
		chaosBalances:    {next: bc, c: &chaosCounts{}},
		chaosOrdered:     {next: oc, c: &chaosCounts{}},
		chaosSinkHandler: {next: sc, c: &chaosCounts{}},
	}, nil
}

// runChaosConsumer runs the three handlers on the broker until ctx ends,
// reporting their counts to the run.
func runChaosConsumer(ctx context.Context, spec *chaosChild, logger *slog.Logger) error {
	pool, drv, err := chaosPool(ctx, spec, 4, logger)
	if err != nil {
		return err
	}
	defer pool.Close()
	hs, err := chaosDeliveryHandlers(spec, drv, logger)
	if err != nil {
		return err
	}
	var run func(ctx context.Context, name string, h *chaosCounting) error
	switch spec.Broker {
	case "kafka":
		run = func(ctx context.Context, name string, h *chaosCounting) error {
			c, err := kafka.New(&kafka.Config{Brokers: spec.URLs, Group: name, Topics: []string{spec.Stream}, Handler: h, Logger: logger,
				Options: []kgo.Opt{kgo.SessionTimeout(chaosSessionTimeout), kgo.RebalanceTimeout(chaosSessionTimeout)}})
			if err != nil {
				return err
			}
			return c.Run(ctx)
		}
	default:
		nc, js, err := chaosConnectNATS(spec.URLs)
		if err != nil {
			return err
		}
		defer nc.Close()
		run = func(ctx context.Context, name string, h *chaosCounting) error {
			c, err := jetstream.New(js, &jetstream.Config{Stream: spec.Stream, Durable: chaosDurable(name),
				Handler: h, AckWait: chaosAckWait, Logger: logger})
			if err != nil {
				return err
			}
			return c.Run(ctx)
		}
	}
	incarnation := fmt.Sprintf("%s@%d", spec.Name, time.Now().UnixNano())
	done := make(chan struct{}, len(hs))
	for name, h := range hs {
		go func() {
			defer func() { done <- struct{}{} }()
			for ctx.Err() == nil {
				err := run(ctx, name, h)
				if ctx.Err() != nil {
					return
				}
				logger.Warn("chaos: consumer stopped; starting it again", "handler", name, "err", err)
				sleepCtx(ctx, 500*time.Millisecond)
			}
		}()
	}
	report := func() {
		r := chaosReport{Incarnation: incarnation, Counts: map[string]chaosCountsJSON{}}
		for name, h := range hs {
			r.Counts[name] = h.c.snapshot()
		}
		body, _ := json.Marshal(r) // cannot fail
		rctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(rctx, http.MethodPost, spec.SinkURL+"/report", bytes.NewReader(body))
		if err != nil {
			return
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}
	t := time.NewTicker(chaosReportEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			for range hs {
				<-done
			}
			report()
			return nil
		case <-t.C:
			report()
		}
	}
}

// runChaosRelay publishes the outbox until ctx ends.
func runChaosRelay(ctx context.Context, spec *chaosChild, logger *slog.Logger) error {
	pool, drv, err := chaosPool(ctx, spec, 3, logger)
	if err != nil {
		return err
	}
	defer pool.Close()
	var pub outbox.Publisher
	switch spec.Broker {
	case "kafka":
		cl, err := kgo.NewClient(kgo.SeedBrokers(spec.URLs...))
		if err != nil {
			return err
		}
		defer cl.Close()
		if pub, err = kafka.NewPublisher(cl); err != nil {
			return err
		}
	default:
		nc, js, err := chaosConnectNATS(spec.URLs)
		if err != nil {
			return err
		}
		defer nc.Close()
		if pub, err = jetstream.NewPublisher(js); err != nil {
			return err
		}
	}
	relay, err := outbox.NewRelay(drv, pub, &outbox.RelayConfig{Owner: spec.Name, ClaimTTL: chaosRelayClaimTTL,
		PollInterval: 100 * time.Millisecond, Backoff: idem.Backoff{Base: 50 * time.Millisecond, Max: time.Second}, Logger: logger})
	if err != nil {
		return err
	}
	for ctx.Err() == nil {
		err := relay.Run(ctx)
		if ctx.Err() != nil || errors.Is(err, context.Canceled) {
			break
		}
		logger.Warn("chaos: relay stopped; starting it again", "err", err)
		sleepCtx(ctx, 500*time.Millisecond)
	}
	return nil
}

// sleepCtx sleeps for d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
