package kafka

import (
	"bytes"
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
	"github.com/idemhq/idem/internal/errtext"
	"github.com/idemhq/idem/internal/lograte"
	"github.com/idemhq/idem/internal/verdicts"
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
	// Map turns a record into an idem message; an error, a panic or no
	// message makes the record a decode failure (dead-lettered with the
	// reason, never dropped; a panic is logged with its stack, one line
	// every 10 s). Default: DefaultMap.
	Map func(r *kgo.Record) (*idem.Message, error)
	// MaxPoll bounds the records handled between two commits. Default 500.
	// With Concurrency above 1 it does not apply: see there.
	MaxPoll int
	// Batch, above 1, hands a poll's records to the Handler's
	// HandleDeliveries in chunks of up to that many, each of one
	// partition's records (to the Handler all keyless records are of one
	// aggregate, which a retry holds); the Handler must be
	// an idem.BatchDeliveryHandler (idem.Consumer is, a LeaseConsumer is
	// not), else New refuses it. Their effects commit in one transaction.
	// A record the batch did not settle holds its partition for a retry,
	// as a single record's retry does; offsets are committed only up to
	// the first record of a partition not settled. Default 1: one record
	// at a time.
	// On Redis keep it below redisstore's Config.MaxWatchedKeys (2,000 by
	// default, counting a sequence per aggregate under an ordering guard
	// too): a larger batch is refused, never split, and its messages are
	// decided one by one.
	Batch int
	// Concurrency, above 1, handles up to that many partitions of a poll
	// at once, each in its own goroutine; within a partition records are
	// still handled in offset order (and batched per partition), so
	// per-key order holds. The Handler must be safe for concurrent use
	// (idem.Consumer is). A poll then takes every record fetched, not
	// MaxPoll (a backlogged partition's records come first in a fetch,
	// and MaxPoll of them would leave the others waiting), so the
	// client's fetch limits (kgo.FetchMaxBytes,
	// kgo.FetchMaxPartitionBytes) bound it, and the next poll waits for
	// every partition of this one. Default 1: a poll's records one after
	// another.
	Concurrency int
	// Logger receives commit failures, fetch errors, and the client's
	// warnings and errors (a broker it cannot reach, a group it cannot
	// join): one line of a kind every 10 s, the next one counting those
	// left out (similar_not_logged), so that an outage does not flood it.
	// Default slog.Default().
	Logger *slog.Logger
	// Options are extra franz-go client options (TLS, SASL, ...), applied
	// after the Consumer's own. Of those, kgo.FetchMaxWait is 250 ms
	// rather than kgo's 5 s: it bounds how late a partition resumes after
	// a retry's delay; and kgo.FetchIsolationLevel is read_committed
	// rather than kgo's read_uncommitted: a record of a transaction its
	// producer aborted is never handed over (applied, it could not be
	// taken back), nor one of a transaction still open. kgo.OnPartitionsCallbackBlocked,
	// kgo.OnPartitionsRevoked and kgo.OnPartitionsLost are the Consumer's
	// own and cannot be replaced (a poll yields to a rebalance; a
	// partition given up is no longer held for a retry): the Consumer's
	// are applied after Options.
	Options []kgo.Opt
	// StopTimeout bounds how long Run goes on talking to the cluster
	// once its context ends: the last commit and the group leave. A
	// cluster that hangs instead of failing (a frozen broker, a dropped
	// network path) held them for as long as the client retried, minutes.
	// Past it the client's requests are cancelled: records of a commit
	// cut short come again to the partition's next owner, decided as
	// Duplicates, and the group drops the member at its session timeout.
	// Default 10 s. A kgo.WithContext in Options replaces the bound.
	StopTimeout time.Duration
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
	// logs summarizes lines that every record of a producer may cause
	// alike (a Map that panics on them).
	logs *lograte.Limiter
}

// New returns a Consumer; it connects when Run starts.
func New(cfg *Config) (*Consumer, error) {
	switch {
	case cfg == nil:
		return nil, fmt.Errorf("%w: kafka: no Config", idem.ErrInvalidConfig)
	case len(cfg.Brokers) == 0:
		return nil, fmt.Errorf("%w: kafka: Config.Brokers is required", idem.ErrInvalidConfig)
	case cfg.Group == "":
		return nil, fmt.Errorf("%w: kafka: Config.Group is required", idem.ErrInvalidConfig)
	case len(cfg.Topics) == 0:
		return nil, fmt.Errorf("%w: kafka: Config.Topics is required", idem.ErrInvalidConfig)
	case cfg.Handler == nil:
		return nil, fmt.Errorf("%w: kafka: Config.Handler is required", idem.ErrInvalidConfig)
	}
	c := &Consumer{cfg: *cfg, logs: lograte.New(10 * time.Second)}
	if c.cfg.Map == nil {
		c.cfg.Map = DefaultMap
	}
	if c.cfg.MaxPoll < 0 {
		return nil, fmt.Errorf("%w: kafka: MaxPoll %d is negative", idem.ErrInvalidConfig, c.cfg.MaxPoll)
	}
	if c.cfg.MaxPoll == 0 {
		c.cfg.MaxPoll = 500
	}
	if c.cfg.Batch < 0 {
		return nil, fmt.Errorf("%w: kafka: Batch %d is negative", idem.ErrInvalidConfig, c.cfg.Batch)
	}
	if c.cfg.Concurrency < 0 {
		return nil, fmt.Errorf("%w: kafka: Concurrency %d is negative", idem.ErrInvalidConfig, c.cfg.Concurrency)
	}
	if c.cfg.StopTimeout < 0 {
		return nil, fmt.Errorf("%w: kafka: StopTimeout %s is negative", idem.ErrInvalidConfig, c.cfg.StopTimeout)
	}
	if c.cfg.StopTimeout == 0 {
		c.cfg.StopTimeout = 10 * time.Second
	}
	if _, ok := c.cfg.Handler.(idem.BatchDeliveryHandler); !ok && c.cfg.Batch > 1 {
		return nil, fmt.Errorf("%w: kafka: Batch %d needs a Handler that implements idem.BatchDeliveryHandler (idem.Consumer does; %T decides one record at a time)", idem.ErrInvalidConfig, c.cfg.Batch, c.cfg.Handler)
	}
	if c.cfg.Logger == nil {
		c.cfg.Logger = slog.Default()
	}
	return c, nil
}

// fetchMaxWait is the default kgo.FetchMaxWait of a Consumer's client.
const fetchMaxWait = 250 * time.Millisecond

// Run consumes until ctx is done, and returns ctx's error, or the error
// of an invalid client configuration. Failures of the brokers (fetch
// errors, an unreachable cluster) are logged and retried by the client. On
// return every partition's records whose outcome was durable have been
// committed up to its first record still to be retried (unless the
// commit itself failed, in which case those records are redelivered and
// are Duplicates), and nothing past it: records a batch decided behind a
// retry are durable but not committed, and whoever consumes the partition
// next hands them to the Handler again.
func (c *Consumer) Run(ctx context.Context) error {
	// A rebalance waiting on this member's poll says so: the poll stops
	// at its next record or batch, commits what it settled and lets the
	// rebalance through.
	hurry := newYield()
	blocked := func(context.Context, *kgo.Client) { hurry.raise() }
	// A partition revoked or lost is no longer this member's to hold for
	// a retry: its pause would outlive the assignment (kgo keeps pauses),
	// and should it come back, it would not be fetched until the old
	// retry's time although its new owner may have settled the record.
	h := &holds{at: map[partition]time.Time{}}
	gone := func(_ context.Context, cl *kgo.Client, lost map[string][]int32) { h.forget(cl, lost) }
	own := []kgo.Opt{kgo.OnPartitionsCallbackBlocked(blocked), kgo.OnPartitionsRevoked(gone), kgo.OnPartitionsLost(gone)}
	// The client's requests (the last commit, the leave in Close) end
	// StopTimeout after ctx does, whether the cluster answers or not.
	cctx, cancelClient := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelClient()
	stopWatch := context.AfterFunc(ctx, func() { time.AfterFunc(c.cfg.StopTimeout, cancelClient) })
	defer stopWatch()
	opts := append([]kgo.Opt{
		kgo.WithContext(cctx),
		kgo.SeedBrokers(c.cfg.Brokers...),
		kgo.ConsumerGroup(c.cfg.Group),
		kgo.ConsumeTopics(c.cfg.Topics...),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		// A partition resumed after a retry's delay is fetched once the
		// fetch already waiting on the others returns: at most this late
		// (kgo's default is 5 s).
		kgo.FetchMaxWait(fetchMaxWait),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		// The client's own warnings and errors (a broker it cannot
		// reach, a group it cannot join) go to Logger; a kgo.WithLogger
		// in Options replaces this.
		kgo.WithLogger(kgoLogger{c.cfg.Logger, c.logs}),
	}, c.cfg.Options...)
	opts = append(opts, own...)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("kafka: client: %w", err)
	}
	defer func() {
		cl.AllowRebalance() // Close waits for a blocked rebalance otherwise
		cl.Close()
	}()
	return c.loop(ctx, cl, hurry, h)
}

// holds is when each partition paused for a retry is due. The loop holds
// and resumes partitions while rebalances are blocked; a revocation
// forgets them from kgo's callback, between polls.
type holds struct {
	mu sync.Mutex
	at map[partition]time.Time
}

// forget resumes the partitions given up (revoked or lost) that were held,
// and drops them.
func (h *holds) forget(cl *kgo.Client, gone map[string][]int32) {
	h.mu.Lock()
	resume := map[string][]int32{}
	for topic, parts := range gone {
		for _, p := range parts {
			if _, ok := h.at[partition{topic, p}]; ok {
				delete(h.at, partition{topic, p})
				resume[topic] = append(resume[topic], p)
			}
		}
	}
	h.mu.Unlock()
	if len(resume) > 0 {
		cl.ResumeFetchPartitions(resume)
	}
}

// kgoLogger passes franz-go's warnings and errors to a slog.Logger, one
// line of a message every interval of logs: an unreachable cluster makes
// the client say the same every few hundred milliseconds (a connection it
// cannot open, a group loop that failed), which would bury the cause.
type kgoLogger struct {
	l    *slog.Logger
	logs *lograte.Limiter
}

// Level implements kgo.Logger.
func (kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelWarn }

// Log implements kgo.Logger.
func (k kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	lvl := slog.LevelWarn
	if level == kgo.LogLevelError {
		lvl = slog.LevelError
	}
	ok, n := k.logs.Allow(msg)
	if !ok {
		return
	}
	if n > 0 {
		keyvals = append(keyvals, "similar_not_logged", n)
	}
	k.l.Log(context.Background(), lvl, "kafka: "+msg, keyvals...)
}

// partition names a topic's partition.
type partition struct {
	topic string
	part  int32
}

// retry is a record whose verdict asked for another try after a delay.
type retry struct {
	rec   *kgo.Record
	after time.Duration
}

// member is the state of one Run.
type member struct {
	*Consumer
	cl    *kgo.Client
	held  *holds // partitions paused for a retry
	hurry *yield // a rebalance waits on the poll
	// stop is closed when the poll's handling is to end: Run stopping, or
	// a rebalance waiting on it. It ends a delivery's wait for the store.
	stop <-chan struct{}

	mu sync.Mutex // guards tries and ahead: partitions are handled at once with Concurrency
	// tries counts, per partition and offset, the deliveries of records
	// that failed and are not settled: the one its partition retries and
	// those after it that a batch decided and that failed too. Like
	// ahead, an entry is checked by the record's stamp.
	tries map[partition]map[int64]tried
	// ahead holds, per partition, the records a batch decided durably
	// after a record of their partition that is to be retried: they come
	// again with the retry, and are then settled without being handled a
	// second time (a decode failure would be dead-lettered again, a dead
	// letter re-parked). A record is known by its offset and checked by
	// its leader epoch and timestamp, so that another record at the same
	// offset (a truncated log, a recreated topic) is handled.
	ahead map[partition]map[int64]stamp
}

// stamp tells apart two records at one offset of a partition.
type stamp struct {
	epoch int32
	ts    int64 // Unix milliseconds, Kafka's precision
}

func stampOf(r *kgo.Record) stamp { return stamp{r.LeaderEpoch, r.Timestamp.UnixMilli()} }

// tried is how many times the record with the stamp was delivered.
type tried struct {
	stamp
	n int
}

func (c *Consumer) loop(ctx context.Context, cl *kgo.Client, hurry *yield, held *holds) error {
	m := &member{Consumer: c, cl: cl, hurry: hurry, held: held, tries: map[partition]map[int64]tried{}, ahead: map[partition]map[int64]stamp{}}
	maxPoll := c.cfg.MaxPoll
	var idle time.Duration // the pause after a poll of errors only
	if c.cfg.Concurrency > 1 {
		// Everything fetched: under a backlog a poll of MaxPoll records
		// would hold one partition's and leave nothing to handle at once.
		maxPoll = -1
	}
	for {
		pctx, cancel := m.pollContext(ctx)
		fetches := cl.PollRecords(pctx, maxPoll)
		cancel()
		if ctx.Err() != nil {
			cl.AllowRebalance()
			return ctx.Err()
		}
		if fetches.IsClientClosed() {
			return errors.New("kafka: client closed")
		}
		failed := false
		for _, fe := range fetches.Errors() {
			if !errors.Is(fe.Err, context.Canceled) && !errors.Is(fe.Err, context.DeadlineExceeded) {
				failed = true
				// Per partition every poll while the cluster is down:
				// one line per topic every 10 s.
				c.logs.Warn(c.cfg.Logger, fe.Topic, "kafka: fetch error", slog.String("topic", fe.Topic), slog.Int("partition", int(fe.Partition)), slog.Any("error", fe.Err))
			}
		}
		m.prune(fetches)
		var endPoll func()
		m.stop, endPoll = m.stopping(ctx)
		var (
			done    []*kgo.Record
			retries []retry
			stopped bool
		)
		if c.cfg.Concurrency > 1 {
			done, retries, stopped = m.handlePartitions(ctx, fetches)
		} else {
			done, retries, stopped = m.handleRecords(ctx, fetches.Records())
		}
		endPoll()
		if c.cfg.FaultHook != nil {
			c.cfg.FaultHook(FaultBeforeCommit)
		}
		if len(done) > 0 {
			if err := cl.CommitRecords(context.WithoutCancel(ctx), done...); err != nil {
				c.logs.Warn(c.cfg.Logger, "", "kafka: commit failed; a later commit covers the records, or, should their partitions move first, they are redelivered as duplicates", slog.Any("error", err))
			}
		}
		m.hold(retries)
		m.resumeDue()
		cl.AllowRebalance()
		m.hurry.reset()
		if stopped {
			return ctx.Err()
		}
		// A poll of errors only: some the client returns at once, poll
		// after poll, for as long as they last (a topic recreated under
		// the member, an authorization withdrawn): without a pause the
		// loop spun on them.
		if !failed || fetches.NumRecords() > 0 {
			idle = 0
			continue
		}
		idle = min(max(2*idle, 50*time.Millisecond), time.Second)
		t := time.NewTimer(idle)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// yield is a rebalance waiting on the member's poll: raised from kgo's
// OnPartitionsCallbackBlocked, reset once the poll let it through.
type yield struct {
	mu sync.Mutex
	up bool
	ch chan struct{} // closed when raised
}

func newYield() *yield { return &yield{ch: make(chan struct{})} }

// raise says a rebalance waits.
func (y *yield) raise() {
	y.mu.Lock()
	defer y.mu.Unlock()
	if !y.up {
		y.up = true
		close(y.ch)
	}
}

// raised reports whether a rebalance waits.
func (y *yield) raised() bool {
	y.mu.Lock()
	defer y.mu.Unlock()
	return y.up
}

// done returns a channel closed once a rebalance waits.
func (y *yield) done() <-chan struct{} {
	y.mu.Lock()
	defer y.mu.Unlock()
	return y.ch
}

// reset forgets the rebalance, let through.
func (y *yield) reset() {
	y.mu.Lock()
	defer y.mu.Unlock()
	if y.up {
		y.up, y.ch = false, make(chan struct{})
	}
}

// stopping returns the channel that ends the waits of a poll's deliveries
// for the store (see member.stop): closed when ctx ends or a rebalance
// waits on the poll; and the func that ends the poll, to call once its
// records are decided.
func (m *member) stopping(ctx context.Context) (<-chan struct{}, func()) {
	stop, end := make(chan struct{}), make(chan struct{})
	rebalance := m.hurry.done()
	go func() {
		select {
		case <-ctx.Done():
		case <-rebalance:
		case <-end:
			return
		}
		close(stop)
	}()
	return stop, func() { close(end) }
}

// hold rewinds the partition of every retry to its record and pauses it
// until the retry is due (a retry at once is not paused). It runs while
// the poll still blocks rebalances, and after the commit, as
// kgo.Client.SetOffsets requires.
func (m *member) hold(retries []retry) {
	if len(retries) == 0 {
		return
	}
	offsets := map[string]map[int32]kgo.EpochOffset{}
	paused := map[string][]int32{}
	now := time.Now()
	m.held.mu.Lock()
	for _, rt := range retries {
		r := rt.rec
		if offsets[r.Topic] == nil {
			offsets[r.Topic] = map[int32]kgo.EpochOffset{}
		}
		offsets[r.Topic][r.Partition] = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset}
		if rt.after > 0 {
			paused[r.Topic] = append(paused[r.Topic], r.Partition)
			m.held.at[partition{r.Topic, r.Partition}] = now.Add(rt.after)
		}
	}
	m.held.mu.Unlock() // kgo is called without it: its callbacks take it
	if len(paused) > 0 {
		// Paused first: no fetch starts at the rewound offset meanwhile.
		m.cl.PauseFetchPartitions(paused)
	}
	m.cl.SetOffsets(offsets)
}

// resumeDue resumes the held partitions whose retry is due.
func (m *member) resumeDue() {
	now := time.Now()
	resume := map[string][]int32{}
	m.held.mu.Lock()
	for p, h := range m.held.at {
		if !h.After(now) {
			resume[p.topic] = append(resume[p.topic], p.part)
			delete(m.held.at, p)
		}
	}
	m.held.mu.Unlock()
	if len(resume) > 0 {
		m.cl.ResumeFetchPartitions(resume)
	}
}

// pollContext returns the context of the next poll: ctx, ending when the
// next retry is due if a partition is held.
func (m *member) pollContext(ctx context.Context) (context.Context, context.CancelFunc) {
	var next time.Time
	m.held.mu.Lock()
	defer m.held.mu.Unlock()
	for _, due := range m.held.at {
		if next.IsZero() || due.Before(next) {
			next = due
		}
	}
	if next.IsZero() {
		return ctx, func() {}
	}
	return context.WithDeadline(ctx, next)
}

// handlePartitions decides each partition's records of fetches with
// handleRecords, up to Concurrency partitions at once.
func (m *member) handlePartitions(ctx context.Context, fetches kgo.Fetches) ([]*kgo.Record, []retry, bool) {
	var parts [][]*kgo.Record
	fetches.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) > 0 {
			parts = append(parts, p.Records)
		}
	})
	done := make([][]*kgo.Record, len(parts))
	retries := make([][]retry, len(parts))
	stopped := make([]bool, len(parts))
	sem := make(chan struct{}, m.cfg.Concurrency)
	var wg sync.WaitGroup
	for i, recs := range parts {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			done[i], retries[i], stopped[i] = m.handleRecords(ctx, recs)
		})
	}
	wg.Wait()
	return slices.Concat(done...), slices.Concat(retries...), slices.Contains(stopped, true)
}

// handleRecords decides recs in order, in batches when the Handler takes
// them. It returns the records settled, a prefix of every partition's, the
// first record of each partition that is to be retried (the partition's
// records after it are left for the retry), and whether ctx ended before
// all were decided.
func (m *member) handleRecords(ctx context.Context, recs []*kgo.Record) ([]*kgo.Record, []retry, bool) {
	bh, batched := m.cfg.Handler.(idem.BatchDeliveryHandler)
	batched = batched && m.cfg.Batch > 1
	var (
		done    []*kgo.Record
		retries []retry
		skip    = map[partition]bool{} // retrying: the rest waits
		// gaps holds, per partition, the aggregates (as the ordering
		// guard keys them) with a record held for a sequence gap, and
		// the highest sequence held.
		gaps = map[partition]map[string]int64{}
	)
	for len(recs) > 0 {
		if ctx.Err() != nil {
			return done, retries, true
		}
		if m.hurry.raised() {
			// Yield to the rebalance: each partition's unhandled records
			// come again from the first, or go to its next owner.
			return done, append(retries, rewinds(recs, skip)...), false
		}
		// chunk is the next records in order, of one partition; those
		// decided durably behind an earlier retry are settled as they
		// were, the others (handled) go to the handler, up to Batch of
		// them. One partition's: the Consumer holds a batch's later
		// records of an aggregate behind one to be retried, and to it
		// every keyless record is of one aggregate, so a batch mixing
		// partitions made another partition's keyless records wait for
		// this one's retry, and held that partition too.
		var (
			chunk   []*kgo.Record
			ahead   []bool
			handled []int
		)
		for len(recs) > 0 && (len(handled) == 0 || batched && len(handled) < m.cfg.Batch) {
			r := recs[0]
			p := partition{r.Topic, r.Partition}
			if skip[p] && !m.fillsGap(gaps[p], r) {
				recs = recs[1:]
				continue
			}
			if len(chunk) > 0 && (chunk[0].Topic != r.Topic || chunk[0].Partition != r.Partition) {
				break
			}
			recs = recs[1:]
			a := m.isAhead(p, r)
			if !a {
				handled = append(handled, len(chunk))
			}
			chunk, ahead = append(chunk, r), append(ahead, a)
		}
		vs := make([]idem.Verdict, len(chunk))
		attempts := make([]int, len(chunk))
		msgs := make([]*idem.Message, len(chunk))
		for i := range chunk {
			vs[i].Ack = ahead[i]
		}
		if len(handled) > 0 {
			ds := make([]*idem.Delivery, len(handled))
			for j, i := range handled {
				ds[j] = m.delivery(chunk[i])
				// Stopping Run during an outage ends the wait for the
				// store: the delivery comes back held (no attempt) and
				// its partition is not committed past it. Without it,
				// Run returned only once the store answered again. A
				// rebalance waiting on the poll ends it too, or it
				// waited for the store, and the group with it.
				ds[j].Stopping = m.stop
				attempts[i], msgs[i] = ds[j].Attempt, ds[j].Msg
			}
			for j, v := range m.decide(ctx, bh, batched, ds) {
				vs[handled[j]] = v
			}
		}
		for i, r := range chunk {
			p := partition{r.Topic, r.Partition}
			if msg := msgs[i]; !vs[i].Ack && msg != nil && msg.Seq > 0 && errors.Is(vs[i].Err, idem.ErrGap) {
				// Held for a gap: the events it waits for come later in
				// this partition, if at all (a key has one partition).
				if gaps[p] == nil {
					gaps[p] = map[string]int64{}
				}
				k := m.aggregateKey(msg.AggregateID)
				gaps[p][k] = max(gaps[p][k], msg.Seq)
			}
			switch {
			case skip[p]:
				// After a record of its partition that is to be retried:
				// not committed, delivered again after it, and then not
				// handled again if its outcome is durable; if it failed
				// too, this was one of its attempts (waiting behind an
				// earlier record of its aggregate is not).
				switch {
				case vs[i].Ack && !ahead[i]:
					m.aheadOf(p, r)
				case !vs[i].Ack && !noAttempt(vs[i].Err):
					m.failed(p, r, attempts[i])
				}
			case vs[i].Ack:
				if ahead[i] {
					m.forgetAhead(p, r.Offset)
				}
				m.settled(p, r)
				done = append(done, r)
			default:
				// The partition's first record not settled. Waiting
				// behind a record of its aggregate later in the
				// partition but earlier in sequence is no attempt, nor
				// is a wait for the store that a stop or a rebalance
				// ended.
				if !noAttempt(vs[i].Err) {
					m.failed(p, r, attempts[i])
				}
				skip[p] = true
				retries = append(retries, retry{r, vs[i].RetryAfter})
			}
		}
	}
	return done, retries, false
}

// noAttempt reports whether err, of a verdict to retry, says that the
// record was not tried: it waited behind an earlier record of its
// aggregate, or for the store until the poll ended.
func noAttempt(err error) bool {
	return errors.Is(err, idem.ErrWaitsForAggregate) || verdicts.Unattempted(err)
}

// fillsGap reports whether r, a record behind a retry of its partition,
// may fill a gap held there (see gaps in handleRecords): it is of an
// aggregate held for a gap and has a lower sequence than the one held, so
// it is due before it. It is then decided at once rather than after the
// gapped record, which would otherwise wait for it until the gap policy's
// deadline and be dead-lettered, and the aggregate's later events with
// it. Deciding it ahead of the partition's order keeps the aggregate's
// order: the guard applies its events in sequence order. A record of such
// an aggregate without a sequence is not ordered by the guard, only by
// the partition: once one is passed, nothing more of its aggregate goes
// ahead.
func (m *member) fillsGap(held map[string]int64, r *kgo.Record) bool {
	if len(held) == 0 {
		return false
	}
	msg, err := m.mapRecord(r)
	if err != nil {
		return false
	}
	k := m.aggregateKey(msg.AggregateID)
	top, ok := held[k]
	switch {
	case !ok:
		return false
	case msg.Seq == 0:
		delete(held, k)
		return false
	}
	return msg.Seq < top
}

// aggregateKey is id as the Handler's ordering guard keys it.
func (m *member) aggregateKey(id string) string {
	if k, ok := m.cfg.Handler.(idem.AggregateKeyer); ok {
		return k.AggregateKey(id)
	}
	return id
}

// rewinds returns, for each partition of recs not in skip, a retry at
// once of its first record: hold rewinds the partition to it.
func rewinds(recs []*kgo.Record, skip map[partition]bool) []retry {
	var out []retry
	seen := map[partition]bool{}
	for _, r := range recs {
		if p := (partition{r.Topic, r.Partition}); !skip[p] && !seen[p] {
			seen[p] = true
			out = append(out, retry{rec: r})
		}
	}
	return out
}

// delivery maps r, counting its attempt.
func (m *member) delivery(r *kgo.Record) *idem.Delivery {
	d := &idem.Delivery{Raw: r.Value, Source: fmt.Sprintf("kafka:%s/%d@%d", r.Topic, r.Partition, r.Offset), Attempt: 1}
	m.mu.Lock()
	if t, ok := m.tries[partition{r.Topic, r.Partition}][r.Offset]; ok && t.stamp == stampOf(r) {
		d.Attempt = t.n + 1
	}
	m.mu.Unlock()
	d.Msg, d.DecodeErr = m.mapRecord(r)
	return d
}

// mapRecord is Config.Map through verdicts.Decode: a panic or no message
// is a decode failure.
func (m *member) mapRecord(r *kgo.Record) (*idem.Message, error) {
	return verdicts.Decode(m.logs, m.cfg.Logger, "kafka", fmt.Sprintf("%s/%d@%d", r.Topic, r.Partition, r.Offset),
		func() (*idem.Message, error) { return m.cfg.Map(r) })
}

// settled forgets the tries of r, settled, and of p's records before it.
func (m *member) settled(p partition, r *kgo.Record) {
	m.mu.Lock()
	defer m.mu.Unlock()
	forgetBefore(m.tries, p, r.Offset+1)
}

// forgetBefore deletes the entries of p in byOffset below offset.
func forgetBefore[V any](byOffset map[partition]map[int64]V, p partition, offset int64) {
	for off := range byOffset[p] {
		if off < offset {
			delete(byOffset[p], off)
		}
	}
	if len(byOffset[p]) == 0 {
		delete(byOffset, p)
	}
}

// decide hands ds to the Handler, in one call when batched, and returns
// a verdict for each.
func (m *member) decide(ctx context.Context, bh idem.BatchDeliveryHandler, batched bool, ds []*idem.Delivery) []idem.Verdict {
	ctx = context.WithoutCancel(ctx) // decided and committed even if ctx ends now
	if !batched {
		vs := make([]idem.Verdict, len(ds))
		for i, d := range ds {
			vs[i] = m.cfg.Handler.HandleDelivery(ctx, d)
		}
		return vs
	}
	return verdicts.Check(bh.HandleDeliveries(ctx, ds), len(ds), m.cfg.Logger, "kafka")
}

// aheadOf records that r, of p, was decided durably behind a retry.
func (m *member) aheadOf(p partition, r *kgo.Record) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.ahead[p] == nil {
		m.ahead[p] = map[int64]stamp{}
	}
	m.ahead[p][r.Offset] = stampOf(r)
}

// isAhead reports whether r, of p, was decided durably behind a retry.
func (m *member) isAhead(p partition, r *kgo.Record) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.ahead[p][r.Offset]
	return ok && s == stampOf(r)
}

// prune forgets the tries and ahead records of each partition of fetches
// that lie before its first record fetched: settled since (by another
// member, while the partition was assigned elsewhere) and never delivered
// to this member again. It relies on SetOffsets discarding every fetch
// buffered or in flight (as kgo does), so that after a rewind the
// partition's first record polled is the one rewound to.
func (m *member) prune(fetches kgo.Fetches) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.tries) == 0 && len(m.ahead) == 0 {
		return
	}
	fetches.EachPartition(func(fp kgo.FetchTopicPartition) {
		if len(fp.Records) == 0 {
			return
		}
		p, first := partition{fp.Topic, fp.Partition}, fp.Records[0].Offset
		forgetBefore(m.tries, p, first)
		forgetBefore(m.ahead, p, first)
	})
}

// forgetAhead forgets the record at offset of p, settled now.
func (m *member) forgetAhead(p partition, offset int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.ahead[p], offset)
	if len(m.ahead[p]) == 0 {
		delete(m.ahead, p)
	}
}

// failed records that r, of p, was tried attempt times.
func (m *member) failed(p partition, r *kgo.Record, attempt int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.tries[p] == nil {
		m.tries[p] = map[int64]tried{}
	}
	m.tries[p][r.Offset] = tried{stampOf(r), attempt}
}

// DefaultMap reads the message ID from the idem-id header, the aggregate
// from the record key, the sequence from idem-seq and the type from
// idem-type; Stream is the topic, Payload the value and Time the record's
// timestamp. Every other header goes to Headers (the last value of a
// repeated key), so metadata such as a producer's trace context
// (traceparent) reaches the handler and the hooks. A record without
// idem-id is a decode failure: a topic/partition/offset fallback would give
// a producer's retry, a new record, a new ID, hiding the duplicate.
//
// A key that is not a valid aggregate ID (binary, such as a big-endian
// integer, or longer than idem.MaxIDLen) leaves AggregateID empty when the
// record has no idem-seq, which is all the ordering guard needs it for; a
// record with idem-seq and such a key is a decode failure (map it with
// Config.Map).
func DefaultMap(r *kgo.Record) (*idem.Message, error) {
	msg := &idem.Message{Stream: r.Topic, AggregateID: string(r.Key), Payload: r.Value, Time: r.Timestamp}
	// Kafka lets a record repeat a header; two different values of one of
	// idem's would leave the message's ID, Type or sequence to whichever
	// came last: refused instead.
	seen := map[string][]byte{}
	for _, h := range r.Headers {
		switch h.Key {
		case HeaderID, HeaderType, HeaderSeq:
			if v, ok := seen[h.Key]; ok && !bytes.Equal(v, h.Value) {
				return nil, fmt.Errorf("%w: kafka: record %s/%d@%d has two %s headers, %s and %s", idem.ErrInvalidMessage, r.Topic, r.Partition, r.Offset, h.Key, errtext.Quote(v), errtext.Quote(h.Value))
			}
			seen[h.Key] = h.Value
		}
		switch h.Key {
		case HeaderID:
			msg.ID = string(h.Value)
		case HeaderType:
			msg.Type = string(h.Value)
		case HeaderSeq:
			seq, err := strconv.ParseInt(string(h.Value), 10, 64)
			if err != nil || seq < 1 {
				return nil, fmt.Errorf("%w: kafka: record %s/%d@%d: %s header %s is not a positive integer", idem.ErrInvalidMessage, r.Topic, r.Partition, r.Offset, HeaderSeq, errtext.Quote(h.Value))
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
		return nil, fmt.Errorf("%w: kafka: record %s/%d@%d has no %s header", idem.ErrInvalidMessage, r.Topic, r.Partition, r.Offset, HeaderID)
	}
	if msg.Seq > 0 && len(r.Key) == 0 {
		return nil, fmt.Errorf("%w: kafka: record %s/%d@%d (%s %s) has a %s header but no key: the aggregate a sequence counts in is the record key",
			idem.ErrInvalidMessage, r.Topic, r.Partition, r.Offset, HeaderID, errtext.Quote(msg.ID), HeaderSeq)
	}
	err := msg.Validate()
	if ve := (*idem.ValidationError)(nil); msg.Seq == 0 && errors.As(err, &ve) && ve.Field == "AggregateID" {
		msg.AggregateID = ""
		err = msg.Validate()
	}
	if err != nil {
		return nil, err
	}
	return msg, nil
}
