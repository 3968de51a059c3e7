package idem

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/lograte"
)

// ConflictPolicy says what to do when a message ID arrives again with a
// different payload.
type ConflictPolicy uint8

const (
	// OnConflictError (the default) reports Conflict with a
	// *ConflictError; the message is never applied. Callers should
	// dead-letter it.
	OnConflictError ConflictPolicy = iota
	// OnConflictWarn treats the message as a Duplicate and logs a warning
	// with both hashes.
	OnConflictWarn
)

// Handler is a named unit of work whose effects idem applies at most once
// per message ID.
//
// The name is stored with every marker: choose a stable string and never
// derive it from Go identifiers, so that a refactor does not orphan the
// markers (which would re-apply old messages). Two handlers with different
// names dedupe independently.
type Handler[TTx any] struct {
	// Name identifies the handler; see ValidateHandlerName. Required.
	Name string
	// Apply performs the effect of one message using tx, the transaction
	// that also holds the marker. Returning an error (or panicking) rolls
	// both back.
	Apply func(ctx context.Context, tx TTx, msg *Message) error
	// ApplyBatch, when set, receives the new messages of a batch (in the
	// order given, duplicates and conflicts removed; under Ordering each
	// aggregate's in sequence order) so it can apply them with one
	// set-based write. When nil, batches call Apply per message.
	// When only ApplyBatch is set, Process calls it with one message.
	ApplyBatch func(ctx context.Context, tx TTx, msgs []*Message) error
	// OnConflict is the payload-conflict policy. Default OnConflictError.
	OnConflict ConflictPolicy
	// Ordering, when set, turns on the per-aggregate ordering guard (and
	// optionally version-only dedup); see Ordering. It needs a driver that
	// implements driver.SequenceGuard (and, for batches outside
	// version-only mode, driver.MarkerDeleter). With ApplyInRow it only
	// holds the gap policy (and Normalize): the guard is the handler's row.
	Ordering *Ordering

	// ApplyInRow, instead of Apply, makes the handler's own row the
	// ordering guard and the dedup (the in-row guard): the projection's
	// row holds the aggregate's last applied sequence, and the handler's
	// write carries the condition g states. It reports what the write
	// found (RowWrite), and idem decides Applied, Stale, Duplicate or a
	// gap under Ordering's gap policy, as the separate guard would. idem
	// writes no row of its own: no marker, no sequence row. Every message
	// must carry AggregateID and Seq, and Ordering must be set. When the
	// write did not advance, write nothing else: under Process idem rolls
	// back, under ProcessTx the caller's transaction commits what the
	// handler wrote. See docs/ordering.md.
	ApplyInRow func(ctx context.Context, tx TTx, g *RowGuard) (RowWrite, error)
	// ApplyInRowBatch is ApplyInRow for a batch: one guard per aggregate,
	// in byte order of the aggregate keys (lock rows in that order), so
	// one set-based statement can write them all and report per guard
	// (RETURNING) whether it advanced. It returns one RowWrite per guard,
	// in order. When nil, batches call ApplyInRow per guard; when only
	// ApplyInRowBatch is set, Process calls it with one guard.
	ApplyInRowBatch func(ctx context.Context, tx TTx, gs []*RowGuard) ([]RowWrite, error)
}

// name is h's name, or "" for a nil handler (reported as such to hooks
// before the call fails validation).
func (h *Handler[TTx]) name() string {
	if h == nil {
		return ""
	}
	return h.Name
}

// Config configures a Processor. The zero value is valid.
type Config struct {
	// Logger receives warnings (payload conflicts under OnConflictWarn,
	// failed rollbacks). Default: slog.Default().
	Logger *slog.Logger
	// Hooks receive outcomes and timings (HookOutcome) and run around
	// every call (HookCall); see Hook. Default: none.
	Hooks []Hook
}

// Processor applies handlers at most once per (handler, message ID) on top
// of a store driver. It is safe for concurrent use.
type Processor[TTx any] struct {
	drv         driver.Driver[TTx]
	beginInsert driver.BeginMarkerInserter[TTx]
	beginMany   driver.BeginMarkerManyInserter[TTx]
	delMarkers  driver.MarkerDeleter[TTx]
	seq         driver.SequenceGuard[TTx]
	seqBatch    driver.SequenceBatchStore[TTx]
	seqMany     driver.SequenceManyAdvancer[TTx]
	beginSeq    driver.BeginSequenceAdvancer[TTx]
	beginLater  driver.DeferredBeginner[TTx]
	atCommit    driver.CommitMarkerInserter[TTx]
	logger      *slog.Logger
	logs        *lograte.Limiter // summarizes repeated failure lines
	onOutcome   []HookOutcome
	onCall      callHooks
}

// NewProcessor returns a Processor over drv. It does not migrate the schema;
// call the driver's Migrate (or `idem migrate`) first.
func NewProcessor[TTx any](drv driver.Driver[TTx], cfg *Config) (*Processor[TTx], error) {
	if drv == nil {
		return nil, fmt.Errorf("%w: nil driver", ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	p := &Processor[TTx]{drv: drv, logger: cfg.Logger, logs: lograte.New(logEvery)}
	if p.logger == nil {
		p.logger = slog.Default()
	}
	if bi, ok := drv.(driver.BeginMarkerInserter[TTx]); ok {
		p.beginInsert = bi
	}
	if bm, ok := drv.(driver.BeginMarkerManyInserter[TTx]); ok {
		p.beginMany = bm
	}
	if md, ok := drv.(driver.MarkerDeleter[TTx]); ok {
		p.delMarkers = md
	}
	if sg, ok := drv.(driver.SequenceGuard[TTx]); ok {
		p.seq = sg
	}
	if sb, ok := drv.(driver.SequenceBatchStore[TTx]); ok {
		p.seqBatch = sb
	}
	if sm, ok := drv.(driver.SequenceManyAdvancer[TTx]); ok {
		p.seqMany = sm
	}
	if bs, ok := drv.(driver.BeginSequenceAdvancer[TTx]); ok {
		p.beginSeq = bs
	}
	if bd, ok := drv.(driver.DeferredBeginner[TTx]); ok {
		p.beginLater = bd
	}
	if ac, ok := drv.(driver.CommitMarkerInserter[TTx]); ok {
		p.atCommit = ac
	}
	for i, h := range cfg.Hooks {
		o, isOutcome := h.(HookOutcome)
		c, isCall := h.(HookCall)
		if !isOutcome && !isCall {
			return nil, fmt.Errorf("%w: Hooks[%d] (%T) implements no Hook interface", ErrInvalidConfig, i, h)
		}
		if isOutcome {
			p.onOutcome = append(p.onOutcome, o)
		}
		if isCall {
			p.onCall = append(p.onCall, c)
		}
	}
	return p, nil
}

// Process applies msg with h in a transaction the processor opens and
// commits. The marker is inserted first, so a concurrent delivery of the
// same ID waits on it and then reports Duplicate without an error.
//
// The error is non-nil exactly when the outcome is OutcomeNone (nothing was
// recorded: retry the delivery) or Conflict (a *ConflictError: do not
// retry). Invalid messages and handler names give a *ValidationError.
func (p *Processor[TTx]) Process(ctx context.Context, h *Handler[TTx], msg *Message) (Outcome, error) {
	start := time.Now()
	ctx, cs := p.onCall.start(ctx, h.name(), msg, nil, false, false, start)
	defer cs.endOnPanic()
	out, err := p.process(ctx, h, msg)
	p.report(ctx, h, msg, out, err, start, 1)
	cs.end([]Outcome{out}, err)
	return out, err
}

// ProcessTx is Process inside tx, a transaction the caller owns, so the
// marker commits or rolls back with the caller's other writes. ProcessTx
// never commits or rolls back tx. If it returns an error with OutcomeNone,
// the caller must roll tx back: it may hold the marker without the effect.
//
// Under REPEATABLE READ or SERIALIZABLE isolation a concurrent duplicate may
// surface as the database's serialization error instead of Duplicate; retry
// the transaction.
//
// For a handler with Ordering under GapWait, a gap comes back as a retriable
// *GapError without a deadline; after rolling back, pass it to SightGap to
// record the first sighting and learn whether the deadline has passed. A
// Stale message leaves no marker in tx (on drivers that implement
// driver.MarkerDeleter, as all of idem's do), as under Process.
func (p *Processor[TTx]) ProcessTx(ctx context.Context, tx TTx, h *Handler[TTx], msg *Message) (Outcome, error) {
	start := time.Now()
	ctx, cs := p.onCall.start(ctx, h.name(), msg, nil, false, false, start)
	defer cs.endOnPanic()
	out, err := p.processTx(ctx, tx, h, msg)
	p.report(ctx, h, msg, out, err, start, 1)
	cs.end([]Outcome{out}, err)
	return out, err
}

func (p *Processor[TTx]) process(ctx context.Context, h *Handler[TTx], msg *Message) (Outcome, error) {
	if err := checkHandler(h); err != nil {
		return OutcomeNone, err
	}
	if err := msg.Validate(); err != nil {
		return OutcomeNone, err
	}
	if h.inRow() {
		return p.processInRow(ctx, nil, h, msg)
	}
	agg, guarded, err := p.guardKey(h, msg)
	if err != nil {
		return OutcomeNone, err
	}
	if guarded && h.Ordering.VersionOnly {
		return p.processVersionOnly(ctx, h, msg, agg)
	}
	params := &driver.MarkerInsertParams{Handler: h.Name, MessageID: msg.ID, PayloadHash: msg.PayloadHash()}
	if !guarded && p.atCommit != nil {
		tx, ok, err := p.atCommit.BeginMarkerAtCommit(ctx, params)
		if err != nil {
			return OutcomeNone, fmt.Errorf("idem: begin: %w", err)
		}
		if ok {
			return p.applyCommitMarker(ctx, tx, h, msg, params.PayloadHash)
		}
	}
	var (
		tx  TTx
		res driver.MarkerInsertResult
	)
	if p.beginInsert != nil {
		tx, res, err = p.beginInsert.BeginMarkerInsert(ctx, params)
		if err != nil {
			return OutcomeNone, fmt.Errorf("idem: begin and insert marker: %w", err)
		}
	} else {
		if tx, err = p.drv.Begin(ctx); err != nil {
			return OutcomeNone, fmt.Errorf("idem: begin: %w", err)
		}
		if res, err = p.drv.MarkerInsert(ctx, tx, params); err != nil {
			p.rollback(ctx, tx)
			return OutcomeNone, fmt.Errorf("idem: insert marker: %w", err)
		}
	}
	if !res.Inserted {
		p.rollback(ctx, tx)
		return p.existing(h, msg.ID, params.PayloadHash, res.ExistingHash)
	}
	return p.guardApplyCommit(ctx, tx, h, msg, agg, guarded)
}

// guardApplyCommit runs the ordering guard (when guarded), the handler and
// the commit of a transaction the processor owns.
func (p *Processor[TTx]) guardApplyCommit(ctx context.Context, tx TTx, h *Handler[TTx], msg *Message, agg string, guarded bool) (Outcome, error) {
	if guarded {
		proceed, out, err := p.guard(ctx, tx, h, msg, agg)
		if !proceed {
			p.rollback(ctx, tx)
			if err != nil {
				return OutcomeNone, p.sight(ctx, h, err)
			}
			return out, nil
		}
	}
	if err := p.callOwned(ctx, tx, func() error { return callApply(ctx, h, tx, msg) }); err != nil {
		p.rollback(ctx, tx)
		return OutcomeNone, err
	}
	if err := p.drv.Commit(ctx, tx); err != nil {
		return OutcomeNone, fmt.Errorf("idem: commit: %w", err)
	}
	return Applied, nil
}

// applyCommitMarker runs the handler and the commit of a transaction whose
// marker its commit inserts (driver.CommitMarkerInserter): a marker found
// there at commit makes the message a Duplicate or a Conflict, with
// nothing applied.
func (p *Processor[TTx]) applyCommitMarker(ctx context.Context, tx TTx, h *Handler[TTx], msg *Message, hash []byte) (Outcome, error) {
	if err := p.callOwned(ctx, tx, func() error { return callApply(ctx, h, tx, msg) }); err != nil {
		p.rollback(ctx, tx)
		return OutcomeNone, err
	}
	if err := p.drv.Commit(ctx, tx); err != nil {
		var me *driver.MarkerExistsError
		if errors.As(err, &me) {
			return p.existing(h, msg.ID, hash, me.ExistingHash)
		}
		return OutcomeNone, fmt.Errorf("idem: commit: %w", err)
	}
	return Applied, nil
}

// callOwned runs the handler call f in tx, a transaction the processor
// owns. Should the goroutine exit inside it (runtime.Goexit: t.FailNow
// in a test's handler), tx is rolled back on the way out, rather than left
// open holding its connection (SQLite's only one) for good. Panics are
// recovered inside f.
func (p *Processor[TTx]) callOwned(ctx context.Context, tx TTx, f func() error) error {
	returned := false
	defer func() {
		if !returned {
			p.rollback(ctx, tx)
		}
	}()
	err := f()
	returned = true
	return err
}

// processVersionOnly dedupes by the ordering guard alone: no marker.
func (p *Processor[TTx]) processVersionOnly(ctx context.Context, h *Handler[TTx], msg *Message, agg string) (Outcome, error) {
	if p.beginSeq == nil {
		tx, err := p.drv.Begin(ctx)
		if err != nil {
			return OutcomeNone, fmt.Errorf("idem: begin: %w", err)
		}
		return p.guardApplyCommit(ctx, tx, h, msg, agg, true)
	}
	tx, res, err := p.beginSeq.BeginSequenceAdvance(ctx, p.advanceParams(h, msg, agg))
	if err != nil {
		return OutcomeNone, fmt.Errorf("idem: begin and run the ordering guard: %w", err)
	}
	if proceed, out, err := p.decide(h, msg, agg, res); !proceed {
		p.rollback(ctx, tx)
		if err != nil {
			return OutcomeNone, p.sight(ctx, h, err)
		}
		return out, nil
	}
	return p.guardApplyCommit(ctx, tx, h, msg, agg, false)
}

func (p *Processor[TTx]) processTx(ctx context.Context, tx TTx, h *Handler[TTx], msg *Message) (Outcome, error) {
	if err := checkHandler(h); err != nil {
		return OutcomeNone, err
	}
	if err := msg.Validate(); err != nil {
		return OutcomeNone, err
	}
	if h.inRow() {
		return p.processInRow(ctx, &tx, h, msg)
	}
	agg, guarded, err := p.guardKey(h, msg)
	if err != nil {
		return OutcomeNone, err
	}
	if !guarded || !h.Ordering.VersionOnly {
		params := &driver.MarkerInsertParams{Handler: h.Name, MessageID: msg.ID, PayloadHash: msg.PayloadHash()}
		res, err := p.drv.MarkerInsert(ctx, tx, params)
		if err != nil {
			return OutcomeNone, fmt.Errorf("idem: insert marker: %w", err)
		}
		if !res.Inserted {
			return p.existing(h, msg.ID, params.PayloadHash, res.ExistingHash)
		}
	}
	if guarded {
		proceed, out, err := p.guard(ctx, tx, h, msg, agg)
		if !proceed {
			if out == Stale && err == nil && !h.Ordering.VersionOnly && p.delMarkers != nil {
				// A stale message leaves no marker, as under Process,
				// though the caller commits its transaction.
				if derr := p.delMarkers.MarkerDelete(ctx, tx, &driver.MarkerDeleteParams{Handler: h.Name, MessageIDs: []string{msg.ID}}); derr != nil {
					return OutcomeNone, fmt.Errorf("idem: delete the marker of a stale message: %w", derr)
				}
			}
			// A gap under GapWait is returned without its durable first
			// sighting: recording it now would wait for the caller's own
			// open transaction on single-writer stores. See SightGap.
			return out, err
		}
	}
	if err := callApply(ctx, h, tx, msg); err != nil {
		return OutcomeNone, err
	}
	return Applied, nil
}

// existing decides Duplicate or Conflict for a marker that was already there.
func (p *Processor[TTx]) existing(h *Handler[TTx], id string, received, stored []byte) (Outcome, error) {
	if samePayload(received, stored) {
		return Duplicate, nil
	}
	return payloadConflict(p.logger, h.Name, h.OnConflict, id, received, stored)
}

// samePayload reports whether a stored marker's payload hash accepts a
// delivery's: equal, a prefix of it of at least MinStoredHash bytes (a
// store that keeps a shortened hash), or empty (an imported marker, whose
// payload is unknown; see ImportMarkers).
func samePayload(received, stored []byte) bool {
	switch {
	case len(stored) == 0:
		return true
	case len(stored) < len(received):
		return len(stored) >= MinStoredHash && bytes.Equal(received[:len(stored)], stored)
	}
	return bytes.Equal(received, stored)
}

// MinStoredHash is the shortest prefix of a payload's SHA-256 that a store
// may keep in place of the whole hash (driver.MarkerInsertResult's
// ExistingHash). Sixteen bytes keep conflict detection sound: two payloads
// of one message ID share a 128-bit prefix by accident with probability
// 2^-128, and a producer crafting a colliding pair needs about 2^64 hashes,
// only to have its own second message taken for a duplicate of its first.
const MinStoredHash = 16

// payloadConflict applies policy to a message whose payload hash differs
// from the stored one: Conflict with a *ConflictError, or under
// OnConflictWarn a logged Duplicate. Atomic and lease mode share it.
func payloadConflict(logger *slog.Logger, handler string, policy ConflictPolicy, id string, received, stored []byte) (Outcome, error) {
	if policy == OnConflictWarn {
		logger.Warn("idem: payload conflict treated as duplicate",
			slog.String("handler", handler), slog.String("message_id", id),
			slog.String("stored_hash", shortHash(stored)), slog.String("received_hash", shortHash(received)))
		return Duplicate, nil
	}
	return Conflict, &ConflictError{Handler: handler, MessageID: id, StoredHash: stored, ReceivedHash: received}
}

// ProcessBatch applies msgs with h in one transaction. The handler sees only
// the messages that are new (no marker yet, first occurrence in the batch);
// the others are Duplicate or Conflict. Either every new message and its
// marker commit, or none do.
//
// With h.Ordering the guard runs too, aggregate by aggregate in sequence
// order, and the handler sees each aggregate's messages in sequence order
// (in the places the batch gave that aggregate's messages). A message the
// guard refuses is Stale (or, version-only, Duplicate) and leaves no marker;
// a message behind a gap, and every later one of its aggregate, is
// OutcomeNone: it was not applied, and the rest of the batch committed
// without it. Process it again later (alone, Process reports the
// *GapError and, under GapWait, records its first sighting).
//
// The outcomes are parallel to msgs. The error is non-nil only when nothing
// was committed (then the outcomes are nil): an invalid message fails the
// whole batch with a *ValidationError before the store is touched.
// Conflicts are reported as Conflict outcomes (and to hooks), not as an
// error, because the rest of the batch committed.
func (p *Processor[TTx]) ProcessBatch(ctx context.Context, h *Handler[TTx], msgs []*Message) ([]Outcome, error) {
	return p.processBatchCall(ctx, h, msgs, false)
}

// processBatchCall is ProcessBatch. With redecided (a Consumer's call),
// the messages the caller decides again alone are left to those calls'
// outcome reports, so that each counts once: all of them when the batch
// did not commit, and the Conflict and OutcomeNone ones when it did.
func (p *Processor[TTx]) processBatchCall(ctx context.Context, h *Handler[TTx], msgs []*Message, redecided bool) ([]Outcome, error) {
	start := time.Now()
	ctx, cs := p.onCall.start(ctx, h.name(), nil, msgs, true, false, start)
	defer cs.endOnPanic()
	outs, errs, err := p.processBatch(ctx, nil, false, h, msgs)
	p.reportBatch(ctx, h, msgs, outs, errs, err, start, redecided)
	cs.end(outs, err)
	return outs, err
}

// ProcessBatchTx is ProcessBatch inside tx, a transaction the caller owns.
// As with ProcessTx, on error the caller must roll tx back.
func (p *Processor[TTx]) ProcessBatchTx(ctx context.Context, tx TTx, h *Handler[TTx], msgs []*Message) ([]Outcome, error) {
	start := time.Now()
	ctx, cs := p.onCall.start(ctx, h.name(), nil, msgs, true, false, start)
	defer cs.endOnPanic()
	outs, errs, err := p.processBatch(ctx, &tx, true, h, msgs)
	p.reportBatch(ctx, h, msgs, outs, errs, err, start, false)
	cs.end(outs, err)
	return outs, err
}

// batchGuard is a batch's ordering state: each message's guard key, and
// whether the guard applies to it.
type batchGuard struct {
	keys    []string
	guarded []bool
	// inOrder is set by guardBatch when its candidates of each aggregate
	// come in sequence order in the batch already, as a broker delivers
	// them: inSeqOrder has nothing to move then, as long as the guarded
	// indexes it is given are among those candidates (any subset of an
	// ordered run is ordered).
	inOrder bool
}

// newBatchGuard validates h's ordering setup for msgs. It returns nil when
// h has no Ordering.
func (p *Processor[TTx]) newBatchGuard(h *Handler[TTx], msgs []*Message) (*batchGuard, error) {
	o := h.Ordering
	if o == nil {
		return nil, nil
	}
	if p.seq == nil {
		return nil, fmt.Errorf("%w: handler %q has Ordering but the driver does not implement driver.SequenceGuard", ErrInvalidConfig, h.Name)
	}
	if !o.VersionOnly && p.delMarkers == nil {
		return nil, fmt.Errorf("%w: handler %q has Ordering, and batches of it need a driver that implements driver.MarkerDeleter: use Process", ErrInvalidConfig, h.Name)
	}
	g := &batchGuard{keys: make([]string, len(msgs)), guarded: make([]bool, len(msgs))}
	for i, m := range msgs {
		agg, ok, err := orderingKey(h.Name, o, m)
		if err != nil {
			return nil, fmt.Errorf("idem: batch message %d: %w", i, err)
		}
		g.keys[i], g.guarded[i] = agg, ok
	}
	return g, nil
}

// guardBatch advances g's guard inside tx for the candidates (indexes into
// msgs), each aggregate's in sequence order, and returns the ones it
// refused: Stale, Duplicate (version-only) or OutcomeNone with a *GapError
// in errs.
func (p *Processor[TTx]) guardBatch(ctx context.Context, tx TTx, h *Handler[TTx], msgs []*Message, g *batchGuard, cand []int) (refused map[int]Outcome, errs map[int]error, err error) {
	order := slices.Clone(cand)
	slices.SortFunc(order, func(a, b int) int {
		if c := strings.Compare(g.keys[a], g.keys[b]); c != 0 {
			return c // one lock order for all batches: no deadlock
		}
		if c := cmp.Compare(msgs[a].Seq, msgs[b].Seq); c != 0 {
			return c
		}
		// Two IDs claiming one sequence: the first delivered applies,
		// as one at a time (cand may come in another order).
		return cmp.Compare(a, b)
	})
	g.inOrder = true
	for k := 1; k < len(order); k++ {
		if g.keys[order[k]] == g.keys[order[k-1]] && order[k] < order[k-1] {
			g.inOrder = false
			break
		}
	}
	res, err := p.advanceBatch(ctx, tx, h, msgs, g, order)
	if err != nil {
		return nil, nil, err
	}
	for k, i := range order {
		proceed, out, gerr := p.decide(h, msgs[i], g.keys[i], res[k])
		if proceed {
			continue
		}
		if refused == nil {
			refused = make(map[int]Outcome)
		}
		refused[i] = out
		if gerr != nil {
			if errs == nil {
				errs = make(map[int]error)
			}
			errs[i] = gerr
		}
	}
	return refused, errs, nil
}

// advanceBatch runs the guard's advance for the messages at order (sorted
// by aggregate, then sequence), in turn. With a driver.SequenceManyAdvancer
// that is one call, whose decision is checked against the one made here;
// with a driver.SequenceBatchStore two: lock and read every aggregate's
// last sequence, decide each message here as SequenceAdvance would, write
// the new ones back. Otherwise it is one SequenceAdvance per message.
func (p *Processor[TTx]) advanceBatch(ctx context.Context, tx TTx, h *Handler[TTx], msgs []*Message, g *batchGuard, order []int) ([]driver.SequenceAdvanceResult, error) {
	res := make([]driver.SequenceAdvanceResult, len(order))
	if p.seqBatch == nil && p.seqMany == nil {
		for k, i := range order {
			r, err := p.seq.SequenceAdvance(ctx, tx, p.advanceParams(h, msgs[i], g.keys[i]))
			if err != nil {
				return nil, fmt.Errorf("idem: ordering guard: %w", err)
			}
			res[k] = r
		}
		return res, nil
	}
	allowGap := h.Ordering.Gap == GapAllow
	aggs := make([]string, 0, len(order))
	for _, i := range order {
		if n := len(aggs); n == 0 || aggs[n-1] != g.keys[i] {
			aggs = append(aggs, g.keys[i])
		}
	}
	var (
		lasts, after []int64
		err          error
	)
	if p.seqMany != nil {
		mp := &driver.SequenceAdvanceManyParams{Handler: h.Name, AggregateIDs: aggs, Seqs: make([][]int64, len(aggs)), AllowGap: allowGap}
		a := -1
		for _, i := range order {
			if a < 0 || aggs[a] != g.keys[i] {
				a++
			}
			if n := len(mp.Seqs[a]); n == 0 || mp.Seqs[a][n-1] != msgs[i].Seq {
				mp.Seqs[a] = append(mp.Seqs[a], msgs[i].Seq)
			}
		}
		lasts, after, err = p.seqMany.SequenceAdvanceMany(ctx, tx, mp)
		if err == nil && (len(lasts) != len(aggs) || len(after) != len(aggs)) {
			err = fmt.Errorf("driver returned %d and %d sequences for %d aggregates", len(lasts), len(after), len(aggs))
		}
	} else {
		lasts, err = p.seqBatch.SequenceLockMany(ctx, tx, &driver.SequenceLockManyParams{Handler: h.Name, AggregateIDs: aggs})
		if err == nil && len(lasts) != len(aggs) {
			err = fmt.Errorf("driver returned %d sequences for %d aggregates", len(lasts), len(aggs))
		}
	}
	if err != nil {
		return nil, fmt.Errorf("idem: ordering guard: %w", err)
	}
	var before []int64 // for SequenceSetMany: what moved
	if after == nil {
		before = slices.Clone(lasts)
	}
	a := -1 // index of the current aggregate in aggs and lasts
	for k, i := range order {
		if a < 0 || aggs[a] != g.keys[i] {
			a++
		}
		last, seq := lasts[a], msgs[i].Seq
		if seq != last+1 && !(allowGap && seq > last) {
			res[k].Last = last
			continue
		}
		res[k].Advanced = true
		lasts[a] = seq
	}
	if after != nil {
		// lasts now holds what this decision leaves behind: the store's
		// must be the same, or a message would be reported applied (or
		// not) against what was written.
		for a, want := range lasts {
			if after[a] != want {
				return nil, fmt.Errorf("idem: ordering guard: the store advanced %q to %d, idem's decision is %d: %w",
					aggs[a], after[a], want, ErrSequenceMismatch)
			}
		}
		return res, nil
	}
	set := &driver.SequenceSetManyParams{Handler: h.Name}
	for a, last := range lasts {
		if last != before[a] { // an advance only ever moves forward
			set.AggregateIDs, set.Seqs = append(set.AggregateIDs, aggs[a]), append(set.Seqs, last)
		}
	}
	if len(set.AggregateIDs) > 0 {
		if err := p.seqBatch.SequenceSetMany(ctx, tx, set); err != nil {
			return nil, fmt.Errorf("idem: ordering guard: %w", err)
		}
	}
	return res, nil
}

// inSeqOrder reorders idx (indexes into msgs, in batch order) so that the
// guarded messages of each aggregate come in sequence order, each taking
// one of the places its aggregate's messages had.
func (g *batchGuard) inSeqOrder(idx []int, msgs []*Message) {
	if g.inOrder {
		return
	}
	places := make(map[string][]int)
	for at, i := range idx {
		if g.guarded[i] {
			places[g.keys[i]] = append(places[g.keys[i]], at)
		}
	}
	for _, at := range places {
		if len(at) < 2 {
			continue
		}
		group := make([]int, len(at))
		for k, a := range at {
			group[k] = idx[a]
		}
		slices.SortStableFunc(group, func(a, b int) int { return cmp.Compare(msgs[a].Seq, msgs[b].Seq) })
		for k, a := range at {
			idx[a] = group[k]
		}
	}
}

func (p *Processor[TTx]) processBatch(ctx context.Context, callerTx *TTx, owned bool, h *Handler[TTx], msgs []*Message) ([]Outcome, map[int]error, error) {
	if err := checkHandler(h); err != nil {
		return nil, nil, err
	}
	if len(msgs) == 0 {
		return []Outcome{}, nil, nil
	}
	for i, m := range msgs {
		if err := m.Validate(); err != nil {
			return nil, nil, fmt.Errorf("idem: batch message %d: %w", i, err)
		}
	}
	if h.inRow() {
		return p.processBatchInRow(ctx, callerTx, owned, h, msgs)
	}
	g, err := p.newBatchGuard(h, msgs)
	if err != nil {
		return nil, nil, err
	}
	if g != nil && h.Ordering.VersionOnly {
		return p.processBatchVersionOnly(ctx, callerTx, owned, h, msgs, g)
	}

	// First occurrence of each ID goes to the store; later occurrences are
	// decided against it after the insert. Sorted IDs make concurrent
	// overlapping batches lock in one order instead of deadlocking, and
	// put an ID's copies next to each other, first delivered first.
	hashes := make([][]byte, len(msgs))
	byID := make([]int, len(msgs))
	for i, m := range msgs {
		hashes[i] = m.PayloadHash()
		byID[i] = i
	}
	slices.SortStableFunc(byID, func(a, b int) int { return strings.Compare(msgs[a].ID, msgs[b].ID) })
	first := make([]int, len(msgs)) // index of the first copy of msgs[i].ID
	uniq := make([]int, 0, len(msgs))
	for k, i := range byID {
		if k > 0 && msgs[i].ID == msgs[byID[k-1]].ID {
			first[i] = first[byID[k-1]]
			continue
		}
		first[i] = i
		uniq = append(uniq, i)
	}
	params := &driver.MarkerInsertManyParams{
		Handler:       h.Name,
		MessageIDs:    make([]string, len(uniq)),
		PayloadHashes: make([][]byte, len(uniq)),
	}
	for k, i := range uniq {
		params.MessageIDs[k] = msgs[i].ID
		params.PayloadHashes[k] = hashes[i]
	}

	var (
		tx  TTx
		res []driver.MarkerInsertResult
	)
	switch {
	case owned:
		tx = *callerTx
	case p.beginMany != nil:
		if tx, res, err = p.beginMany.BeginMarkerInsertMany(ctx, params); err != nil {
			return nil, nil, fmt.Errorf("idem: begin and insert markers: %w", err)
		}
	default:
		if tx, err = p.drv.Begin(ctx); err != nil {
			return nil, nil, fmt.Errorf("idem: begin: %w", err)
		}
	}
	fail := func(err error) ([]Outcome, map[int]error, error) {
		if !owned {
			p.rollback(ctx, tx)
		}
		return nil, nil, err
	}
	if res == nil {
		if res, err = p.drv.MarkerInsertMany(ctx, tx, params); err != nil {
			return fail(fmt.Errorf("idem: insert markers: %w", err))
		}
	}
	if len(res) != len(uniq) {
		return fail(fmt.Errorf("idem: driver returned %d marker results for %d IDs", len(res), len(uniq)))
	}

	outs := make([]Outcome, len(msgs))
	var errs map[int]error // per message: conflicts and gaps
	setErr := func(i int, err error) {
		if errs == nil {
			errs = make(map[int]error)
		}
		errs[i] = err
	}
	decide := func(i int, storedHash []byte) {
		var err error
		if outs[i], err = p.existing(h, msgs[i].ID, hashes[i], storedHash); err != nil {
			setErr(i, err)
		}
	}
	stored := make([][]byte, len(msgs)) // hash the store holds after this batch, by first copy
	for k, i := range uniq {
		if res[k].Inserted {
			outs[i] = Applied
			stored[i] = hashes[i]
			continue
		}
		stored[i] = res[k].ExistingHash
		decide(i, res[k].ExistingHash)
	}
	var refused map[int]Outcome // first occurrences the ordering guard refused
	if g != nil {
		var cand []int
		for _, i := range uniq {
			if outs[i] == Applied && g.guarded[i] {
				cand = append(cand, i)
			}
		}
		var gapErrs map[int]error
		if refused, gapErrs, err = p.guardBatch(ctx, tx, h, msgs, g, cand); err != nil {
			return fail(err)
		}
		if len(refused) > 0 {
			del := &driver.MarkerDeleteParams{Handler: h.Name, MessageIDs: make([]string, 0, len(refused))}
			for i, out := range refused {
				outs[i] = out
				del.MessageIDs = append(del.MessageIDs, msgs[i].ID)
			}
			slices.Sort(del.MessageIDs)
			if err := p.delMarkers.MarkerDelete(ctx, tx, del); err != nil {
				return fail(fmt.Errorf("idem: delete the markers of refused messages: %w", err))
			}
			for i, err := range gapErrs {
				setErr(i, err)
			}
		}
	}
	fresh := make([]int, 0, len(uniq))
	for i, m := range msgs {
		if f := first[i]; f != i {
			if _, ok := refused[f]; ok {
				if !samePayload(hashes[i], hashes[f]) {
					// The same ID with another payload, whose first copy
					// left no marker: not that message, so not its fate.
					// Undecided, like a message behind a gap: alone, it
					// is decided against what the store holds then.
					outs[i] = OutcomeNone
					setErr(i, fmt.Errorf("idem: message %s came twice in the batch with different payloads and its first copy was not applied (%v): decide this one alone", m.ID, outs[f]))
					continue
				}
				// Its first occurrence left no marker: this copy, the
				// same message, shares that fate.
				outs[i] = outs[f]
				if err, ok := errs[f]; ok {
					setErr(i, err)
				}
				continue
			}
			decide(i, stored[f])
			continue
		}
		if outs[i] == Applied {
			fresh = append(fresh, i)
		}
	}
	if err := p.applyBatchCommit(ctx, tx, owned, h, msgs, fresh, g); err != nil {
		return nil, nil, err
	}
	return outs, errs, nil
}

// processBatchVersionOnly is processBatch for a version-only handler: the
// guard alone decides every message, and no marker is written.
func (p *Processor[TTx]) processBatchVersionOnly(ctx context.Context, callerTx *TTx, owned bool, h *Handler[TTx], msgs []*Message, g *batchGuard) ([]Outcome, map[int]error, error) {
	var tx TTx
	if owned {
		tx = *callerTx
	} else {
		var err error
		// The guard's statement is the first: BEGIN can go with it.
		if tx, err = p.beginDeferred(ctx); err != nil {
			return nil, nil, err
		}
	}
	all := make([]int, len(msgs))
	for i := range all {
		all[i] = i
	}
	refused, errs, err := p.guardBatch(ctx, tx, h, msgs, g, all)
	if err != nil {
		if !owned {
			p.rollback(ctx, tx)
		}
		return nil, nil, err
	}
	outs := make([]Outcome, len(msgs))
	fresh := make([]int, 0, len(msgs))
	for i := range msgs {
		if out, ok := refused[i]; ok {
			outs[i] = out
			continue
		}
		outs[i] = Applied
		fresh = append(fresh, i)
	}
	if err := p.applyBatchCommit(ctx, tx, owned, h, msgs, fresh, g); err != nil {
		return nil, nil, err
	}
	return outs, errs, nil
}

// applyBatchCommit hands the fresh messages (indexes into msgs, in batch
// order) to the handler, each aggregate's in sequence order when g is set,
// and commits tx when the processor owns it; with nothing fresh it rolls
// back instead. On error tx is rolled back (when owned) and nothing
// committed.
func (p *Processor[TTx]) applyBatchCommit(ctx context.Context, tx TTx, owned bool, h *Handler[TTx], msgs []*Message, fresh []int, g *batchGuard) error {
	if len(fresh) > 0 {
		if g != nil {
			g.inSeqOrder(fresh, msgs)
		}
		batch := make([]*Message, len(fresh))
		for k, i := range fresh {
			batch[k] = msgs[i]
		}
		apply := func() error { return callApplyBatch(ctx, h, tx, batch) }
		if !owned {
			inner := apply
			apply = func() error { return p.callOwned(ctx, tx, inner) }
		}
		if err := apply(); err != nil {
			if !owned {
				p.rollback(ctx, tx)
			}
			return err
		}
	}
	if owned {
		return nil
	}
	if len(fresh) == 0 {
		p.rollback(ctx, tx)
		return nil
	}
	if err := p.drv.Commit(ctx, tx); err != nil {
		return fmt.Errorf("idem: commit: %w", err)
	}
	return nil
}

func checkHandler[TTx any](h *Handler[TTx]) error {
	if h == nil {
		return fmt.Errorf("%w: nil handler", ErrInvalidConfig)
	}
	if err := ValidateHandlerName(h.Name); err != nil {
		return err
	}
	if h.Apply == nil && h.ApplyBatch == nil && !h.inRow() {
		return fmt.Errorf("%w: handler %q has neither Apply nor ApplyBatch (nor ApplyInRow)", ErrInvalidConfig, h.Name)
	}
	return nil
}

func callApply[TTx any](ctx context.Context, h *Handler[TTx], tx TTx, msg *Message) (err error) {
	defer recoverPanic(&err)
	if h.Apply != nil {
		err = h.Apply(ctx, tx, msg)
	} else {
		err = h.ApplyBatch(ctx, tx, []*Message{msg})
	}
	if err != nil {
		return handlerError(h.Name, err)
	}
	return nil
}

func callApplyBatch[TTx any](ctx context.Context, h *Handler[TTx], tx TTx, msgs []*Message) (err error) {
	defer recoverPanic(&err)
	if h.ApplyBatch != nil {
		err = h.ApplyBatch(ctx, tx, msgs)
	} else {
		for _, m := range msgs {
			if err = h.Apply(ctx, tx, m); err != nil {
				return fmt.Errorf("idem: handler %q, message %q: %w", h.Name, m.ID, err)
			}
		}
	}
	if err != nil {
		return handlerError(h.Name, err)
	}
	return nil
}

func handlerError(name string, err error) error {
	var pe *PanicError
	if errors.As(err, &pe) {
		return err
	}
	return fmt.Errorf("idem: handler %q: %w", name, err)
}

func recoverPanic(err *error) {
	if r := recover(); r != nil {
		*err = &PanicError{Value: r, Stack: debug.Stack()}
	}
}

func (p *Processor[TTx]) rollback(ctx context.Context, tx TTx) {
	if err := p.drv.Rollback(rollbackContext(ctx), tx); err != nil && !wasCut(ctx) {
		// A rollback fails when the connection broke, which the failed
		// call reports already: one line per kind every 10 s. (After a
		// stop's cut the driver drops the connection instead: no line.)
		p.logs.Warn(p.logger, Fingerprint(err), "idem: rollback failed", slog.Any("error", err))
	}
}

func (p *Processor[TTx]) report(ctx context.Context, h *Handler[TTx], msg *Message, out Outcome, err error, start time.Time, n int) {
	if len(p.onOutcome) == 0 {
		return
	}
	ev := &OutcomeEvent{Outcome: out, Err: err, Duration: time.Since(start), BatchSize: n}
	if h != nil {
		ev.Handler = h.Name
	}
	if msg != nil {
		ev.MessageID = msg.ID
	}
	for _, hk := range p.onOutcome {
		hk.OnOutcome(ctx, ev)
	}
}

func (p *Processor[TTx]) reportBatch(ctx context.Context, h *Handler[TTx], msgs []*Message, outs []Outcome, conflicts map[int]error, err error, start time.Time, redecided bool) {
	if len(p.onOutcome) == 0 || (redecided && err != nil) {
		return
	}
	d := time.Since(start)
	for i, m := range msgs {
		if redecided && (outs[i] == Conflict || outs[i] == OutcomeNone) {
			continue
		}
		ev := &OutcomeEvent{Err: err, Duration: d, BatchSize: len(msgs)}
		if h != nil {
			ev.Handler = h.Name
		}
		if m != nil {
			ev.MessageID = m.ID
		}
		if err == nil {
			ev.Outcome = outs[i]
			ev.Err = conflicts[i]
		}
		for _, hk := range p.onOutcome {
			hk.OnOutcome(ctx, ev)
		}
	}
}
