package rabbitmq

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"maps"
	"math"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/lograte"
	"github.com/idemhq/idem/internal/verdicts"
)

// Queue types Config.QueueType accepts.
const (
	QueueQuorum  = "quorum"
	QueueClassic = "classic"
)

// ErrConsumerCancelled ends Run when the server cancels its consumer: the
// queue was deleted, or (quorum) lost its leader for good. Whatever
// supervises Run should recreate the queue or alert; nothing was acked
// that was not decided.
var ErrConsumerCancelled = errors.New("rabbitmq: the server cancelled the consumer")

// ErrTopology ends Run when the server refuses the topology: a queue that
// exists with other arguments (PRECONDITION_FAILED), a queue that does not
// exist under Config.Passive (NOT_FOUND), or no permission to use it
// (ACCESS_REFUSED). Reconnecting would not help.
var ErrTopology = errors.New("rabbitmq: topology refused")

// ErrRefused ends Run when the broker refuses the connection for good:
// credentials, the SASL mechanism, or the virtual host (ACCESS_REFUSED
// when connecting). A broker that cannot be reached is no such refusal:
// Run keeps trying.
var ErrRefused = errors.New("rabbitmq: connection refused by the broker")

// Config configures a Consumer.
type Config struct {
	// URL is the broker's AMQP URI, for example
	// amqp://guest:guest@127.0.0.1:5672/. Required.
	URL string
	// AMQP configures the connection (TLS, heartbeat, client properties).
	// Its Properties["connection_name"], default "idem <Queue>", names the
	// connection in the management UI and in rabbitmqctl. Its Recovery
	// must be nil: the consumer reconnects itself, since the delivery tags
	// of a lost channel cannot be acknowledged on another one.
	AMQP amqp.Config
	// Queue is the work queue to consume. Required. Run declares it
	// (durable, of QueueType) unless Passive; bind it to your exchanges
	// yourself.
	Queue string
	// QueueType is the type Run declares the work queue and its retry
	// queues with: QueueQuorum (the default, replicated, and counting
	// redeliveries in x-delivery-count) or QueueClassic.
	QueueType string
	// Passive makes Run check that the work queue exists (a passive
	// declare) instead of declaring it: for queues your deployment
	// creates with arguments of its own. Retry queues are declared all the
	// same.
	Passive bool
	// Handler decides every delivery. Required.
	Handler idem.DeliveryHandler
	// Map turns a delivery into an idem message; an error, a panic or no
	// message makes the delivery a decode failure (dead-lettered with the
	// reason, never dropped); a panic is logged with its stack, one line
	// per interval. Default: DefaultMap.
	Map func(d *amqp.Delivery) (*idem.Message, error)
	// MaxDeliver marks the delivery whose attempt reaches it LastAttempt,
	// so that a failure is dead-lettered instead of retried. 0, the
	// default, sets no limit: idem.ConsumerConfig.MaxAttempts (unlimited
	// by default) alone decides when a failure becomes a dead letter. The
	// broker never drops a message for this consumer: retries are
	// republished copies. If you give the queue a delivery-limit (quorum)
	// set MaxDeliver no higher, or the broker drops what idem would have
	// dead-lettered.
	MaxDeliver int
	// Batch, above 1, hands up to that many deliveries of a lane at a
	// time to the Handler's HandleDeliveries; the Handler must be an
	// idem.BatchDeliveryHandler (idem.Consumer is, a LeaseConsumer is
	// not), else New refuses it. Their effects commit in one transaction;
	// each delivery is still settled on its own verdict. Default 1.
	Batch int
	// BatchWait bounds how long a lane waits to fill a batch: the extra
	// latency a batch may add when messages trickle in. Default 50 ms.
	BatchWait time.Duration
	// Concurrency, above 1, decides up to that many messages (or, with
	// Batch, batches) at once. Deliveries are spread over Concurrency
	// lanes by key: the mapped message's AggregateID (as the Handler's
	// ordering guard sees it, when the Handler is an idem.AggregateKeyer),
	// or the routing key when it has none. Each lane decides its
	// deliveries one after another in delivery order, so two messages of
	// one aggregate are never decided at once. The Handler must be safe
	// for concurrent use (idem.Consumer is). Default 1.
	Concurrency int
	// Prefetch is the channel's QoS prefetch count: how many
	// unacknowledged deliveries the broker pushes to this consumer. It
	// must cover what the lanes work on, Concurrency × Batch, and be at
	// most 65,535 (AMQP's limit). Default Concurrency × Batch + 32 (at
	// most 65,535), so that the next messages are on their way while
	// those are decided.
	Prefetch int
	// Reconnect spaces the attempts to connect again after the
	// connection was lost (and the first one, when the broker is down at
	// start): Base doubling up to Max, jittered. Defaults 100 ms and 5 s.
	// A connection that ends before it settled a delivery or lasted Max
	// counts as a failed attempt: the backoff goes on growing, with one
	// warning for the streak. Its Retries is not used: the consumer tries
	// until Run's context ends.
	Reconnect idem.Backoff
	// Logger receives lost connections, reconnections and failures to
	// settle. Default slog.Default().
	Logger *slog.Logger
}

// Consumer consumes one queue with manual acknowledgements and carries
// out its Handler's verdicts: Ack once the outcome (or its dead letter) is
// committed; a retry is republished to a retry queue that hands it back
// after the verdict's delay, and the delivery acked once the broker
// confirmed the copy. Run several, in one process or many, to share a
// queue.
type Consumer struct {
	cfg  Config
	seed maphash.Seed // spreads keys over lanes
	// sessions counts the connections Run consumed on, and conn is the
	// current one: for tests.
	sessions atomic.Int64
	conn     atomic.Pointer[amqp.Connection]
	// logs summarizes lines written per message that a broker in trouble
	// would otherwise repeat for every one (retry copies not confirmed).
	logs *lograte.Limiter
}

// New returns a Consumer. It connects when Run starts.
func New(cfg *Config) (*Consumer, error) {
	switch {
	case cfg == nil:
		return nil, fmt.Errorf("%w: rabbitmq: no Config", idem.ErrInvalidConfig)
	case cfg.URL == "":
		return nil, fmt.Errorf("%w: rabbitmq: Config.URL is required", idem.ErrInvalidConfig)
	case cfg.Queue == "":
		return nil, fmt.Errorf("%w: rabbitmq: Config.Queue is required", idem.ErrInvalidConfig)
	case cfg.Handler == nil:
		return nil, fmt.Errorf("%w: rabbitmq: Config.Handler is required", idem.ErrInvalidConfig)
	case cfg.AMQP.Recovery != nil:
		return nil, fmt.Errorf("%w: rabbitmq: Config.AMQP.Recovery must be nil: the consumer reconnects itself", idem.ErrInvalidConfig)
	}
	if _, err := amqp.ParseURI(cfg.URL); err != nil {
		return nil, fmt.Errorf("%w: rabbitmq: Config.URL: %w", idem.ErrInvalidConfig, err)
	}
	c := &Consumer{cfg: *cfg, seed: maphash.MakeSeed(), logs: lograte.New(logEvery)}
	if c.cfg.Map == nil {
		c.cfg.Map = DefaultMap
	}
	switch c.cfg.QueueType {
	case "":
		c.cfg.QueueType = QueueQuorum
	case QueueQuorum, QueueClassic:
	default:
		return nil, fmt.Errorf("%w: rabbitmq: QueueType %q must be %q or %q", idem.ErrInvalidConfig, c.cfg.QueueType, QueueQuorum, QueueClassic)
	}
	if c.cfg.MaxDeliver < 0 || c.cfg.Batch < 0 || c.cfg.BatchWait < 0 || c.cfg.Concurrency < 0 || c.cfg.Prefetch < 0 {
		return nil, fmt.Errorf("%w: rabbitmq: MaxDeliver, Batch, BatchWait, Concurrency and Prefetch must not be negative", idem.ErrInvalidConfig)
	}
	if _, ok := c.cfg.Handler.(idem.BatchDeliveryHandler); !ok && c.cfg.Batch > 1 {
		return nil, fmt.Errorf("%w: rabbitmq: Batch %d needs a Handler that implements idem.BatchDeliveryHandler (idem.Consumer does; %T decides one message at a time)", idem.ErrInvalidConfig, c.cfg.Batch, c.cfg.Handler)
	}
	c.cfg.Batch = max(c.cfg.Batch, 1)
	c.cfg.Concurrency = max(c.cfg.Concurrency, 1)
	if c.cfg.BatchWait == 0 {
		c.cfg.BatchWait = 50 * time.Millisecond
	}
	if c.cfg.Prefetch == 0 {
		c.cfg.Prefetch = min(c.cfg.Concurrency*c.cfg.Batch+32, math.MaxUint16)
	}
	if c.cfg.Prefetch > math.MaxUint16 {
		// AMQP's prefetch count is 16 bits: amqp091 would truncate it,
		// 65,536 to 0, which the broker takes for no limit at all.
		return nil, fmt.Errorf("%w: rabbitmq: Prefetch %d is above AMQP's limit of %d", idem.ErrInvalidConfig, c.cfg.Prefetch, math.MaxUint16)
	}
	if c.cfg.Prefetch < c.cfg.Concurrency*c.cfg.Batch {
		return nil, fmt.Errorf("%w: rabbitmq: Prefetch %d is below Concurrency × Batch (%d): the lanes could never fill", idem.ErrInvalidConfig, c.cfg.Prefetch, c.cfg.Concurrency*c.cfg.Batch)
	}
	if c.cfg.Reconnect.Base <= 0 {
		c.cfg.Reconnect.Base = 100 * time.Millisecond
	}
	if c.cfg.Reconnect.Max <= 0 {
		c.cfg.Reconnect.Max = 5 * time.Second
	}
	if c.cfg.Logger == nil {
		c.cfg.Logger = slog.Default()
	}
	props := amqp.Table{}
	for k, v := range c.cfg.AMQP.Properties {
		props[k] = v
	}
	if _, ok := props["connection_name"]; !ok {
		props["connection_name"] = "idem " + c.cfg.Queue
	}
	c.cfg.AMQP.Properties = props
	return c, nil
}

// Run consumes until ctx is done, the server cancels the consumer (the
// queue deleted: ErrConsumerCancelled), refuses the topology
// (ErrTopology) or the connection (ErrRefused), and returns ctx's error or that failure. A lost
// connection is not the end: Run connects again, backing off
// (Config.Reconnect), and the deliveries the lost channel held come back
// from the queue (a decided one as a Duplicate). When ctx ends, the
// deliveries being decided are finished and settled first, and those
// received but not started are returned to the queue: nacked with requeue,
// which keeps their place; or, when the store was down (a delivery was
// held by the outage), republished to the queue as copies that keep their
// attempt, and then acked, so that a stop during an outage spends no
// attempt and no delivery-limit.
func (c *Consumer) Run(ctx context.Context) error {
	failures := 0
	for {
		healthy, err := c.session(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, ErrConsumerCancelled) || errors.Is(err, ErrTopology) || errors.Is(err, ErrRefused) {
			return err
		}
		if healthy {
			failures = 0
		}
		if failures == 0 {
			c.cfg.Logger.Warn("rabbitmq: no connection; connecting again", slog.String("queue", c.cfg.Queue), slog.Any("error", err))
		}
		d := c.cfg.Reconnect.Delay(failures)
		failures++
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// refused wraps err in ErrTopology when it is the server refusing a
// declare for good.
func refused(what string, err error) error {
	var ae *amqp.Error
	if errors.As(err, &ae) && (ae.Code == amqp.PreconditionFailed || ae.Code == amqp.NotFound || ae.Code == amqp.AccessRefused) {
		return fmt.Errorf("%w: %s: %w", ErrTopology, what, err)
	}
	return fmt.Errorf("rabbitmq: %s: %w", what, err)
}

// dial connects with a copy of cfg's client properties: amqp091 writes
// into that map while it opens a connection, so two dials sharing one
// Config (Run's and Lag's, say) raced on it.
func dial(url string, cfg amqp.Config) (*amqp.Connection, error) {
	cfg.Properties = maps.Clone(cfg.Properties)
	return amqp.DialConfig(url, cfg)
}

// connectTimeout bounds a TCP connect and the AMQP handshake after it, as
// amqp091's own default dialer does.
const connectTimeout = 30 * time.Second

// cancelWait bounds the wait for the broker's answer to the consumer's
// cancel on a stop: a broker that does not answer (a network partition)
// would hold the stop until the heartbeats time out.
const cancelWait = 5 * time.Second

// logEvery is how often a Consumer writes a line of a kind the broker
// could make it repeat for every message.
const logEvery = 10 * time.Second

// socket is the network connection under an AMQP connection, so that it
// can be closed when amqp091 would wait: a handshake or a declare on a
// broker that does not answer is not cut short by Connection.Close, which
// waits for the broker's close-ok.
type socket struct {
	mu     sync.Mutex
	nc     net.Conn
	closed bool
}

// set records nc, closing it at once if the socket was closed meanwhile.
func (s *socket) set(nc net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nc = nc
	if s.closed {
		_ = nc.Close()
	}
}

// isClosed reports whether close was called; false on a nil socket.
func (s *socket) isClosed() bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// close closes the network connection: amqp091 then shuts the AMQP
// connection down, and the broker returns what it had not acknowledged.
func (s *socket) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.nc != nil {
		_ = s.nc.Close()
	}
}

// dialContext is dial that ctx's end interrupts: the TCP connect (unless
// cfg has a Dial of its own) and, through sock, the handshake and any
// call until the caller stops watching ctx.
func dialContext(ctx context.Context, url string, cfg amqp.Config, sock *socket) (*amqp.Connection, error) {
	inner := cfg.Dial
	if inner == nil {
		inner = func(network, addr string) (net.Conn, error) {
			d := net.Dialer{Timeout: connectTimeout}
			nc, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// Cleared by amqp091 once the handshake is done.
			if err := nc.SetDeadline(time.Now().Add(connectTimeout)); err != nil {
				_ = nc.Close()
				return nil, err
			}
			return nc, nil
		}
	}
	cfg.Dial = func(network, addr string) (net.Conn, error) {
		nc, err := inner(network, addr)
		if err == nil {
			sock.set(nc)
		}
		return nc, err
	}
	return dial(url, cfg)
}

// session runs one connection until ctx ends or the connection, channel
// or consumer does. healthy reports whether it got as far as consuming and
// then settled a delivery or lasted Reconnect.Max: a session that ends at
// once, again and again, is a failure streak like a refused connection (one
// warning, the backoff growing), not a new outage each time. A message
// whose header table the client library cannot parse (nested deeper than
// it reads, or with more entries than it takes, which the broker accepts)
// closes the connection as soon as it is delivered, and reconnecting at
// the base delay would spin on it.
func (c *Consumer) session(ctx context.Context) (healthy bool, err error) {
	// Until it consumes, ctx's end cuts the session short, even on a
	// broker that does not answer; from then on a stop is graceful.
	sock := &socket{}
	unwatch := context.AfterFunc(ctx, sock.close)
	defer unwatch()
	conn, err := dialContext(ctx, c.cfg.URL, c.cfg.AMQP, sock)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.AccessRefused {
		return false, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	if err != nil {
		return false, fmt.Errorf("rabbitmq: connect: %w", err)
	}
	defer conn.Close()
	c.conn.Store(conn)
	ch, err := conn.Channel()
	if err != nil {
		return false, fmt.Errorf("rabbitmq: open channel: %w", err)
	}
	if err := c.declareQueue(ch); err != nil {
		return false, err
	}
	rt, err := newRetrier(conn, c.cfg.Queue, c.cfg.QueueType)
	if err != nil {
		return false, err
	}
	if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return false, fmt.Errorf("rabbitmq: qos: %w", err)
	}
	tag := "idem-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	cancelled := ch.NotifyCancel(make(chan string, 1))
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	// The retry copies' channel too: the server closes it when it refuses
	// a retry queue (PRECONDITION_FAILED: one declared with other
	// arguments), and a session going on without it could never retry
	// again, returning each failure to the queue after its delay, one
	// attempt more, until the process restarts.
	rtClosed := rt.ch.NotifyClose(make(chan *amqp.Error, 1))
	msgs, err := ch.Consume(c.cfg.Queue, tag, false, false, false, false, nil)
	if err != nil {
		return false, refused("consume "+c.cfg.Queue, err)
	}
	unwatch()
	c.sessions.Add(1)
	started := time.Now()

	s := &session{c: c, ch: ch, rt: rt, stopping: make(chan struct{})}
	defer func() {
		healthy = s.settled.Load() > 0 || time.Since(started) >= c.cfg.Reconnect.Max
	}()
	// The first of ctx's end, the consumer's cancel and a channel's
	// close stops the session: stopping is closed, so that a lane held
	// by a store outage gives up, and a full lane stops taking more.
	var (
		end     error
		stopped bool
	)
	go func() {
		select {
		case <-ctx.Done():
			stopped = true
		case <-cancelled:
			end = fmt.Errorf("%w: queue %q (deleted?)", ErrConsumerCancelled, c.cfg.Queue)
		case e := <-closed:
			end = fmt.Errorf("rabbitmq: channel closed: %w", amqpErr(e))
		case e := <-rtClosed:
			end = refused("retry channel closed", amqpErr(e))
		}
		close(s.stopping)
	}()
	s.startLanes()
loop:
	for {
		select {
		case <-s.stopping:
			break loop
		case m, ok := <-msgs:
			if !ok {
				// The deliveries end before the cancel or the close
				// is told: wait for the reason.
				<-s.stopping
				break loop
			}
			s.add(&m)
		}
	}
	if stopped {
		// Stop the broker pushing more; what it pushed meanwhile is
		// put back with the rest.
		cancelled := make(chan error, 1)
		go func() { cancelled <- ch.Cancel(tag, false) }()
		t := time.NewTimer(cancelWait)
		select {
		case err := <-cancelled:
			if err != nil {
				c.cfg.Logger.Debug("rabbitmq: cancel consumer on stop", slog.Any("error", err))
			}
		case <-t.C:
			// Nothing gets through: give the connection up. The broker
			// returns what it had not acknowledged; a decided delivery
			// comes back as a Duplicate.
			c.cfg.Logger.Warn("rabbitmq: the broker did not answer the consumer's cancel on stop; closing the connection", slog.String("queue", c.cfg.Queue), slog.Duration("waited", cancelWait))
			sock.close()
		}
		t.Stop()
		for m := range msgs {
			s.putBack(&m)
		}
	}
	s.closeLanes()
	// Nothing not started is left unsettled on a live channel: returned
	// to the queue (a closed channel requeues them on its own).
	s.returnLeftovers(stopped)
	if stopped {
		return true, ctx.Err()
	}
	return true, end
}

// amqpErr returns e as an error, or a generic one when the channel closed
// without a reason (a clean close).
func amqpErr(e *amqp.Error) error {
	if e == nil {
		return amqp.ErrClosed
	}
	return e
}

// declareQueue declares the work queue, or checks it exists (Passive).
func (c *Consumer) declareQueue(ch *amqp.Channel) error {
	if c.cfg.Passive {
		if _, err := ch.QueueDeclarePassive(c.cfg.Queue, true, false, false, false, nil); err != nil {
			return refused("queue "+c.cfg.Queue, err)
		}
		return nil
	}
	if _, err := ch.QueueDeclare(c.cfg.Queue, true, false, false, false, amqp.Table{"x-queue-type": c.cfg.QueueType}); err != nil {
		return refused("declare queue "+c.cfg.Queue, err)
	}
	return nil
}

// pending is a delivery received and mapped but not settled.
type pending struct {
	m *amqp.Delivery
	d *idem.Delivery
}

// session is one connection's consuming: lanes deciding deliveries in
// order per key.
type session struct {
	c        *Consumer
	ch       *amqp.Channel
	rt       *retrier
	stopping chan struct{} // closed when the session stops consuming
	lanes    []chan pending
	wg       sync.WaitGroup
	mu       sync.Mutex
	leftover []pending    // received, not started when the session stopped
	held     bool         // a delivery was held by a store outage when the session stopped
	settled  atomic.Int64 // deliveries settled (acked, or retried)
	ackLost  atomic.Bool  // an ack failed: its channel is gone
}

// ackFailed logs an ack that failed: its channel or connection is gone,
// and so are the acks of every delivery decided with it (a batch, the
// other lanes). The first is a warning, the rest of the session's Debug.
func (s *session) ackFailed(msg string, p pending, err error) {
	level := slog.LevelDebug
	if s.ackLost.CompareAndSwap(false, true) {
		level = slog.LevelWarn
		msg += " (further failed acks of this connection are logged at debug level)"
	}
	s.c.cfg.Logger.Log(context.Background(), level, msg, slog.String("source", p.d.Source), slog.Any("error", err))
}

// startLanes starts Concurrency lanes.
func (s *session) startLanes() {
	s.lanes = make([]chan pending, s.c.cfg.Concurrency)
	for i := range s.lanes {
		s.lanes[i] = make(chan pending, s.c.cfg.Batch)
		s.wg.Go(func() { s.runLane(s.lanes[i]) })
	}
}

// closeLanes waits for the lanes to finish what they decide.
func (s *session) closeLanes() {
	for _, l := range s.lanes {
		close(l)
	}
	s.wg.Wait()
}

// add maps m and queues it on its lane, waiting while the lane is full
// (or until the session stops: then it is put back).
func (s *session) add(m *amqp.Delivery) {
	p := pending{m: m, d: s.c.delivery(m, s.stopping)}
	select {
	case s.lanes[s.c.lane(m, p.d)] <- p:
	case <-s.stopping:
		s.putBack(m)
	}
}

// putBack keeps p to be returned to the queue.
func (s *session) putBack(m *amqp.Delivery) {
	s.mu.Lock()
	s.leftover = append(s.leftover, pending{m: m})
	s.mu.Unlock()
}

// stopped reports whether the session stopped consuming.
func (s *session) stopped() bool {
	select {
	case <-s.stopping:
		return true
	default:
		return false
	}
}

// runLane decides the lane's deliveries in order, up to Batch at a time.
func (s *session) runLane(in chan pending) {
	bh, batched := s.c.cfg.Handler.(idem.BatchDeliveryHandler)
	batched = batched && s.c.cfg.Batch > 1
	var batch []pending
	for p := range in {
		batch = append(batch[:0], p)
		if batched {
			batch = s.fill(in, batch)
		}
		if s.stopped() {
			s.mu.Lock()
			s.leftover = append(s.leftover, batch...)
			s.mu.Unlock()
			continue
		}
		// Decided and settled even if Run's context ends now: the
		// effects may commit.
		ctx := context.Background()
		if !batched {
			v := s.c.cfg.Handler.HandleDelivery(ctx, p.d)
			s.settle(p, v)
			continue
		}
		ds := make([]*idem.Delivery, len(batch))
		for i, p := range batch {
			ds[i] = p.d
		}
		vs := verdicts.Check(bh.HandleDeliveries(ctx, ds), len(ds), s.c.cfg.Logger, "rabbitmq")
		for i, p := range batch {
			s.settle(p, vs[i])
		}
	}
}

// fill adds to batch what comes on in within BatchWait, up to Batch.
func (s *session) fill(in chan pending, batch []pending) []pending {
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for len(batch) < s.c.cfg.Batch {
		select {
		case p, ok := <-in:
			if !ok {
				return batch
			}
			batch = append(batch, p)
			continue
		default:
		}
		if t == nil {
			t = time.NewTimer(s.c.cfg.BatchWait)
		}
		select {
		case p, ok := <-in:
			if !ok {
				return batch
			}
			batch = append(batch, p)
		case <-t.C:
			return batch
		case <-s.stopping:
			return batch
		}
	}
	return batch
}

// settle carries out v for p: ack; or, for a retry, a copy to the retry
// queue and then the ack.
func (s *session) settle(p pending, v idem.Verdict) {
	log := s.c.cfg.Logger
	if v.Ack {
		s.settled.Add(1)
		if err := p.m.Ack(false); err != nil {
			// The message comes back when the channel closes; its
			// outcome is durable, so that delivery is a Duplicate.
			s.ackFailed("rabbitmq: ack failed; the message will be delivered again", p, err)
		}
		return
	}
	if verdicts.Unattempted(v.Err) && s.stopped() {
		// Held while the store was down, cut short by the stop, or
		// waiting behind such a delivery (its error wraps the other's),
		// and the session stopped: no attempt of the message. It goes
		// back to the queue with those not started, once the lanes are
		// done (returnLeftovers). One waiting behind a failure goes to
		// the retry queue below, behind that failure's copy.
		s.mu.Lock()
		s.leftover = append(s.leftover, p)
		s.held = true
		s.mu.Unlock()
		return
	}
	attempt := p.d.Attempt + 1
	if errors.Is(v.Err, idem.ErrWaitsForAggregate) {
		// Waited behind an earlier delivery of its aggregate (in a
		// batch): not tried, so its copy keeps its attempt.
		attempt = max(p.d.Attempt, 1)
	}
	err := s.rt.republish(p.m, attempt, v.RetryAfter)
	if err == nil {
		s.settled.Add(1)
		if err := p.m.Ack(false); err != nil {
			// The copy is in the retry queue and the original comes
			// back when the channel closes: two deliveries of one
			// message, which idem tells apart (a Duplicate).
			s.ackFailed("rabbitmq: ack after the retry copy failed; the message will be delivered again", p, err)
		}
		return
	}
	// No copy: hand the message back after its delay rather than at
	// once, so that a broken retry queue does not turn into a hot loop.
	// A broker that refuses one copy (an alarm, a full retry queue)
	// refuses the next ones alike: one line per interval, with a count.
	s.c.logs.Warn(log, "", "rabbitmq: retry copy not confirmed; returning the message to its queue after the delay",
		slog.String("source", p.d.Source), slog.Duration("retry_after", v.RetryAfter), slog.Any("error", err))
	t := time.NewTimer(v.RetryAfter)
	select {
	case <-t.C:
	case <-s.stopping:
		t.Stop()
	}
	s.requeue(p)
}

// returnLeftovers returns to the queue what the session received and never
// attempted: the deliveries not started, and those held by a store outage
// when it stopped. Called once the lanes are done.
//
// A requeue (nack) keeps a message's place in the queue, but a quorum
// queue counts it in x-delivery-count, which attemptOf adds to the attempt,
// and in its delivery-limit; a classic queue marks it redelivered, one
// attempt more. That is the price of an ordinary stop. A stop while the
// store is down costs nothing instead: the outage may outlast many stops
// (a supervisor restarting the process whose store does not answer), and
// an outage must spend no attempt. So when a delivery was held by the
// outage and Run's context ended (graceful), each is republished to the
// work queue, in delivery order, as a copy carrying the attempt it was
// (HeaderAttempt, without x-delivery-count: the next delivery is that
// same attempt, and the broker's delivery-limit counts from zero), and
// the originals are acked once the broker confirmed every copy. The
// copies join the back of the queue, as retries do: later messages of
// their aggregates may overtake them. If a copy is not confirmed, every
// original is requeued instead (a copy the broker did take is then
// decided as a Duplicate): nothing is lost.
func (s *session) returnLeftovers(graceful bool) {
	s.mu.Lock()
	ps, held := s.leftover, s.held
	s.leftover = nil
	s.mu.Unlock()
	if len(ps) == 0 {
		return
	}
	if !graceful || !held {
		for _, p := range ps {
			s.requeue(p)
		}
		return
	}
	slices.SortFunc(ps, func(a, b pending) int { return cmp.Compare(a.m.DeliveryTag, b.m.DeliveryTag) })
	ms := make([]*amqp.Delivery, len(ps))
	for i, p := range ps {
		ms[i] = p.m
	}
	log := s.c.cfg.Logger
	if err := s.rt.putBack(ms); err != nil {
		log.Warn("rabbitmq: copies of the deliveries held by the store outage not confirmed on stop; requeueing them (a quorum queue counts the return as an attempt)", slog.Int("deliveries", len(ps)), slog.Any("error", err))
		for _, p := range ps {
			s.requeue(p)
		}
		return
	}
	// One ack of them all (multiple): every delivery of the channel not
	// yet settled is one of ps, since the lanes are done and the consumer
	// cancelled (its deliveries all came before the cancel-ok). Acks one
	// by one could be lost: a quorum queue's channel holds back its
	// settlements past 32 outstanding ones, and drops what it holds when
	// the connection closes right after, which returned the originals
	// beside their copies.
	if err := s.ch.Ack(ps[len(ps)-1].m.DeliveryTag, true); err != nil {
		// The copies are in the queue and the originals come back
		// when the channel closes: idem decides the second of each
		// pair as a Duplicate.
		log.Warn("rabbitmq: ack after returning copies on stop failed; those messages will be delivered twice", slog.Int("deliveries", len(ps)), slog.Any("error", err))
	}
}

// requeue returns p to its queue.
func (s *session) requeue(p pending) {
	if err := p.m.Nack(false, true); err != nil {
		s.c.cfg.Logger.Debug("rabbitmq: nack on stop failed; the channel's close returns the message", slog.Any("error", err))
	}
}

// delivery maps m; stopping is closed when its session ends.
func (c *Consumer) delivery(m *amqp.Delivery, stopping <-chan struct{}) *idem.Delivery {
	d := &idem.Delivery{Raw: m.Body, Stopping: stopping, Attempt: attemptOf(m.Headers, m.Redelivered, c.cfg.QueueType == QueueQuorum)}
	d.Source = "rabbitmq:" + c.cfg.Queue + "/" + m.RoutingKey
	if rk, _ := textHeader(m.Headers, HeaderRoutingKey); rk != "" {
		d.Source = "rabbitmq:" + c.cfg.Queue + "/" + rk
	}
	if m.MessageId != "" {
		d.Source += "#" + m.MessageId
	}
	d.LastAttempt = c.cfg.MaxDeliver > 0 && d.Attempt >= c.cfg.MaxDeliver
	d.Msg, d.DecodeErr = c.mapMessage(m, d.Source)
	return d
}

// mapMessage is Config.Map through verdicts.Decode: a panic or no message
// is a decode failure.
func (c *Consumer) mapMessage(m *amqp.Delivery, source string) (*idem.Message, error) {
	return verdicts.Decode(c.logs, c.cfg.Logger, "rabbitmq", source, func() (*idem.Message, error) { return c.cfg.Map(m) })
}

// key returns what orders m, mapped to d: its aggregate as the Handler's
// ordering guard sees it (idem.AggregateKeyer), else its routing key.
func (c *Consumer) key(m *amqp.Delivery, d *idem.Delivery) string {
	if d.Msg != nil && d.Msg.AggregateID != "" {
		if k, ok := c.cfg.Handler.(idem.AggregateKeyer); ok {
			return k.AggregateKey(d.Msg.AggregateID)
		}
		return d.Msg.AggregateID
	}
	return m.RoutingKey
}

// lane returns the lane of m, mapped to d.
func (c *Consumer) lane(m *amqp.Delivery, d *idem.Delivery) int {
	if c.cfg.Concurrency == 1 {
		return 0
	}
	return int(maphash.String(c.seed, c.key(m, d)) % uint64(c.cfg.Concurrency))
}
