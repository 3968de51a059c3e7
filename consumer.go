package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/dlpages"
	"github.com/idemhq/idem/internal/lograte"
	"github.com/idemhq/idem/internal/outage"
)

// Class is how a failed delivery is treated.
type Class uint8

const (
	// Retriable failures are delivered again after a backoff.
	Retriable Class = iota
	// PermanentClass failures cannot succeed by retrying: they are
	// dead-lettered at once.
	PermanentClass
)

// errInFlightAtLastAttempt is the reason of the dead letter of a message
// still in flight on the broker's last delivery.
var errInFlightAtLastAttempt = errors.New("idem: still in flight on the broker's last delivery: another worker holds its lease, or a failed attempt's retry is not due")

// Dead-letter classes, stored with every dead letter.
const (
	DeadLetterPermanent = "permanent" // the error was permanent (Permanent, validation, unknown type, final gap)
	DeadLetterConflict  = "conflict"  // same ID, different payload
	DeadLetterDecode    = "decode"    // the broker record did not map to a message
	DeadLetterExhausted = "exhausted" // retriable, but out of attempts
)

// ConsumerConfig configures a Consumer. The zero value is valid.
type ConsumerConfig struct {
	// Classify decides whether a handler error is worth retrying. It is
	// asked only about errors idem does not already know to be permanent
	// (Permanent, validation errors, payload conflicts, unknown types
	// and final gaps always are). Default: every other error is Retriable.
	Classify func(err error) Class
	// Backoff shapes the delay before a retriable failure is delivered
	// again: exponential with full jitter. Default: 50 ms doubling up to
	// 1 s; set Max higher for slow dependencies. Its Retries is not used
	// here: MaxAttempts bounds a Consumer's retries.
	Backoff Backoff
	// MaxAttempts dead-letters a retriable failure once the broker has
	// delivered the message this many times; a message waiting under
	// GapWait for its aggregate's missing event is not failing, and
	// Ordering.WaitFor alone bounds its wait. 0, the default, retries
	// without limit: where losing an event is worse than waiting, a stuck
	// message should page someone (alert on the age of the oldest
	// unacknowledged message or on repeated "will retry" logs), not
	// silently turn into a dead letter. A broker's own delivery limit
	// (JetStream MaxDeliver) still ends in a dead letter: see
	// Delivery.LastAttempt.
	MaxAttempts int
	// ProbeBackoff spaces the probes of a store found down: Base
	// doubling up to Max, jittered. Defaults 100 ms and 1 s, so work
	// resumes within about a second of the store answering. Its Retries
	// and Multiplier are not used.
	ProbeBackoff Backoff
	// Logger receives retries and dead letters (repeats of one kind of
	// failure are summarized: one line per kind every 10 s, with the
	// count of those not written), and an outage's start and end. Default
	// slog.Default().
	Logger *slog.Logger
	// Hooks receive every verdict (HookVerdict) and the outages of the
	// store (HookOutage); each must implement one of them (the metrics
	// package's hook implements both).
	Hooks []Hook
	// StopGrace bounds how long a delivery under way may run on once its
	// adapter stops (Delivery.Stopping closes, as it does in every adapter
	// of this module): past it, its transaction is cancelled and rolled
	// back, and its verdict is a retry whose Err matches ErrStopped, no
	// attempt of the message, which the broker delivers again as after a
	// crash. This is what ends a stop while the store hangs without
	// failing (a frozen server, a network path that dropped without a
	// reset), which no error would report for minutes. One grace counts
	// from the stop for every delivery decided after it. The Kafka
	// adapter stops its deliveries at a rebalance too (the partitions may
	// move): one running StopGrace into it is cut the same way. Default
	// 10 s; negative waits for ever. A LeaseConsumer cuts its store
	// writes the same way (a cut claim the store did take is taken up by
	// this process's next delivery of the message, or waits for its lease
	// after a restart, as after a crash), never a call under way; the
	// write recording a call's result gets StopGrace of its own, so its
	// stop may take twice StopGrace.
	StopGrace time.Duration
	// SlowWarning logs a WARN for a delivery still undecided that long
	// after it began (its deliveries repeat on one line per 10 s, with a
	// count): a store that hangs without failing shows nowhere else, no
	// error and no outage, while its consumer stops making progress. Set
	// it above the longest a handler should take. Default 1 minute;
	// negative: never.
	SlowWarning time.Duration
	// ReplayClaimTimeout is how long a dead letter may stay claimed by a
	// replay (state replaying) before a Replay run takes it for a claim
	// left by a consumer that crashed, and requests it again. Set it
	// above the longest a message may run. Default 15 minutes.
	ReplayClaimTimeout time.Duration
}

// logEvery is how often a Consumer writes a line of one kind of failure
// that repeats: once per kind and interval, with the count left out.
const logEvery = 10 * time.Second

// defaultReplayClaimTimeout is ConsumerConfig.ReplayClaimTimeout's default.
const defaultReplayClaimTimeout = 15 * time.Minute

// defaultStopGrace is ConsumerConfig.StopGrace's default.
const defaultStopGrace = 10 * time.Second

// defaultSlowWarning is ConsumerConfig.SlowWarning's default.
const defaultSlowWarning = time.Minute

// Consumer decides the fate of broker deliveries for one handler: it
// processes each through a Processor, asks for a retry with a backoff when
// the failure may pass, and dead-letters it otherwise, acknowledging only
// once the outcome or the dead letter is committed. It implements
// DeliveryHandler, which the broker adapters (Kafka, JetStream, RabbitMQ,
// the Watermill bridge) drive. It is safe for concurrent use.
type Consumer[TTx any] struct {
	*deliveries
	proc *Processor[TTx]
	h    *Handler[TTx]
}

// deliveries is the decision logic Consumer and LeaseConsumer share.
//
// When the store is down, a delivery is not the message's failure: it is
// held (the adapter's worker waits in HandleDelivery, so it pulls nothing
// new and, on JetStream, keeps the message in progress) until a probe
// finds the store back, and then processed again, no attempt counted.
type deliveries struct {
	name string
	// process runs msg; for InFlight it may say how long a retry would
	// be refused anyway (a failed lease's next attempt), else 0.
	process func(ctx context.Context, msg *Message) (Outcome, time.Duration, error)
	// rearm, when set, makes a message failed for good claimable again
	// before its dead letter is replayed (lease mode).
	rearm     func(ctx context.Context, messageID string) error
	ordering  *Ordering // the handler's, for the order of retries and replays
	dl        driver.DeadLetterStore
	cfg       ConsumerConfig
	onVerdict []HookVerdict
	onOutage  []HookOutage
	watch     *outage.Watch    // nil: the store cannot be probed
	logs      *lograte.Limiter // summarizes repeated failure lines
	// cuts is set when a delivery still running StopGrace after its
	// adapter's stop is cancelled (a Consumer's transaction, rolled back;
	// a LeaseConsumer's store writes, never its call).
	cuts  bool
	stops stopClock // when each stop was first seen

	downMu sync.Mutex
	downs  []downtime // the store's recent outages, oldest first (GapWait only)
}

// downtime is an outage of the store that a consumer saw, on the host's
// clock.
type downtime struct{ from, to time.Time }

// maxDowntimes bounds how many outages a consumer remembers for the
// waits of GapWait.
const maxDowntimes = 64

// newDeliveries checks cfg and returns the shared logic for the handler
// named name, whose store is drv: when it is a driver.Prober, an outage of
// it pauses the consumer.
func newDeliveries(name string, process func(context.Context, *Message) (Outcome, time.Duration, error), dl driver.DeadLetterStore, drv any, cfg *ConsumerConfig) (*deliveries, error) {
	c := &deliveries{name: name, process: process, dl: dl, logs: lograte.New(logEvery)}
	if cfg != nil {
		c.cfg = *cfg
	}
	if c.cfg.MaxAttempts < 0 {
		return nil, fmt.Errorf("%w: MaxAttempts %d is negative", ErrInvalidConfig, c.cfg.MaxAttempts)
	}
	if c.cfg.ReplayClaimTimeout < 0 {
		return nil, fmt.Errorf("%w: ReplayClaimTimeout %s is negative", ErrInvalidConfig, c.cfg.ReplayClaimTimeout)
	}
	if c.cfg.ReplayClaimTimeout == 0 {
		c.cfg.ReplayClaimTimeout = defaultReplayClaimTimeout
	}
	if c.cfg.StopGrace == 0 {
		c.cfg.StopGrace = defaultStopGrace
	}
	if c.cfg.SlowWarning == 0 {
		c.cfg.SlowWarning = defaultSlowWarning
	}
	if c.cfg.Logger == nil {
		c.cfg.Logger = slog.Default()
	}
	if b := c.cfg.ProbeBackoff; b.Base < 0 || b.Max < 0 {
		return nil, fmt.Errorf("%w: ProbeBackoff %s..%s is negative", ErrInvalidConfig, b.Base, b.Max)
	}
	for i, hk := range c.cfg.Hooks {
		v, isVerdict := hk.(HookVerdict)
		o, isOutage := hk.(HookOutage)
		if !isVerdict && !isOutage {
			return nil, fmt.Errorf("%w: consumer hook %d (%T) implements neither HookVerdict nor HookOutage", ErrInvalidConfig, i, hk)
		}
		if isVerdict {
			c.onVerdict = append(c.onVerdict, v)
		}
		if isOutage {
			c.onOutage = append(c.onOutage, o)
		}
	}
	if p, ok := drv.(driver.Prober); ok {
		c.watch = outage.New(p, outage.Config{
			Component: "consumer " + strconv.Quote(name), Logger: c.cfg.Logger,
			Base: c.cfg.ProbeBackoff.Base, Max: c.cfg.ProbeBackoff.Max,
			OnChange: c.outageChanged,
			// Before any delivery resumes: one meeting a gap must find
			// the outage counted (creditOutages).
			OnEnd: func(ch outage.Change) { c.rememberOutage(time.Now(), ch.Duration) },
		})
	}
	return c, nil
}

// outageChanged tells the HookOutage hooks.
func (c *deliveries) outageChanged(ch outage.Change) {
	ev := &OutageEvent{Handler: c.name, Down: ch.Down, Cause: ch.Cause, Duration: ch.Duration}
	for _, hk := range c.onOutage {
		hk.OnOutage(context.Background(), ev)
	}
}

// rememberOutage records an outage of the store that lasted took and
// ended at end, for a handler that waits for gaps. It forgets outages
// that can no longer matter: those that ended before any wait still
// running began, even crediting it every outage kept.
func (c *deliveries) rememberOutage(end time.Time, took time.Duration) {
	o := c.ordering
	if o == nil || o.Gap != GapWait || took <= 0 {
		return
	}
	keep := o.WaitFor
	if keep <= 0 {
		keep = DefaultGapWait
	}
	c.downMu.Lock()
	defer c.downMu.Unlock()
	c.downs = append(c.downs, downtime{from: end.Add(-took), to: end})
	drop := max(len(c.downs)-maxDowntimes, 0)
	for _, d := range c.downs[drop:] {
		keep += d.to.Sub(d.from)
	}
	for drop < len(c.downs) && end.Sub(c.downs[drop].to) > keep {
		drop++
	}
	c.downs = append(c.downs[:0], c.downs[drop:]...)
}

// downSince is how long the store was down, by the outages this consumer
// saw, between since and now.
func (c *deliveries) downSince(since, now time.Time) time.Duration {
	c.downMu.Lock()
	defer c.downMu.Unlock()
	var down time.Duration
	for _, d := range c.downs {
		from, to := d.from, d.to
		if from.Before(since) {
			from = since
		}
		if to.After(now) {
			to = now
		}
		if to.After(from) {
			down += to.Sub(from)
		}
	}
	return down
}

// creditOutages gives a gap that waits under GapWait back the time the
// store was down during its wait, by the outages this consumer saw:
// nothing could be applied then, the missing message included, so an
// outage longer than WaitFor would otherwise turn every message waiting
// for one into a dead letter. WaitFor counts time with the store up: a
// final gap whose wait an outage cut short is retriable again, for what
// is left of it. The wait is measured from the error's Remaining (the
// store's clock) back on the host's, so clock skew does not enter.
func (c *deliveries) creditOutages(err error) error {
	var ge *GapError
	if !errors.As(err, &ge) || ge.Policy != GapWait || ge.Deadline.IsZero() {
		return err
	}
	now := time.Now()
	waited := ge.Deadline.Sub(ge.FirstSeen) - ge.Remaining
	down := c.downSince(now.Add(-waited), now)
	if down <= 0 {
		return err
	}
	ge.Deadline = ge.Deadline.Add(down)
	ge.Remaining += down
	ge.Final = ge.Remaining <= 0
	return err
}

// waitingForGap reports whether err is a retriable gap of GapWait: the
// message waits for its aggregate's missing event, which is not its
// failure, and WaitFor bounds that wait. MaxAttempts does not count such
// deliveries, or a handful of quick retries (Backoff's default is 50 ms to
// 1 s) would dead-letter a message whatever WaitFor says, as the lease
// processor's own attempt count already does not. A broker's delivery
// limit (Delivery.LastAttempt) still ends in a dead letter.
func waitingForGap(err error) bool {
	var ge *GapError
	// A gap whose sighting could not be recorded has no deadline: nothing
	// bounds its wait, so its deliveries count as failures.
	return errors.As(err, &ge) && ge.Policy == GapWait && !ge.Final && !ge.Deadline.IsZero()
}

// storeDown reports whether err, a processing failure, came from the
// store being down (a probe confirms it): the delivery then runs again
// once the store answers. An error that looks like an outage while the
// store answers the probe runs again once more after a short pause, if
// *again: a server going down can still answer on a pooled connection
// for a moment, and its first failures would otherwise count against
// their messages.
func (c *deliveries) storeDown(ctx context.Context, stop <-chan struct{}, err error, again *bool) bool {
	if err == nil || IsPermanent(err) || storeAnswered(err) || !c.watch.Suspect(err) {
		return false
	}
	if c.watch.Confirm(ctx, err) {
		return true
	}
	if !*again || ctx.Err() != nil || closed(stop) {
		return false
	}
	*again = false
	c.watch.Pause(ctx, stop)
	return true
}

// held is the verdict of a delivery that waited for its store, and whose
// wait ended before the store answered (the adapter stopped): no attempt
// of the message, which the broker delivers again.
func (c *deliveries) held(d *Delivery, waitErr, last error) Verdict {
	err := fmt.Errorf("%w: %w", ErrStoreUnavailable, waitErr)
	if last != nil {
		err = fmt.Errorf("%w: %w (last failure: %w)", ErrStoreUnavailable, waitErr, last)
	}
	if d != nil && d.LastAttempt && !d.replay {
		// The JetStream and RabbitMQ adapters requeue such a delivery
		// as a copy, and log an ERROR if they cannot.
		c.cfg.Logger.Warn("idem: stopped while the store was down, on the broker's last delivery: the adapter must requeue it, or the broker may not deliver it again",
			slog.String("handler", c.name), slog.String("source", d.Source), slog.Any("error", err))
	}
	attempt := 0
	if d != nil {
		attempt = d.Attempt
	}
	return Verdict{RetryAfter: c.cfg.Backoff.Delay(max(attempt-1, 0)), Err: err}
}

// NewConsumer returns a Consumer applying h through p, with dead letters in
// dl, normally the same driver as p's. A handler whose setup every message
// would fail on (an in-row handler without Ordering, an unknown gap
// policy, Ordering on a driver without driver.SequenceGuard) is refused
// with an error matching ErrInvalidConfig.
func NewConsumer[TTx any](p *Processor[TTx], h *Handler[TTx], dl driver.DeadLetterStore, cfg *ConsumerConfig) (*Consumer[TTx], error) {
	if p == nil || dl == nil {
		return nil, fmt.Errorf("%w: NewConsumer needs a processor and a dead-letter store", ErrInvalidConfig)
	}
	if err := checkHandler(h); err != nil {
		return nil, err
	}
	// A setup no message can pass is refused here, not retried with
	// every delivery (or dead-lettered as the messages' failure).
	if err := p.checkSetup(h); err != nil {
		return nil, err
	}
	d, err := newDeliveries(h.Name, func(ctx context.Context, msg *Message) (Outcome, time.Duration, error) {
		out, err := p.Process(ctx, h, msg)
		return out, 0, err
	}, dl, p.drv, cfg)
	if err != nil {
		return nil, err
	}
	d.ordering = h.Ordering
	d.cuts = true
	return &Consumer[TTx]{deliveries: d, proc: p, h: h}, nil
}

// HandleDelivery implements DeliveryHandler.
func (c *Consumer[TTx]) HandleDelivery(ctx context.Context, d *Delivery) Verdict {
	return c.handle(ctx, d)
}

// handle decides d and reports the verdict.
func (c *deliveries) handle(ctx context.Context, d *Delivery) Verdict {
	v := c.decide(ctx, d)
	c.report(ctx, d, v)
	return v
}

// report hands a verdict to the hooks.
func (c *deliveries) report(ctx context.Context, d *Delivery, v Verdict) {
	if len(c.onVerdict) == 0 {
		return
	}
	ev := &VerdictEvent{Handler: c.name, Verdict: v}
	if d != nil {
		ev.Attempt = d.Attempt
		if d.Msg != nil {
			ev.MessageID = d.Msg.ID
			ev.Message = d.Msg
		}
	}
	for _, hk := range c.onVerdict {
		hk.OnVerdict(ctx, ev)
	}
}

func (c *deliveries) decide(ctx context.Context, d *Delivery) Verdict {
	if d == nil {
		return Verdict{Err: fmt.Errorf("%w: nil delivery", ErrInvalidConfig), RetryAfter: c.cfg.Backoff.Delay(0)}
	}
	if d.Msg == nil || d.DecodeErr != nil {
		err := d.DecodeErr
		if err == nil {
			err = errors.New("idem: delivery carries no message")
		}
		return c.deadLetter(ctx, d, DeadLetterDecode, err, OutcomeNone)
	}
	var (
		out       Outcome
		notBefore time.Duration
		err       error
	)
	pctx, release := c.cutOnStop(ctx, d.Stopping)
	defer release()
	defer c.warnWhenSlow(d, 1)()
	for again := true; ; {
		// Held while the store is down: neither processed nor counted.
		if werr := c.watch.Wait(ctx, d.Stopping); werr != nil {
			return c.held(d, werr, err)
		}
		out, notBefore, err = c.process(pctx, d.Msg)
		if err != nil && wasCut(pctx) && !storeAnswered(err) {
			return c.cutShort(d, err)
		}
		if !c.storeDown(ctx, d.Stopping, err, &again) {
			break
		}
	}
	err = c.creditOutages(err)
	switch {
	case err == nil && out != InFlight:
		return Verdict{Ack: true, Outcome: out}
	case err == nil && d.LastAttempt:
		return c.deadLetter(ctx, d, DeadLetterExhausted, errInFlightAtLastAttempt, out)
	case err == nil:
		// Lease mode: another worker holds the message, or a failed
		// attempt's retry is not due. Ask again later; the holder acks
		// its own delivery.
		delay := max(c.cfg.Backoff.Delay(max(d.Attempt-1, 0)), notBefore)
		c.cfg.Logger.Debug("idem: message in flight; will ask again", slog.String("handler", c.name),
			slog.String("message_id", d.Msg.ID), slog.Int("attempt", d.Attempt), slog.Duration("retry_after", delay))
		return Verdict{RetryAfter: delay, Outcome: out}
	}
	switch {
	case out == Conflict:
		return c.deadLetter(ctx, d, DeadLetterConflict, err, out)
	case errors.Is(err, ErrWaitsForAggregate):
		// Only a batch sets it, on deliveries it did not try, and never
		// through here: this one is the handler's. Adapters that count
		// attempts themselves count none for it, so a retry would come
		// back for ever.
		return c.deadLetter(ctx, d, DeadLetterPermanent, fmt.Errorf("idem: the handler returned idem.ErrWaitsForAggregate, which only the Consumer may set: %w", err), out)
	case c.classify(err) == PermanentClass:
		return c.deadLetter(ctx, d, DeadLetterPermanent, err, out)
	case d.replay && ctx.Err() != nil:
		// A replay stopped with its consumer: not the message's failure.
		// Its dead letter stays as it was, replay requested, for the
		// next run.
		return Verdict{Outcome: out, Err: err}
	case d.LastAttempt || (c.cfg.MaxAttempts > 0 && d.Attempt >= c.cfg.MaxAttempts && !waitingForGap(err)):
		return c.deadLetter(ctx, d, DeadLetterExhausted, err, out)
	}
	// Not before the message may run again (lease mode: a failed
	// attempt's retry time), or the delivery would find it in flight.
	delay := max(c.cfg.Backoff.Delay(max(d.Attempt-1, 0)), notBefore)
	var ge *GapError
	if errors.As(err, &ge) && !ge.Deadline.IsZero() {
		// Waiting for a missing event: try again soon, not later than
		// the deadline, as the store's clock measures it (Deadline is on
		// it; the host's may be ahead or behind).
		delay = min(delay, max(ge.Remaining, 0))
	}
	c.logs.Warn(c.cfg.Logger, Fingerprint(err), "idem: delivery failed; will retry", slog.String("handler", c.name),
		slog.String("message_id", d.Msg.ID), slog.Int("attempt", d.Attempt), slog.Duration("retry_after", delay), slog.Any("error", err))
	return Verdict{RetryAfter: delay, Outcome: out, Err: err}
}

// HandleDeliveries implements BatchDeliveryHandler: the valid deliveries
// are applied with Processor.ProcessBatch, in one transaction whose
// handler sees only the new messages. A delivery the batch did not settle
// (a conflict, or a message behind a sequence gap) is then decided alone
// by HandleDelivery, as is every delivery of a batch that cannot commit (a
// handler error, an invalid message), so retries and dead letters are
// decided per message as always.
//
// Deciding them alone keeps each aggregate's order: once a delivery is to
// be retried, the later deliveries of its AggregateID (normalized as the
// ordering guard does, if it does) in the batch are not processed but
// returned for a retry too (deliveries without an AggregateID count as one
// aggregate: a Kafka batch is one partition's records, whose order a
// retry holds), so that none is applied before it (an adapter
// retries them in order: Kafka). A delivery on its LastAttempt is decided
// all the same, since the broker would drop it.
func (c *Consumer[TTx]) HandleDeliveries(ctx context.Context, ds []*Delivery) []Verdict {
	vs := make([]Verdict, len(ds))
	one := func(i int) { vs[i] = c.handle(ctx, ds[i]) }
	var (
		idx  []int
		msgs []*Message
	)
	for i, d := range ds {
		if d == nil || d.Msg == nil || d.DecodeErr != nil || d.Msg.Validate() != nil {
			one(i)
			continue
		}
		idx = append(idx, i)
		msgs = append(msgs, d.Msg)
	}
	if len(msgs) == 0 {
		return vs
	}
	var (
		outs []Outcome
		err  error
	)
	pctx, release := c.cutOnStop(ctx, ds[idx[0]].Stopping)
	defer release()
	slow := c.warnWhenSlow(ds[idx[0]], len(msgs))
	defer slow()
	for again := true; ; {
		// Held while the store is down, as one delivery is.
		if werr := c.watch.Wait(ctx, ds[idx[0]].Stopping); werr != nil {
			for _, i := range idx {
				vs[i] = c.held(ds[i], werr, err)
				c.report(ctx, ds[i], vs[i])
			}
			return vs
		}
		outs, err = c.proc.processBatchCall(pctx, c.h, msgs, true)
		if err != nil && wasCut(pctx) {
			for _, i := range idx {
				vs[i] = c.cutShort(ds[i], err)
				c.report(ctx, ds[i], vs[i])
			}
			return vs
		}
		if !c.storeDown(ctx, ds[idx[0]].Stopping, err, &again) {
			break
		}
	}
	slow() // what follows decides deliveries one by one, each watched
	// Decided again one by one within the batch's grace, should its
	// adapter stop.
	one = func(i int) { vs[i] = c.handle(pctx, ds[i]) }
	if err != nil {
		c.cfg.Logger.Debug("idem: batch did not commit; deciding its deliveries one by one", slog.String("handler", c.name), slog.Int("size", len(msgs)), slog.Any("error", err))
		held := map[string]int{} // aggregate → index of its delivery to be retried
		// Each aggregate's messages in sequence order, as the batch would
		// have applied them: alone in batch order, a later one would meet
		// a gap the batch did not have.
		all := make([]*Message, len(ds))
		for _, i := range idx {
			all[i] = ds[i].Msg
		}
		orderBySeq(c.name, c.ordering, all, idx)
		for _, i := range idx {
			m := ds[i].Msg
			agg := c.aggregateKey(m.AggregateID) // the aggregate as the guard sees it
			if first, ok := held[agg]; ok && !ds[i].LastAttempt {
				err := fmt.Errorf("%w: message %s waits for %s to be retried first", ErrWaitsForAggregate, m.ID, ds[first].Msg.ID)
				if fe := vs[first].Err; errors.Is(fe, ErrStoreUnavailable) || errors.Is(fe, ErrStopped) {
					// Behind one not tried either (held, or cut by the
					// stop): an adapter that puts such ones back at a
					// stop (RabbitMQ) puts this one back with it.
					err = fmt.Errorf("%w: %w", err, fe)
				}
				vs[i] = Verdict{RetryAfter: vs[first].RetryAfter, Err: err}
				c.report(ctx, ds[i], vs[i])
				continue
			}
			one(i)
			if !vs[i].Ack {
				if _, ok := held[agg]; !ok {
					held[agg] = i
				}
			}
		}
		return vs
	}
	for j, i := range idx {
		if outs[j] == Conflict || outs[j] == OutcomeNone {
			// Decided again alone: a conflict's dead letter, or a gap's
			// retry (and, under GapWait, its first sighting).
			one(i)
			continue
		}
		vs[i] = Verdict{Ack: true, Outcome: outs[j]}
		c.report(ctx, ds[i], vs[i])
	}
	return vs
}

// classify applies idem's own rules, then the user's.
func (c *deliveries) classify(err error) Class {
	if IsPermanent(err) {
		return PermanentClass
	}
	if c.cfg.Classify != nil {
		return c.cfg.Classify(err)
	}
	return Retriable
}

// deadLetter records d and acknowledges it once the dead letter is
// committed; if that fails the delivery is retried instead, never dropped.
func (c *deliveries) deadLetter(ctx context.Context, d *Delivery, class string, cause error, out Outcome) Verdict {
	dl := &driver.DeadLetter{
		Handler: c.name, Raw: d.Raw, Source: storableText(d.Source), Error: storableText(cause.Error()),
		Class: class, Fingerprint: Fingerprint(cause), Attempts: max(d.Attempt, 1),
		// A lease-mode message that failed for good, delivered or
		// replayed again: its dead letter keeps the first error's text
		// and group, and logs the repeat.
		Repeat: errors.Is(cause, ErrFailedPermanently),
	}
	if d.replay {
		dl.Actor, dl.Outcome = c.actor(), "replay failed: "+storableText(cause.Error())
	}
	if d.Msg != nil {
		if d.Raw == nil {
			dl.Raw = d.Msg.Payload
		}
		// An invalid ID is not storable as a key. A valid one is, also
		// when another field failed validation (a negative Seq): the dead
		// letter then names its message, and keeps its envelope.
		if checkText(d.Msg.ID, MaxIDLen) == "" {
			dl.MessageID, dl.PayloadHash = d.Msg.ID, d.Msg.PayloadHash()
			// Lossless and storable whatever the headers, Type or Time
			// hold (see envelope.go): a dead letter without an envelope
			// can never be replayed.
			if env, err := marshalEnvelope(d.Msg); err == nil {
				dl.Envelope = env
			}
		}
	}
	var id int64
	// A store that is down holds the dead letter as it holds a delivery.
	err := c.watch.Do(ctx, d.Stopping, func() (err error) {
		id, err = c.putDeadLetter(ctx, dl)
		return err
	})
	// The wait for the store ended first (the adapter stopped): the
	// delivery was held, as in decide, and is no attempt of the message.
	held := errors.Is(err, outage.ErrStopped) || ctx.Err() != nil && errors.Is(err, ctx.Err())
	// On the broker's last delivery a retry verdict would lose the
	// message: the broker does not deliver it again. Keep writing while
	// the delivery lasts (the adapter keeps the message in progress).
	for n := 0; err != nil && d.LastAttempt && !d.replay && ctx.Err() == nil && !closed(d.Stopping); n++ {
		if n%10 == 0 {
			c.cfg.Logger.Error("idem: dead letter not stored on the broker's last delivery; writing it again", slog.String("handler", c.name),
				slog.String("message_id", dl.MessageID), slog.Int("tries", n+1), slog.Any("error", err))
		}
		t := time.NewTimer(c.cfg.Backoff.Delay(n))
		select {
		case <-ctx.Done():
			t.Stop()
		case <-d.Stopping:
			t.Stop()
		case <-t.C:
			id, err = c.putDeadLetter(ctx, dl)
		}
	}
	if err != nil {
		err = fmt.Errorf("idem: dead-letter %s: %w (while handling: %w)", dl.MessageID, err, cause)
		if held {
			err = fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
		}
		if d.LastAttempt && !d.replay {
			c.cfg.Logger.Warn("idem: dead letter not stored, and the broker's last delivery ended: the adapter must requeue it, or the broker may not deliver it again",
				slog.String("handler", c.name), slog.String("message_id", dl.MessageID), slog.String("source", dl.Source), slog.Any("error", err))
		} else if held {
			c.cfg.Logger.Warn("idem: stopped while the store was down, before the dead letter was stored; the delivery comes again, no attempt counted",
				slog.String("handler", c.name), slog.String("message_id", dl.MessageID), slog.String("source", dl.Source), slog.Any("error", err))
		} else {
			c.cfg.Logger.Error("idem: dead letter not stored; will retry the delivery", slog.String("handler", c.name), slog.Any("error", err))
		}
		return Verdict{RetryAfter: c.cfg.Backoff.Delay(max(d.Attempt-1, 0)), Outcome: out, Err: err}
	}
	c.logs.Warn(c.cfg.Logger, class+"\x00"+dl.Fingerprint, "idem: dead-lettered", slog.String("handler", c.name), slog.String("message_id", dl.MessageID),
		slog.Int64("dead_letter", id), slog.String("class", class), slog.String("fingerprint", dl.Fingerprint), slog.Any("error", cause))
	return Verdict{Ack: true, DeadLettered: true, DeadLetterClass: class, Outcome: out, Err: cause}
}

// closed reports whether ch is closed (never, for nil).
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// putDeadLetter writes dl. The write outlives a cancelled delivery
// context, bounded on its own: the broker is acknowledged on its success.
func (c *deliveries) putDeadLetter(ctx context.Context, dl *driver.DeadLetter) (int64, error) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	return c.dl.DeadLetterPut(wctx, dl)
}

// ReplayResult counts a Replay run.
type ReplayResult struct {
	// Replayed dead letters ran again: Applied, Duplicate or Stale.
	Replayed int
	// Outcomes counts the outcomes of the replayed ones.
	Outcomes map[Outcome]int
	// Parked dead letters failed again and were parked with the new error.
	Parked int
}

// AggregateKeyer is implemented by delivery handlers whose ordering guard
// maps aggregate IDs (Ordering.Normalize): AggregateKey returns an
// aggregate ID as the guard sees it. An adapter that decides several
// aggregates at once (the jetstream package's Config.Concurrency) keys its
// lanes by it, so that two IDs the guard takes for one aggregate, "ACC"
// and "acc" under FoldAggregateID say, are never decided at the same time.
// Consumer and LeaseConsumer implement it; a handler that wraps one should
// pass the call on.
type AggregateKeyer interface {
	AggregateKey(aggregateID string) string
}

// AggregateKey implements AggregateKeyer: aggregateID normalized by the
// handler's Ordering.Normalize, or unchanged without one.
func (c *Consumer[TTx]) AggregateKey(aggregateID string) string { return c.aggregateKey(aggregateID) }

// aggregateKey is AggregateKey.
func (c *deliveries) aggregateKey(aggregateID string) string {
	if o := c.ordering; o != nil && o.Normalize != nil {
		return o.Normalize(aggregateID)
	}
	return aggregateID
}

// Replay runs this handler's dead letters in state replay_requested through
// the same path as a delivery (dedup, ordering guard): an already-applied
// message is a Duplicate, never a second effect. A success marks the dead
// letter replayed; a failure parks it again with the new error. A replay
// stopped by ctx is no failure: its dead letter is requested again, and
// Replay returns ctx's error. Call it on an interval (see Run) or after
// RequestReplay.
//
// Each dead letter is claimed before it runs: moved from replay_requested
// to replaying in one conditional write, which one consumer wins. So two
// consumers replaying at once never run one dead letter twice, and one
// that another consumer replayed, or an operator discarded, since this
// run listed it is left alone. A claim left by a consumer that crashed is
// requested again after ConsumerConfig.ReplayClaimTimeout.
//
// The claim does not stop a dead letter's state from changing while its
// message runs: a delivery of the same message that fails parks it again,
// and an operator may then discard it or request its replay again. If the
// message then applies, the dead letter is marked replayed (its history
// shows the discard or request, then the replay); if it fails, it is
// parked again, as any message failing again is. The result of a run
// that ended is recorded even when ctx ends just then.
//
// With an Ordering, a run leaves alone the aggregates another run is
// replaying (a dead letter of theirs is claimed, or this run's claim of
// one failed): their later sequences, run here meanwhile, would meet the
// gap the other run has not closed yet and be parked again. The next run
// takes what is left.
//
// Memory is bounded by one dead letter's body: the run lists summaries
// (without envelope and payload) a page at a time, and reads each body
// when it runs it (with an Ordering, once more before, to learn its
// aggregate and sequence).
func (c *Consumer[TTx]) Replay(ctx context.Context) (ReplayResult, error) { return c.replay(ctx) }

// replayPage is how many dead-letter summaries a replay, a replay request
// or a discard reads at once.
const replayPage = 500

// replay is Replay.
func (c *deliveries) replay(ctx context.Context) (ReplayResult, error) {
	res := ReplayResult{Outcomes: map[Outcome]int{}}
	if err := c.requestStaleClaims(ctx); err != nil {
		return res, err
	}
	var ids []int64
	err := deadLetterPages(ctx, c.dl, &driver.DeadLetterFilter{Handler: c.name, State: driver.DeadLetterReplayRequested}, func(page []driver.DeadLetter) error {
		for _, d := range page {
			ids = append(ids, d.ID)
		}
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("idem: list dead letters to replay: %w", err)
	}
	var (
		keys []replayKey
		busy map[string]bool // aggregates another run is replaying
	)
	if c.ordering != nil {
		// Each aggregate's messages run in sequence order: in the order
		// they were parked, a later sequence would meet the gap an
		// earlier one leaves until it is replayed too.
		if ids, keys, err = c.inSeqOrder(ctx, ids); err != nil {
			return res, err
		}
		// And in one run at a time: another consumer's run (every
		// replica runs Replay) may be running an earlier sequence of an
		// aggregate; a later one run here meanwhile would meet the gap
		// it has not closed yet, and be parked again. Read after the
		// list, so that a claim taken since the list was read is seen
		// here, or makes this run's claim of it fail (below).
		if busy, err = c.aggregatesReplaying(ctx); err != nil {
			return res, err
		}
	}
	for i, id := range ids {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		if keys != nil && keys[i].guarded && busy[keys[i].agg] {
			continue // left to the run replaying the aggregate, or to the next run
		}
		// The list is as old as this run: another consumer may be
		// replaying a dead letter, or have replayed it since, and an
		// operator discarded it after it failed again. Run only what
		// this consumer claims.
		n, err := c.dl.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: []int64{id}, From: []string{driver.DeadLetterReplayRequested},
			To: driver.DeadLetterReplaying, Actor: c.actor()})
		if err != nil {
			return res, fmt.Errorf("idem: claim dead letter %d for its replay: %w", id, err)
		}
		if n == 0 {
			if keys != nil && keys[i].guarded {
				// Most likely another run claimed it: its aggregate's
				// later sequences are that run's to replay.
				busy[keys[i].agg] = true
			}
			continue
		}
		if err := c.replayClaimed(ctx, id, &res); err != nil {
			return res, err
		}
	}
	return res, nil
}

// replayClaimed runs dead letter id, which this consumer claimed, and
// moves it on: replayed, parked, or requested again when the run stopped.
func (c *deliveries) replayClaimed(ctx context.Context, id int64, res *ReplayResult) error {
	dls, err := c.dl.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: []int64{id}})
	if err != nil {
		return errors.Join(fmt.Errorf("idem: read dead letter %d to replay it: %w", id, err), c.unclaim(ctx, id, "replay stopped: "+err.Error()))
	}
	if len(dls) == 0 {
		return nil // deleted since
	}
	dl := &dls[0]
	var msg *Message
	why := "no envelope to replay"
	if dl.Envelope != nil {
		m, err := unmarshalEnvelope(dl.Envelope)
		if err != nil {
			why = "envelope not readable: " + storableText(err.Error())
		}
		msg = m
	}
	if msg == nil {
		// Nothing to run: park it again, it needs a person.
		wctx, cancel := settleContext(ctx)
		defer cancel()
		if _, err := c.dl.DeadLetterSetState(wctx, &driver.DeadLetterStateChange{IDs: []int64{id}, From: []string{driver.DeadLetterReplaying},
			To: driver.DeadLetterParked, Actor: c.actor(), Outcome: why}); err != nil {
			return err
		}
		res.Parked++
		return nil
	}
	if c.rearm != nil {
		if err := c.rearm(ctx, msg.ID); err != nil {
			err = fmt.Errorf("idem: make %s claimable for its replay: %w", msg.ID, err)
			return errors.Join(err, c.unclaim(ctx, id, "replay stopped: "+err.Error()))
		}
	}
	// A failure parks it again through deadLetter, whose write logs
	// the replay's attempt.
	v := c.handle(ctx, &Delivery{Msg: msg, Raw: dl.Raw, Source: dl.Source, Attempt: dl.Attempts + 1, LastAttempt: true, replay: true})
	if v.DeadLettered {
		res.Parked++ // failed again: parked with the new error
		return nil
	}
	if !v.Ack {
		// Stopped, or its new failure could not even be stored: it is
		// requested again, for the next run.
		reason := "replay stopped"
		if v.Err != nil {
			reason += ": " + storableText(v.Err.Error())
		}
		if err := c.unclaim(ctx, id, reason); err != nil {
			return err
		}
		return ctx.Err()
	}
	// The message ran: its result is recorded even when ctx ended just
	// now (a consumer stopping), or the dead letter would stay claimed
	// until ReplayClaimTimeout, and the replay then run would log an
	// applied message as a duplicate.
	wctx, cancel := settleContext(ctx)
	defer cancel()
	n, err := c.dl.DeadLetterSetState(wctx, &driver.DeadLetterStateChange{IDs: []int64{id}, From: []string{driver.DeadLetterReplaying},
		To: driver.DeadLetterReplayed, Actor: c.actor(), Outcome: v.Outcome.String()})
	if err != nil {
		return err
	}
	if n == 0 && v.Outcome == Applied {
		// It left replaying while it ran (a failed delivery of the same
		// message parked it, and an operator may have discarded it, or
		// requested its replay again), and its effect was applied all
		// the same: say so in its state and history. A replay requested
		// again is done: run again it would only be a duplicate.
		n, err = c.dl.DeadLetterSetState(wctx, &driver.DeadLetterStateChange{IDs: []int64{id},
			From: []string{driver.DeadLetterParked, driver.DeadLetterDiscarded, driver.DeadLetterReplayRequested},
			To:   driver.DeadLetterReplayed, Actor: c.actor(), Outcome: v.Outcome.String() + " (the replay was running when its state changed)"})
		if err != nil {
			return err
		}
		if n > 0 {
			c.cfg.Logger.Warn("idem: dead letter left replaying while its replay ran and applied; marked replayed", slog.String("handler", c.name),
				slog.Int64("dead_letter", id), slog.String("message_id", msg.ID))
		}
	}
	if n == 0 {
		// It changed state while it ran, and nothing applied here: its
		// state stands.
		c.cfg.Logger.Debug("idem: dead letter left replaying while its replay ran", slog.String("handler", c.name),
			slog.Int64("dead_letter", id), slog.String("message_id", msg.ID), slog.String("outcome", v.Outcome.String()))
		return nil
	}
	res.Replayed++
	res.Outcomes[v.Outcome]++
	return nil
}

// settleContext is the context of a write that records how a claimed
// replay ended: it outlives ctx's cancellation, bounded on its own.
func settleContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
}

// unclaim requests dead letter id again, for the next run, after a
// replay that did not finish: written even when ctx is done (the reason
// it stopped), bounded on its own.
func (c *deliveries) unclaim(ctx context.Context, id int64, reason string) error {
	wctx, cancel := settleContext(ctx)
	defer cancel()
	if _, err := c.dl.DeadLetterSetState(wctx, &driver.DeadLetterStateChange{IDs: []int64{id}, From: []string{driver.DeadLetterReplaying},
		To: driver.DeadLetterReplayRequested, Actor: c.actor(), Outcome: reason}); err != nil {
		return fmt.Errorf("idem: request dead letter %d again after its replay stopped: %w", id, err)
	}
	return nil
}

// requestStaleClaims requests again this handler's dead letters claimed
// by a replay (replaying) longer ago than ReplayClaimTimeout: the
// consumer that claimed them crashed or was cut off.
func (c *deliveries) requestStaleClaims(ctx context.Context) error {
	var stale []int64
	err := deadLetterPages(ctx, c.dl, &driver.DeadLetterFilter{Handler: c.name, State: driver.DeadLetterReplaying}, func(page []driver.DeadLetter) error {
		for _, d := range page {
			hist, err := c.dl.DeadLetterHistory(ctx, d.ID)
			if err != nil {
				return err
			}
			if len(hist) > 0 && time.Since(hist[len(hist)-1].At) > c.cfg.ReplayClaimTimeout {
				stale = append(stale, d.ID)
			}
		}
		return nil
	})
	if err == nil && len(stale) > 0 {
		var n int
		n, err = c.dl.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: stale, From: []string{driver.DeadLetterReplaying},
			To: driver.DeadLetterReplayRequested, Actor: c.actor(), Outcome: "its replay was claimed more than " + c.cfg.ReplayClaimTimeout.String() + " ago and did not finish"})
		if n > 0 {
			c.cfg.Logger.Warn("idem: dead letters claimed by a replay that did not finish; requested again", slog.String("handler", c.name), slog.Int("dead_letters", n))
		}
	}
	if err != nil {
		return fmt.Errorf("idem: request stale replay claims again: %w", err)
	}
	return nil
}

// replayKey is the ordering guard's key of a dead letter's message;
// guarded is false when the guard does not apply to it (no sequence, no
// readable envelope).
type replayKey struct {
	agg     string
	guarded bool
}

// replayMessage reads dead letter id's message, with only its ordering
// fields, so that memory holds one body at most; nil when it has none that
// can be read.
func (c *deliveries) replayMessage(ctx context.Context, id int64) (*Message, error) {
	dls, err := c.dl.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: []int64{id}})
	if err != nil || len(dls) != 1 || dls[0].Envelope == nil {
		return nil, err
	}
	m, err := unmarshalEnvelope(dls[0].Envelope)
	if err != nil {
		return nil, nil
	}
	return &Message{ID: m.ID, AggregateID: m.AggregateID, Seq: m.Seq}, nil
}

// keyOf returns msg's replayKey.
func (c *deliveries) keyOf(msg *Message) replayKey {
	if msg == nil {
		return replayKey{}
	}
	agg, ok, err := orderingKey(c.name, c.ordering, msg)
	return replayKey{agg: agg, guarded: ok && err == nil}
}

// inSeqOrder returns ids with each aggregate's messages in sequence
// order, and the aggregate key of each. It reads the dead letters one at
// a time and keeps only each message's ordering key, so that memory holds
// one body at most.
func (c *deliveries) inSeqOrder(ctx context.Context, ids []int64) ([]int64, []replayKey, error) {
	msgs := make([]*Message, len(ids))
	order := make([]int, len(ids))
	for k, id := range ids {
		order[k] = k
		m, err := c.replayMessage(ctx, id)
		if err != nil {
			return nil, nil, fmt.Errorf("idem: read dead letter %d to order its replay: %w", id, err)
		}
		msgs[k] = m
	}
	orderBySeq(c.name, c.ordering, msgs, order)
	out := make([]int64, len(ids))
	keys := make([]replayKey, len(ids))
	for i, k := range order {
		out[i], keys[i] = ids[k], c.keyOf(msgs[k])
	}
	return out, keys, nil
}

// aggregatesReplaying returns the aggregates of this handler's dead
// letters that a replay has claimed now (replaying).
func (c *deliveries) aggregatesReplaying(ctx context.Context) (map[string]bool, error) {
	busy := map[string]bool{}
	err := deadLetterPages(ctx, c.dl, &driver.DeadLetterFilter{Handler: c.name, State: driver.DeadLetterReplaying}, func(page []driver.DeadLetter) error {
		for _, d := range page {
			m, err := c.replayMessage(ctx, d.ID)
			if err != nil {
				return err
			}
			if k := c.keyOf(m); k.guarded {
				busy[k.agg] = true
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("idem: read the dead letters being replayed: %w", err)
	}
	return busy, nil
}

// deadLetterPages lists the summaries of the dead letters f selects,
// replayPage at a time (see dlpages.Each).
func deadLetterPages(ctx context.Context, dl driver.DeadLetterStore, f *driver.DeadLetterFilter, fn func([]driver.DeadLetter) error) error {
	return dlpages.Each(ctx, dl, f, replayPage, fn)
}

// Run replays requested dead letters every interval until ctx is done,
// logging failures, and returns ctx's error.
func (c *Consumer[TTx]) Run(ctx context.Context, interval time.Duration) error {
	return c.run(ctx, interval)
}

// run is Run.
func (c *deliveries) run(ctx context.Context, interval time.Duration) error {
	if interval <= 0 {
		return fmt.Errorf("%w: replay interval %s must be positive", ErrInvalidConfig, interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if r, err := c.replay(ctx); err != nil && ctx.Err() == nil {
			c.cfg.Logger.Warn("idem: replay failed; retrying at the next interval", slog.Any("error", err))
		} else if r.Replayed+r.Parked > 0 {
			c.cfg.Logger.Info("idem: replayed dead letters", slog.String("handler", c.name), slog.Int("replayed", r.Replayed), slog.Int("parked", r.Parked))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// actor names this consumer in the dead-letter log.
func (c *deliveries) actor() string { return "consumer " + c.name }

// RequestReplay marks the parked dead letters matching f for replay by the
// consumers of their handlers, logs the request with actor (who asked),
// and returns how many it marked.
func RequestReplay(ctx context.Context, dl driver.DeadLetterStore, f *driver.DeadLetterFilter, actor string) (int, error) {
	return moveDeadLetters(ctx, dl, f, driver.DeadLetterReplayRequested, actor)
}

// Discard marks the parked dead letters matching f discarded: an operator's
// decision that they need no processing, logged with actor. They are kept
// for the record.
func Discard(ctx context.Context, dl driver.DeadLetterStore, f *driver.DeadLetterFilter, actor string) (int, error) {
	return moveDeadLetters(ctx, dl, f, driver.DeadLetterDiscarded, actor)
}

func moveDeadLetters(ctx context.Context, dl driver.DeadLetterStore, f *driver.DeadLetterFilter, state, actor string) (int, error) {
	sel := driver.DeadLetterFilter{}
	if f != nil {
		sel = *f
	}
	sel.State = driver.DeadLetterParked
	moved := 0
	err := deadLetterPages(ctx, dl, &sel, func(page []driver.DeadLetter) error {
		ids := make([]int64, len(page))
		for i, d := range page {
			ids[i] = d.ID
		}
		n, err := dl.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: ids, From: []string{driver.DeadLetterParked}, To: state, Actor: actor})
		moved += n
		if err != nil {
			return fmt.Errorf("idem: mark dead letters %s: %w", state, err)
		}
		return nil
	})
	if err != nil {
		return moved, fmt.Errorf("idem: move dead letters: %w", err)
	}
	return moved, nil
}

// Fingerprint groups alike failures: the error's type and its message with
// numbers, hex strings and quoted values replaced, so "order 17 not found"
// and "order 18 not found" share one.
func Fingerprint(err error) string {
	if err == nil {
		return ""
	}
	typ := fmt.Sprintf("%T", err)
	for u := errors.Unwrap(err); u != nil; u = errors.Unwrap(u) {
		typ = fmt.Sprintf("%T", u) // the innermost error names the cause best
	}
	var b strings.Builder
	msg := storableText(err.Error())
	inQuote := false
	for i := 0; i < len(msg) && b.Len() <= 200; i++ {
		ch := msg[i]
		switch {
		case ch == '"':
			if !inQuote {
				b.WriteString(`"…"`)
			}
			inQuote = !inQuote
		case inQuote:
		case isWordByte(ch):
			// A word with a digit in it (a number, an ID, a hash) varies
			// from one failure to the next: blank it.
			j, digit := i, false
			for ; j < len(msg) && isWordByte(msg[j]); j++ {
				digit = digit || (msg[j] >= '0' && msg[j] <= '9')
			}
			if digit {
				b.WriteByte('#')
			} else {
				b.WriteString(msg[i:j])
			}
			i = j - 1
		default:
			// A whole character: cutting one in two at the length bound
			// would leave text a store refuses (Postgres: invalid UTF-8),
			// and the dead letter unwritten.
			_, size := utf8.DecodeRuneInString(msg[i:])
			b.WriteString(msg[i : i+size])
			i += size - 1
		}
	}
	return typ + ": " + b.String()
}

func isWordByte(c byte) bool {
	return c == '_' || c == '-' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
}

// storableText is s as valid UTF-8 without NUL, bounded: storable in any
// text column.
func storableText(s string) string { return lastErrorText(errors.New(s)) }
