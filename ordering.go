package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"golang.org/x/text/cases"
	"golang.org/x/text/unicode/norm"

	"github.com/idemhq/idem/driver"
)

// GapPolicy says what the ordering guard does with a message whose sequence
// is more than one past the last applied sequence of its aggregate.
type GapPolicy uint8

const (
	// GapFail (the default) refuses the message at once with a final
	// *GapError: dead-letter it. The aggregate's later messages also find
	// the gap and are refused, so nothing is applied past the missing one
	// until it arrives (or is replayed) and the refused ones are replayed.
	GapFail GapPolicy = iota
	// GapWait refuses the message with a retriable *GapError until
	// Ordering.WaitFor has passed since the store first saw it, then with
	// a final one. Use it when the broker may reorder briefly. A Consumer
	// does not count against the wait the time it found the store down:
	// nothing, the missing message included, could be applied then.
	GapWait
	// GapAllow applies the message and advances the aggregate to its
	// sequence: the latest state wins and skipped sequences become stale.
	GapAllow
)

// String returns the policy's lower-case name.
func (g GapPolicy) String() string {
	switch g {
	case GapFail:
		return "fail"
	case GapWait:
		return "wait"
	case GapAllow:
		return "allow"
	}
	return fmt.Sprintf("gappolicy(%d)", uint8(g))
}

// DefaultGapWait is Ordering.WaitFor when it is zero.
const DefaultGapWait = time.Minute

// Ordering turns on the per-aggregate ordering guard for a handler. Messages
// with an AggregateID and a Seq (≥ 1) pass through it; messages without a
// Seq skip it (except in version-only mode, which requires one).
//
// The guard keeps the last applied sequence per (handler, aggregate) and
// reads and advances it in the transaction that applies the message:
//
//   - Seq ≤ last: Stale, not applied, acknowledge it;
//   - Seq = last + 1: applied, last = Seq;
//   - Seq > last + 1: a gap, handled by the Gap policy.
//
// Concurrent messages of one aggregate serialize on its guard row.
type Ordering struct {
	// Gap is the gap policy. Default GapFail.
	Gap GapPolicy
	// WaitFor is how long after its first sighting a message stays
	// retriable under GapWait. Default DefaultGapWait. A Consumer (and a
	// LeaseConsumer) adds to it the outages of the store it saw during
	// the wait.
	WaitFor time.Duration
	// Normalize, when set, maps aggregate IDs before the guard compares
	// them; by default they compare byte for byte. FoldAggregateID is a
	// ready-made one. The result must still be a valid aggregate ID.
	Normalize func(aggregateID string) string
	// VersionOnly dedupes by the guard alone: no marker row is written, so
	// storage is one row per aggregate and needs no retention. Every
	// message must then carry AggregateID and Seq. A redelivery of the
	// last applied sequence is a Duplicate, of an older one Stale; a
	// payload conflict cannot be detected.
	VersionOnly bool
}

// FoldAggregateID is an aggregate-ID normalizer for Ordering.Normalize: it
// trims surrounding white space, applies Unicode NFC and full case folding,
// so " Straße", "STRASSE" and "stra\u00dfe" all become "strasse", and "é"
// composed or decomposed compare equal. It does not fold look-alikes from
// other scripts (Latin "a" and Cyrillic "а" stay distinct) and keeps inner
// white space and separators as they are. Folding can lengthen an ID
// ("İ" becomes three bytes from two): the guard refuses a result over 255
// bytes with a *ValidationError.
func FoldAggregateID(id string) string {
	return norm.NFC.String(cases.Fold().String(norm.NFC.String(strings.TrimSpace(id))))
}

// ErrGap matches every *GapError.
var ErrGap = errors.New("idem: sequence gap")

// GapError reports a message whose sequence is ahead of the next expected
// one. The message was not applied.
type GapError struct {
	// Handler and AggregateID name the guarded sequence.
	Handler     string
	AggregateID string
	// Last is the last applied sequence; Seq the message's.
	Last, Seq int64
	// Policy is the handler's gap policy that produced the error.
	Policy GapPolicy
	// FirstSeen and Deadline are set under GapWait, on the store's clock
	// (the one the first sighting was recorded by).
	FirstSeen, Deadline time.Time
	// Remaining is what was left of the wait when the gap was seen, by the
	// store's clock: Deadline minus the store's time then. A retry is due
	// within it; measuring time.Until(Deadline) on a host whose clock
	// differs from the store's would be off by the skew.
	Remaining time.Duration
	// Final is true when retrying is pointless: under GapFail always, under
	// GapWait once Deadline has passed. IsPermanent reports Final.
	Final bool
}

// Error implements error.
func (e *GapError) Error() string {
	s := fmt.Sprintf("idem: handler %q, aggregate %q: sequence %d arrived after %d (missing %d..%d), gap policy %s",
		e.Handler, e.AggregateID, e.Seq, e.Last, e.Last+1, e.Seq-1, e.Policy)
	if e.Policy == GapWait {
		if e.Final {
			s += fmt.Sprintf("; waited since %s, deadline passed", e.FirstSeen.Format(time.RFC3339))
		} else if !e.Deadline.IsZero() {
			s += fmt.Sprintf("; retry until %s", e.Deadline.Format(time.RFC3339))
		} else {
			s += "; to be retried"
		}
	}
	return s
}

// Is makes errors.Is(err, ErrGap) true.
func (e *GapError) Is(target error) bool { return target == ErrGap }

// guardKey validates the handler's ordering setup for msg and returns the
// aggregate key the guard uses (normalized if configured), and whether the
// guard applies at all.
func (p *Processor[TTx]) guardKey(h *Handler[TTx], msg *Message) (string, bool, error) {
	o := h.Ordering
	if o == nil {
		return "", false, nil
	}
	if p.seq == nil {
		return "", false, fmt.Errorf("%w: handler %q has Ordering but the driver does not implement driver.SequenceGuard", ErrInvalidConfig, h.Name)
	}
	return orderingKey(h.Name, o, msg)
}

// checkSetup validates what of h's setup no message changes: the in-row
// guard's, and the ordering guard's gap policy and driver. Process finds
// the same errors with each message.
func (p *Processor[TTx]) checkSetup(h *Handler[TTx]) error {
	if h.inRow() {
		if err := p.checkInRow(h); err != nil {
			return err
		}
	}
	o := h.Ordering
	if o == nil {
		return nil
	}
	if err := checkGap(h.Name, o); err != nil {
		return err
	}
	if !h.inRow() && p.seq == nil {
		return fmt.Errorf("%w: handler %q has Ordering but the driver does not implement driver.SequenceGuard", ErrInvalidConfig, h.Name)
	}
	return nil
}

// checkGap refuses a gap policy that is none of GapFail, GapWait and
// GapAllow.
func checkGap(handler string, o *Ordering) error {
	if o.Gap > GapAllow {
		return fmt.Errorf("%w: handler %q: unknown gap policy %d", ErrInvalidConfig, handler, o.Gap)
	}
	return nil
}

// orderingKey validates o for msg and returns the guard's aggregate key
// and whether the guard applies. Atomic and lease mode share it.
func orderingKey(handler string, o *Ordering, msg *Message) (string, bool, error) {
	if err := checkGap(handler, o); err != nil {
		return "", false, err
	}
	if msg.Seq == 0 {
		if o.VersionOnly {
			return "", false, &ValidationError{Field: "Seq", Reason: fmt.Sprintf("is required: handler %q dedupes by aggregate sequence alone (version-only mode)", handler), err: ErrInvalidMessage}
		}
		return "", false, nil
	}
	agg := msg.AggregateID
	if o.Normalize != nil {
		agg = o.Normalize(agg)
		if reason := checkText(agg, MaxIDLen); reason != "" {
			return "", false, &ValidationError{Field: "AggregateID", Reason: "after normalization " + reason, Value: msg.AggregateID, err: ErrInvalidMessage}
		}
	}
	return agg, true, nil
}

// guard advances the aggregate's sequence inside tx. proceed is true when
// the handler should run; otherwise out is Stale (or Duplicate in
// version-only mode), or err is a *GapError (after the transaction is
// rolled back the caller records the sighting with sight).
func (p *Processor[TTx]) guard(ctx context.Context, tx TTx, h *Handler[TTx], msg *Message, agg string) (proceed bool, out Outcome, err error) {
	res, err := p.seq.SequenceAdvance(ctx, tx, p.advanceParams(h, msg, agg))
	if err != nil {
		return false, OutcomeNone, fmt.Errorf("idem: ordering guard: %w", err)
	}
	return p.decide(h, msg, agg, res)
}

// advanceParams are the guard's parameters for msg.
func (p *Processor[TTx]) advanceParams(h *Handler[TTx], msg *Message, agg string) *driver.SequenceAdvanceParams {
	return &driver.SequenceAdvanceParams{Handler: h.Name, AggregateID: agg, Seq: msg.Seq, AllowGap: h.Ordering.Gap == GapAllow}
}

// decide turns the guard's result into guard's answer.
func (p *Processor[TTx]) decide(h *Handler[TTx], msg *Message, agg string, res driver.SequenceAdvanceResult) (proceed bool, out Outcome, err error) {
	o := h.Ordering
	switch {
	case res.Advanced:
		return true, OutcomeNone, nil
	case o.VersionOnly && msg.Seq == res.Last:
		return false, Duplicate, nil
	case msg.Seq <= res.Last:
		return false, Stale, nil
	}
	return false, OutcomeNone, &GapError{Handler: h.Name, AggregateID: agg, Last: res.Last, Seq: msg.Seq, Policy: o.Gap, Final: o.Gap == GapFail}
}

// sight completes a GapWait error with the durable first sighting and
// decides whether the deadline has passed. It runs outside the rolled-back
// transaction, so the sighting survives.
func (p *Processor[TTx]) sight(ctx context.Context, h *Handler[TTx], err error) error {
	var ge *GapError
	if !errors.As(err, &ge) || ge.Policy != GapWait {
		return err
	}
	r, serr := p.seq.GapSighting(ctx, &driver.GapSightingParams{Handler: h.Name, AggregateID: ge.AggregateID, Seq: ge.Seq})
	if serr != nil {
		return fmt.Errorf("idem: record gap sighting: %w (while handling: %w)", serr, err)
	}
	wait := h.Ordering.WaitFor
	if wait <= 0 {
		wait = DefaultGapWait
	}
	ge.FirstSeen = r.FirstSeen
	ge.Deadline = r.FirstSeen.Add(wait)
	ge.Remaining = ge.Deadline.Sub(r.Now)
	ge.Final = ge.Remaining <= 0
	return ge
}

// SightGap completes a *GapError that ProcessTx returned under GapWait: it
// records the first sighting durably (in its own statement: call it after
// rolling back the transaction) and returns the error with FirstSeen,
// Deadline and Final set. Any other error is returned unchanged.
func (p *Processor[TTx]) SightGap(ctx context.Context, h *Handler[TTx], err error) error {
	if h == nil || h.Ordering == nil || p.seq == nil {
		return err
	}
	return p.sight(ctx, h, err)
}

// orderBySeq reorders idx (indexes into msgs) so that the messages the
// handler's ordering guard covers come, aggregate by aggregate, in sequence
// order, each taking one of the places its aggregate's messages had; the
// others keep theirs. A nil o, or a nil message, changes nothing for it.
func orderBySeq(handler string, o *Ordering, msgs []*Message, idx []int) {
	if o == nil {
		return
	}
	g := &batchGuard{keys: make([]string, len(msgs)), guarded: make([]bool, len(msgs))}
	for _, i := range idx {
		if msgs[i] == nil {
			continue
		}
		if agg, ok, err := orderingKey(handler, o, msgs[i]); err == nil {
			g.keys[i], g.guarded[i] = agg, ok
		}
	}
	g.inSeqOrder(idx, msgs)
}
