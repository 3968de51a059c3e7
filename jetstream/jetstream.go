package jetstream

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/errtext"
	"github.com/idemhq/idem/internal/lograte"
	"github.com/idemhq/idem/internal/verdicts"
)

// Headers the default mapping reads. A producer (or idem's outbox) sets
// them; Nats-Msg-Id is JetStream's own.
const (
	HeaderMsgID     = "Nats-Msg-Id"
	HeaderID        = "idem-id"
	HeaderAggregate = "idem-aggregate"
	HeaderSeq       = "idem-seq"
	HeaderType      = "idem-type"
	HeaderTime      = "idem-time" // RFC 3339, as Publisher writes Message.Time
)

// Config configures a Consumer.
type Config struct {
	// Stream is the JetStream stream to consume. Required.
	Stream string
	// Durable names the durable pull consumer; consumers with the same
	// name share its messages. Required.
	Durable string
	// FilterSubject limits the consumer to matching subjects. Default: all.
	FilterSubject string
	// Handler decides every delivery. Required.
	Handler idem.DeliveryHandler
	// Map turns a JetStream message into an idem message; an error, a
	// panic or no message makes the delivery a decode failure
	// (dead-lettered with the reason, never dropped). Default: DefaultMap.
	// When the ID it returns differs from the message's Nats-Msg-Id or
	// idem-id header only by white space, which NATS trims from header
	// values, the consumer logs a warning (one line per header every
	// 10 s, counting the others).
	Map func(m jetstream.Msg) (*idem.Message, error)
	// MaxDeliver is the consumer's delivery limit. 0 or -1, the default,
	// sets none: a message is redelivered until it is decided, and
	// idem.ConsumerConfig.MaxAttempts (unlimited by default) alone turns
	// a failure that does not pass into a dead letter; nothing is dropped
	// by the broker. With a limit, the last delivery is marked
	// LastAttempt so that a failure is dead-lettered rather than dropped,
	// but a consumer that dies during it, JetStream drops the message
	// with no more than an advisory (see docs/jetstream.md), and a
	// dependency down for longer than the limit's redeliveries take turns
	// every message then in flight into an exhausted dead letter. Run
	// sets it on the durable; when another consumer of the durable set a
	// lower one since, the lower one marks the last delivery.
	MaxDeliver int
	// AckWait is how long JetStream waits for an ack before redelivering.
	// While the handler runs, the consumer resets it every AckWait/2
	// (InProgress), so only a consumer that stopped (crashed, lost its
	// connection) has its messages redelivered. Default 30 s. Like
	// MaxDeliver, the durable's is used when another consumer set it lower.
	AckWait time.Duration
	// Batch, above 1, fetches up to that many messages at a time and hands
	// them to the Handler's HandleDeliveries; the Handler must be an
	// idem.BatchDeliveryHandler (idem.Consumer is, a LeaseConsumer is
	// not), else New refuses it. Their effects commit in one transaction.
	// Each message is still settled on its own verdict. Default 1: one
	// message at a time.
	// On Redis keep it below redisstore's Config.MaxWatchedKeys (2,000 by
	// default, counting a sequence per aggregate under an ordering guard
	// too): a larger batch is refused, never split, and its messages are
	// decided one by one.
	Batch int
	// BatchWait bounds how long a fetch waits to fill a batch: the extra
	// latency a batch may add when messages trickle in. It must be below
	// half of AckWait. Default 50 ms.
	BatchWait time.Duration
	// Prefetch is how many messages a consumer handling one at a time
	// pulls ahead of the one it handles. Their AckWait runs while they
	// wait, so with handlers that take seconds keep Prefetch × the
	// handler's time below AckWait. When Run's context ends they are
	// Nak'd, not left to wait for AckWait. Default 64.
	Prefetch int
	// Concurrency, above 1, decides up to that many messages (or, with
	// Batch, batches) at once. Messages are spread over Concurrency lanes
	// by key, the mapped message's AggregateID (as the Handler's ordering
	// guard sees it, when the Handler is an idem.AggregateKeyer), or its
	// subject when it has none; each lane decides its messages one after
	// another in the order JetStream handed them out, so two messages of
	// one aggregate are never decided at once and keep their delivery
	// order. With Batch, each
	// fetched batch is split by lane and the lanes' parts are decided at
	// once, each in a transaction of its own; the next fetch waits for all
	// of them. A message a lane holds but has not started when Run's
	// context ends is Nak'd, as are those pulled ahead. The Handler must be
	// safe for concurrent use (idem.Consumer is). Default 1: one message
	// or batch at a time.
	Concurrency int
	// Logger receives failures to ack, IDs that NATS may have trimmed, and
	// pulls whose server went quiet (missed heartbeats).
	// Default slog.Default().
	Logger *slog.Logger
}

// Consumer runs one pull subscription on a durable consumer. Run several,
// in one process or many, to share a durable's messages; each processes its
// messages one at a time, in the order JetStream hands them out, or, with
// Config.Concurrency, several aggregates' at once.
type Consumer struct {
	js   jetstream.JetStream
	cfg  Config
	seed maphash.Seed // spreads keys over lanes
	dur  durable
	// watchEvery is how often Run reads the durable's info:
	// durableRefresh, shorter in tests.
	watchEvery time.Duration
	// pullHeartbeat is the idle heartbeat asked of the server for a
	// pull: zero leaves nats.go's default; tests shorten it.
	pullHeartbeat time.Duration
	// logs summarizes warnings that every message of a producer may
	// cause alike (trimmed IDs).
	logs *lograte.Limiter
}

// New returns a Consumer on js. It creates or updates the durable consumer
// when Run starts.
func New(js jetstream.JetStream, cfg *Config) (*Consumer, error) {
	switch {
	case js == nil:
		return nil, fmt.Errorf("%w: jetstream: no JetStream context", idem.ErrInvalidConfig)
	case cfg == nil:
		return nil, fmt.Errorf("%w: jetstream: no Config", idem.ErrInvalidConfig)
	case cfg.Stream == "":
		return nil, fmt.Errorf("%w: jetstream: Config.Stream is required", idem.ErrInvalidConfig)
	case cfg.Durable == "":
		return nil, fmt.Errorf("%w: jetstream: Config.Durable is required", idem.ErrInvalidConfig)
	case cfg.Handler == nil:
		return nil, fmt.Errorf("%w: jetstream: Config.Handler is required", idem.ErrInvalidConfig)
	}
	c := &Consumer{js: js, cfg: *cfg, seed: maphash.MakeSeed(), watchEvery: durableRefresh, logs: lograte.New(10 * time.Second)}
	if c.cfg.Map == nil {
		c.cfg.Map = DefaultMap
	}
	if c.cfg.MaxDeliver == 0 {
		c.cfg.MaxDeliver = -1
	}
	if c.cfg.MaxDeliver < -1 {
		return nil, fmt.Errorf("%w: jetstream: MaxDeliver %d must be positive, or -1 for no limit", idem.ErrInvalidConfig, c.cfg.MaxDeliver)
	}
	if c.cfg.AckWait <= 0 {
		c.cfg.AckWait = 30 * time.Second
	}
	if c.cfg.Batch < 0 || c.cfg.BatchWait < 0 || c.cfg.Prefetch < 0 || c.cfg.Concurrency < 0 {
		return nil, fmt.Errorf("%w: jetstream: Batch, BatchWait, Prefetch and Concurrency must not be negative", idem.ErrInvalidConfig)
	}
	if _, ok := c.cfg.Handler.(idem.BatchDeliveryHandler); !ok && c.cfg.Batch > 1 {
		return nil, fmt.Errorf("%w: jetstream: Batch %d needs a Handler that implements idem.BatchDeliveryHandler (idem.Consumer does; %T decides one message at a time)", idem.ErrInvalidConfig, c.cfg.Batch, c.cfg.Handler)
	}
	if c.cfg.Prefetch == 0 {
		c.cfg.Prefetch = 64
	}
	if c.cfg.BatchWait == 0 {
		c.cfg.BatchWait = 50 * time.Millisecond
	}
	if c.cfg.BatchWait >= c.cfg.AckWait/2 {
		// A message early in a fetch would run out its AckWait before
		// the batch is handed over, and come again into the same batch.
		return nil, fmt.Errorf("%w: jetstream: BatchWait %s must be below half of AckWait %s", idem.ErrInvalidConfig, c.cfg.BatchWait, c.cfg.AckWait)
	}
	if c.cfg.Logger == nil {
		c.cfg.Logger = slog.Default()
	}
	return c, nil
}

// Run consumes until ctx is done or the subscription fails (a closed
// connection included), and returns ctx's error or the failure. When ctx
// ends, the deliveries being handled are finished and acknowledged first;
// those pulled but not started are Nak'd, so that JetStream hands them to
// another consumer at once, except that one on its last delivery
// (MaxDeliver) is decided rather than dropped, after the earlier messages
// of its aggregate. A consumer that dies instead (a crash, a lost
// connection) has its unacknowledged messages redelivered after AckWait.
func (c *Consumer) Run(ctx context.Context) error {
	want := jetstream.ConsumerConfig{Durable: c.cfg.Durable}
	if cur, err := c.js.Consumer(ctx, c.cfg.Stream, c.cfg.Durable); err == nil {
		// An existing durable keeps its other settings: those set by
		// hand (MaxAckPending), and those JetStream does not let an
		// update change (DeliverPolicy), which a config built afresh
		// would try to reset, and be refused.
		want = cur.CachedInfo().Config
	} else if !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return fmt.Errorf("jetstream: consumer %s/%s: %w", c.cfg.Stream, c.cfg.Durable, err)
	}
	want.FilterSubject, want.FilterSubjects = c.cfg.FilterSubject, nil
	want.AckPolicy = jetstream.AckExplicitPolicy
	want.AckWait, want.MaxDeliver = c.cfg.AckWait, c.cfg.MaxDeliver
	cons, err := c.js.CreateOrUpdateConsumer(ctx, c.cfg.Stream, want)
	if err != nil {
		return fmt.Errorf("jetstream: consumer %s/%s: %w", c.cfg.Stream, c.cfg.Durable, err)
	}
	c.dur.set(cons, cons.CachedInfo())
	if bh, ok := c.cfg.Handler.(idem.BatchDeliveryHandler); ok && c.cfg.Batch > 1 {
		return c.runBatches(ctx, cons, bh)
	}
	prefetch := c.cfg.Prefetch
	for {
		if prefetch == c.cfg.Prefetch {
			err := c.runMessages(ctx, cons, prefetch)
			if !errors.Is(err, errStatusLookalike) {
				return err
			}
		} else {
			// One message per pull, so that the lookalike ends its own
			// pull only: it comes back first (its stream sequence is
			// the lowest) with every message pulled behind it, which
			// would be lost with it again and again. Back to Prefetch
			// once it has not been seen for a while (deleted).
			sctx, cancel := context.WithTimeout(ctx, lookalikeQuiet*c.dur.ackWait(c.cfg.AckWait))
			err := c.runMessages(sctx, cons, prefetch)
			cancel()
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, context.DeadlineExceeded) {
				prefetch = c.cfg.Prefetch
				continue
			}
			if !errors.Is(err, errStatusLookalike) {
				return err
			}
		}
		prefetch = 1
		// Subscribe again after a pause: a server refusing the pulls for
		// another reason should not be asked in a loop.
		t := time.NewTimer(lookalikePause)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// lookalikeQuiet is how many AckWaits without a message posing as the
// server's status end the one-message pulls that follow one;
// lookalikePause is the pause before pulling again after one.
const (
	lookalikeQuiet = 10
	lookalikePause = 100 * time.Millisecond
)

// errStatusLookalike ends runMessages when its subscription was ended by
// what nats.go took for the server's status (a bad request, the consumer
// deleted) while the durable still exists: a stream message with an empty
// payload and a Status header, which nats.go cannot tell from one.
var errStatusLookalike = errors.New("jetstream: subscription ended by a message that looks like a server status")

// statusLookalike reports whether err, which ended a subscription or a
// fetch of cons, came from a stream message posing as the server's status:
// nats.go says the request was bad or the consumer deleted, yet the
// durable is there. It logs what to do about such a message.
func (c *Consumer) statusLookalike(ctx context.Context, cons jetstream.Consumer, err error) bool {
	if !errors.Is(err, jetstream.ErrBadRequest) && !errors.Is(err, jetstream.ErrConsumerDeleted) {
		return false
	}
	if _, ierr := cons.Info(ctx); ierr != nil {
		return false
	}
	c.cfg.Logger.Warn("jetstream: the server seemed to end the pull, but the durable is there: a message with an empty payload and a Status header, "+
		"which nats.go takes for the server's status, is likely on the stream; it is never decided and comes back every AckWait until deleted "+
		"(by its stream sequence); pulling again", slog.String("consumer", c.cfg.Stream+"/"+c.cfg.Durable), slog.Any("error", err))
	return true
}

// runMessages consumes one message at a time (or in lanes) through one
// subscription, until ctx is done or the subscription ends.
func (c *Consumer) runMessages(ctx context.Context, cons jetstream.Consumer, prefetch int) error {
	opts := []jetstream.PullMessagesOpt{jetstream.PullMaxMessages(prefetch)}
	if c.pullHeartbeat > 0 {
		opts = append(opts, jetstream.PullHeartbeat(c.pullHeartbeat))
	}
	it, err := cons.Messages(opts...)
	if err != nil {
		return fmt.Errorf("jetstream: subscribe %s/%s: %w", c.cfg.Stream, c.cfg.Durable, err)
	}
	// When ctx ends the subscription drains: the server sends no more, and
	// Next hands out what was already on its way. Those messages, and any
	// a lane holds but has not started, are collected, not decided, and
	// put back once the subscription is gone (see putBack).
	var once sync.Once
	defer once.Do(it.Stop)
	defer context.AfterFunc(ctx, func() { once.Do(it.Drain) })()
	// The iterator learns that the durable was deleted only from a pull
	// request pending at that moment; later ones find no responders,
	// which it retries for ever. A watch ends it instead.
	var gone error
	stopWatch := c.watchDurable(ctx, cons, func(err error) {
		gone = err
		once.Do(it.Stop)
	})
	defer stopWatch()
	var (
		mu        sync.Mutex
		unstarted []pending
	)
	collect := func(p pending) {
		mu.Lock()
		defer mu.Unlock()
		unstarted = append(unstarted, p)
	}
	decide := func(m jetstream.Msg, d *idem.Delivery) { c.decide(context.WithoutCancel(ctx), m, d) }
	var ls *lanes
	if c.cfg.Concurrency > 1 {
		ls = c.startLanes(ctx, collect)
		decide = ls.add
	}
	for {
		m, err := it.Next()
		if err == nil {
			if ctx.Err() != nil {
				collect(pending{m, c.delivery(ctx, m)})
				continue
			}
			decide(m, c.delivery(ctx, m))
			continue
		}
		if errors.Is(err, jetstream.ErrNoHeartbeat) && ctx.Err() == nil {
			// The server serving the pull went quiet: a cluster node
			// died, a leader moved, or the network dropped packets. The
			// iterator stays usable and pulls again on the next call, so
			// Run goes on rather than ending on what is not a failure of
			// the consumer. (At most one such line per two heartbeats.)
			c.cfg.Logger.Warn("jetstream: no heartbeat from the server serving the pull; pulling again",
				slog.String("consumer", c.cfg.Stream+"/"+c.cfg.Durable))
			continue
		}
		if ls != nil {
			ls.close()
		}
		if stopWatch() {
			return fmt.Errorf("jetstream: consumer %s/%s: %w", c.cfg.Stream, c.cfg.Durable, gone)
		}
		if ctx.Err() == nil {
			if c.statusLookalike(ctx, cons, err) {
				return errStatusLookalike
			}
			// Failed, or closed under us (the connection was closed).
			return fmt.Errorf("jetstream: next message from %s/%s: %w", c.cfg.Stream, c.cfg.Durable, err)
		}
		c.putBack(context.WithoutCancel(ctx), unstarted)
		return ctx.Err()
	}
}

// watchDurable reads the durable's info every watchEvery until ctx
// ends or the returned stop is called, keeping its limits current (see
// durable). If the durable or its stream no longer exists it calls
// gone with the error and ends. stop waits for the watch to end and
// reports whether gone was called (its effects are visible then).
func (c *Consumer) watchDurable(ctx context.Context, cons jetstream.Consumer, gone func(error)) (stop func() bool) {
	quit, done := make(chan struct{}), make(chan bool, 1)
	go func() {
		t := time.NewTicker(c.watchEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				done <- false
				return
			case <-quit:
				done <- false
				return
			case <-t.C:
			}
			ictx, cancel := context.WithTimeout(ctx, 2*time.Second)
			info, err := cons.Info(ictx)
			cancel()
			if errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) {
				gone(err)
				done <- true
				return
			}
			if err == nil {
				c.dur.set(cons, info)
			}
		}
	}()
	var once sync.Once
	var wasGone bool
	return func() bool {
		once.Do(func() {
			close(quit)
			wasGone = <-done
		})
		return wasGone
	}
}

// putBack returns the messages a stopping Run pulled but did not start:
// Nak'd, so that JetStream hands them to another consumer at once rather
// than after AckWait. It runs once the drained subscription is closed,
// after the server has dropped its interest: a Nak sent earlier would
// have the message redelivered to this consumer. Exception: a key's
// messages up to its last one on its last delivery are decided, in stream
// order. Put back, JetStream would drop that one; decided alone, it would
// overtake the key's earlier messages.
func (c *Consumer) putBack(ctx context.Context, ps []pending) {
	slices.SortStableFunc(ps, func(a, b pending) int { return cmp.Compare(streamSeq(a.m), streamSeq(b.m)) })
	decideUpTo := map[string]int{}
	for i, p := range ps {
		if p.d.LastAttempt {
			decideUpTo[c.key(p.m, p.d)] = i
		}
	}
	for i, p := range ps {
		if j, ok := decideUpTo[c.key(p.m, p.d)]; ok && i <= j {
			c.decide(ctx, p.m, p.d)
			continue
		}
		if err := p.m.Nak(); err != nil {
			c.cfg.Logger.Debug("jetstream: nak on stop failed; redelivered after AckWait", slog.String("source", p.d.Source), slog.Any("error", err))
		}
	}
}

// streamSeq returns m's stream sequence, or 0 without metadata.
func streamSeq(m jetstream.Msg) uint64 {
	md, err := m.Metadata()
	if err != nil {
		return 0
	}
	return md.Sequence.Stream
}

// runBatches fetches up to Batch messages at a time and decides them
// together, or with Concurrency each lane's part of them together.
func (c *Consumer) runBatches(ctx context.Context, cons jetstream.Consumer, bh idem.BatchDeliveryHandler) error {
	failures := 0 // fetches in a row that failed with no message
	// After a message posing as the server's status, fetches take one
	// message until then (see Run).
	var single time.Time
	// The watch keeps the durable's limits current; a fetch itself finds
	// out that the durable is gone (fetchFailed).
	defer c.watchDurable(ctx, cons, func(error) {})()
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		size := c.cfg.Batch
		if time.Now().Before(single) {
			size = 1
		}
		mb, err := cons.Fetch(size, jetstream.FetchMaxWait(c.cfg.BatchWait))
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			failures++
			if err := c.fetchFailed(ctx, cons, err, failures, &single); err != nil {
				return err
			}
			continue
		}
		var (
			msgs []jetstream.Msg
			ds   []*idem.Delivery
		)
		for m := range mb.Messages() {
			msgs = append(msgs, m)
			ds = append(ds, c.delivery(ctx, m))
		}
		if err := mb.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && ctx.Err() == nil {
			if len(ds) == 0 {
				failures++
				if err := c.fetchFailed(ctx, cons, err, failures, &single); err != nil {
					return err
				}
				continue
			}
			if c.statusLookalike(ctx, cons, err) {
				single = time.Now().Add(lookalikeQuiet * c.dur.ackWait(c.cfg.AckWait))
			} else {
				c.cfg.Logger.Warn("jetstream: fetch ended with an error", slog.Any("error", err))
			}
		}
		failures = 0
		if len(ds) == 0 {
			continue
		}
		// Decided and settled even if ctx ends now: the effects may have
		// committed.
		dctx := context.WithoutCancel(ctx)
		if c.cfg.Concurrency <= 1 {
			c.decideBatch(dctx, bh, msgs, ds)
			continue
		}
		laneMsgs := make([][]jetstream.Msg, c.cfg.Concurrency)
		laneDs := make([][]*idem.Delivery, c.cfg.Concurrency)
		for i, m := range msgs {
			l := c.lane(m, ds[i])
			laneMsgs[l] = append(laneMsgs[l], m)
			laneDs[l] = append(laneDs[l], ds[i])
		}
		var wg sync.WaitGroup
		for l := range laneMsgs {
			if len(laneMsgs[l]) > 0 {
				wg.Go(func() { c.decideBatch(dctx, bh, laneMsgs[l], laneDs[l]) })
			}
		}
		wg.Wait()
	}
}

// fetchFailed handles the failures-th fetch in a row that ended with err
// and no message. What JetStream's own iterator takes as final (the durable
// deleted, a bad request, the connection closed) ends Run, unless the
// durable is there (a message posing as the server's status, see
// statusLookalike: the next fetches take one message, after a pause),
// and so does a durable
// or stream that no longer exists (a fetch then finds no responders);
// anything else, such as no responders while a new leader is elected, is
// logged once and the next fetch waits, longer after each failure, up to a
// second.
func (c *Consumer) fetchFailed(ctx context.Context, cons jetstream.Consumer, err error, failures int, single *time.Time) error {
	where := c.cfg.Stream + "/" + c.cfg.Durable
	switch {
	case c.statusLookalike(ctx, cons, err):
		*single = time.Now().Add(lookalikeQuiet * c.dur.ackWait(c.cfg.AckWait))
		failures = 5 // a pause of lookalikePause, as Run's
	case errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrBadRequest) ||
		errors.Is(err, jetstream.ErrConnectionClosed) || errors.Is(err, nats.ErrConnectionClosed):
		return fmt.Errorf("jetstream: fetch from %s: %w", where, err)
	}
	if _, ierr := cons.Info(ctx); errors.Is(ierr, jetstream.ErrConsumerNotFound) || errors.Is(ierr, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("jetstream: fetch from %s: %w (%w)", where, err, ierr)
	}
	if failures == 1 {
		c.cfg.Logger.Warn("jetstream: fetch failed; fetching again", slog.String("consumer", where), slog.Any("error", err))
	}
	t := time.NewTimer(min(10*time.Millisecond<<min(failures-1, 7), time.Second))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// decideBatch decides msgs, mapped to ds, in one call and settles each.
func (c *Consumer) decideBatch(ctx context.Context, bh idem.BatchDeliveryHandler, msgs []jetstream.Msg, ds []*idem.Delivery) {
	stop := c.keepAlive(msgs...)
	vs := verdicts.Check(bh.HandleDeliveries(ctx, ds), len(msgs), c.cfg.Logger, "jetstream")
	stop()
	for i, m := range msgs {
		c.settle(m, ds[i], vs[i])
	}
}

// decide decides m, mapped to d, and settles it.
func (c *Consumer) decide(ctx context.Context, m jetstream.Msg, d *idem.Delivery) {
	stop := c.keepAlive(m)
	v := c.cfg.Handler.HandleDelivery(ctx, d)
	stop()
	c.settle(m, d, v)
}

// key returns what orders m, mapped to d: its aggregate as the Handler's
// ordering guard sees it (idem.AggregateKeyer), else its subject.
func (c *Consumer) key(m jetstream.Msg, d *idem.Delivery) string {
	if d.Msg != nil && d.Msg.AggregateID != "" {
		if k, ok := c.cfg.Handler.(idem.AggregateKeyer); ok {
			return k.AggregateKey(d.Msg.AggregateID)
		}
		return d.Msg.AggregateID
	}
	return m.Subject()
}

// lane returns the lane of m, mapped to d: its key's.
func (c *Consumer) lane(m jetstream.Msg, d *idem.Delivery) int {
	return int(maphash.String(c.seed, c.key(m, d)) % uint64(c.cfg.Concurrency))
}

// pending is a message pulled and mapped but not decided yet: waiting in
// a lane, or left over when Run stops.
type pending struct {
	m jetstream.Msg
	d *idem.Delivery
}

// lanes are Concurrency goroutines, each deciding its messages in order.
type lanes struct {
	c  *Consumer
	ch []chan pending
	wg sync.WaitGroup
}

// startLanes starts the lanes; they decide until ctx ends and then hand
// what they still hold to collect.
func (c *Consumer) startLanes(ctx context.Context, collect func(pending)) *lanes {
	ls := &lanes{c: c, ch: make([]chan pending, c.cfg.Concurrency)}
	for i := range ls.ch {
		// One waiting message per lane: a lane busy with a slow message
		// stalls the others only once a second message comes for it.
		ls.ch[i] = make(chan pending, 1)
		ls.wg.Go(func() {
			for p := range ls.ch[i] {
				if ctx.Err() != nil {
					collect(p)
					continue
				}
				c.decide(context.WithoutCancel(ctx), p.m, p.d)
			}
		})
	}
	return ls
}

// add queues m, mapped to d, on its lane, waiting while the lane is full.
func (ls *lanes) add(m jetstream.Msg, d *idem.Delivery) {
	ls.ch[ls.c.lane(m, d)] <- pending{m, d}
}

// close waits for the lanes to finish what they hold.
func (ls *lanes) close() {
	for _, ch := range ls.ch {
		close(ch)
	}
	ls.wg.Wait()
}

// minKeepAlive bounds keepAlive's interval from below, whatever AckWait
// another consumer set on the durable.
const minKeepAlive = 5 * time.Millisecond

// keepAlive tells JetStream every AckWait/2 that msgs are still being
// worked on (InProgress resets their AckWait), so that a handler slower
// than AckWait, a lease-mode call say, does not see its message
// redelivered meanwhile. The returned func stops it. A timer that has not
// fired costs no goroutine.
func (c *Consumer) keepAlive(msgs ...jetstream.Msg) (stop func()) {
	var (
		mu      sync.Mutex
		stopped bool
		t       *time.Timer
	)
	every := func() time.Duration { return max(c.dur.ackWait(c.cfg.AckWait)/2, minKeepAlive) }
	tick := func() {
		mu.Lock()
		defer mu.Unlock()
		if stopped {
			return
		}
		for _, m := range msgs {
			if err := m.InProgress(); err != nil {
				c.cfg.Logger.Debug("jetstream: in-progress ack failed", slog.Any("error", err))
			}
		}
		t.Reset(every())
	}
	// The first InProgress goes out early: the message may have waited
	// (Prefetch, a lane) for much of its AckWait before its handler
	// started, and keepAlive cannot tell how long. A handler faster than
	// that sends none.
	mu.Lock()
	t = time.AfterFunc(min(every(), max(c.dur.ackWait(c.cfg.AckWait)/20, minKeepAlive)), tick)
	mu.Unlock()
	return func() {
		mu.Lock()
		defer mu.Unlock()
		stopped = true
		t.Stop()
	}
}

// delivery maps m, pulled by the Run whose context is ctx.
func (c *Consumer) delivery(ctx context.Context, m jetstream.Msg) *idem.Delivery {
	d := &idem.Delivery{Raw: m.Data(), Source: "jetstream:" + c.cfg.Stream + "/" + m.Subject(), Stopping: ctx.Done()}
	if md, err := m.Metadata(); err == nil {
		d.Attempt = int(md.NumDelivered)
		maxDeliver := c.maxDeliver(d.Attempt > 1)
		d.LastAttempt = maxDeliver > 0 && d.Attempt >= maxDeliver
		d.Source += "@" + strconv.FormatUint(md.Sequence.Stream, 10)
	}
	d.Msg, d.DecodeErr = c.mapMessage(m, d.Source)
	if d.DecodeErr != nil {
		return d
	}
	c.warnTrimmedID(m, d)
	return d
}

// mapMessage is Config.Map through verdicts.Decode: a panic or no message
// is a decode failure.
func (c *Consumer) mapMessage(m jetstream.Msg, source string) (*idem.Message, error) {
	return verdicts.Decode(c.logs, c.cfg.Logger, "jetstream", source, func() (*idem.Message, error) { return c.cfg.Map(m) })
}

// warnTrimmedID logs a warning when the ID that Map gave d differs from
// m's Nats-Msg-Id or idem-id header only by white space. NATS trims white
// space around header values and turns CR and LF inside them into spaces.
// So such an ID reached the stream under another one, and the stream's
// duplicate window, like any consumer that reads the header, took it for
// every ID that differs from it only so: one of them may have been
// dropped. The header alone cannot show this, since it arrives trimmed;
// only an ID carried elsewhere (the payload, read by a custom Map) can.
func (c *Consumer) warnTrimmedID(m jetstream.Msg, d *idem.Delivery) {
	h := m.Headers()
	for _, name := range []string{HeaderMsgID, HeaderID} {
		v := h.Get(name)
		if v == "" || v == d.Msg.ID || headerForm(v) != headerForm(d.Msg.ID) {
			continue
		}
		// A producer that pads its IDs pads every one: one line per
		// header every 10 s, counting the others.
		c.logs.Warn(c.cfg.Logger, name, "jetstream: the message's ID differs from its "+name+" header only by white space, which NATS trims from header values; "+
			"the stream's duplicate window takes IDs that differ only so for one, and may have dropped a message; give IDs no surrounding white space or line breaks",
			slog.String("source", d.Source), slog.String("id", d.Msg.ID), slog.String("header", name), slog.String("header_value", v))
		return
	}
}

// headerForm returns s as a NATS header value arrives: CR and LF turned
// into spaces, surrounding white space trimmed.
func headerForm(s string) string {
	return strings.TrimSpace(strings.Map(func(r rune) rune {
		if r == '\r' || r == '\n' {
			return ' '
		}
		return r
	}, s))
}

// settle acknowledges, terminates or naks m by its verdict.
func (c *Consumer) settle(m jetstream.Msg, d *idem.Delivery, v idem.Verdict) {
	var err error
	switch {
	case v.DeadLettered:
		err = m.Term()
	case v.Ack:
		err = m.Ack()
	case d.LastAttempt && stopping(d):
		// Not decided on its last delivery because Run stopped (while
		// the store was down, or while its dead letter could not be
		// written): JetStream drops a message Nak'd or left unacked
		// now. Requeue a copy, which it delivers afresh, and end this
		// delivery; Nak it only if the copy could not be published. A
		// retry verdict on a last delivery without a stop is the
		// handler's own, and JetStream's MaxDeliver applies to it.
		seq, rerr := c.requeue(m)
		if rerr != nil {
			c.cfg.Logger.Error("jetstream: last delivery not decided at the stop, and its copy could not be requeued (or its acknowledgement was lost): JetStream drops the original",
				slog.String("source", d.Source), slog.Any("error", rerr), slog.Any("verdict_error", v.Err))
			err = m.NakWithDelay(v.RetryAfter)
			break
		}
		c.cfg.Logger.Warn("jetstream: last delivery not decided; requeued as a new stream message, delivered afresh",
			slog.String("source", d.Source), slog.Uint64("requeued_as", seq), slog.Any("verdict_error", v.Err))
		// Term, not TermWithReason, which servers before 2.10.4 ignore.
		err = m.Term()
	default:
		err = m.NakWithDelay(v.RetryAfter)
	}
	if err != nil {
		// The message is redelivered after AckWait; the outcome is
		// already durable, so that redelivery is a Duplicate.
		c.cfg.Logger.Warn("jetstream: settling a message failed; it will be redelivered", slog.String("source", d.Source), slog.Any("error", err))
	}
}

// stopping reports whether the Run that pulled d has stopped.
func stopping(d *idem.Delivery) bool {
	select {
	case <-d.Stopping:
		return true
	default:
		return false
	}
}

// HeaderRequeuedFrom is set on the copy of a message requeued on its last
// delivery (see requeue): the original's stream sequence. DefaultMap
// leaves it out of Message.Headers, as the other idem- headers.
const HeaderRequeuedFrom = "idem-requeued-from"

// requeueTimeout bounds the publish of a requeued copy.
const requeueTimeout = 5 * time.Second

// requeue publishes a copy of m to its subject on the stream and returns
// the copy's stream sequence. The copy keeps the payload and the headers
// but those the server acts on (Nats-*): its Nats-Msg-Id moves to idem-id,
// which DefaultMap reads next, so the copy keeps its message ID (idem's
// markers make it a Duplicate if the original was applied) and the
// stream's duplicate window does not drop it. It lands at the stream's
// end, behind later messages of its subject.
func (c *Consumer) requeue(m jetstream.Msg) (uint64, error) {
	if nc := c.js.Conn(); nc != nil && nc.Status() != nats.CONNECTED {
		// Each of a stop's last deliveries would wait out the timeout.
		return 0, fmt.Errorf("jetstream: requeue: connection %s", nc.Status())
	}
	ctx, cancel := context.WithTimeout(context.Background(), requeueTimeout)
	defer cancel()
	st, err := c.js.Stream(ctx, c.cfg.Stream)
	if err != nil {
		return 0, fmt.Errorf("jetstream: requeue: %w", err)
	}
	if n := st.CachedInfo().Config.MaxMsgsPerSubject; n > 0 {
		// A copy would count against the subject's limit and could
		// displace a newer message of it, not yet consumed.
		return 0, fmt.Errorf("jetstream: requeue: stream %q keeps %d messages a subject: a copy could displace a newer one", c.cfg.Stream, n)
	}
	orig := m.Headers()
	h := nats.Header{}
	for k, vs := range orig {
		if !strings.HasPrefix(k, serverHeaderPrefix) {
			h[k] = slices.Clone(vs)
		}
	}
	if id := orig.Get(HeaderMsgID); id != "" {
		h.Set(HeaderID, id)
	}
	if seq := streamSeq(m); seq > 0 {
		h.Set(HeaderRequeuedFrom, strconv.FormatUint(seq, 10))
	}
	ack, err := c.js.PublishMsg(ctx, &nats.Msg{Subject: m.Subject(), Header: h, Data: m.Data()}, jetstream.WithExpectStream(c.cfg.Stream))
	if err != nil {
		return 0, err
	}
	return ack.Sequence, nil
}

// DefaultMap reads the message ID from Nats-Msg-Id, else idem-id; the
// aggregate from idem-aggregate, the sequence from idem-seq, the type from
// idem-type and the time from idem-time; the payload is the message data
// and Stream the subject. Every other header goes to Headers (its first
// value), so metadata such as a producer's trace context (traceparent)
// reaches the handler and the hooks; so do headers the server set or acts
// on (Nats-*, on a sourced stream's messages say), which Publisher
// refuses: drop them from a message the handler forwards to JetStream
// through the outbox. A message with neither ID header is a
// decode failure: JetStream's own stream sequence would differ between a
// message and its republished copy, so it cannot stand in for a producer's
// ID.
func DefaultMap(m jetstream.Msg) (*idem.Message, error) {
	return mapMessage(m.Subject(), m.Headers(), m.Data())
}

// mapMessage is DefaultMap on a message's parts.
func mapMessage(subject string, h nats.Header, data []byte) (*idem.Message, error) {
	id := h.Get(HeaderMsgID)
	if id == "" {
		id = h.Get(HeaderID)
	}
	if id == "" {
		return nil, fmt.Errorf("%w: jetstream: message on %q has no %s or %s header", idem.ErrInvalidMessage, subject, HeaderMsgID, HeaderID)
	}
	msg := &idem.Message{ID: id, Stream: subject, Type: h.Get(HeaderType), AggregateID: h.Get(HeaderAggregate), Payload: data}
	for k, vs := range h {
		switch k {
		case HeaderMsgID, HeaderID, HeaderAggregate, HeaderSeq, HeaderType, HeaderTime, HeaderRequeuedFrom:
			continue
		}
		if strings.HasPrefix(k, "Nats-Expected-") {
			// A publisher's condition for the server (a requeued copy
			// carries Nats-Expected-Stream): nothing for a handler.
			continue
		}
		if len(vs) == 0 {
			continue
		}
		if msg.Headers == nil {
			msg.Headers = make(map[string]string, len(h))
		}
		msg.Headers[k] = vs[0]
	}
	if s := h.Get(HeaderSeq); s != "" {
		seq, err := strconv.ParseInt(s, 10, 64)
		if err != nil || seq < 1 {
			return nil, fmt.Errorf("%w: jetstream: message %s: %s header %s is not a positive integer", idem.ErrInvalidMessage, errtext.Quote(id), HeaderSeq, errtext.Quote(s))
		}
		msg.Seq = seq
	}
	if s := h.Get(HeaderTime); s != "" {
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			return nil, fmt.Errorf("%w: jetstream: message %s: %s header %s is not an RFC 3339 time", idem.ErrInvalidMessage, errtext.Quote(id), HeaderTime, errtext.Quote(s))
		}
		msg.Time = t
	}
	if err := msg.Validate(); err != nil {
		return nil, err
	}
	return msg, nil
}

// Refresh periods of durable: Run's watch rereads the durable's limits
// every durableRefresh, and a redelivery (the ones a lower MaxDeliver would
// drop) rereads them first once they are redeliveryRefresh old, waiting
// for the answer at most refreshTimeout; after a failed read, the next
// comes durableRefresh later, so a slow server holds up deliveries little.
const (
	durableRefresh    = 5 * time.Second
	redeliveryRefresh = 100 * time.Millisecond
	refreshTimeout    = 250 * time.Millisecond
)

// durable holds the durable consumer's limits as JetStream last reported
// them. Run sets them from Config, but every Consumer sharing the durable
// does the same, so another process (a rolling deploy with new settings)
// may have changed them since: LastAttempt and the in-progress interval go
// by the lower of the durable's and this Config's, so that a message is
// dead-lettered no later than JetStream would drop it, and its AckWait is
// reset before it runs out.
type durable struct {
	mu         sync.Mutex
	cons       jetstream.Consumer
	maxDeliver int // <= 0: no limit
	wait       time.Duration
	readAt     time.Time // last read, or last failed read plus durableRefresh
	reading    bool      // a redelivery's read is under way
	warned     [2]int64  // the limits last warned about
}

// set records info, the durable's as cons last reported it.
func (u *durable) set(cons jetstream.Consumer, info *jetstream.ConsumerInfo) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.cons, u.readAt = cons, time.Now()
	if info != nil {
		u.maxDeliver, u.wait = info.Config.MaxDeliver, info.Config.AckWait
	}
}

// ackWait returns the lower of own and the durable's AckWait.
func (u *durable) ackWait(own time.Duration) time.Duration {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.wait > 0 && u.wait < own {
		return u.wait
	}
	return own
}

// maxDeliver returns the delivery limit a delivery is judged by: the lower
// of Config.MaxDeliver and the durable's, <= 0 for none. For a redelivery
// it rereads the durable's first when they are old (see redeliveryRefresh).
func (c *Consumer) maxDeliver(redelivery bool) int {
	u := &c.dur
	u.mu.Lock()
	cons := u.cons
	read := redelivery && cons != nil && !u.reading && time.Since(u.readAt) >= redeliveryRefresh
	u.reading = u.reading || read
	u.mu.Unlock()
	if read {
		ctx, cancel := context.WithTimeout(context.Background(), refreshTimeout)
		info, err := cons.Info(ctx)
		cancel()
		if err != nil {
			c.cfg.Logger.Debug("jetstream: reading the durable's limits failed; keeping the last ones", slog.Any("error", err))
			u.mu.Lock()
			u.readAt = time.Now().Add(durableRefresh)
			u.mu.Unlock()
		} else {
			u.set(cons, info)
		}
		u.mu.Lock()
		u.reading = false
		u.mu.Unlock()
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	own, theirs := c.cfg.MaxDeliver, u.maxDeliver
	if u.cons != nil && (theirs != own || u.wait != c.cfg.AckWait) && u.warned != [2]int64{int64(theirs), int64(u.wait)} {
		u.warned = [2]int64{int64(theirs), int64(u.wait)}
		c.cfg.Logger.Warn("jetstream: the durable's limits differ from this consumer's Config (another consumer set them); going by the lower",
			slog.String("consumer", c.cfg.Stream+"/"+c.cfg.Durable), slog.Int("max_deliver", theirs), slog.Int("config_max_deliver", own),
			slog.Duration("ack_wait", u.wait), slog.Duration("config_ack_wait", c.cfg.AckWait))
	}
	switch {
	case theirs <= 0:
		return own
	case own <= 0:
		return theirs
	}
	return min(own, theirs)
}
