package watermill

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/errtext"
	"github.com/idemhq/idem/internal/lograte"
	"github.com/idemhq/idem/internal/verdicts"
)

// Metadata keys the default mapping reads and Publisher writes. Every other
// metadata key reaches the handler in idem.Message.Headers.
const (
	// MetadataAggregate carries idem.Message.AggregateID.
	MetadataAggregate = "idem-aggregate"
	// MetadataSeq carries idem.Message.Seq, a decimal integer ≥ 1.
	MetadataSeq = "idem-seq"
	// MetadataType carries idem.Message.Type.
	MetadataType = "idem-type"
	// MetadataTime carries idem.Message.Time, RFC 3339.
	MetadataTime = "idem-time"
	// MetadataAttempt is the attempt counter the Handler maintains: set
	// on the message before each decision, so that Watermill's Retry
	// middleware, a PoisonQueue and the pub/subs that copy a nacked
	// message (watermill-sql) carry it along.
	MetadataAttempt = "idem-attempt"
	// MetadataOutcome is set on the message once decided: the verdict's
	// outcome ("applied", "duplicate", ...), or "dead-lettered:<class>".
	MetadataOutcome = "idem-outcome"
)

// RetryMode says how a Handler hands a retry verdict back to Watermill.
type RetryMode uint8

const (
	// NackAfterDelay, the default, waits out the verdict's RetryAfter in
	// the handler (up to Config.MaxWait; cut short when the delivery
	// stops) and then returns a *RetryError: the router Nacks and the
	// pub/sub redelivers at once.
	// Use it without Watermill's Retry middleware.
	NackAfterDelay RetryMode = iota
	// ErrorAtOnce returns the *RetryError without waiting: Watermill's
	// Retry middleware, wrapping the handler, waits its own backoff and
	// calls the handler again on the same message.
	ErrorAtOnce
)

// Config configures a Handler. The zero value is valid.
type Config struct {
	// Map turns a Watermill message into an idem message; an error, a
	// panic or no message makes the delivery a decode failure,
	// dead-lettered with the reason, never dropped (a panic is logged with
	// its stack, one line every 10 s). Default: DefaultMap.
	Map func(msg *message.Message) (*idem.Message, error)
	// Retry says how a retry verdict goes back to Watermill. Default
	// NackAfterDelay.
	Retry RetryMode
	// MaxWait bounds how long NackAfterDelay waits in the handler before
	// the Nack. A retry's backoff is short (ConsumerConfig.Backoff: up to
	// 1 s by default), but in lease mode a copy of a message whose lease
	// another worker holds is asked to retry once that lease can have
	// run out, up to the lease's TTL (15 min by default): waiting that
	// long would hold the subscription (RabbitMQ closes a channel whose
	// delivery stays unacknowledged past its consumer timeout). Past
	// MaxWait the handler Nacks, and the redelivery asks again. Default
	// 5 s.
	MaxWait time.Duration
	// Attempt, when set, returns the pub/sub's own count of deliveries
	// of msg (from 1; 0 when unknown), such as a RabbitMQ quorum queue's
	// x-delivery-count plus one. The Handler counts the attempts it sees
	// itself as well (MetadataAttempt, and in memory per message ID) and
	// takes the highest, so that no attempt is counted twice.
	Attempt func(msg *message.Message) int
	// Stopping, when set, is closed when the consumer stops (close it
	// before Router.Close). A delivery held while the store is down then
	// ends with a retry whose error matches idem.ErrStoreUnavailable, and
	// one still running idem.ConsumerConfig.StopGrace later with one
	// matching idem.ErrStopped.
	// The message's context ending does the same. Default: the
	// message's context alone.
	Stopping <-chan struct{}
	// Logger receives what the Handler itself notices (an attempt count
	// it could not parse). The DeliveryHandler logs the verdicts. Default
	// slog.Default().
	Logger *slog.Logger
}

// maxTracked bounds the attempt counts a Handler keeps in memory: the
// messages being retried at once. Past it the oldest entries go, and those
// messages count from their MetadataAttempt again.
const maxTracked = 8192

// maxAttempt bounds the attempt count a Handler takes from MetadataAttempt
// and Config.Attempt, so that counting on never overflows.
const maxAttempt = 1 << 30

// Handler decides Watermill messages through an idem.DeliveryHandler (an
// idem.Consumer in atomic mode, an idem.LeaseConsumer in lease mode) and
// turns each verdict into Watermill's terms:
//
//   - applied, duplicate or stale: nil, and the router acknowledges;
//   - dead-lettered (committed to idem's dead-letter store): nil, and the
//     router acknowledges;
//   - retry: a *RetryError, after the verdict's delay (at most
//     Config.MaxWait) under NackAfterDelay; the router Nacks and the
//     pub/sub redelivers;
//   - store unreachable: the call waits until the store answers and is
//     then decided as above; if the delivery stops first, a *RetryError
//     matching idem.ErrStoreUnavailable (idem.ErrStopped for one still
//     running idem.ConsumerConfig.StopGrace after the stop). Never nil:
//     never acknowledged.
//
// A message without a usable ID (DefaultMap: an empty UUID) is a decode
// failure, dead-lettered with the reason and then acknowledged.
//
// Register Handle with Router.AddConsumerHandler, or HandlerFunc with
// Router.AddHandler. It is safe for concurrent use.
type Handler struct {
	dh  idem.DeliveryHandler
	cfg Config
	// logs summarizes lines that every message of a producer may cause
	// alike (a Map that panics on them).
	logs *lograte.Limiter

	mu       sync.Mutex
	attempts map[string]*list.Element // message ID → its count in order
	order    *list.List               // *tracked, oldest first, for eviction
}

// tracked is the attempt count of one message ID.
type tracked struct {
	id string
	n  int
}

// New returns a Handler deciding through dh.
func New(dh idem.DeliveryHandler, cfg *Config) (*Handler, error) {
	if dh == nil {
		return nil, fmt.Errorf("%w: watermill: New needs a DeliveryHandler (an idem.Consumer or idem.LeaseConsumer)", idem.ErrInvalidConfig)
	}
	h := &Handler{dh: dh, attempts: map[string]*list.Element{}, order: list.New(), logs: lograte.New(10 * time.Second)}
	if cfg != nil {
		h.cfg = *cfg
	}
	if h.cfg.Retry > ErrorAtOnce {
		return nil, fmt.Errorf("%w: watermill: unknown RetryMode %d", idem.ErrInvalidConfig, h.cfg.Retry)
	}
	if h.cfg.MaxWait < 0 {
		return nil, fmt.Errorf("%w: watermill: MaxWait %s is negative", idem.ErrInvalidConfig, h.cfg.MaxWait)
	}
	if h.cfg.MaxWait == 0 {
		h.cfg.MaxWait = 5 * time.Second
	}
	if h.cfg.Map == nil {
		h.cfg.Map = DefaultMap
	}
	if h.cfg.Logger == nil {
		h.cfg.Logger = slog.Default()
	}
	return h, nil
}

// RetryError is what a Handler returns for a delivery that is not
// acknowledged: a retry verdict, or a delivery held while the store was
// down whose consumer stopped (it then matches idem.ErrStoreUnavailable),
// or cut short by the stop (idem.ErrStopped).
type RetryError struct {
	// MessageID is the idem message ID.
	MessageID string
	// Attempt is the attempt the Handler counted for this delivery.
	Attempt int
	// RetryAfter is the delay idem asked for (already waited out, up to
	// Config.MaxWait, under NackAfterDelay).
	RetryAfter time.Duration
	// Err is the verdict's error; nil for a lease held by another worker.
	Err error
}

// Error implements error.
func (e *RetryError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("idem: message %q in flight elsewhere; retry after %s (attempt %d)", e.MessageID, e.RetryAfter, e.Attempt)
	}
	return fmt.Sprintf("idem: message %q: retry after %s (attempt %d): %v", e.MessageID, e.RetryAfter, e.Attempt, e.Err)
}

// Unwrap returns the verdict's error.
func (e *RetryError) Unwrap() error { return e.Err }

// Handle decides msg; see Handler for what it returns. It has the shape of
// message.NoPublishHandlerFunc.
func (h *Handler) Handle(msg *message.Message) error {
	ctx := msg.Context()
	stopping, release := h.stopping(ctx)
	defer release()
	d := &idem.Delivery{Raw: msg.Payload, Source: source(msg), Stopping: stopping}
	d.Msg, d.DecodeErr = h.mapMessage(msg)
	key := ""
	if d.Msg != nil {
		key = d.Msg.ID
	}
	d.Attempt = h.nextAttempt(key, msg)
	msg.Metadata.Set(MetadataAttempt, strconv.Itoa(d.Attempt))

	dctx, cancel := decideContext(ctx)
	defer cancel()
	v := h.dh.HandleDelivery(withMessage(dctx, msg), d)
	if v.Ack {
		h.forget(key)
		if v.DeadLettered {
			msg.Metadata.Set(MetadataOutcome, "dead-lettered:"+v.DeadLetterClass)
		} else {
			msg.Metadata.Set(MetadataOutcome, v.Outcome.String())
		}
		return nil
	}
	if verdicts.Unattempted(v.Err) {
		// Held while the store was down, or cut short by the stop
		// (idem.ConsumerConfig.StopGrace): no attempt of the message.
		h.uncount(key)
		if d.Attempt > 1 {
			msg.Metadata.Set(MetadataAttempt, strconv.Itoa(d.Attempt-1))
		} else {
			delete(msg.Metadata, MetadataAttempt)
		}
	}
	rerr := &RetryError{MessageID: key, Attempt: d.Attempt, RetryAfter: v.RetryAfter, Err: v.Err}
	if h.cfg.Retry == NackAfterDelay && v.RetryAfter > 0 && !verdicts.Unattempted(v.Err) {
		t := time.NewTimer(min(v.RetryAfter, h.cfg.MaxWait))
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		case <-d.Stopping:
		}
	}
	return rerr
}

// mapMessage is Config.Map, a panic in which (a hostile payload meeting
// a bug in a custom Map) is a decode failure: dead-lettered with the
// reason, like an error, rather than a panic out of Handle that every
// redelivery would repeat. So is a Map that returns neither a message nor
// an error. The message is nil whenever the error is not.
func (h *Handler) mapMessage(msg *message.Message) (m *idem.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			// A producer's poison messages are alike: one line every
			// 10 s, counting the others.
			h.logs.Log(h.cfg.Logger, slog.LevelError, "", "watermill: Config.Map panicked; the message is a decode failure",
				slog.String("uuid", msg.UUID), slog.Any("panic", r), slog.String("stack", string(debug.Stack())))
			m, err = nil, fmt.Errorf("%w: watermill: mapping message %s panicked: %s", idem.ErrInvalidMessage, errtext.Quote(msg.UUID), errtext.Quote(fmt.Sprint(r)))
		}
	}()
	m, err = h.cfg.Map(msg)
	switch {
	case err != nil:
		return nil, err
	case m == nil:
		return nil, fmt.Errorf("%w: watermill: Config.Map returned no message and no error for message %s", idem.ErrInvalidMessage, errtext.Quote(msg.UUID))
	}
	return m, nil
}

// HandlerFunc is Handle with the shape of message.HandlerFunc: it never
// produces messages (publish them through idem's outbox, in the handler's
// transaction).
func (h *Handler) HandlerFunc(msg *message.Message) ([]*message.Message, error) {
	return nil, h.Handle(msg)
}

// decideContext is the context a delivery is decided with: ctx, the
// message's, without its cancellation but with its deadline. Router.Close
// cancels the context of the messages in flight (GoChannel, watermill-amqp,
// watermill-sql); a transaction under way then commits within the router's
// CloseTimeout, as the other adapters let it, instead of failing as an
// attempt of the message (dead-lettered as exhausted on its last one). A
// stop still ends a wait for the store (Delivery.Stopping is ctx's end).
// A deadline (Watermill's Timeout middleware) still cuts the transaction
// short: the message took too long, a failed attempt.
func decideContext(ctx context.Context) (context.Context, context.CancelFunc) {
	dctx := context.WithoutCancel(ctx)
	if dl, ok := ctx.Deadline(); ok {
		return context.WithDeadline(dctx, dl)
	}
	return dctx, func() {}
}

// stopping returns the channel closed when the delivery with context ctx
// stops (ctx's end or Config.Stopping), and the func that releases it.
func (h *Handler) stopping(ctx context.Context) (<-chan struct{}, func()) {
	if h.cfg.Stopping == nil {
		return ctx.Done(), func() {}
	}
	sctx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-h.cfg.Stopping:
			cancel()
		case <-sctx.Done():
		}
	}()
	return sctx.Done(), cancel
}

// nextAttempt counts a delivery of the message with ID key (empty: not
// decoded) and returns its attempt: one more than the highest of what this
// Handler saw of it, what its MetadataAttempt says, and the pub/sub's own
// count (Config.Attempt) less one.
func (h *Handler) nextAttempt(key string, msg *message.Message) int {
	seen := 0
	if s := msg.Metadata.Get(MetadataAttempt); s != "" {
		if n, err := strconv.Atoi(s); err == nil && n > 0 {
			seen = n
		} else {
			h.cfg.Logger.Warn("watermill: ignoring an attempt count that is no positive integer",
				slog.String("key", MetadataAttempt), slog.String("value", s), slog.String("uuid", msg.UUID))
		}
	}
	if h.cfg.Attempt != nil {
		if a := h.cfg.Attempt(msg); a > 1 {
			seen = max(seen, a-1)
		}
	}
	// A count counted on from metadata the producer wrote must not
	// overflow into a negative attempt, which no MaxAttempts reaches.
	seen = min(seen, maxAttempt)
	if key == "" {
		return seen + 1
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	el, ok := h.attempts[key]
	if !ok {
		if h.order.Len() >= maxTracked {
			delete(h.attempts, h.order.Remove(h.order.Front()).(*tracked).id)
		}
		el = h.order.PushBack(&tracked{id: key})
		h.attempts[key] = el
	}
	t := el.Value.(*tracked)
	t.n = max(t.n, seen) + 1
	return t.n
}

// uncount takes back the attempt nextAttempt counted for key.
func (h *Handler) uncount(key string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if el, ok := h.attempts[key]; ok {
		if t := el.Value.(*tracked); t.n > 0 {
			t.n--
		}
	}
}

// forget drops the count of key, decided for good.
func (h *Handler) forget(key string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if el, ok := h.attempts[key]; ok {
		h.order.Remove(el)
		delete(h.attempts, key)
	}
}

// source names msg for dead letters and logs: "watermill:<topic>@<uuid>".
func source(msg *message.Message) string {
	topic := message.SubscribeTopicFromCtx(msg.Context())
	if topic == "" {
		topic = "?"
	}
	return "watermill:" + topic + "@" + msg.UUID
}

// DefaultMap maps msg as Publisher writes it: the ID is the UUID; the
// aggregate, sequence, type and time come from the MetadataAggregate,
// MetadataSeq, MetadataType and MetadataTime keys; Stream is the topic the
// router subscribed to (empty outside a router); every other metadata key
// not beginning with idem.ReservedHeaderPrefix goes to Headers. A message
// with an empty UUID, or an ID, sequence or time idem refuses, is a
// decode failure: an error matching idem.ErrInvalidMessage, which quotes
// the values it names cut short.
func DefaultMap(msg *message.Message) (*idem.Message, error) {
	if msg.UUID == "" {
		return nil, fmt.Errorf("%w: watermill: message on %s has no UUID to serve as its ID", idem.ErrInvalidMessage, errtext.Quote(message.SubscribeTopicFromCtx(msg.Context())))
	}
	m := &idem.Message{
		ID: msg.UUID, Stream: message.SubscribeTopicFromCtx(msg.Context()), Payload: msg.Payload,
		AggregateID: msg.Metadata.Get(MetadataAggregate), Type: msg.Metadata.Get(MetadataType),
	}
	if s := msg.Metadata.Get(MetadataSeq); s != "" {
		seq, err := strconv.ParseInt(s, 10, 64)
		if err != nil || seq < 1 {
			return nil, fmt.Errorf("%w: watermill: message %s: %s %s is not a positive integer", idem.ErrInvalidMessage, errtext.Quote(msg.UUID), MetadataSeq, errtext.Quote(s))
		}
		m.Seq = seq
	}
	if s := msg.Metadata.Get(MetadataTime); s != "" {
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			// time's error quotes the whole value: leave it out.
			return nil, fmt.Errorf("%w: watermill: message %s: %s %s is not an RFC 3339 time", idem.ErrInvalidMessage, errtext.Quote(msg.UUID), MetadataTime, errtext.Quote(s))
		}
		m.Time = t
	}
	for k, v := range msg.Metadata {
		if len(k) >= len(idem.ReservedHeaderPrefix) && k[:len(idem.ReservedHeaderPrefix)] == idem.ReservedHeaderPrefix {
			continue
		}
		if m.Headers == nil {
			m.Headers = make(map[string]string, len(msg.Metadata))
		}
		m.Headers[k] = v
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("watermill: message %s: %w", errtext.Quote(msg.UUID), err)
	}
	return m, nil
}

// Poisonable is a filter for Watermill's PoisonQueueWithFilter: false for
// the errors of a Handler, which idem decides itself (a retry it asked
// for, a delivery held while the store was down), and for a delivery
// whose context ended (context.Canceled or context.DeadlineExceeded: the
// router closing, or a Timeout middleware); true for any other. A plain
// PoisonQueue would acknowledge what idem asked to retry, or could not
// record, and give up on it outside idem's dead-letter store. Watermill's
// Retry middleware returns the context's error, not the Handler's, when
// the message's context ends while it waits its backoff: that delivery
// is stopping, and is Nacked, not poisoned.
func Poisonable(err error) bool {
	var re *RetryError
	return !errors.As(err, &re) && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}

// ShouldRetry is for the ShouldRetry field of Watermill's Retry
// middleware: false for a delivery held while the store was down whose
// consumer is stopping (retrying it in the process would only wait
// again), true otherwise.
func ShouldRetry(p middleware.RetryParams) bool {
	return !verdicts.Unattempted(p.Err)
}

// PoisonQueue is Watermill's PoisonQueueWithFilter with Poisonable as the
// filter: messages whose handler failed for another reason go to topic
// through pub; what idem decides stays idem's.
func PoisonQueue(pub message.Publisher, topic string) (message.HandlerMiddleware, error) {
	mw, err := middleware.PoisonQueueWithFilter(pub, topic, Poisonable)
	if err != nil {
		return nil, fmt.Errorf("watermill: poison queue: %w", err)
	}
	return mw, nil
}
