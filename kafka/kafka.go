package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
)

// Headers the default mapping reads.
const (
	HeaderID   = "idem-id"
	HeaderSeq  = "idem-seq"
	HeaderType = "idem-type"
)

// Config configures a Consumer.
type Config struct {
	// Brokers are the seed brokers. Required.
	Brokers []string
	// Group is the consumer group; consumers in one group share the
	// topics' partitions. Required.
	Group string
	// Topics to consume. Required.
	Topics []string
	// Handler decides every record. Required.
	Handler idem.DeliveryHandler
	// Map turns a record into an idem message; an error makes the record
	// a decode failure (dead-lettered with the reason, never dropped).
	// Default: DefaultMap.
	Map func(r *kgo.Record) (*idem.Message, error)
	// MaxPoll bounds the records handled between two commits. Default 500.
	// With Concurrency above 1 it does not apply: see there.
	MaxPoll int
	// Batch, above 1, hands a poll's records to the Handler's
	// HandleDeliveries in chunks of up to that many when it is an
	// idem.BatchDeliveryHandler (idem.Consumer is): their effects commit
	// in one transaction. A record the batch did not settle is then
	// retried alone, holding the records after it; offsets are committed
	// only up to the first record not settled. Default 1: one record at a
	// time.
	Batch int
	// Concurrency, above 1, handles up to that many partitions of a poll
	// at once, each in its own goroutine; within a partition records are
	// still handled in offset order (and batched per partition), so
	// per-key order holds. The Handler must be safe for concurrent use
	// (idem.Consumer is). A poll then takes every record fetched, not
	// MaxPoll (a backlogged partition's records come first in a fetch,
	// and MaxPoll of them would leave the others waiting), so the
	// client's fetch limits (kgo.FetchMaxBytes,
	// kgo.FetchMaxPartitionBytes) bound it; the next poll waits for every
	// partition of this one, and a record retrying holds the others'
	// next poll. Default 1: a poll's records one after another.
	Concurrency int
	// Logger receives commit failures. Default slog.Default().
	Logger *slog.Logger
	// Options are extra franz-go client options (TLS, SASL, ...).
	Options []kgo.Opt
	// FaultHook, when set, is called at FaultBeforeCommit. Crash tests
	// stop the consumer's goroutine there (runtime.Goexit), so that
	// records are processed but never committed.
	FaultHook func(point string)
}

// FaultBeforeCommit is the FaultHook point after a poll's records were
// handled and before their offsets are committed.
const FaultBeforeCommit = "before-commit"

// Consumer is one member of a consumer group. Run several, in one process
// or many, to share the partitions.
type Consumer struct {
	cfg Config
}

// New returns a Consumer; it connects when Run starts.
func New(cfg *Config) (*Consumer, error) {
	if cfg == nil || len(cfg.Brokers) == 0 || cfg.Group == "" || len(cfg.Topics) == 0 || cfg.Handler == nil {
		return nil, fmt.Errorf("%w: kafka: Brokers, Group, Topics and Handler are required", idem.ErrInvalidConfig)
	}
	c := &Consumer{cfg: *cfg}
	if c.cfg.Map == nil {
		c.cfg.Map = DefaultMap
	}
	if c.cfg.MaxPoll <= 0 {
		c.cfg.MaxPoll = 500
	}
	if c.cfg.Batch < 0 {
		return nil, fmt.Errorf("%w: kafka: Batch %d is negative", idem.ErrInvalidConfig, c.cfg.Batch)
	}
	if c.cfg.Concurrency < 0 {
		return nil, fmt.Errorf("%w: kafka: Concurrency %d is negative", idem.ErrInvalidConfig, c.cfg.Concurrency)
	}
	if c.cfg.Logger == nil {
		c.cfg.Logger = slog.Default()
	}
	return c, nil
}

// Run consumes until ctx is done or the client fails. On return every
// record whose outcome was durable has been committed (unless the commit
// itself failed, in which case those records are redelivered and are
// Duplicates) and no other.
func (c *Consumer) Run(ctx context.Context) error {
	opts := append([]kgo.Opt{
		kgo.SeedBrokers(c.cfg.Brokers...),
		kgo.ConsumerGroup(c.cfg.Group),
		kgo.ConsumeTopics(c.cfg.Topics...),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	}, c.cfg.Options...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("kafka: client: %w", err)
	}
	defer func() {
		cl.AllowRebalance() // Close waits for a blocked rebalance otherwise
		cl.Close()
	}()
	return c.loop(ctx, cl)
}

func (c *Consumer) loop(ctx context.Context, cl *kgo.Client) error {
	for {
		maxPoll := c.cfg.MaxPoll
		if c.cfg.Concurrency > 1 {
			// Everything fetched: under a backlog a poll of MaxPoll
			// records would hold one partition's and leave nothing to
			// handle at once.
			maxPoll = -1
		}
		fetches := cl.PollRecords(ctx, maxPoll)
		if ctx.Err() != nil {
			cl.AllowRebalance()
			return ctx.Err()
		}
		if fetches.IsClientClosed() {
			return errors.New("kafka: client closed")
		}
		for _, fe := range fetches.Errors() {
			if !errors.Is(fe.Err, context.Canceled) {
				c.cfg.Logger.Warn("kafka: fetch error", slog.String("topic", fe.Topic), slog.Int("partition", int(fe.Partition)), slog.Any("error", fe.Err))
			}
		}
		var done []*kgo.Record
		stopped := false
		if c.cfg.Concurrency > 1 {
			done, stopped = c.handlePartitions(ctx, fetches)
		} else {
			done, stopped = c.handleRecords(ctx, fetches.Records())
		}
		if c.cfg.FaultHook != nil {
			c.cfg.FaultHook(FaultBeforeCommit)
		}
		if len(done) > 0 {
			if err := cl.CommitRecords(context.WithoutCancel(ctx), done...); err != nil {
				c.cfg.Logger.Warn("kafka: commit failed; the records will be redelivered as duplicates", slog.Any("error", err))
			}
		}
		cl.AllowRebalance()
		if stopped {
			return ctx.Err()
		}
	}
}

// handlePartitions decides each partition's records of fetches with
// handleRecords, up to Concurrency partitions at once, and returns the
// records settled (a prefix of every partition's) and whether ctx ended
// before all were.
func (c *Consumer) handlePartitions(ctx context.Context, fetches kgo.Fetches) ([]*kgo.Record, bool) {
	var parts [][]*kgo.Record
	fetches.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) > 0 {
			parts = append(parts, p.Records)
		}
	})
	done := make([][]*kgo.Record, len(parts))
	stopped := make([]bool, len(parts))
	sem := make(chan struct{}, c.cfg.Concurrency)
	var wg sync.WaitGroup
	for i, recs := range parts {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			done[i], stopped[i] = c.handleRecords(ctx, recs)
		})
	}
	wg.Wait()
	var all []*kgo.Record
	for _, d := range done {
		all = append(all, d...)
	}
	return all, slices.Contains(stopped, true)
}

// handleRecords decides recs in order, in batches when the Handler takes
// them, and returns the records settled, a prefix of recs, and whether ctx
// ended before all were.
func (c *Consumer) handleRecords(ctx context.Context, recs []*kgo.Record) ([]*kgo.Record, bool) {
	if bh, ok := c.cfg.Handler.(idem.BatchDeliveryHandler); ok && c.cfg.Batch > 1 {
		return c.handleBatches(ctx, bh, recs)
	}
	for i, r := range recs {
		if ctx.Err() != nil || !c.handle(ctx, c.delivery(r), 1, 0) {
			return recs[:i], true // ctx ended, maybe while r was retrying
		}
	}
	return recs, false
}

// handleBatches decides recs in chunks of Batch and returns the records
// settled, a prefix of recs in poll order (so of every partition), and
// whether ctx ended before all were.
func (c *Consumer) handleBatches(ctx context.Context, bh idem.BatchDeliveryHandler, recs []*kgo.Record) ([]*kgo.Record, bool) {
	var done []*kgo.Record
	for lo := 0; lo < len(recs); lo += c.cfg.Batch {
		if ctx.Err() != nil {
			return done, true
		}
		chunk := recs[lo:min(lo+c.cfg.Batch, len(recs))]
		ds := make([]*idem.Delivery, len(chunk))
		for i, r := range chunk {
			ds[i] = c.delivery(r)
			ds[i].Attempt = 1
		}
		vs := bh.HandleDeliveries(context.WithoutCancel(ctx), ds)
		for i, r := range chunk {
			// A record the batch did not settle is retried alone; the
			// ones after it wait, and are not committed before it.
			if !vs[i].Ack && !c.handle(ctx, ds[i], 2, vs[i].RetryAfter) {
				return done, true
			}
			done = append(done, r)
		}
	}
	return done, false
}

// delivery maps r.
func (c *Consumer) delivery(r *kgo.Record) *idem.Delivery {
	d := &idem.Delivery{Raw: r.Value, Source: fmt.Sprintf("kafka:%s/%d@%d", r.Topic, r.Partition, r.Offset)}
	d.Msg, d.DecodeErr = c.cfg.Map(r)
	if d.DecodeErr != nil {
		d.Msg = nil
	}
	return d
}

// handle decides d, the delivery of r, from attempt first on, waiting wait
// before it and each retry's RetryAfter after it; it returns false when
// ctx ends before the outcome is durable.
func (c *Consumer) handle(ctx context.Context, d *idem.Delivery, first int, wait time.Duration) bool {
	for attempt := first; ; attempt++ {
		if wait > 0 || attempt > first {
			select {
			case <-ctx.Done():
				return false
			case <-time.After(wait):
			}
		}
		d.Attempt = attempt
		v := c.cfg.Handler.HandleDelivery(context.WithoutCancel(ctx), d)
		if v.Ack {
			return true
		}
		wait = v.RetryAfter
	}
}

// DefaultMap reads the message ID from the idem-id header, the aggregate
// from the record key, the sequence from idem-seq and the type from
// idem-type; Stream is the topic and Payload the value. Every other header
// goes to Headers (the last value of a repeated key), so metadata such as a
// producer's trace context (traceparent) reaches the handler and the
// hooks. A record without
// idem-id is a decode failure: a topic/partition/offset fallback would give
// a producer's retry, a new record, a new ID, hiding the duplicate.
func DefaultMap(r *kgo.Record) (*idem.Message, error) {
	msg := &idem.Message{Stream: r.Topic, AggregateID: string(r.Key), Payload: r.Value}
	for _, h := range r.Headers {
		switch h.Key {
		case HeaderID:
			msg.ID = string(h.Value)
		case HeaderType:
			msg.Type = string(h.Value)
		case HeaderSeq:
			seq, err := strconv.ParseInt(string(h.Value), 10, 64)
			if err != nil || seq < 1 {
				return nil, fmt.Errorf("kafka: record %s/%d@%d: %s header %q is not a positive integer", r.Topic, r.Partition, r.Offset, HeaderSeq, h.Value)
			}
			msg.Seq = seq
		default:
			if msg.Headers == nil {
				msg.Headers = make(map[string]string, len(r.Headers))
			}
			msg.Headers[h.Key] = string(h.Value)
		}
	}
	if msg.ID == "" {
		return nil, fmt.Errorf("kafka: record %s/%d@%d has no %s header", r.Topic, r.Partition, r.Offset, HeaderID)
	}
	if err := msg.Validate(); err != nil {
		return nil, err
	}
	return msg, nil
}
