// Package metrics exports idem's outcomes and timings to Prometheus.
//
// Install a *Metrics as a processor hook (idem.Config.Hooks or
// idem.LeaseConfig.Hooks), and as a consumer hook (idem.ConsumerConfig.Hooks)
// for the broker-side verdicts, and serve the registry as usual:
//
//	reg := prometheus.NewRegistry()
//	m, err := metrics.New(reg, nil)
//	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{m}})
//	c, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{m}})
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// It exports, labelled by handler name (which you choose, so cardinality
// stays bounded; message IDs are never labels):
//
//	idem_messages_total{handler, outcome}      applied, duplicate, conflict,
//	                                           stale, in_flight, or error
//	idem_errors_total{handler, kind}           why an outcome was error:
//	                                           retriable, permanent, panic,
//	                                           gap, invalid or canceled
//	idem_message_duration_seconds{handler}     processing time per message
//	                                           (a batch's time shared out)
//	idem_deliveries_total{handler, verdict}    a Consumer's verdicts: acked,
//	                                           retried, in_flight (lease
//	                                           mode: held elsewhere) or
//	                                           dead_lettered
//	idem_dead_letters_total{handler, class}    a Consumer's dead letters by
//	                                           class: permanent, conflict,
//	                                           decode or exhausted
//	idem_leases_lost_total{handler, op}        lease mode: leases this worker
//	                                           lost (heartbeat, done, failed,
//	                                           expired)
//	idem_consumer_store_up{handler}            1 while a Consumer's store
//	                                           answers, 0 while it waits out
//	                                           an outage
//	idem_store_outages_total{handler}          outages a Consumer paused for
//	idem_outbox_published_total                rows an outbox relay published
//	                                           (as a relay hook,
//	                                           outbox.RelayConfig.Hooks)
//	idem_outbox_publish_failures_total         rows a relay claimed and did
//	                                           not publish
//
// A Sampler (NewSampler) reads gauges when Prometheus scrapes: the
// outbox's idem_outbox_lag_seconds and idem_outbox_pending from a relay,
// and idem_consumer_lag{handler, source}, the broker's count of what a
// consumer has not acknowledged, from an adapter's Consumer.
//
// A Consumer's batch that does not commit is decided again message by
// message, and so are a committed batch's conflicts and gaps: each such
// message is counted once, by the call that decided it. (A message that
// waits behind an earlier one of its aggregate to be retried is decided
// by no call: it has a verdict, retried, and no outcome.) A handler name
// idem refuses is labelled InvalidHandler.
//
// Counting costs a map lookup and an atomic add per message, on the
// processing goroutine.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/operations.md#prometheus-metrics
package metrics

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/outbox"
)

// Config configures New. The zero value is valid.
type Config struct {
	// Namespace prefixes every metric name. Default "idem".
	Namespace string
	// ConstLabels are added to every metric, for example the service.
	ConstLabels prometheus.Labels
	// Buckets are the upper bounds, in seconds, of the duration
	// histogram, in increasing order (New refuses others). Default:
	// 0.25 ms doubling to ~8 s.
	Buckets []float64
}

// OutcomeError is the outcome label of a call that ended with an error
// (idem.OutcomeNone): the error is classified in idem_errors_total.
const OutcomeError = "error"

// Error kinds, the kind label of idem_errors_total.
const (
	KindRetriable = "retriable" // the handler or the store failed; a retry may succeed
	KindPermanent = "permanent" // idem.Permanent: retrying cannot help
	KindPanic     = "panic"     // the handler panicked (idem.PanicError)
	KindGap       = "gap"       // the ordering guard refused it (idem.ErrGap)
	KindInvalid   = "invalid"   // invalid message, handler or configuration
	KindCanceled  = "canceled"  // the context was canceled or timed out
)

// Verdict labels of idem_deliveries_total.
const (
	VerdictAcked        = "acked"         // the outcome is durable; the broker was told so
	VerdictRetried      = "retried"       // not acknowledged: redelivered after a backoff
	VerdictInFlight     = "in_flight"     // lease mode: another worker holds it (or its retry is not due); asked again later
	VerdictDeadLettered = "dead_lettered" // committed to the dead-letter store, then acknowledged
)

// Metrics is an idem hook that counts outcomes and verdicts and times
// processing. It is safe for concurrent use.
type Metrics struct {
	messages   *prometheus.CounterVec
	errors     *prometheus.CounterVec
	seconds    *prometheus.HistogramVec
	deliveries *prometheus.CounterVec
	deadLetter *prometheus.CounterVec
	leasesLost *prometheus.CounterVec
	storeUp    *prometheus.GaugeVec
	outages    *prometheus.CounterVec
	published  prometheus.Counter
	pubFailed  prometheus.Counter

	upMu      sync.Mutex // orders the store-up gauge's first set with OnOutage
	up        sync.Map   // handler → struct{}: its store-up gauge is set
	counters  sync.Map   // outcomeKey → prometheus.Counter
	observers sync.Map   // handler → prometheus.Observer
}

type outcomeKey struct {
	handler string
	outcome idem.Outcome
}

// New creates the metrics and registers them with reg. It fails, with an
// error matching idem.ErrInvalidConfig, when reg is nil or already holds
// metrics of the same names.
func New(reg prometheus.Registerer, cfg *Config) (*Metrics, error) {
	if reg == nil {
		return nil, fmt.Errorf("%w: metrics.New needs a prometheus.Registerer", idem.ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	ns := cfg.Namespace
	if ns == "" {
		ns = "idem"
	}
	buckets := cfg.Buckets
	if len(buckets) == 0 {
		buckets = prometheus.ExponentialBuckets(0.00025, 2, 16)
	}
	// The histogram checks its buckets only when its first series is
	// made: with the first message processed, as a panic.
	for i := 1; i < len(buckets); i++ {
		if !(buckets[i-1] < buckets[i]) {
			return nil, fmt.Errorf("%w: metrics: Buckets must be in increasing order; %v at %d is followed by %v", idem.ErrInvalidConfig, buckets[i-1], i-1, buckets[i])
		}
	}
	m := &Metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "messages_total", ConstLabels: cfg.ConstLabels,
			Help: "Messages processed, by handler and outcome (applied, duplicate, conflict, stale, in_flight, error).",
		}, []string{"handler", "outcome"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "errors_total", ConstLabels: cfg.ConstLabels,
			Help: "Messages whose processing returned an error, by handler and kind (retriable, permanent, panic, gap, invalid, canceled).",
		}, []string{"handler", "kind"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "message_duration_seconds", ConstLabels: cfg.ConstLabels, Buckets: buckets,
			Help: "Processing time per message, from the call to its outcome; a batch's time is shared among its messages.",
		}, []string{"handler"}),
		deliveries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "deliveries_total", ConstLabels: cfg.ConstLabels,
			Help: "Broker deliveries decided by a Consumer, by handler and verdict (acked, retried, in_flight, dead_lettered).",
		}, []string{"handler", "verdict"}),
		deadLetter: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "dead_letters_total", ConstLabels: cfg.ConstLabels,
			Help: "Deliveries a Consumer dead-lettered, by handler and class (permanent, conflict, decode, exhausted).",
		}, []string{"handler", "class"}),
		leasesLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "leases_lost_total", ConstLabels: cfg.ConstLabels,
			Help: "Lease mode: leases this worker lost, by handler and the operation that found out (heartbeat, done, failed, expired).",
		}, []string{"handler", "op"}),
		storeUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Name: "consumer_store_up", ConstLabels: cfg.ConstLabels,
			Help: "1 while a Consumer's store answers, 0 while it is down and the Consumer is paused, by handler.",
		}, []string{"handler"}),
		outages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "store_outages_total", ConstLabels: cfg.ConstLabels,
			Help: "Outages of its store a Consumer paused for, by handler.",
		}, []string{"handler"}),
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "outbox_published_total", ConstLabels: cfg.ConstLabels,
			Help: "Outbox rows a relay of this process published: the broker acknowledged them and they were marked.",
		}),
		pubFailed: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "outbox_publish_failures_total", ConstLabels: cfg.ConstLabels,
			Help: "Outbox rows a relay of this process claimed and did not publish (the broker refused them, or the claim ran out); they stay pending.",
		}),
	}
	cs := []prometheus.Collector{m.messages, m.errors, m.seconds, m.deliveries, m.deadLetter, m.leasesLost, m.storeUp, m.outages, m.published, m.pubFailed}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, done := range cs[:i] { // all or nothing
				reg.Unregister(done)
			}
			return nil, fmt.Errorf("%w: register idem metrics: %w", idem.ErrInvalidConfig, err)
		}
	}
	return m, nil
}

// OnOutcome implements idem.HookOutcome.
func (m *Metrics) OnOutcome(_ context.Context, ev *idem.OutcomeEvent) {
	key := outcomeKey{ev.Handler, ev.Outcome}
	c, ok := m.counters.Load(key)
	if !ok {
		label := ev.Outcome.String()
		if ev.Outcome == idem.OutcomeNone {
			label = OutcomeError
		}
		c, _ = m.counters.LoadOrStore(key, m.messages.WithLabelValues(handlerLabel(ev.Handler), label))
	}
	c.(prometheus.Counter).Inc()
	if ev.Outcome == idem.OutcomeNone {
		m.errors.WithLabelValues(handlerLabel(ev.Handler), Kind(ev.Err)).Inc()
	}
	o, ok := m.observers.Load(ev.Handler)
	if !ok {
		o, _ = m.observers.LoadOrStore(ev.Handler, m.seconds.WithLabelValues(handlerLabel(ev.Handler)))
	}
	d := ev.Duration.Seconds()
	if ev.BatchSize > 1 {
		d /= float64(ev.BatchSize)
	}
	o.(prometheus.Observer).Observe(d)
}

// OnVerdict implements idem.HookVerdict.
func (m *Metrics) OnVerdict(_ context.Context, ev *idem.VerdictEvent) {
	verdict := VerdictRetried
	switch {
	case ev.Verdict.DeadLettered:
		verdict = VerdictDeadLettered
		m.deadLetter.WithLabelValues(handlerLabel(ev.Handler), ev.Verdict.DeadLetterClass).Inc()
	case ev.Verdict.Ack:
		verdict = VerdictAcked
	case ev.Verdict.Outcome == idem.InFlight:
		verdict = VerdictInFlight
	}
	m.deliveries.WithLabelValues(handlerLabel(ev.Handler), verdict).Inc()
	if _, seen := m.up.Load(ev.Handler); !seen {
		// The first verdict says the store was reached, unless OnOutage
		// set the gauge first: it exists from then on.
		m.upMu.Lock()
		if _, seen := m.up.LoadOrStore(ev.Handler, struct{}{}); !seen {
			m.storeUp.WithLabelValues(handlerLabel(ev.Handler)).Set(1)
		}
		m.upMu.Unlock()
	}
}

// OnOutage implements idem.HookOutage.
func (m *Metrics) OnOutage(_ context.Context, ev *idem.OutageEvent) {
	m.upMu.Lock()
	defer m.upMu.Unlock()
	m.up.Store(ev.Handler, struct{}{})
	if ev.Down {
		m.storeUp.WithLabelValues(handlerLabel(ev.Handler)).Set(0)
		m.outages.WithLabelValues(handlerLabel(ev.Handler)).Inc()
		return
	}
	m.storeUp.WithLabelValues(handlerLabel(ev.Handler)).Set(1)
}

// OnLeaseLost implements idem.HookLeaseLost.
func (m *Metrics) OnLeaseLost(_ context.Context, ev *idem.LeaseLostEvent) {
	m.leasesLost.WithLabelValues(handlerLabel(ev.Handler), ev.Op).Inc()
}

// OnRelayCycle implements outbox.HookCycle.
func (m *Metrics) OnRelayCycle(_ context.Context, ev *outbox.CycleEvent) {
	m.published.Add(float64(ev.Result.Published))
	m.pubFailed.Add(float64(ev.Result.Failed))
}

// InvalidHandler is the handler label of calls made with a handler name
// idem refuses (they fail with a *idem.ValidationError): such a name may
// not even be valid UTF-8, which a label must be.
const InvalidHandler = "invalid"

// handlerLabel is name as a label value.
func handlerLabel(name string) string {
	if idem.ValidateHandlerName(name) != nil {
		return InvalidHandler
	}
	return name
}

// Kind classifies a processing error into one of the Kind constants.
func Kind(err error) string {
	var pe *idem.PanicError
	switch {
	case errors.As(err, &pe):
		return KindPanic
	case errors.Is(err, idem.ErrGap):
		return KindGap
	case errors.Is(err, idem.ErrInvalidMessage), errors.Is(err, idem.ErrInvalidHandlerName), errors.Is(err, idem.ErrInvalidConfig):
		return KindInvalid
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return KindCanceled
	case idem.IsPermanent(err):
		return KindPermanent
	}
	return KindRetriable
}
