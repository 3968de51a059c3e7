// Package bench measures idem's overhead: the throughput of a consumer that
// applies each event through idem, relative to the same transaction without
// the marker, on the same store and in the same process.
//
// A Target runs one store's four transaction shapes: a plain transaction per
// message, an idempotent one (Processor.Process), a plain transaction per
// batch, and an idempotent one (Processor.ProcessBatch). All four apply the
// same effect, an upsert into a balances table, so the difference between
// plain and idempotent is the marker alone. Every event has a new message
// ID: the marker insert path is what is measured.
//
// Run drives one variant with several workers; Compare alternates plain and
// idempotent rounds and reports medians and their ratio. The package is used
// both by `go test -bench` and by the idem command line, so it never imports
// package testing.
package bench

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
)

// TablePrefix is the prefix of every table the benchmark creates, idem's
// included, so that pointing a benchmark at an existing database never
// touches the application's tables.
const TablePrefix = "idem_bench_"

// handlerName is the name of the benchmark handler.
const handlerName = "bench.balances"

// Variant selects whether a run goes through idem.
type Variant uint8

const (
	// Plain runs the transaction without a marker, using the store's
	// native API.
	Plain Variant = iota
	// Idem runs the same transaction through an idem.Processor.
	Idem
)

// String returns "plain" or "idem".
func (v Variant) String() string {
	switch v {
	case Plain:
		return "plain"
	case Idem:
		return "idem"
	}
	return "variant(" + strconv.Itoa(int(v)) + ")"
}

// Target is one store set up for benchmarking: a balances table and a
// migrated idem schema. Its methods are safe for concurrent use.
//
// Every message carries its account in AggregateID and its amount, in
// decimal, in Payload; see Decode. The batch methods receive messages with
// unique IDs and apply the balances aggregated per account, in account
// order (see Aggregate).
type Target interface {
	// Name identifies the store, for example "postgres".
	Name() string
	// PlainOne applies msg in its own transaction without idem.
	PlainOne(ctx context.Context, msg *idem.Message) error
	// IdemOne applies msg with Processor.Process. An outcome other than
	// Applied is an error.
	IdemOne(ctx context.Context, msg *idem.Message) error
	// PlainBatch applies msgs in one transaction without idem.
	PlainBatch(ctx context.Context, msgs []*idem.Message) error
	// IdemBatch applies msgs with Processor.ProcessBatch. An outcome other
	// than Applied is an error.
	IdemBatch(ctx context.Context, msgs []*idem.Message) error
}

// VersionOnlyTarget is implemented by targets that can run the idempotent
// variants in version-only mode (Ordering.VersionOnly): no marker, the
// per-aggregate sequence guard alone.
type VersionOnlyTarget interface {
	// IdemOneVersionOnly applies msg with Processor.Process and a
	// version-only handler. An outcome other than Applied is an error.
	IdemOneVersionOnly(ctx context.Context, msg *idem.Message) error
	// IdemBatchVersionOnly applies msgs with Processor.ProcessBatch and a
	// version-only handler applying them with the set-based write of
	// IdemBatch. An outcome other than Applied is an error.
	IdemBatchVersionOnly(ctx context.Context, msgs []*idem.Message) error
}

// VersionOnly returns t with its idempotent variants running in
// version-only mode, or an error if t does not support it.
func VersionOnly(t Target) (Target, error) {
	vt, ok := t.(VersionOnlyTarget)
	if !ok {
		return nil, fmt.Errorf("%w: %s does not support version-only mode", ErrUnsupported, t.Name())
	}
	return versionOnly{Target: t, vt: vt}, nil
}

type versionOnly struct {
	Target
	vt VersionOnlyTarget
}

func (v versionOnly) Name() string { return v.Target.Name() + "/version-only" }

func (v versionOnly) IdemOne(ctx context.Context, msg *idem.Message) error {
	return v.vt.IdemOneVersionOnly(ctx, msg)
}

func (v versionOnly) IdemBatch(ctx context.Context, msgs []*idem.Message) error {
	return v.vt.IdemBatchVersionOnly(ctx, msgs)
}

// idemVariants runs a target's idempotent variants: one processor and the
// target's handler in each mode. Every store's target embeds it, so the
// variants differ between stores only in the handler's writes.
type idemVariants[TTx any] struct {
	proc          *idem.Processor[TTx]
	h, vh, eh, oh *idem.Handler[TTx]
}

// newIdemVariants derives the version-only, per-event and ordered
// handlers from h.
func newIdemVariants[TTx any](proc *idem.Processor[TTx], h *idem.Handler[TTx]) idemVariants[TTx] {
	return idemVariants[TTx]{proc: proc, h: h, vh: versionOnlyHandler(h), eh: perEventHandler(h), oh: orderedHandler(h)}
}

// IdemOne implements Target.
func (v idemVariants[TTx]) IdemOne(ctx context.Context, msg *idem.Message) error {
	out, err := v.proc.Process(ctx, v.h, msg)
	return checkApplied1(msg, out, err)
}

// IdemBatch implements Target.
func (v idemVariants[TTx]) IdemBatch(ctx context.Context, msgs []*idem.Message) error {
	return processBatch(ctx, v.proc, v.h, msgs)
}

// IdemOneVersionOnly implements VersionOnlyTarget.
func (v idemVariants[TTx]) IdemOneVersionOnly(ctx context.Context, msg *idem.Message) error {
	out, err := v.proc.Process(ctx, v.vh, msg)
	return checkApplied1(msg, out, err)
}

// IdemBatchVersionOnly implements VersionOnlyTarget.
func (v idemVariants[TTx]) IdemBatchVersionOnly(ctx context.Context, msgs []*idem.Message) error {
	return processBatch(ctx, v.proc, v.vh, msgs)
}

// IdemBatchPerEvent implements PerEventTarget.
func (v idemVariants[TTx]) IdemBatchPerEvent(ctx context.Context, msgs []*idem.Message) error {
	return processBatch(ctx, v.proc, v.eh, msgs)
}

// IdemBatchOrdered implements OrderedTarget.
func (v idemVariants[TTx]) IdemBatchOrdered(ctx context.Context, msgs []*idem.Message) error {
	return processBatch(ctx, v.proc, v.oh, msgs)
}

// versionOnlyHandler returns a version-only copy of h: it dedupes by each
// account's sequence (Seq), latest wins.
func versionOnlyHandler[TTx any](h *idem.Handler[TTx]) *idem.Handler[TTx] {
	v := *h
	v.Name = h.Name + ".version_only"
	v.Ordering = &idem.Ordering{Gap: idem.GapAllow, VersionOnly: true}
	return &v
}

// OrderedTarget is implemented by targets that can run the idempotent batch
// variant with the ordering guard on (Ordering with GapAllow: each
// account's sequence numbers grow, with gaps, as a partition's offsets
// do).
type OrderedTarget interface {
	// IdemBatchOrdered applies msgs with Processor.ProcessBatch and an
	// ordered handler. An outcome other than Applied is an error.
	IdemBatchOrdered(ctx context.Context, msgs []*idem.Message) error
}

// Ordered returns t with IdemBatch running the ordering guard, or an error
// if t does not support it.
func Ordered(t Target) (Target, error) {
	ot, ok := t.(OrderedTarget)
	if !ok {
		return nil, fmt.Errorf("%w: %s does not support ordered batches", ErrUnsupported, t.Name())
	}
	return ordered{Target: t, ot: ot}, nil
}

type ordered struct {
	Target
	ot OrderedTarget
}

func (o ordered) Name() string { return o.Target.Name() + "/ordered" }

func (o ordered) IdemBatch(ctx context.Context, msgs []*idem.Message) error {
	return o.ot.IdemBatchOrdered(ctx, msgs)
}

// orderedHandler returns a copy of h with the ordering guard on.
func orderedHandler[TTx any](h *idem.Handler[TTx]) *idem.Handler[TTx] {
	o := *h
	o.Name = h.Name + ".ordered"
	o.Ordering = &idem.Ordering{Gap: idem.GapAllow}
	return &o
}

// Case is one workload shape of the standard set.
type Case struct {
	// Name identifies the case, for example "batch-1000".
	Name string
	// BatchSize is as in Workload: 0 is the per-message API.
	BatchSize int
	// VersionOnly runs the idempotent variant in version-only mode (see
	// VersionOnly).
	VersionOnly bool
	// PerEvent applies a batch one statement per event (see PerEvent).
	PerEvent bool
	// Ordered runs the idempotent batch variant with the ordering guard
	// (see Ordered).
	Ordered bool
	// VsHand measures idem against the hand-rolled dedupe instead of the
	// plain transaction (see HandRolled); batches then apply one upsert
	// per event on both sides.
	VsHand bool
	// InRow runs both variants with the in-row guard (see InRow): the
	// balance row holds the account's sequence and its upsert the guard.
	InRow bool
	// WriteOnly runs the idempotent per-message variant on a store's
	// write-only path (see WriteOnly).
	WriteOnly bool
	// Store, when set, is the only store (Target.Name) the case runs on.
	Store string
}

// ErrUnsupported is wrapped by the error of a case's Target when the store
// lacks the variant the case needs (the in-row guard, a hand-rolled
// baseline, a write-only path).
var ErrUnsupported = errors.New("bench: the store does not support this case")

// RunsOn reports whether the case runs on the store named store.
func (c Case) RunsOn(store string) bool { return c.Store == "" || c.Store == store }

// Cases returns the standard cases in the order they run.
func Cases() []Case {
	return []Case{
		{Name: "per-message"},
		{Name: "version-only", VersionOnly: true},
		{Name: "batch-100", BatchSize: 100},
		{Name: "batch-100-ordered", BatchSize: 100, Ordered: true},
		{Name: "batch-1000", BatchSize: 1000},
		{Name: "batch-1000-per-event", BatchSize: 1000, PerEvent: true},
		{Name: "batch-1000-version-only", BatchSize: 1000, VersionOnly: true},
		{Name: "version-in-row", InRow: true},
		{Name: "batch-1000-version-in-row", BatchSize: 1000, InRow: true},
		{Name: "per-message-vs-hand", VsHand: true},
		{Name: "batch-1000-per-event-vs-hand", BatchSize: 1000, VsHand: true},
		{Name: "per-message-write-only", WriteOnly: true, Store: "redis"},
		{Name: "per-message-write-only-vs-hand", WriteOnly: true, VsHand: true, Store: "redis"},
	}
}

// Target returns t adapted to the case: t itself, or t in version-only,
// per-event, ordered, hand-rolled or in-row mode.
func (c Case) Target(t Target) (Target, error) {
	switch {
	case c.WriteOnly:
		wt, err := WriteOnly(t)
		if err != nil || !c.VsHand {
			return wt, err
		}
		h, err := HandRolled(t)
		if err != nil {
			return nil, err
		}
		hr := h.(handRolled)
		hr.Target = wt
		return hr, nil
	case c.VsHand:
		return HandRolled(t)
	case c.InRow:
		return InRow(t)
	case c.VersionOnly:
		return VersionOnly(t)
	case c.PerEvent:
		return PerEvent(t)
	case c.Ordered:
		return Ordered(t)
	}
	return t, nil
}

// WriteOnlyTarget is implemented by targets whose store has a write-only
// path: a handler that only writes, its marker checked and its writes
// applied in one call at commit (redisstore's Config.WriteOnly).
type WriteOnlyTarget interface {
	// IdemOneWriteOnly applies msg with Processor.Process on the
	// write-only path. An outcome other than Applied is an error.
	IdemOneWriteOnly(ctx context.Context, msg *idem.Message) error
}

// WriteOnly returns t with its idempotent per-message variant on the
// write-only path, or an error if t has none. Its batches are t's.
func WriteOnly(t Target) (Target, error) {
	wt, ok := t.(WriteOnlyTarget)
	if !ok {
		return nil, fmt.Errorf("%w: %s has no write-only path", ErrUnsupported, t.Name())
	}
	return writeOnly{Target: t, wt: wt}, nil
}

type writeOnly struct {
	Target
	wt WriteOnlyTarget
}

func (w writeOnly) Name() string { return w.Target.Name() + "/write-only" }

func (w writeOnly) IdemOne(ctx context.Context, msg *idem.Message) error {
	return w.wt.IdemOneWriteOnly(ctx, msg)
}

// Versus returns a target whose Plain variants are base's idempotent ones
// and whose Idem variants are t's: Compare then gives idem on t as a ratio
// of idem on base, an A/B of two configurations of one store in one
// process.
func Versus(t, base Target) Target { return versus{Target: t, base: base} }

type versus struct {
	Target
	base Target
}

func (v versus) Name() string { return v.Target.Name() + "/vs-" + v.base.Name() }

func (v versus) PlainOne(ctx context.Context, msg *idem.Message) error {
	return v.base.IdemOne(ctx, msg)
}

func (v versus) PlainBatch(ctx context.Context, msgs []*idem.Message) error {
	return v.base.IdemBatch(ctx, msgs)
}

// HandRolledTarget is implemented by targets that can run the dedupe a
// team writes by hand before reaching for a library: a processed-events
// table keyed by the message ID alone (no handler name, no payload hash, no
// index for retention), the ID inserted in the business transaction before
// the effect, and the effect applied only when that insert added a row.
type HandRolledTarget interface {
	// HandOne applies msg in its own transaction behind the hand-rolled
	// dedupe.
	HandOne(ctx context.Context, msg *idem.Message) error
	// HandBatchPerEvent applies msgs in one transaction behind the
	// hand-rolled dedupe, one upsert per new event.
	HandBatchPerEvent(ctx context.Context, msgs []*idem.Message) error
}

// HandRolled returns t with the hand-rolled dedupe as its baseline: its
// Plain variant runs HandRolledTarget's methods, and its batches apply one
// upsert per event on both sides (as PerEvent's do). The ratio is then
// idem's throughput relative to the code it replaces. It returns an error
// if t supports neither.
func HandRolled(t Target) (Target, error) {
	ht, ok := t.(HandRolledTarget)
	if !ok {
		return nil, fmt.Errorf("%w: %s has no hand-rolled dedupe", ErrUnsupported, t.Name())
	}
	pt, ok := t.(PerEventTarget)
	if !ok {
		return nil, fmt.Errorf("%w: %s does not support per-event batches", ErrUnsupported, t.Name())
	}
	return handRolled{Target: t, ht: ht, pt: pt}, nil
}

type handRolled struct {
	Target
	ht HandRolledTarget
	pt PerEventTarget
}

func (h handRolled) Name() string { return h.Target.Name() + "/vs-hand" }

func (h handRolled) PlainOne(ctx context.Context, msg *idem.Message) error {
	return h.ht.HandOne(ctx, msg)
}

func (h handRolled) PlainBatch(ctx context.Context, msgs []*idem.Message) error {
	return h.ht.HandBatchPerEvent(ctx, msgs)
}

func (h handRolled) IdemBatch(ctx context.Context, msgs []*idem.Message) error {
	return h.pt.IdemBatchPerEvent(ctx, msgs)
}

// handTable is the hand-rolled dedupe's table (or key prefix, on Redis).
const handTable = TablePrefix + "hand_processed"

// PerEventTarget is implemented by targets whose batch variants can apply a
// batch's events one statement each, as a consumer that loops over a poll's
// records does, instead of one set-based statement over the aggregated
// balances. The marker insert is the same set-based statement either way.
type PerEventTarget interface {
	// PlainBatchPerEvent applies msgs in one transaction without idem,
	// one upsert per event.
	PlainBatchPerEvent(ctx context.Context, msgs []*idem.Message) error
	// IdemBatchPerEvent applies msgs with Processor.ProcessBatch, the
	// handler running one upsert per new event. An outcome other than
	// Applied is an error.
	IdemBatchPerEvent(ctx context.Context, msgs []*idem.Message) error
}

// PerEvent returns t with its batch variants applying one statement per
// event, or an error if t does not support it. Its per-message methods are
// t's.
func PerEvent(t Target) (Target, error) {
	pt, ok := t.(PerEventTarget)
	if !ok {
		return nil, fmt.Errorf("%w: %s does not support per-event batches", ErrUnsupported, t.Name())
	}
	return perEvent{Target: t, pt: pt}, nil
}

type perEvent struct {
	Target
	pt PerEventTarget
}

func (p perEvent) Name() string { return p.Target.Name() + "/per-event" }

func (p perEvent) PlainBatch(ctx context.Context, msgs []*idem.Message) error {
	return p.pt.PlainBatchPerEvent(ctx, msgs)
}

func (p perEvent) IdemBatch(ctx context.Context, msgs []*idem.Message) error {
	return p.pt.IdemBatchPerEvent(ctx, msgs)
}

// perEventHandler returns a copy of h whose ApplyBatch calls h.Apply for
// each message in turn.
func perEventHandler[TTx any](h *idem.Handler[TTx]) *idem.Handler[TTx] {
	e := *h
	e.Name = h.Name + ".per_event"
	apply := h.Apply
	e.ApplyBatch = func(ctx context.Context, tx TTx, msgs []*idem.Message) error {
		for _, m := range msgs {
			if err := apply(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	}
	return &e
}

// checkApplied1 returns an error unless out is Applied.
func checkApplied1(msg *idem.Message, out idem.Outcome, err error) error {
	if err != nil {
		return err
	}
	if out != idem.Applied {
		return fmt.Errorf("bench: message %q: outcome %v, want applied", msg.ID, out)
	}
	return nil
}

// Workload describes one run.
type Workload struct {
	// Workers is the number of goroutines applying events concurrently.
	// Default 1.
	Workers int
	// BatchSize is the number of events per transaction. 0 means one
	// event per transaction through the per-message API (Process); any
	// other value uses the batch API (ProcessBatch), even 1.
	BatchSize int
	// Events stops the run after this many events. 0 means no limit.
	Events int
	// Duration stops the run once this much time has passed; workers
	// finish the transaction they are in. 0 means no limit. At least one
	// of Events and Duration must be set.
	Duration time.Duration
	// Accounts is the number of distinct balance rows. The accounts are
	// partitioned between the workers, as a broker partitions by key, so
	// workers never wait on each other's row locks. Default 10,000: a
	// batch of 1,000 events then touches about 820 distinct rows, so the
	// effect writes close to one row per event, as the marker does.
	Accounts int
}

func (w Workload) withDefaults() (Workload, error) {
	if w.Workers <= 0 {
		w.Workers = 1
	}
	if w.Accounts <= 0 {
		w.Accounts = 10000
	}
	if w.Accounts < w.Workers {
		w.Accounts = w.Workers
	}
	if w.BatchSize < 0 {
		return w, fmt.Errorf("bench: batch size %d is negative", w.BatchSize)
	}
	if w.Events < 0 || w.Duration < 0 {
		return w, errors.New("bench: negative event count or duration")
	}
	if w.Events == 0 && w.Duration == 0 {
		return w, errors.New("bench: workload sets neither Events nor Duration")
	}
	return w, nil
}

// Result is the outcome of one run.
type Result struct {
	// Variant is what ran.
	Variant Variant
	// Events is the number of events applied.
	Events int
	// Elapsed is the wall time from the start of the first transaction to
	// the end of the last.
	Elapsed time.Duration
	// Window is the run's Duration for a timed run, else zero.
	Window time.Duration
	// WindowEvents estimates the events applied within Window: every
	// transaction that ended in it, and of each transaction still running
	// when it closed, the share of its events that its time inside the
	// window represents.
	WindowEvents float64
}

// Rate returns the throughput in events per second: WindowEvents over
// Window for a timed run, else Events over Elapsed.
//
// A timed run lets each worker finish the transaction it is in when time
// is up, so the last workers run on alone, on a machine the others have
// left idle. Events over Elapsed counts that tail, and the more so the
// longer a transaction is against the run: with 500ms rounds of
// 1,000-event transactions the ratio came out 0.05–0.1 higher than with
// 3s rounds. The window counts only the time when every worker was busy.
func (r Result) Rate() float64 {
	if r.Window > 0 {
		return r.WindowEvents / r.Window.Seconds()
	}
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Events) / r.Elapsed.Seconds()
}

// Run applies w's events to t with variant v and measures the throughput.
// Each run uses message IDs never used before, so every event takes the
// marker insert path. The first error stops all workers and is returned.
func Run(ctx context.Context, t Target, v Variant, w Workload) (Result, error) {
	w, err := w.withDefaults()
	if err != nil {
		return Result{}, err
	}
	if v != Plain && v != Idem {
		return Result{}, fmt.Errorf("bench: unknown variant %d", v)
	}
	prefix, err := runPrefix()
	if err != nil {
		return Result{}, err
	}
	// Sequence numbers grow across runs, processes included, as long as
	// no run applies a million events in a millisecond: a run's numbers
	// start above every earlier run's, so version-only targets never see
	// a stale event. Each account belongs to one worker, which claims
	// its numbers in increasing order.
	seqBase := time.Now().UnixMilli() * 1_000_000
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)

	unit := max(w.BatchSize, 1)
	var (
		next    atomic.Int64 // next sequence number to hand out
		applied atomic.Int64
		wg      sync.WaitGroup
	)
	// Build every worker's generator before the clock starts: under the
	// race detector that alone can outlast a short run.
	gens := make([]*generator, w.Workers)
	for i := range gens {
		gens[i] = newGenerator(prefix, seqBase, i, w.Workers, w.Accounts, unit)
	}
	start := time.Now()
	var deadline time.Time
	if w.Duration > 0 {
		deadline = start.Add(w.Duration)
	}
	// claim returns the half-open range of sequence numbers of the
	// worker's next transaction, or ok false when the run is over.
	claim := func() (lo, hi int64, ok bool) {
		if ctx.Err() != nil || (!deadline.IsZero() && !time.Now().Before(deadline)) {
			return 0, 0, false
		}
		hi = next.Add(int64(unit))
		lo = hi - int64(unit)
		if w.Events > 0 {
			if lo >= int64(w.Events) {
				return 0, 0, false
			}
			hi = min(hi, int64(w.Events))
		}
		return lo, hi, true
	}
	// Each worker's share of WindowEvents, written by that worker only.
	inWindow := make([]float64, w.Workers)
	for i := range w.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g := gens[i]
			for {
				lo, hi, ok := claim()
				if !ok {
					return
				}
				msgs := g.messages(lo, hi)
				t0 := time.Now()
				var err error
				switch {
				case w.BatchSize == 0 && v == Plain:
					err = t.PlainOne(ctx, msgs[0])
				case w.BatchSize == 0:
					err = t.IdemOne(ctx, msgs[0])
				case v == Plain:
					err = t.PlainBatch(ctx, msgs)
				default:
					err = t.IdemBatch(ctx, msgs)
				}
				if err != nil {
					cancel(fmt.Errorf("bench: %s %s worker %d: %w", t.Name(), v, i, err))
					return
				}
				applied.Add(hi - lo)
				inWindow[i] += windowShare(float64(hi-lo), t0, time.Now(), deadline)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := context.Cause(ctx); err != nil {
		return Result{}, err
	}
	res := Result{Variant: v, Events: int(applied.Load()), Elapsed: elapsed}
	if !deadline.IsZero() {
		res.Window = w.Duration
		for _, n := range inWindow {
			res.WindowEvents += n
		}
	}
	return res, nil
}

// windowShare returns the part of a transaction's n events that falls
// before deadline, for a transaction that ran from t0 to t1: all of them
// if it ended in time, none if it began after, else the fraction of its
// time before the deadline. A zero deadline means no window.
func windowShare(n float64, t0, t1, deadline time.Time) float64 {
	switch {
	case deadline.IsZero():
		return 0
	case !t1.After(deadline):
		return n
	case !t0.Before(deadline):
		return 0
	}
	return n * float64(deadline.Sub(t0)) / float64(t1.Sub(t0))
}

// runPrefix returns a random prefix that makes a run's message IDs unique
// across runs and processes sharing one database.
func runPrefix() (string, error) {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("bench: random run prefix: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// inSQLTx runs fn in a transaction begun on db with BeginTx (the driver's
// defaults, as a plain database/sql caller has them) and commits it: the
// plain and hand-rolled variants of the database/sql targets.
func inSQLTx(ctx context.Context, db *sql.DB, fn func(tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("bench: begin: %w", err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("bench: commit: %w", err)
	}
	return nil
}
