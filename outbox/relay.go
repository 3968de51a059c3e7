package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/errtext"
	"github.com/idemhq/idem/internal/lograte"
	"github.com/idemhq/idem/internal/outage"
)

// Publisher sends messages to a broker. The kafka, jetstream and rabbitmq
// packages implement it, as does the Watermill bridge's NewPublisher.
type Publisher interface {
	// Publish sends msgs, the pending rows of one ordering key in order,
	// and returns nil only once the broker has acknowledged every one of
	// them. After an error the relay sends them all again later, from
	// the first: a Publisher must not let a message overtake an earlier
	// one that failed. A panic counts as an error.
	Publish(ctx context.Context, msgs []*idem.Message) error
}

// BrokerProber is implemented by a Publisher that can tell its broker
// being out of reach from the refusal of a message. A relay whose
// Publisher implements it treats a broker outage as no failure of the
// rows: a failed publish that Unavailable suspects and a Probe confirms
// counts no attempt, records no error on the row and holds no key; the
// relay stops publishing, logs one line, probes the broker with a backoff
// capped at a second, logs one line when it answers again, and goes on.
// Without it, each key whose publish fails counts an attempt and waits
// out its own backoff, outage or not.
type BrokerProber interface {
	// Unavailable reports whether err, returned by Publish, looks like
	// the broker being out of reach. It is only a hint: Probe confirms.
	Unavailable(err error) bool
	// Probe returns nil when the broker answers. An error that matches
	// idem.IsPermanent says it never will through this Publisher (its
	// connection is closed for good): Run then ends with that error.
	Probe(ctx context.Context) error
}

// ErrBrokerUnavailable matches the error of a relay cycle (RunOnce) that
// left rows unpublished because the broker was out of reach, as the
// Publisher's BrokerProber confirmed. Those rows did not fail: no attempt
// is counted on them and their keys are not held.
var ErrBrokerUnavailable = errors.New("outbox: broker unavailable")

// Fault points of RelayConfig.FaultHook, in the order a relay cycle
// reaches them.
const (
	// FaultBeforePublish: rows claimed, nothing published yet.
	FaultBeforePublish = "before-publish"
	// FaultAfterPublish: the broker acknowledged, the rows are not
	// marked published yet.
	FaultAfterPublish = "after-publish"
	// FaultAfterMark: the rows are marked published, the claims not yet
	// released.
	FaultAfterMark = "after-mark"
)

// RelayConfig configures a Relay. The zero value is valid.
type RelayConfig struct {
	// Owner names this relay in its claims; it must differ between
	// relays, and be text (valid UTF-8, no NUL byte) of at most 255
	// bytes. Default "hostname:pid:" plus a random suffix.
	Owner string
	// BatchSize bounds the rows claimed per cycle. Default 100.
	BatchSize int
	// BatchBytes bounds the payload bytes claimed per cycle, so that a
	// relay's memory stays bounded however large the rows: a cycle takes
	// rows in order while their payloads fit, and always the first (a
	// larger one goes out alone); the next cycle starts at once. Default
	// 32 MiB; -1 sets no bound.
	BatchBytes int
	// Concurrency bounds the ordering keys published at once; one key's
	// rows always go out one after the other. Default 8.
	Concurrency int
	// ClaimTTL is how long a claim keeps other relays off its keys. A
	// relay stops starting publishes at half of it and gives each
	// publish until nine tenths, so a claim does not expire while its
	// owner is still sending. A crashed relay's keys wait this long.
	// Default 30 s.
	ClaimTTL time.Duration
	// PollInterval is how often an idle relay looks for rows when the
	// store does not notify it (or as a fallback when it does), and so
	// the longest a commit waits for its relay. Default 1 s. An idle look
	// reads the pending rows' index, and while pending rows sit on held
	// aggregates (a broker outage) it reads them all: measured 77 ms for
	// 100,000 rows on Postgres, so a short interval costs most then.
	PollInterval time.Duration
	// Backoff spaces the retries of an ordering key whose publish failed,
	// growing with the attempts on the key's first pending row, and the
	// cycles after one that published nothing: exponential with full
	// jitter, by default from 100 ms up to 30 s (a key waits at least half
	// of Base). A key waiting out its backoff is skipped by every relay,
	// so one key the broker refuses does not hold up the others; the
	// relay that held it runs a cycle when its backoff ends, whatever
	// PollInterval. Retries is ignored: the relay retries until the
	// broker takes the rows.
	Backoff idem.Backoff
	// Logger receives failed publishes and store errors. Default
	// slog.Default().
	Logger *slog.Logger
	// Hooks are told about the relay's cycles: each value implementing
	// HookCycle is called after every cycle that claimed rows or failed.
	// The metrics package counts published and failed rows with it.
	Hooks []idem.Hook
	// FaultHook, when set, is called at each Fault* point on the
	// goroutine running the cycle. Crash tests stop that goroutine there
	// (runtime.Goexit) to check what a restart does.
	FaultHook func(point string)
}

// Relay publishes the outbox's pending rows. Several relays, in one
// process or many, may drain one outbox. It is safe for concurrent use,
// but one Relay runs one cycle at a time.
type Relay struct {
	store    driver.OutboxRelayStore
	notifier driver.OutboxNotifier
	pub      Publisher
	cfg      RelayConfig
	watch    *outage.Watch // nil: the store cannot be probed
	broker   BrokerProber  // nil: the Publisher cannot probe its broker
	// brokerDown is set when a probe confirmed a broker outage, at
	// brokerSince (Unix nanoseconds), and cleared once a probe succeeds
	// again.
	brokerDown  atomic.Bool
	brokerSince atomic.Int64
	logs        *lograte.Limiter // summarizes repeated failure lines
	hooks       []HookCycle
	mu          sync.Mutex // one cycle at a time
	holdMu      sync.Mutex // guards retries
	// retries are when the keys this relay held after a failed publish
	// become claimable again (with a margin): Run's wait ends at the
	// first rather than after PollInterval, since no commit would wake it
	// for those keys.
	retries []time.Time
	// limit is how many rows a cycle claims: BatchSize, or fewer after a
	// cycle that claimed so many that no key's turn came within half the
	// claim (see adaptLimit). Guarded by mu.
	limit int
	// full says the last cycle claimed as many rows as it asked for, or
	// BatchBytes cut its claim: more may be waiting.
	full atomic.Bool
}

// HookCycle is told about a relay's cycles (RelayConfig.Hooks): each one
// that claimed rows or failed. It runs on the relay's goroutine: keep it
// fast and never block.
type HookCycle interface {
	OnRelayCycle(ctx context.Context, ev *CycleEvent)
}

// CycleEvent describes one relay cycle.
type CycleEvent struct {
	// Owner is the relay's owner name.
	Owner string
	// Result counts the rows claimed, published and failed.
	Result CycleResult
	// Err is the cycle's error, as RunOnce returns it.
	Err error
	// Duration is the cycle's wall time.
	Duration time.Duration
}

// CycleResult counts one relay cycle.
type CycleResult struct {
	// Claimed rows were taken from the outbox for this cycle.
	Claimed int
	// Published rows were acknowledged by the broker and marked.
	Published int
	// Failed rows were not published (a publish error, or the claim
	// running out); they stay pending.
	Failed int
}

// NewRelay returns a relay draining drv's outbox (drv must implement
// driver.OutboxRelayStore; a driver that implements driver.OutboxNotifier
// wakes the relay on commit, as Postgres does once
// postgres.Driver.SetOutboxNotify turned it on) through pub.
func NewRelay(drv any, pub Publisher, cfg *RelayConfig) (*Relay, error) {
	store, ok := drv.(driver.OutboxRelayStore)
	if !ok || store == nil {
		return nil, fmt.Errorf("%w: %T does not implement driver.OutboxRelayStore", idem.ErrInvalidConfig, drv)
	}
	if pub == nil {
		return nil, fmt.Errorf("%w: outbox relay needs a Publisher", idem.ErrInvalidConfig)
	}
	r := &Relay{store: store, pub: pub}
	r.notifier, _ = drv.(driver.OutboxNotifier)
	r.broker, _ = pub.(BrokerProber)
	if cfg != nil {
		r.cfg = *cfg
	}
	c := &r.cfg
	if c.BatchSize < 0 || c.Concurrency < 0 || c.ClaimTTL < 0 || c.PollInterval < 0 || c.Backoff.Base < 0 || c.Backoff.Max < 0 {
		return nil, fmt.Errorf("%w: outbox relay settings must not be negative", idem.ErrInvalidConfig)
	}
	if c.BatchBytes < -1 {
		return nil, fmt.Errorf("%w: outbox relay BatchBytes %d must be -1 (no bound), 0 (the default) or more", idem.ErrInvalidConfig, c.BatchBytes)
	}
	if c.Owner == "" {
		c.Owner = defaultOwner()
	}
	// The owner is written into every claim: one a store cannot hold
	// would fail every claim, for ever, as a failing store does.
	if reason := checkOwner(c.Owner); reason != "" {
		return nil, fmt.Errorf("%w: outbox relay Owner %q %s", idem.ErrInvalidConfig, c.Owner, reason)
	}
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.BatchBytes == 0 {
		c.BatchBytes = 32 << 20
	}
	r.limit = c.BatchSize
	if c.Concurrency == 0 {
		c.Concurrency = 8
	}
	if c.ClaimTTL == 0 {
		c.ClaimTTL = 30 * time.Second
	}
	if c.ClaimTTL < 100*time.Millisecond {
		return nil, fmt.Errorf("%w: ClaimTTL %s is below 100ms", idem.ErrInvalidConfig, c.ClaimTTL)
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.Backoff.Base == 0 {
		c.Backoff.Base = 100 * time.Millisecond
	}
	if c.Backoff.Max == 0 {
		c.Backoff.Max = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	r.logs = lograte.New(10 * time.Second)
	for _, h := range c.Hooks {
		if hc, ok := h.(HookCycle); ok {
			r.hooks = append(r.hooks, hc)
		}
	}
	if p, ok := drv.(driver.Prober); ok {
		r.watch = outage.New(p, outage.Config{Component: "outbox relay " + strconv.Quote(c.Owner), Logger: c.Logger})
	}
	return r, nil
}

// checkOwner returns why owner cannot name a relay in its claims, or "":
// it must be text (valid UTF-8, no NUL byte) of at most idem.MaxIDLen
// bytes, as the stores' claim columns hold.
func checkOwner(owner string) string {
	switch {
	case len(owner) > idem.MaxIDLen:
		return fmt.Sprintf("is %d bytes; the maximum is %d", len(owner), idem.MaxIDLen)
	case !utf8.ValidString(owner):
		return "is not valid UTF-8"
	case strings.IndexByte(owner, 0) >= 0:
		return "has a NUL byte"
	}
	return ""
}

func defaultOwner() string {
	host, _ := os.Hostname()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b))
}

// Owner returns the relay's owner name.
func (r *Relay) Owner() string { return r.cfg.Owner }

func (r *Relay) fault(point string) {
	if r.cfg.FaultHook != nil {
		r.cfg.FaultHook(point)
	}
}

// RunOnce runs one cycle: claim up to BatchSize rows (fewer for a while
// after a claim too large to publish in half ClaimTTL) and BatchBytes of
// payloads, publish each ordering key's rows in order (keys
// concurrently), mark what the broker
// acknowledged as published, record the failures, release the claims. The
// error joins the publish and store failures; rows not published stay
// pending for a later cycle, and a key whose publish failed is skipped by
// every relay until its backoff (RelayConfig.Backoff) has passed. A
// publish cut off by the end of ctx (cancelled, or past its deadline) is
// the relay stopping, not the key's failure: no attempt, no hold. So give
// ctx no deadline shorter than ClaimTTL: the relay cuts a slow publish
// off itself, at nine tenths of the claim, and that one is the key's
// failure, held for its backoff.
func (r *Relay) RunOnce(ctx context.Context) (CycleResult, error) {
	res, _, _, err := r.runOnce(ctx)
	return res, err
}

// runOnce is RunOnce, also reporting whether the store failed a write
// the cycle needed (the claim, a mark, a failure's hold, the release):
// Run backs the whole relay off then, since a key's own hold cannot be
// counted on; and how many keys it claimed but left unpublished, unheld,
// because their turn came too late in the claim: Run comes back for them
// soon.
func (r *Relay) runOnce(ctx context.Context) (res CycleResult, storeFailed bool, late int, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	start := time.Now()
	if len(r.hooks) > 0 {
		defer func() {
			if res.Claimed == 0 && err == nil {
				return // an idle look: nothing to tell
			}
			ev := &CycleEvent{Owner: r.cfg.Owner, Result: res, Err: err, Duration: time.Since(start)}
			for _, h := range r.hooks {
				h.OnRelayCycle(ctx, ev)
			}
		}()
	}
	if r.brokerDown.Load() {
		// A broker outage is under way: claim nothing (which would keep
		// the keys from other relays) until a probe finds it back.
		if perr := r.probeBroker(ctx); perr != nil {
			return res, false, 0, fmt.Errorf("outbox: %w: %w", ErrBrokerUnavailable, perr)
		}
		r.brokerUp()
	}
	r.holdMu.Lock()
	r.retries = slices.DeleteFunc(r.retries, func(at time.Time) bool { return !start.Before(at) }) // claimable now
	r.holdMu.Unlock()
	limit := r.limit
	rows, cut, err := r.store.OutboxClaim(ctx, r.cfg.Owner, limit, r.cfg.BatchBytes, r.cfg.ClaimTTL)
	if err != nil {
		return res, true, 0, fmt.Errorf("outbox: claim: %w", err)
	}
	claimTook := time.Since(start)
	r.full.Store(len(rows) >= limit || cut) // limit is at least 1
	res.Claimed = len(rows)
	if len(rows) == 0 {
		return res, false, 0, nil
	}
	r.fault(FaultBeforePublish)
	// Stop starting publishes at half the claim; give each until nine
	// tenths, so that the claim outlives its owner's sends.
	startBy := start.Add(r.cfg.ClaimTTL / 2)
	pctx, cancel := context.WithDeadlineCause(ctx, start.Add(r.cfg.ClaimTTL-r.cfg.ClaimTTL/10), errClaimRunningOut)
	defer cancel()

	groups := groupByKey(rows)
	var (
		mu        sync.Mutex
		published []int64
		errs      []error
		wg        sync.WaitGroup
		sem       = make(chan struct{}, r.cfg.Concurrency)
		noHold    atomic.Bool // a failure's hold was not recorded
		down      int         // keys left unpublished by a broker outage
	)
	for _, g := range groups {
		sem <- struct{}{}
		wg.Add(1)
		go func(g []driver.OutboxRow) {
			defer func() { <-sem; wg.Done() }()
			n, err := r.publishGroup(pctx, startBy, g, &noHold)
			mu.Lock()
			defer mu.Unlock()
			for _, row := range g[:n] {
				published = append(published, row.ID)
			}
			switch {
			case errors.Is(err, ErrBrokerUnavailable):
				down++ // no failure of the key: counted, not listed
			case errors.Is(err, errLate):
				// Counted, not listed: a claim of thousands of keys
				// would otherwise log each.
				late++
			case err != nil:
				errs = append(errs, err)
			}
		}(g)
	}
	wg.Wait()
	cancel()
	if late > 0 {
		errs = append(errs, fmt.Errorf("outbox: %d of %d keys: %w", late, len(groups), errLate))
	}
	if down > 0 {
		errs = append(errs, fmt.Errorf("outbox: %d of %d keys left for later: %w", down, len(groups), ErrBrokerUnavailable))
	}
	r.fault(FaultAfterPublish)
	if down == 0 {
		// Keys a broker outage left late say nothing of the claim's size.
		r.adaptLimit(limit, len(rows), len(published), late, claimTook)
	}
	// The marks must land even if ctx just ended: the broker has the rows.
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), markBudget(len(published)))
	defer scancel()
	if len(published) > 0 {
		if err := r.store.OutboxMarkPublished(sctx, published); err != nil {
			storeFailed = true
			errs = append(errs, fmt.Errorf("outbox: mark published (the rows will be published again): %w", err))
		} else {
			res.Published = len(published)
		}
	}
	r.fault(FaultAfterMark)
	res.Failed = res.Claimed - res.Published
	// Its own budget: a long mark (tens of thousands of rows on a slow
	// disk) must not leave the release none, which would keep the keys
	// from other relays until the claims expire.
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer rcancel()
	if err := r.store.OutboxRelease(rctx, r.cfg.Owner); err != nil {
		storeFailed = true
		errs = append(errs, fmt.Errorf("outbox: release claims (they expire after %s): %w", r.cfg.ClaimTTL, err))
	}
	return res, storeFailed || noHold.Load(), late, errors.Join(errs...)
}

// adaptLimit sets the next cycle's claim from this one's, which claimed
// n rows of limit in took and published p of them, leaving late keys for
// later because their turn came after half the claim. A claim so large
// that reading it took half the claim (a slow store, a BatchSize of tens
// of thousands) would publish nothing every cycle, for ever: the next
// claims are halved until keys get their turn, and doubled back towards
// BatchSize after a full cycle on time whose claim took under an eighth
// of ClaimTTL, so that the doubled one stays well inside half.
func (r *Relay) adaptLimit(limit, n, p, late int, took time.Duration) {
	switch {
	case late > 0 && p == 0:
		next := max(1, n/2)
		r.limit = next
		r.logs.Warn(r.cfg.Logger, "outbox-claim-halved", "outbox: no key's turn came within half the claim; claiming fewer rows a cycle",
			slog.String("owner", r.cfg.Owner), slog.Int("claimed", n), slog.Int("next_claim", next), slog.Duration("claim_ttl", r.cfg.ClaimTTL))
	case late == 0 && n >= limit && limit < r.cfg.BatchSize && took < r.cfg.ClaimTTL/8:
		r.limit = min(r.cfg.BatchSize, 2*limit)
	}
}

// markBudget is how long marking n published rows may take once the
// cycle's context has ended: 10 s, and 1 ms more a row. A budget that did
// not grow with the claim would fail the same large mark on a slow store
// every cycle, publishing the same rows again and again.
func markBudget(n int) time.Duration {
	return 10*time.Second + time.Duration(n)*time.Millisecond
}

// errClaimRunningOut ends a cycle's publishes at nine tenths of the claim:
// a publish that slow is its key's failure. Any other end of their
// context (cancelled, or its own deadline reached) is the relay stopping.
var errClaimRunningOut = errors.New("outbox: publish cut off at nine tenths of the claim")

// errLate is keys left for the next cycle: their turn came after half the
// claim.
var errLate = errors.New("claim half gone before their turn; left for the next cycle")

// publishGroup publishes one ordering key's rows, in order, and returns
// how many of them (a prefix) the broker acknowledged. It sets noHold when
// a failure's hold could not be recorded.
func (r *Relay) publishGroup(ctx context.Context, startBy time.Time, g []driver.OutboxRow, noHold *atomic.Bool) (int, error) {
	if r.brokerDown.Load() {
		return 0, ErrBrokerUnavailable // the outage began during this cycle
	}
	if time.Now().After(startBy) {
		return 0, fmt.Errorf("outbox: key %q: %w", g[0].OrderingKey, errLate)
	}
	msgs := make([]*idem.Message, 0, len(g))
	var err error
	for _, row := range g {
		m, merr := rowMessage(&row)
		if merr != nil {
			// A row written other than by Add: the key fails at it as a
			// refused publish does, held and visible, so that it does
			// not take every cycle's claim from the other keys. The
			// rows before it go out first: their order allows it.
			err = fmt.Errorf("outbox: key %q: %w", row.OrderingKey, merr)
			break
		}
		msgs = append(msgs, m)
	}
	n := 0
	if len(msgs) > 0 {
		if perr := r.publish(ctx, msgs); perr != nil {
			err = fmt.Errorf("outbox: publish %d rows of key %q from %q: %w", len(msgs), g[0].OrderingKey, g[0].MessageID, perr)
			if ctx.Err() != nil && !errors.Is(context.Cause(ctx), errClaimRunningOut) {
				// The relay is stopping (its context was cancelled or
				// reached its deadline): not the key's failure, and no
				// reason to keep the next relay off it.
				return 0, err
			}
			if r.brokerOutage(ctx, perr) {
				// Not the key's failure either: no attempt, no hold.
				return 0, fmt.Errorf("%w: %w", ErrBrokerUnavailable, err)
			}
		} else {
			n = len(msgs)
		}
	}
	if err == nil {
		return n, nil
	}
	head := &g[n] // the row that failed: the first not published
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	// The key waits out its own backoff, growing with its head row's
	// attempts (at least half of Base: a hold of nothing would let the key
	// take the next cycle again); the other keys go on.
	hold := max(r.cfg.Backoff.Delay(head.Attempts), r.cfg.Backoff.Base/2)
	if ferr := r.store.OutboxFailed(sctx, r.cfg.Owner, head.ID, lastErrorText(err), hold); ferr != nil {
		noHold.Store(true)
		// Every refused key of the claim meets the same store failure:
		// one line per kind every 10 s.
		r.logs.Warn(r.cfg.Logger, idem.Fingerprint(ferr), "outbox: recording a failed publish failed",
			slog.String("owner", r.cfg.Owner), slog.Any("error", ferr))
	} else {
		r.held(time.Now().Add(hold + hold/20 + 10*time.Millisecond))
	}
	return n, err
}

// errPublisherPanicked is the error of a publish whose Publisher
// panicked.
var errPublisherPanicked = errors.New("outbox: the Publisher panicked")

// publish is the Publisher's Publish, a panic in which (a row meeting a
// bug in it) fails the key as a refused publish does, held and visible on
// the row, rather than ending the process: every restart would claim the
// same row first again.
func (r *Relay) publish(ctx context.Context, msgs []*idem.Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			r.logs.Log(r.cfg.Logger, slog.LevelError, "", "outbox: the Publisher panicked; the key fails as if refused",
				slog.String("owner", r.cfg.Owner), slog.String("message_id", msgs[0].ID), slog.Any("panic", v), slog.String("stack", string(debug.Stack())))
			err = fmt.Errorf("%w: %v", errPublisherPanicked, v)
		}
	}()
	return r.pub.Publish(ctx, msgs)
}

// maxLastErrorLen bounds the error text recorded on a failed row, in
// bytes.
const maxLastErrorLen = 2048

// lastErrorText returns err's text as every store's last_error column
// takes it (errtext.Storable). A Publisher's error carries whatever its
// broker or library said; a text the store refused would leave the
// failure unrecorded and the key unheld.
func lastErrorText(err error) string { return errtext.Storable(err.Error(), maxLastErrorLen) }

// brokerOutage reports whether perr, a failed publish, came from the
// broker being out of reach: an outage is already under way, or the
// Publisher's BrokerProber suspects perr and a probe fails too, which
// starts one (and logs its one line).
func (r *Relay) brokerOutage(ctx context.Context, perr error) bool {
	if r.broker == nil {
		return false
	}
	if r.brokerDown.Load() {
		return true
	}
	if !r.broker.Unavailable(perr) && !outage.Network(perr) {
		return false
	}
	probeErr := r.probeBroker(ctx)
	if probeErr == nil {
		return false
	}
	if r.brokerDown.CompareAndSwap(false, true) {
		r.brokerSince.Store(time.Now().UnixNano())
		r.cfg.Logger.Warn("outbox: broker unreachable; pausing publishes until it answers (no attempt is counted on the rows)",
			slog.String("owner", r.cfg.Owner), slog.Any("error", perr), slog.Any("probe", probeErr))
	}
	return true
}

// probeBroker runs one probe of the broker, for at most 2 s whatever
// ctx's state.
func (r *Relay) probeBroker(ctx context.Context) error {
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	return r.broker.Probe(pctx)
}

// brokerUp ends a broker outage, logging its one line.
func (r *Relay) brokerUp() {
	if r.brokerDown.CompareAndSwap(true, false) {
		r.cfg.Logger.Info("outbox: broker answers again; resuming publishes", slog.String("owner", r.cfg.Owner),
			slog.Duration("outage", time.Since(time.Unix(0, r.brokerSince.Load())).Round(time.Millisecond)))
	}
}

// waitBroker waits until a probe finds the broker back, probing with a
// backoff from Backoff.Base capped at a second, and ends the outage. It
// returns ctx's error if ctx ends first, and a probe's error that says
// the broker can never answer (idem.IsPermanent), logged at ERROR: a
// relay waiting on a connection closed for good would wait silently
// for ever.
func (r *Relay) waitBroker(ctx context.Context) error {
	for i := 0; ; i++ {
		t := time.NewTimer(min(r.cfg.Backoff.Delay(i), time.Second))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		err := r.probeBroker(ctx)
		if err == nil {
			break
		}
		if idem.IsPermanent(err) {
			r.cfg.Logger.Error("outbox: the Publisher can never reach its broker again; the relay stops (rows stay pending)",
				slog.String("owner", r.cfg.Owner), slog.Any("error", err))
			return fmt.Errorf("outbox: relay %q: %w", r.cfg.Owner, err)
		}
	}
	r.brokerUp()
	return nil
}

// held records that a key is held until at, for Run's wait.
func (r *Relay) held(at time.Time) {
	r.holdMu.Lock()
	defer r.holdMu.Unlock()
	r.retries = append(r.retries, at)
}

// untilRetry returns how long until the first key this relay held is
// claimable again, or limit if that is later or none is held.
func (r *Relay) untilRetry(limit time.Duration) time.Duration {
	r.holdMu.Lock()
	defer r.holdMu.Unlock()
	for _, at := range r.retries {
		limit = min(limit, time.Until(at))
	}
	return limit
}

// groupByKey splits rows (in ID order) by ordering key, keeping the order
// within each key and the order of first appearance across keys.
func groupByKey(rows []driver.OutboxRow) [][]driver.OutboxRow {
	idx := map[string]int{}
	var groups [][]driver.OutboxRow
	for _, row := range rows {
		i, ok := idx[row.OrderingKey]
		if !ok {
			i = len(groups)
			idx[row.OrderingKey] = i
			groups = append(groups, nil)
		}
		groups[i] = append(groups[i], row)
	}
	return groups
}

// rowMessage rebuilds the message a row was added from.
func rowMessage(row *driver.OutboxRow) (*idem.Message, error) {
	m := &idem.Message{ID: row.MessageID, Stream: row.Destination, Type: row.Type, AggregateID: row.AggregateID, Seq: row.Seq, Payload: row.Payload, Time: row.CreatedAt}
	if len(row.Headers) > 0 {
		if err := json.Unmarshal(row.Headers, &m.Headers); err != nil {
			return nil, fmt.Errorf("outbox: row %d headers: %w", row.ID, err)
		}
	}
	return m, nil
}

// Run publishes until ctx is done and returns ctx's error, or until the
// Publisher's Probe says its broker can never answer again (a NATS
// connection closed for good) and returns that. It runs a cycle
// at once after a full one, after a store notification, or every
// PollInterval; after a failure it waits the backoff, growing while
// failures repeat.
func (r *Relay) Run(ctx context.Context) error {
	var wake <-chan struct{}
	if r.notifier != nil {
		ch, err := r.notifier.OutboxListen(ctx)
		if err != nil {
			r.cfg.Logger.Warn("outbox: no store notifications; polling", slog.Duration("interval", r.cfg.PollInterval), slog.Any("error", err))
		} else {
			wake = ch
		}
	}
	failures := 0
	for {
		res, storeFailed, late, err := r.runOnce(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		var wait time.Duration
		switch {
		case err != nil && !storeFailed && r.brokerDown.Load():
			// The broker is down: no cycle until a probe finds it back
			// (one line marks the outage, one its end). The rows wait,
			// pending, no attempt counted.
			if werr := r.waitBroker(ctx); werr != nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				return werr
			}
			failures = 0
			continue
		case err != nil && storeFailed && r.watch.Check(ctx, err):
			// The store is down: no cycle until a probe finds it back
			// (one line marks the outage, one its end). Rows published
			// but not marked go out again: consumers take them as
			// duplicates.
			if werr := r.watch.Wait(ctx, nil); werr != nil {
				return ctx.Err()
			}
			failures = 0
			continue
		case err != nil && storeFailed:
			// The store failed a write (a claim, a mark, a hold, the
			// release): back off the whole relay.
			wait = r.cfg.Backoff.Delay(failures)
			failures++
			// A broker or store refusing every cycle fails each alike:
			// one line per kind of failure every 10 s.
			r.logs.Warn(r.cfg.Logger, idem.Fingerprint(err), "outbox: relay cycle failed; retrying", slog.String("owner", r.cfg.Owner), slog.Int("published", res.Published),
				slog.Int("failed", res.Failed), slog.Duration("retry_after", wait), slog.Any("error", err))
		case err != nil:
			// Keys failed to publish and wait out their own backoff, held
			// where no relay claims them; the others were published, or
			// there were none. Either way the relay goes on: a wake-up
			// for another key's new row is not kept waiting behind a key
			// the broker refuses (and if the broker refuses everything,
			// each key backs off on its own).
			failures = 0
			r.logs.Warn(r.cfg.Logger, idem.Fingerprint(err), "outbox: some keys failed; they are retried after their backoff", slog.String("owner", r.cfg.Owner), slog.Int("published", res.Published),
				slog.Int("failed", res.Failed), slog.Any("error", err))
			// More may be waiting, and keys left unheld (their turn came
			// too late in the claim) are pending already: go on at once
			// after a cycle that published something. Not after one that
			// published nothing, which would claim those keys again in a
			// loop; they are still taken up within Backoff.Base, not left
			// for a PollInterval that notifications may make long.
			if (r.full.Load() || late > 0) && res.Published > 0 {
				continue
			}
			wait = r.untilRetry(r.cfg.PollInterval)
			if late > 0 {
				wait = min(wait, r.cfg.Backoff.Base)
			}
			err = nil
		case r.full.Load():
			failures = 0
			continue // more may be waiting
		default:
			failures = 0
			wait = r.untilRetry(r.cfg.PollInterval)
		}
		if err != nil {
			// A failure's backoff is not cut short by new rows.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(wait):
			}
			continue
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		case _, ok := <-wake:
			t.Stop()
			if !ok {
				wake = nil
			}
		}
	}
}

// Stats reports the outbox: pending and published rows, the oldest pending
// row's time, failing rows and the last error.
func (r *Relay) Stats(ctx context.Context) (driver.OutboxStats, error) {
	s, err := r.store.OutboxStats(ctx)
	if err != nil {
		return s, fmt.Errorf("outbox: stats: %w", err)
	}
	return s, nil
}
