package metrics

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// LagSampler reports a consumer's lag: the broker's count of the messages
// it has not acknowledged. The jetstream, kafka and rabbitmq Consumers
// implement it.
type LagSampler interface {
	Lag(ctx context.Context) (int64, error)
}

// OutboxStatser reports an outbox's state; *outbox.Relay implements it.
type OutboxStatser interface {
	Stats(ctx context.Context) (driver.OutboxStats, error)
}

// SamplerConfig configures NewSampler. The zero value is valid.
type SamplerConfig struct {
	// Namespace prefixes every metric name. Default "idem".
	Namespace string
	// ConstLabels are added to every metric.
	ConstLabels prometheus.Labels
	// Timeout bounds each reading at a scrape. Default 5 s.
	Timeout time.Duration
}

// Sampler reads gauges from brokers and stores when Prometheus scrapes,
// not on the processing path:
//
//	idem_consumer_lag{handler, source}   a consumer's lag (ConsumerLag)
//	idem_outbox_lag_seconds              the age of the oldest pending
//	                                     outbox row not parked; 0 when none
//	idem_outbox_pending                  pending outbox rows (Outbox)
//	idem_sample_failures_total{metric}   readings that failed; their
//	                                     series is left out of the scrape
//
// It is safe for concurrent use.
type Sampler struct {
	timeout  time.Duration
	lag      *prometheus.Desc
	obLag    *prometheus.Desc
	obPend   *prometheus.Desc
	failures *prometheus.CounterVec

	mu     sync.Mutex
	lags   []lagSource
	outbox OutboxStatser
}

type lagSource struct {
	handler, source string
	s               LagSampler
}

// NewSampler creates a Sampler and registers it with reg. It fails, with
// an error matching idem.ErrInvalidConfig, when reg is nil or already
// holds metrics of the same names.
func NewSampler(reg prometheus.Registerer, cfg *SamplerConfig) (*Sampler, error) {
	if reg == nil {
		return nil, fmt.Errorf("%w: metrics.NewSampler needs a prometheus.Registerer", idem.ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &SamplerConfig{}
	}
	ns := cfg.Namespace
	if ns == "" {
		ns = "idem"
	}
	s := &Sampler{
		timeout: cfg.Timeout,
		lag: prometheus.NewDesc(prometheus.BuildFQName(ns, "consumer", "lag"),
			"Messages the broker holds that a consumer has not acknowledged, by handler and source (stream/durable, group, queue), read at scrape.",
			[]string{"handler", "source"}, cfg.ConstLabels),
		obLag: prometheus.NewDesc(prometheus.BuildFQName(ns, "outbox", "lag_seconds"),
			"Age of the oldest pending outbox row that is not parked, read at scrape; 0 when none is pending.", nil, cfg.ConstLabels),
		obPend: prometheus.NewDesc(prometheus.BuildFQName(ns, "outbox", "pending"),
			"Outbox rows not yet published (parked ones included), read at scrape.", nil, cfg.ConstLabels),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "sample_failures_total", ConstLabels: cfg.ConstLabels,
			Help: "Readings of a sampled gauge that failed at scrape (the series is then left out), by metric."}, []string{"metric"}),
	}
	if s.timeout <= 0 {
		s.timeout = 5 * time.Second
	}
	if err := reg.Register(s); err != nil {
		return nil, fmt.Errorf("%w: register idem sampler: %w", idem.ErrInvalidConfig, err)
	}
	return s, nil
}

// ConsumerLag samples l as idem_consumer_lag{handler, source}. The
// adapters' Consumers name their source with LagSource. Consumers of one
// handler on one source (two consumers of a queue, two members of a group
// in one process) read the same broker count: sampling a second one
// replaces the first, so that the series is collected once. A source
// that is not valid UTF-8 has its invalid bytes replaced by U+FFFD in the
// label.
func (s *Sampler) ConsumerLag(handler, source string, l LagSampler) {
	ls := lagSource{handlerLabel(handler), strings.ToValidUTF8(source, "\uFFFD"), l}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, o := range s.lags {
		if o.handler == ls.handler && o.source == ls.source {
			s.lags[i] = ls
			return
		}
	}
	s.lags = append(s.lags, ls)
}

// Outbox samples o (an outbox relay) as idem_outbox_lag_seconds and
// idem_outbox_pending, replacing any outbox sampled before.
func (s *Sampler) Outbox(o OutboxStatser) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.outbox = o
}

// Describe implements prometheus.Collector.
func (s *Sampler) Describe(ch chan<- *prometheus.Desc) {
	ch <- s.lag
	ch <- s.obLag
	ch <- s.obPend
	s.failures.Describe(ch)
}

// Collect implements prometheus.Collector: every source is read at once,
// each within the timeout, and the failure counts after them, this
// scrape's included.
func (s *Sampler) Collect(ch chan<- prometheus.Metric) {
	s.mu.Lock()
	lags, ob := append([]lagSource(nil), s.lags...), s.outbox
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	var wg sync.WaitGroup
	for _, l := range lags {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := l.s.Lag(ctx)
			if err != nil {
				s.failures.WithLabelValues("consumer_lag").Inc()
				return
			}
			m, err := prometheus.NewConstMetric(s.lag, prometheus.GaugeValue, float64(n), l.handler, l.source)
			if err != nil {
				s.failures.WithLabelValues("consumer_lag").Inc()
				return
			}
			ch <- m
		}()
	}
	if ob != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := ob.Stats(ctx)
			if err != nil {
				s.failures.WithLabelValues("outbox").Inc()
				return
			}
			age := 0.0
			if !st.OldestPending.IsZero() {
				age = max(time.Since(st.OldestPending).Seconds(), 0)
			}
			ch <- prometheus.MustNewConstMetric(s.obLag, prometheus.GaugeValue, age)
			ch <- prometheus.MustNewConstMetric(s.obPend, prometheus.GaugeValue, float64(st.Pending))
		}()
	}
	wg.Wait()
	s.failures.Collect(ch)
}
