package idem

import (
	"context"
	crand "crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/errtext"
	"github.com/idemhq/idem/internal/lograte"
)

// Defaults of LeaseConfig.
const (
	// DefaultLeaseTTL is the default LeaseConfig.TTL.
	DefaultLeaseTTL = 15 * time.Minute
	// DefaultLeaseHeartbeat is the default LeaseConfig.Heartbeat (capped
	// at TTL/3 for short TTLs).
	DefaultLeaseHeartbeat = 30 * time.Second
	// DefaultBackoffBase is the default LeaseConfig.BackoffBase.
	DefaultBackoffBase = time.Second
	// DefaultBackoffMax is the default LeaseConfig.BackoffMax.
	DefaultBackoffMax = 5 * time.Minute
)

// Environment variables that LeaseConfig.FromEnv reads.
const (
	// EnvLeaseTTL sets LeaseConfig.TTL, as a Go duration ("15m", "90s").
	EnvLeaseTTL = "IDEM_LEASE_TTL"
	// EnvLeaseHeartbeat sets LeaseConfig.Heartbeat, as a Go duration.
	EnvLeaseHeartbeat = "IDEM_LEASE_HEARTBEAT"
	// EnvLeaseOwner sets LeaseConfig.Owner.
	EnvLeaseOwner = "IDEM_LEASE_OWNER"
)

// Fault points passed to LeaseConfig.FaultHook, in the order an attempt
// reaches them. Points inside the handler (before and after its external
// call) belong to the handler itself.
const (
	// FaultAfterClaim: the claim is committed; the handler has not
	// started.
	FaultAfterClaim = "after_claim"
	// FaultBeforeHeartbeat: a heartbeat is about to be sent (on the
	// heartbeat goroutine, while the handler runs).
	FaultBeforeHeartbeat = "before_heartbeat"
	// FaultBeforeDone: the handler returned nil; the row is not yet marked
	// done.
	FaultBeforeDone = "before_done"
	// FaultAfterDone: the row is marked done; Process has not returned.
	FaultAfterDone = "after_done"
	// FaultBeforeFail: the handler failed; the row is not yet marked
	// failed.
	FaultBeforeFail = "before_fail"
)

// maxLastErrorLen bounds the error text stored with a failed row, in bytes.
const maxLastErrorLen = 2048

var (
	// ErrFenced matches a *FencedError: a heartbeat, done or failed write
	// whose fencing token was no longer current.
	ErrFenced = errors.New("idem: lease fenced: token is no longer current")
	// ErrLeaseExpired is the cause (context.Cause) of a handler context
	// cancelled because the lease ran out before a heartbeat renewed it.
	ErrLeaseExpired = errors.New("idem: lease expired before a heartbeat renewed it")
	// ErrFailedPermanently matches the error Process returns for a message
	// whose lease-mode handler failed permanently on an earlier delivery
	// (a Permanent error, or MaxAttempts reached). The handler is not
	// called again; the error is permanent.
	ErrFailedPermanently = errors.New("idem: message failed permanently earlier")
)

// FencedError reports a lease write (heartbeat, done, failed) refused because
// the caller's fencing token was no longer current: the lease expired and
// another worker claimed the message since (or the row was finished). Nothing
// was written. It matches ErrFenced.
type FencedError struct {
	// Op is the refused write: "heartbeat", "done" or "failed".
	Op string
	// Handler and MessageID name the row.
	Handler   string
	MessageID string
	// Token is the stale token the caller held.
	Token int64
	// CurrentToken, CurrentOwner and CurrentStatus describe the row as
	// found; CurrentStatus is "missing" if the row no longer exists.
	CurrentToken  int64
	CurrentOwner  string
	CurrentStatus string
}

// Error implements error.
func (e *FencedError) Error() string {
	return fmt.Sprintf("idem: handler %q, message %q: %s with token %d refused: the row is %s with token %d (owner %q)",
		e.Handler, e.MessageID, e.Op, e.Token, e.CurrentStatus, e.CurrentToken, e.CurrentOwner)
}

// Is makes errors.Is(err, ErrFenced) true.
func (e *FencedError) Is(target error) bool { return target == ErrFenced }

// IdempotencyKey returns the key lease mode hands to the handler of handler
// for messageID: the lower-case hex SHA-256 of handler, a NUL byte and
// messageID. It is the same for every attempt, worker and process, so a
// downstream API that deduplicates by it (an Idempotency-Key header, a
// request ID, a unique column) applies the effect once.
//
// A hash rather than the readable "handler:id": it is unambiguous (handler
// names may contain ':' and IDs anything but NUL), always 64 ASCII
// characters (IDs may be 255 bytes of any UTF-8, which header values and
// APIs that cap keys at 64 characters refuse), and does not disclose
// message IDs to third parties.
func IdempotencyKey(handler, messageID string) string {
	h := sha256.New()
	h.Write([]byte(handler))
	h.Write([]byte{0})
	h.Write([]byte(messageID))
	return hex.EncodeToString(h.Sum(nil))
}

// Lease is what a lease-mode handler gets besides the message.
type Lease struct {
	// Token is the fencing token: it grows by one at every claim of this
	// (handler, message ID), so a downstream that remembers the highest
	// token it has seen per key can refuse writes from a worker that lost
	// its lease.
	Token int64
	// IdempotencyKey is IdempotencyKey(handler name, message ID): send it
	// to downstream APIs so that a repeated attempt is recognised.
	IdempotencyKey string
	// Owner is this worker's identity (LeaseConfig.Owner).
	Owner string
	// Attempt counts the claims of this message that went on to call the
	// handler or ended without a verdict, this one included: 1 on the first
	// attempt, more after a failure or an expired lease. Waits behind an
	// ordering gap do not count; a replay of its dead letter starts again
	// at 1.
	Attempt int
}

// LeaseHandler is a handler whose effect lives outside the database: an
// HTTP call, an email, a write to another store. It runs under a lease; see
// LeaseProcessor.
type LeaseHandler struct {
	// Name identifies the handler; see ValidateHandlerName. It is stored
	// with every row and is part of the idempotency key. Use a name for
	// one mode only. Required.
	Name string
	// Call performs the effect. ctx is cancelled as soon as the lease is
	// lost (context.Cause gives ErrLeaseExpired or a *FencedError) and
	// when the caller's context is; stop and return then. Returning nil
	// marks the message done; an error marks it failed and schedules a
	// retry, unless it is Permanent. Required. A handler that consumes
	// several event types routes them with ByType(Routes[*Lease]{...}):
	// a type without a route is then a permanent *UnknownTypeError,
	// dead-lettered, instead of reaching another type's effect.
	Call func(ctx context.Context, l *Lease, msg *Message) error
	// OnConflict is the payload-conflict policy. Default OnConflictError.
	OnConflict ConflictPolicy
	// Ordering, when set, runs the per-aggregate sequence guard for
	// messages with a Seq: before Call, an event at or below the
	// aggregate's last applied sequence is Stale (marked done, not
	// called) and a gap follows Ordering.Gap; a successful Call advances
	// the sequence in the same write that marks the message done. The
	// guard is checked before the call and advanced after it, so two
	// events of one aggregate must not run at the same time: deliver an
	// aggregate's events from one partition or subject, as brokers do.
	// VersionOnly is not available in lease mode (the marker row is the
	// lease). The driver must implement driver.LeaseSequencer.
	Ordering *Ordering
}

// LeaseConfig configures a LeaseProcessor. The zero value is valid: every
// field has a default, filled in and checked by NewLeaseProcessor.
type LeaseConfig struct {
	// TTL is how long a claim or a heartbeat keeps the lease. A worker that
	// crashes holds the message this long before another may retry it; a
	// worker whose heartbeats fail for this long loses it. At least 1 ms.
	// Default 15 min. Environment: IDEM_LEASE_TTL.
	TTL time.Duration
	// Heartbeat is the interval at which the lease is extended while the
	// handler runs. It must be below TTL/2, so that one failed heartbeat
	// does not lose the lease. Default 30 s, or TTL/3 when that is
	// shorter. Environment: IDEM_LEASE_HEARTBEAT.
	Heartbeat time.Duration
	// Owner names this worker in the store, for diagnostics: the fencing
	// token, not the owner, decides who may write. 1–255 bytes of UTF-8
	// without NUL. Default "hostname:pid". Environment: IDEM_LEASE_OWNER.
	// Each claim stores it with a suffix of its own, "worker-1/3f9a0c12e4b7"
	// (Owner cut to fit 255 bytes): a claim whose answer the store lost
	// is then known for this worker's by its next claim of the message,
	// which takes it up instead of waiting for its lease to run out.
	Owner string
	// BackoffBase and BackoffMax shape the delay after a failed attempt
	// before the message may be claimed again: exponential with full
	// jitter, uniform in [0, min(BackoffMax, BackoffBase × 2^(attempt−1))].
	// Defaults 1 s (or BackoffMax, if that is set and shorter) and 5 min
	// (or BackoffBase, if that is longer).
	BackoffBase, BackoffMax time.Duration
	// MaxAttempts makes a failure permanent once the message has been
	// claimed this many times (crashed attempts count; waits behind an
	// ordering gap do not), and bounds the handler's calls: a claim past
	// it, after an attempt that ended without a verdict, fails permanently
	// without a call. Replaying the dead letter grants MaxAttempts more.
	// 0, the default, retries without limit.
	MaxAttempts int
	// Logger receives warnings: lost leases, failed heartbeats, payload
	// conflicts under OnConflictWarn. Default slog.Default().
	Logger *slog.Logger
	// Hooks receive outcomes (HookOutcome), calls (HookCall) and lost leases
	// (HookLeaseLost). Default: none.
	Hooks []Hook
	// FaultHook, when set, is called at each Fault* point of every
	// attempt. It is for tests only: crash tests kill the process in it,
	// zombie tests block in it. Leave it nil in production.
	FaultHook func(point string)
}

// FromEnv overwrites the fields whose IDEM_LEASE_* environment variable is
// set and not empty: IDEM_LEASE_TTL and IDEM_LEASE_HEARTBEAT as Go durations
// ("15m", "30s"), IDEM_LEASE_OWNER as a string. Call it after setting the
// fields in code to let operators override them. A value that does not
// parse, a duration that is not positive, or an owner that is not 1–255
// bytes of UTF-8 without NUL gives an error matching ErrInvalidConfig that
// names the variable; the other rules are checked by NewLeaseProcessor.
//
// FromEnv reads and checks every variable before it sets any field. An
// error leaves c as it was, so a caller that logs the error and carries on
// does not run with half of the operator's settings.
func (c *LeaseConfig) FromEnv() error {
	ttl, heartbeat, owner := c.TTL, c.Heartbeat, c.Owner
	for _, v := range []struct {
		name string
		dst  *time.Duration
	}{{EnvLeaseTTL, &ttl}, {EnvLeaseHeartbeat, &heartbeat}} {
		s := os.Getenv(v.name)
		if s == "" {
			continue
		}
		d, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("%w: %s=%q is not a duration such as 90s or 15m", ErrInvalidConfig, v.name, s)
		}
		if d <= 0 {
			return fmt.Errorf("%w: %s=%q must be positive", ErrInvalidConfig, v.name, s)
		}
		*v.dst = d
	}
	if s := os.Getenv(EnvLeaseOwner); s != "" {
		if reason := checkText(s, MaxIDLen); reason != "" {
			return fmt.Errorf("%w: %s %s", ErrInvalidConfig, EnvLeaseOwner, reason)
		}
		owner = s
	}
	c.TTL, c.Heartbeat, c.Owner = ttl, heartbeat, owner
	return nil
}

// resolve returns c with defaults filled in, or why it is invalid.
func (c LeaseConfig) resolve() (LeaseConfig, error) {
	bad := func(format string, args ...any) (LeaseConfig, error) {
		return LeaseConfig{}, fmt.Errorf("%w: lease: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	switch {
	case c.TTL == 0:
		c.TTL = DefaultLeaseTTL
	case c.TTL < time.Millisecond:
		return bad("TTL (%s) is %s; it must be at least 1ms", EnvLeaseTTL, c.TTL)
	}
	switch {
	case c.Heartbeat == 0:
		c.Heartbeat = min(DefaultLeaseHeartbeat, c.TTL/3)
	case c.Heartbeat < 0:
		return bad("Heartbeat (%s) is %s; it must be positive", EnvLeaseHeartbeat, c.Heartbeat)
	}
	if c.Heartbeat >= c.TTL/2 {
		return bad("Heartbeat (%s) is %s; it must be below TTL/2 = %s so that one failed heartbeat does not lose the lease",
			EnvLeaseHeartbeat, c.Heartbeat, c.TTL/2)
	}
	if c.Owner == "" {
		c.Owner = defaultOwner()
	}
	if reason := checkText(c.Owner, MaxIDLen); reason != "" {
		return bad("Owner (%s) %s", EnvLeaseOwner, reason)
	}
	if c.BackoffBase == 0 {
		c.BackoffBase = DefaultBackoffBase
		if c.BackoffMax > 0 {
			c.BackoffBase = min(c.BackoffBase, c.BackoffMax)
		}
	}
	if c.BackoffMax == 0 {
		c.BackoffMax = max(DefaultBackoffMax, c.BackoffBase)
	}
	if c.BackoffBase < 0 || c.BackoffMax < c.BackoffBase {
		return bad("BackoffBase is %s and BackoffMax %s; want 0 < BackoffBase ≤ BackoffMax", c.BackoffBase, c.BackoffMax)
	}
	if c.MaxAttempts < 0 {
		return bad("MaxAttempts is %d; want 0 (unlimited) or more", c.MaxAttempts)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// defaultOwner returns "hostname:pid".
func defaultOwner() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	pid := fmt.Sprintf(":%d", os.Getpid())
	host = strings.ToValidUTF8(strings.ReplaceAll(host, "\x00", ""), "?")
	for len(host)+len(pid) > MaxIDLen {
		_, size := utf8.DecodeLastRuneInString(host)
		host = host[:len(host)-size]
	}
	return host + pid
}

// HookLeaseLost is told every time a worker loses a lease: a heartbeat, done
// or failed write refused as fenced, or the lease running out before a
// heartbeat renewed it. Each sign is told, by its Op: one lease that ran
// out while its worker was paused may be told as expired, then as a
// refused heartbeat and a refused done. Losses are normal after long pauses and store
// outages, but a steady stream means the TTL is too short for the handler.
// It may run on the heartbeat goroutine: keep it fast and never block.
type HookLeaseLost interface {
	OnLeaseLost(ctx context.Context, ev *LeaseLostEvent)
}

// LeaseLostEvent describes a lost lease.
type LeaseLostEvent struct {
	// Handler and MessageID name the row.
	Handler   string
	MessageID string
	// Owner is this worker; Token the lease it lost.
	Owner string
	Token int64
	// Op is "heartbeat", "done" or "failed" for a fenced write, "expired"
	// when the lease ran out locally.
	Op string
	// Err is the *FencedError, or ErrLeaseExpired.
	Err error
}

// LeaseProcessor runs lease-mode handlers: handlers whose effect lives
// outside the database, so the marker cannot share its transaction.
//
// For each delivery it claims (handler, message ID) with a lease and a
// fencing token in one atomic statement, runs the handler while a heartbeat
// extends the lease, and marks the row done — or failed, with a retry time
// from the backoff. Heartbeat, done and failed are refused (a *FencedError)
// once another worker has claimed the message since; the handler's context
// is cancelled as soon as the lease is lost. No transaction stays open while
// the handler runs.
//
// This is at-least-once plus dedup, not exactly-once: a worker that dies
// after the effect and before done leaves a lease that expires after the TTL,
// and the next claim runs the handler again with the same idempotency key.
// The effect happens once only if the downstream honours that key. See
// docs/lease-mode.md.
//
// It is safe for concurrent use.
type LeaseProcessor struct {
	drv        driver.LeaseDriver
	seq        driver.LeaseSequencer // nil if the driver has no ordering guard
	cfg        LeaseConfig
	onOutcome  []HookOutcome
	onLost     []HookLeaseLost
	onCall     callHooks
	logs       *lograte.Limiter // summarizes repeated failure lines
	unanswered lostClaims       // claims whose answer may have been lost
}

// lostClaims remembers, per handler and message, the owner name of a
// claim that failed with an error: the store may have written it and
// lost only its answer (a connection cut, a server crash). That row is
// then running under an owner name no other claim ever used, so the next
// claim of the message by this processor, seeing it, knows it for its
// own and takes it up, instead of waiting out a lease no one holds. It
// also remembers claims whose closing write failed (see uncalled and
// failCall): their rows are left running the same way.
type lostClaims struct {
	mu     sync.Mutex
	owners map[string]lostClaim
}

type lostClaim struct {
	owner string
	until time.Time // when its lease would have run out anyway
	// fail, when set, is the failed call of this claim whose record the
	// store did not take: taking the lease up writes it instead of
	// calling the handler again.
	fail *pendingFail
}

// pendingFail is a failed call's record: what failCall writes.
type pendingFail struct {
	token     int64
	herr      error
	retryIn   time.Duration
	permanent bool // a Permanent error, or the attempts used up
	exhausted bool // the attempts used up
	called    bool
	attempt   int
}

// maxLostClaims bounds what lostClaims remembers; past it the expired
// entries go, then the oldest.
const maxLostClaims = 10000

// take removes and returns key's lost claim, and whether there is one
// whose lease may still run.
func (lc *lostClaims) take(key string, now time.Time) (lostClaim, bool) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	c, ok := lc.owners[key]
	delete(lc.owners, key)
	return c, ok && now.Before(c.until)
}

// put remembers c as key's lost claim.
func (lc *lostClaims) put(key string, c lostClaim) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if lc.owners == nil {
		lc.owners = map[string]lostClaim{}
	}
	if len(lc.owners) >= maxLostClaims {
		now, oldest, at := time.Now(), "", time.Time{}
		for k, c := range lc.owners {
			if !now.Before(c.until) {
				delete(lc.owners, k)
			} else if oldest == "" || c.until.Before(at) {
				oldest, at = k, c.until
			}
		}
		if len(lc.owners) >= maxLostClaims {
			delete(lc.owners, oldest)
		}
	}
	lc.owners[key] = c
}

// claimOwner is the owner name of a new claim: Owner and a random suffix
// that no other claim shares, cut to the 255 bytes a name may take.
func (p *LeaseProcessor) claimOwner() string {
	var b [6]byte
	_, _ = crand.Read(b[:])
	suffix := "/" + hex.EncodeToString(b[:])
	owner := p.cfg.Owner
	for len(owner)+len(suffix) > MaxIDLen {
		_, size := utf8.DecodeLastRuneInString(owner)
		owner = owner[:len(owner)-size]
	}
	return owner + suffix
}

// name is h's name, or "" for a nil handler.
func (h *LeaseHandler) name() string {
	if h == nil {
		return ""
	}
	return h.Name
}

// NewLeaseProcessor returns a LeaseProcessor over drv. It does not migrate
// the schema. Invalid configuration gives an error matching
// ErrInvalidConfig.
func NewLeaseProcessor(drv driver.LeaseDriver, cfg *LeaseConfig) (*LeaseProcessor, error) {
	if drv == nil {
		return nil, fmt.Errorf("%w: nil lease driver", ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &LeaseConfig{}
	}
	rc, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	p := &LeaseProcessor{drv: drv, cfg: rc, logs: lograte.New(logEvery)}
	p.seq, _ = drv.(driver.LeaseSequencer)
	for i, h := range rc.Hooks {
		o, isOutcome := h.(HookOutcome)
		l, isLost := h.(HookLeaseLost)
		c, isCall := h.(HookCall)
		if !isOutcome && !isLost && !isCall {
			return nil, fmt.Errorf("%w: Hooks[%d] (%T) implements no Hook interface", ErrInvalidConfig, i, h)
		}
		if isCall {
			p.onCall = append(p.onCall, c)
		}
		if isOutcome {
			p.onOutcome = append(p.onOutcome, o)
		}
		if isLost {
			p.onLost = append(p.onLost, l)
		}
	}
	return p, nil
}

// Config returns the configuration in effect, defaults filled in.
func (p *LeaseProcessor) Config() LeaseConfig { return p.cfg }

// Process runs msg through h under a lease. Outcomes:
//
//   - Applied, nil: the handler returned nil and the row is marked done.
//     Acknowledge the delivery.
//   - Duplicate, nil: the row was already done; the handler was not called.
//     Acknowledge.
//   - InFlight, nil: another worker holds a live lease, or the last
//     attempt failed and its retry time has not come. Do not acknowledge:
//     redeliver later.
//   - Conflict, *ConflictError: the row holds a different payload hash;
//     never applied. Dead-letter, then acknowledge.
//   - OutcomeNone, error: nothing is done. The handler's error (the row is
//     marked failed and retried after the backoff), a *PanicError, a
//     *FencedError (the lease was lost: another worker has the message), a
//     store error, or a *ValidationError. IsPermanent reports the errors
//     not worth retrying (Permanent handler errors, MaxAttempts reached,
//     ErrFailedPermanently, validation): dead-letter those.
func (p *LeaseProcessor) Process(ctx context.Context, h *LeaseHandler, msg *Message) (Outcome, error) {
	return p.run(ctx, h, msg, nil)
}

// run is Process. When due is not nil and the outcome is InFlight because
// the last attempt failed, it receives how long until that attempt's retry
// is due.
func (p *LeaseProcessor) run(ctx context.Context, h *LeaseHandler, msg *Message, due *time.Duration) (Outcome, error) {
	start := time.Now()
	ctx, cs := p.onCall.start(ctx, h.name(), msg, nil, false, true, start)
	defer cs.endOnPanic()
	out, err := p.process(ctx, h, msg, due)
	// The call ends after the outcome hooks, as a Processor's does.
	defer cs.end([]Outcome{out}, err)
	if len(p.onOutcome) > 0 {
		ev := &OutcomeEvent{Handler: h.name(), Outcome: out, Err: err, Duration: time.Since(start), BatchSize: 1}
		if msg != nil {
			ev.MessageID = msg.ID
		}
		for _, hk := range p.onOutcome {
			hk.OnOutcome(ctx, ev)
		}
	}
	return out, err
}

func (p *LeaseProcessor) process(ctx context.Context, h *LeaseHandler, msg *Message, due *time.Duration) (Outcome, error) {
	if h == nil {
		return OutcomeNone, fmt.Errorf("%w: nil lease handler", ErrInvalidConfig)
	}
	if err := ValidateHandlerName(h.Name); err != nil {
		return OutcomeNone, err
	}
	if h.Call == nil {
		return OutcomeNone, fmt.Errorf("%w: lease handler %q has no Call", ErrInvalidConfig, h.Name)
	}
	if err := msg.Validate(); err != nil {
		return OutcomeNone, err
	}
	agg, guarded, err := p.guardKey(h, msg)
	if err != nil {
		return OutcomeNone, err
	}
	hash := msg.PayloadHash()
	sent := time.Now()
	key := h.Name + "\x00" + msg.ID
	lost, retry := p.unanswered.take(key, sent)
	owner := lost.owner
	if !retry {
		owner, lost = p.claimOwner(), lostClaim{}
	}
	res, err := p.drv.LeaseClaim(ctx, &driver.LeaseClaimParams{
		Handler: h.Name, MessageID: msg.ID, PayloadHash: hash, Owner: owner, TTL: p.cfg.TTL,
	})
	if err != nil {
		// A failure still to record stays remembered with the claim.
		p.unanswered.put(key, lostClaim{owner: owner, until: sent.Add(p.cfg.TTL), fail: lost.fail})
		return OutcomeNone, fmt.Errorf("idem: handler %q, message %q: claim lease: %w", h.Name, msg.ID, err)
	}
	if row := res.Existing; !res.Claimed && retry && row != nil && row.Status == driver.LeaseRunning && row.Owner == owner && row.LeaseUntil.After(row.Now) {
		// This processor's own claim, whose answer was lost or whose
		// closing write failed, and no other claim took the row since
		// (it would have changed the owner). Take it up, lease and
		// token. What is left of the lease counts from when this claim
		// was sent, not from its answer: the store read the row after
		// that instant, so the local deadline is never later than the
		// store's, however long the answer took.
		left := row.LeaseUntil.Sub(row.Now)
		l := &Lease{Token: row.Token, IdempotencyKey: IdempotencyKey(h.Name, msg.ID), Owner: p.cfg.Owner, Attempt: row.Attempts}
		if f := lost.fail; f != nil && f.token == row.Token {
			// Its call ran and failed: record that, as failCall
			// would have, rather than call again.
			p.cfg.Logger.Info("idem: recording a failed attempt the store could not take before", slog.String("handler", h.Name),
				slog.String("message_id", msg.ID), slog.Duration("lease_left", left))
			return p.writeFail(ctx, h, msg, l, owner, f, due)
		}
		res = driver.LeaseClaimResult{Claimed: true, Token: row.Token, Attempt: row.Attempts, LeaseUntil: row.LeaseUntil}
		sent = sent.Add(left - p.cfg.TTL)
		p.cfg.Logger.Info("idem: took up a lease claimed before the store failed to answer", slog.String("handler", h.Name),
			slog.String("message_id", msg.ID), slog.Duration("lease_left", left))
	}
	if !res.Claimed {
		return p.notClaimed(h, msg.ID, hash, res.Existing, due)
	}
	p.fault(FaultAfterClaim)

	l := &Lease{Token: res.Token, IdempotencyKey: IdempotencyKey(h.Name, msg.ID), Owner: p.cfg.Owner, Attempt: res.Attempt}
	var advance *driver.LeaseAdvance
	if guarded {
		if out, done, err := p.guard(ctx, h, msg, l, agg, owner); done {
			return out, err
		}
		advance = &driver.LeaseAdvance{AggregateID: agg, Seq: msg.Seq}
	}
	if p.cfg.MaxAttempts > 0 && l.Attempt > p.cfg.MaxAttempts {
		// The last allowed attempt ended without recording a failure (a
		// crash, a lost lease, a stop): the attempts are used up, so no
		// further call. (After the guard: a stale message is done, not
		// failed, and a wait behind a gap uses no attempt.)
		// This claim calls nothing, so it gives its attempt back: the row
		// records the attempts that ran.
		return p.failCall(ctx, h, msg, l, owner, Permanent(fmt.Errorf("idem: gave up after %d attempts, the last of which ended without a verdict", l.Attempt-1)), false, nil)
	}
	if !time.Now().Before(sent.Add(p.cfg.TTL)) {
		// The lease ran out before the call (a slow ordering read, say):
		// another worker may hold the message by now, and a call would
		// overlap its call. This claim calls nothing.
		return OutcomeNone, p.release(ctx, h, msg, l, owner, fmt.Errorf("idem: handler %q, message %q: %w before the call", h.Name, msg.ID, ErrLeaseExpired))
	}
	if err := ctx.Err(); err != nil {
		// Stopping: a call would start cancelled, and its failure would
		// count an attempt. This claim calls nothing.
		return OutcomeNone, p.release(ctx, h, msg, l, owner, fmt.Errorf("idem: handler %q, message %q: stopped before the call: %w", h.Name, msg.ID, err))
	}
	// The stop never cuts a call (a LeaseConsumer's StopGrace): the call
	// ends on its own, or when its lease is lost.
	cctx, uncutDone := uncut(ctx)
	defer uncutDone()
	hctx, cancel := context.WithCancelCause(cctx)
	defer cancel(nil)
	k := p.keep(ctx, cancel, h.Name, msg.ID, l, sent)
	herr := callLease(hctx, h, l, msg)
	until := time.Now().Add(k.remaining()) // the lease, as far as this worker knows
	k.stop()
	if herr == nil {
		return p.complete(ctx, h, msg, l, advance, until)
	}
	return p.failCall(ctx, h, msg, l, owner, herr, true, due)
}

// notClaimed decides the outcome of a claim that found a row it could not
// take over; see run for due.
func (p *LeaseProcessor) notClaimed(h *LeaseHandler, id string, hash []byte, row *driver.LeaseRow, due *time.Duration) (Outcome, error) {
	if row == nil {
		// Gone between the claim and the read: try again later.
		return InFlight, nil
	}
	if !samePayload(hash, row.PayloadHash) {
		return payloadConflict(p.cfg.Logger, h.Name, h.OnConflict, id, hash, row.PayloadHash)
	}
	switch row.Status {
	case driver.LeaseDone:
		return Duplicate, nil
	case driver.LeaseRunning:
		// Held: by a live worker, which acknowledges its own delivery, or
		// by one that crashed, whose lease must run out first. Asked
		// again before then, a delivery would find it in flight again,
		// and under a broker delivery limit the last one would
		// dead-letter it before it could be taken over.
		if due != nil && !row.LeaseUntil.IsZero() {
			*due = max(row.LeaseUntil.Sub(row.Now), 0)
		}
		return InFlight, nil
	case driver.LeaseFailed:
		if row.NextAttemptAt.IsZero() {
			return OutcomeNone, &PermanentError{Err: fmt.Errorf("%w: handler %q, message %q, after %d attempts: %s",
				ErrFailedPermanently, h.Name, id, row.Attempts, row.LastError)}
		}
		if due != nil {
			*due = max(row.NextAttemptAt.Sub(row.Now), 0)
		}
		return InFlight, nil
	}
	return OutcomeNone, fmt.Errorf("idem: handler %q, message %q: unknown lease status %q", h.Name, id, row.Status)
}

func callLease(ctx context.Context, h *LeaseHandler, l *Lease, msg *Message) (err error) {
	defer recoverPanic(&err)
	if err = h.Call(ctx, l, msg); err != nil {
		return handlerError(h.Name, err)
	}
	return nil
}

// guardKey is the ordering guard's aggregate key for msg, and whether the
// guard applies.
func (p *LeaseProcessor) guardKey(h *LeaseHandler, msg *Message) (string, bool, error) {
	if h.Ordering == nil {
		return "", false, nil
	}
	if err := p.checkOrdering(h); err != nil {
		return "", false, err
	}
	return orderingKey(h.Name, h.Ordering, msg)
}

// checkOrdering validates h's Ordering, which must be set, for lease mode
// and p's driver.
func (p *LeaseProcessor) checkOrdering(h *LeaseHandler) error {
	if h.Ordering.VersionOnly {
		return fmt.Errorf("%w: lease handler %q: Ordering.VersionOnly is for atomic mode (in lease mode the marker row is the lease)", ErrInvalidConfig, h.Name)
	}
	if p.seq == nil {
		return fmt.Errorf("%w: lease handler %q has Ordering but the driver does not implement driver.LeaseSequencer", ErrInvalidConfig, h.Name)
	}
	return nil
}

// checkSetup validates what of h's setup no message changes: its
// Ordering's gap policy, and what lease mode and p's driver allow.
func (p *LeaseProcessor) checkSetup(h *LeaseHandler) error {
	if h.Ordering == nil {
		return nil
	}
	if err := checkGap(h.Name, h.Ordering); err != nil {
		return err
	}
	return p.checkOrdering(h)
}

// guard runs the ordering guard for a claimed lease before the call. done
// is true when the message is decided without calling the handler: Stale
// (the lease is marked done), or a gap under GapFail or GapWait (the lease
// is released for an immediate retry, like atomic mode's rollback, and a
// *GapError returned), or an error reading the guard.
//
// owner is the claim's owner name, kept for take-up when the write that
// ends the claim fails (see uncalled).
func (p *LeaseProcessor) guard(ctx context.Context, h *LeaseHandler, msg *Message, l *Lease, agg, owner string) (out Outcome, done bool, err error) {
	last, err := p.seq.SequenceLast(ctx, h.Name, agg)
	if err != nil {
		return OutcomeNone, true, p.release(ctx, h, msg, l, owner, fmt.Errorf("idem: ordering guard: %w", err))
	}
	o := h.Ordering
	switch {
	case msg.Seq <= last:
		if out, err := p.complete(ctx, h, msg, l, nil, time.Time{}); err != nil { // no effect to lose: no retry
			p.uncalled(h, msg, owner, err)
			return out, true, err
		}
		return Stale, true, nil
	case msg.Seq == last+1 || o.Gap == GapAllow:
		return OutcomeNone, false, nil
	}
	ge := &GapError{Handler: h.Name, AggregateID: agg, Last: last, Seq: msg.Seq, Policy: o.Gap, Final: o.Gap == GapFail}
	if o.Gap == GapWait {
		r, serr := p.seq.GapSighting(ctx, &driver.GapSightingParams{Handler: h.Name, AggregateID: agg, Seq: msg.Seq})
		if serr != nil {
			return OutcomeNone, true, p.release(ctx, h, msg, l, owner, fmt.Errorf("idem: record gap sighting: %w (while handling: %w)", serr, ge))
		}
		wait := o.WaitFor
		if wait <= 0 {
			wait = DefaultGapWait
		}
		ge.FirstSeen, ge.Deadline = r.FirstSeen, r.FirstSeen.Add(wait)
		ge.Remaining = ge.Deadline.Sub(r.Now)
		ge.Final = ge.Remaining <= 0
	}
	return OutcomeNone, true, p.release(ctx, h, msg, l, owner, ge)
}

// release gives a claimed lease up without a call, so the next delivery
// may claim it at once, and returns cause (or cause joined with the write's
// failure). The claim's attempt is given back: no call, no attempt, so a
// message waiting behind a gap does not use up MaxAttempts.
func (p *LeaseProcessor) release(ctx context.Context, h *LeaseHandler, msg *Message, l *Lease, owner string, cause error) error {
	wctx, cancel := p.writeContext(ctx)
	defer cancel()
	res, err := p.drv.LeaseFail(wctx, &driver.LeaseFailParams{
		Handler: h.Name, MessageID: msg.ID, Token: l.Token, LastError: lastErrorText(cause), NotCalled: true,
	})
	if err != nil {
		p.uncalled(h, msg, owner, err)
		return fmt.Errorf("%w (and releasing the lease: %w)", cause, err)
	}
	if !res.OK {
		fe := fencedError("failed", h.Name, msg.ID, l.Token, res.Current)
		p.fenced(ctx, l, fe)
		return fmt.Errorf("%w (and releasing the lease: %w)", cause, fe)
	}
	return cause
}

// uncalled remembers a claim that called nothing and whose closing write
// (a release, a stale message's done) failed with err, as a claim whose
// answer was lost is remembered: the row is still running under the
// claim's owner name, and the store is likely down. The next delivery of
// the message to this processor takes the lease up at once and decides
// again, with the claim's attempt, instead of finding its own lease in
// flight until the TTL runs out and claiming it with one more attempt
// (under MaxAttempts 1, a permanent failure that never called the
// handler; on a broker's last delivery, a dead letter).
func (p *LeaseProcessor) uncalled(h *LeaseHandler, msg *Message, owner string, err error) {
	if errors.Is(err, ErrFenced) {
		return // the row is another claim's now
	}
	p.unanswered.put(h.Name+"\x00"+msg.ID, lostClaim{owner: owner, until: time.Now().Add(p.cfg.TTL)})
}

// complete marks the row done, advancing the aggregate's sequence when
// advance is set. The effect has happened: a write that fails (a dropped
// connection) is tried again, with a growing pause, while the lease lasts
// (until), since a row left running would be claimed again once it runs
// out, and the effect repeated.
func (p *LeaseProcessor) complete(ctx context.Context, h *LeaseHandler, msg *Message, l *Lease, advance *driver.LeaseAdvance, until time.Time) (Outcome, error) {
	p.fault(FaultBeforeDone)
	var cutUntil time.Time // under a stop's cut: when tries end
	for try := 0; ; try++ {
		wctx, cancel := p.writeContext(ctx)
		res, err := p.drv.LeaseComplete(wctx, &driver.LeaseCompleteParams{Handler: h.Name, MessageID: msg.ID, Token: l.Token, Advance: advance})
		hung := wasCut(wctx)
		cancel()
		if err == nil && !res.OK && try > 0 && res.Current != nil && res.Current.Status == driver.LeaseDone && res.Current.Token == l.Token {
			// An earlier try was written, though its answer was lost.
			res.OK = true
		}
		if err == nil && !res.OK {
			fe := fencedError("done", h.Name, msg.ID, l.Token, res.Current)
			p.fenced(ctx, l, fe)
			return OutcomeNone, fe
		}
		if err == nil {
			p.fault(FaultAfterDone)
			return Applied, nil
		}
		pause := min(50*time.Millisecond<<min(try, 5), time.Second)
		if wasCut(ctx) {
			// The consumer stopped and its grace is over. A store that
			// fails fast (a failover) gets tries for one grace more; one
			// that hung through its try's grace gets no more. The row is
			// then left to its lease, as after a crash.
			if grace, _ := cutGrace(ctx); cutUntil.IsZero() && !hung {
				cutUntil = time.Now().Add(grace)
			}
			if hung || !time.Now().Add(pause).Before(cutUntil) {
				return OutcomeNone, fmt.Errorf("idem: handler %q, message %q: mark done (%d tries, cut by the stop): %w", h.Name, msg.ID, try+1, err)
			}
		}
		if !time.Now().Add(pause).Before(until) {
			return OutcomeNone, fmt.Errorf("idem: handler %q, message %q: mark done (%d tries, until the lease ran out): %w", h.Name, msg.ID, try+1, err)
		}
		// Every worker's mark fails while the store is down, in ways
		// that change as it stops and starts: one line every 10 s says so.
		p.logs.Warn(p.cfg.Logger, "", "idem: marking a lease done failed; trying again while the lease lasts",
			slog.String("handler", h.Name), slog.String("message_id", msg.ID), slog.Duration("retry_after", pause), slog.Any("error", err))
		time.Sleep(pause)
	}
}

// failCall marks the row failed with a retry time, or permanently; called
// says whether this claim called the handler (its attempt counts). The
// retry time goes to due, when set: a delivery before it would only find
// the message in flight. owner is the claim's owner name (see writeFail).
func (p *LeaseProcessor) failCall(ctx context.Context, h *LeaseHandler, msg *Message, l *Lease, owner string, herr error, called bool, due *time.Duration) (Outcome, error) {
	permanent := IsPermanent(herr)
	// A worker stopping (its context cancelled) hands the message on at
	// once; a caller's deadline that ran out is the attempt's failure,
	// backed off like any other.
	// (The stop's cut is no such cancellation: the call ran on.)
	shutdown := errors.Is(ctx.Err(), context.Canceled) && !wasCut(ctx)
	exhausted := !permanent && !shutdown && p.cfg.MaxAttempts > 0 && l.Attempt >= p.cfg.MaxAttempts
	var retryIn time.Duration
	if !shutdown {
		// A worker shutting down hands the message on at once instead.
		retryIn = p.backoff(l.Attempt)
	}
	p.fault(FaultBeforeFail)
	return p.writeFail(ctx, h, msg, l, owner, &pendingFail{token: l.Token, herr: herr, retryIn: retryIn,
		permanent: permanent || exhausted, exhausted: exhausted, called: called, attempt: l.Attempt}, due)
}

// writeFail records the failed call f of the claim l, and returns what
// failCall does. A record the store does not take (it is down) leaves the
// row running under this claim until its lease runs out; for a failure
// to be retried, the next delivery of the message to this processor
// takes the lease up and writes the record then, so that the retry waits
// for the backoff, not the TTL. (A permanent failure is dead-lettered at
// once; a replay of it must call the handler again.)
func (p *LeaseProcessor) writeFail(ctx context.Context, h *LeaseHandler, msg *Message, l *Lease, owner string, f *pendingFail, due *time.Duration) (Outcome, error) {
	wctx, cancel := p.writeContext(ctx)
	defer cancel()
	res, err := p.drv.LeaseFail(wctx, &driver.LeaseFailParams{
		Handler: h.Name, MessageID: msg.ID, Token: f.token,
		LastError: lastErrorText(f.herr), RetryIn: f.retryIn, Permanent: f.permanent, NotCalled: !f.called,
	})
	if err != nil {
		if !f.permanent {
			p.unanswered.put(h.Name+"\x00"+msg.ID, lostClaim{owner: owner, until: time.Now().Add(p.cfg.TTL), fail: f})
		}
		return OutcomeNone, fmt.Errorf("%w (and marking it failed: %w)", f.herr, err)
	}
	if !res.OK {
		fe := fencedError("failed", h.Name, msg.ID, f.token, res.Current)
		p.fenced(ctx, l, fe)
		return OutcomeNone, fmt.Errorf("%w (and marking it failed: %w)", f.herr, fe)
	}
	if f.exhausted {
		return OutcomeNone, &PermanentError{Err: fmt.Errorf("idem: gave up after %d attempts: %w", f.attempt, &recordedFailure{f.herr})}
	}
	if due != nil && !f.permanent {
		*due = f.retryIn
	}
	return OutcomeNone, &recordedFailure{f.herr}
}

// recordedFailure is a lease handler's error once the store recorded the
// failed attempt: the store answered, so however much the error looks
// like an outage (a refused connection to the handler's own service), it
// is the message's failure.
type recordedFailure struct{ error }

// Unwrap returns the handler's error.
func (e *recordedFailure) Unwrap() error { return e.error }

// writeContext bounds a done or failed write. It survives the caller's
// cancellation, so that a worker shutting down still records what its
// handler did; past the TTL the lease is gone anyway. Under a
// LeaseConsumer's stop it runs at most StopGrace past the cut
// (cutWriteContext): a store that hangs then leaves the row to its lease,
// as a crash would.
func (p *LeaseProcessor) writeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.TTL)
	cctx, ccancel := cutWriteContext(ctx, wctx)
	return cctx, func() { ccancel(); cancel() }
}

// backoff returns the delay before attempt+1 may run: full jitter over an
// exponential ceiling.
func (p *LeaseProcessor) backoff(attempt int) time.Duration {
	ceiling := p.cfg.BackoffBase
	for i := 1; i < attempt && ceiling < p.cfg.BackoffMax; i++ {
		if ceiling > p.cfg.BackoffMax/2 {
			ceiling = p.cfg.BackoffMax
			break
		}
		ceiling *= 2
	}
	ceiling = min(ceiling, p.cfg.BackoffMax)
	if ceiling < math.MaxInt64 {
		ceiling++ // rand.N's range is half-open: include the ceiling
	}
	return rand.N(ceiling)
}

func (p *LeaseProcessor) fault(point string) {
	if p.cfg.FaultHook != nil {
		p.cfg.FaultHook(point)
	}
}

// fenced reports a write refused as fenced.
func (p *LeaseProcessor) fenced(ctx context.Context, l *Lease, fe *FencedError) {
	p.lost(ctx, &LeaseLostEvent{Handler: fe.Handler, MessageID: fe.MessageID, Owner: l.Owner, Token: l.Token, Op: fe.Op, Err: fe})
}

// lost reports a lost lease to the log and the hooks.
func (p *LeaseProcessor) lost(ctx context.Context, ev *LeaseLostEvent) {
	p.cfg.Logger.Warn("idem: lease lost", slog.String("handler", ev.Handler), slog.String("message_id", ev.MessageID),
		slog.String("op", ev.Op), slog.Int64("token", ev.Token), slog.Any("error", ev.Err))
	for _, hk := range p.onLost {
		hk.OnLeaseLost(ctx, ev)
	}
}

func fencedError(op, handler, id string, token int64, cur *driver.LeaseRow) *FencedError {
	fe := &FencedError{Op: op, Handler: handler, MessageID: id, Token: token, CurrentStatus: "missing"}
	if cur != nil {
		fe.CurrentToken, fe.CurrentOwner, fe.CurrentStatus = cur.Token, cur.Owner, string(cur.Status)
	}
	return fe
}

// lastErrorText makes err storable: valid UTF-8, no NUL, bounded.
func lastErrorText(err error) string { return errtext.Storable(err.Error(), maxLastErrorLen) }

// keeper heartbeats one lease while its handler runs and cancels the
// handler's context when the lease is lost: at once when a heartbeat is
// fenced, and when TTL has passed since the last claim or heartbeat was sent
// without a renewal (the store computes the expiry from a later instant, so
// the local deadline is never later than the store's).
type keeper struct {
	p       *LeaseProcessor
	ctx     context.Context // the caller's: for the store and hooks, never cancelled by the keeper
	cancel  context.CancelCauseFunc
	handler string
	id      string
	lease   *Lease
	sent    time.Time // when the claim was sent: heartbeats count from it

	mu       sync.Mutex
	deadline time.Time
	timer    *time.Timer
	over     bool // expired or stopped: no more cancellations or reports
	expiring bool // expire took the lease: stop waits for expired

	stopc   chan struct{}
	done    chan struct{}
	expired chan struct{} // closed when expire has cancelled and reported

	// beat bounds the heartbeats; stop cancels it, so that a heartbeat
	// hung on a dead connection does not hold the done or failed write
	// back until what is left of the lease has passed.
	beat     context.Context
	stopBeat context.CancelFunc
}

func (p *LeaseProcessor) keep(ctx context.Context, cancel context.CancelCauseFunc, handler, id string, l *Lease, sent time.Time) *keeper {
	k := &keeper{p: p, ctx: ctx, cancel: cancel, handler: handler, id: id, lease: l, sent: sent,
		deadline: sent.Add(p.cfg.TTL), stopc: make(chan struct{}), done: make(chan struct{}), expired: make(chan struct{})}
	k.beat, k.stopBeat = context.WithCancel(context.WithoutCancel(ctx))
	k.mu.Lock()
	k.timer = time.AfterFunc(time.Until(k.deadline), k.expire)
	k.mu.Unlock()
	go k.run()
	return k
}

func (k *keeper) run() {
	defer close(k.done)
	// Heartbeats fall due every Heartbeat from the claim, not from the
	// call: the time the guard took before it is the lease's too.
	due := k.sent.Add(k.p.cfg.Heartbeat)
	t := time.NewTimer(time.Until(due))
	defer t.Stop()
	for {
		select {
		case <-k.stopc:
			return
		case <-t.C:
		}
		due = due.Add(k.p.cfg.Heartbeat)
		if now := time.Now(); due.Before(now) {
			due = now.Add(k.p.cfg.Heartbeat) // a heartbeat slower than the interval
		}
		t.Reset(time.Until(due))
		k.p.fault(FaultBeforeHeartbeat)
		select {
		case <-k.stopc:
			return
		default:
		}
		sent := time.Now()
		// A slow heartbeat is still worth waiting for while the lease
		// lasts: bound it by the local deadline, and by at least one
		// interval once that has passed.
		hctx, cancel := context.WithTimeout(k.beat, max(k.remaining(), k.p.cfg.Heartbeat))
		res, err := k.p.drv.LeaseHeartbeat(hctx, &driver.LeaseHeartbeatParams{
			Handler: k.handler, MessageID: k.id, Token: k.lease.Token, TTL: k.p.cfg.TTL,
		})
		cancel()
		select {
		case <-k.stopc:
			return // given up by stop: the call is over, its lease no concern
		default:
		}
		switch {
		case err != nil:
			// Every worker's heartbeat fails while the store is down:
			// one line every 10 s says so.
			k.p.logs.Warn(k.p.cfg.Logger, "", "idem: lease heartbeat failed; retrying at the next interval",
				slog.String("handler", k.handler), slog.String("message_id", k.id), slog.Any("error", err))
		case !res.OK:
			fe := fencedError("heartbeat", k.handler, k.id, k.lease.Token, res.Current)
			k.cancel(fe)
			k.p.fenced(k.ctx, k.lease, fe)
			return
		default:
			k.extend(sent.Add(k.p.cfg.TTL))
		}
	}
}

// remaining is the time left until the local deadline.
func (k *keeper) remaining() time.Duration {
	k.mu.Lock()
	defer k.mu.Unlock()
	return time.Until(k.deadline)
}

// extend moves the local deadline after a successful heartbeat, unless the
// lease already expired locally (the handler's context stays cancelled).
func (k *keeper) extend(deadline time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.over {
		return
	}
	k.deadline = deadline
	k.timer.Reset(time.Until(deadline))
}

func (k *keeper) expire() {
	k.mu.Lock()
	if k.over || time.Now().Before(k.deadline) {
		// Stopped, or a heartbeat extended the lease as the timer fired.
		k.mu.Unlock()
		return
	}
	k.over = true
	k.expiring = true
	k.mu.Unlock()
	defer close(k.expired)
	k.cancel(ErrLeaseExpired)
	k.p.lost(k.ctx, &LeaseLostEvent{Handler: k.handler, MessageID: k.id, Owner: k.lease.Owner, Token: k.lease.Token,
		Op: "expired", Err: ErrLeaseExpired})
}

// stop ends the heartbeats and the expiry timer and waits for the heartbeat
// goroutine, so that no heartbeat races the done or failed write; one in
// flight is cancelled, not waited out. (Should it land all the same, it
// changes nothing: the done or failed write that follows ends the
// running lease it would extend.) If the lease already expired it also
// waits for the expiry to be reported, so the report always precedes
// Process returning.
func (k *keeper) stop() {
	close(k.stopc)
	k.stopBeat()
	<-k.done
	k.mu.Lock()
	k.over = true
	k.timer.Stop()
	expiring := k.expiring
	k.mu.Unlock()
	if expiring {
		<-k.expired
	}
}
