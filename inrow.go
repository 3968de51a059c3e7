package idem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// RowGuard is what an in-row handler's guarded write needs (see
// Handler.ApplyInRow): the messages of one aggregate it applies, and the
// condition its write must carry.
//
// The projection's row holds the aggregate's last applied sequence. The
// write moves it to To, and only if the row's last sequence is From − 1
// (strict order: GapFail, GapWait) or below From (AllowGap: latest state
// wins). A missing row counts as last sequence 0.
type RowGuard struct {
	// AggregateID names the aggregate's row: the messages' AggregateID,
	// after Ordering.Normalize when one is set (messages whose IDs
	// normalize alike share a row).
	AggregateID string
	// Msgs are the messages the write applies, in sequence order, no two
	// with one sequence. Process hands over one. A batch hands over a run
	// of the aggregate's messages: consecutive sequences under strict
	// order, rising ones under AllowGap. Apply all of them or none.
	Msgs []*Message
	// AllowGap is set under GapAllow: the condition is last < From rather
	// than last = From − 1.
	AllowGap bool
}

// From is the sequence of the first message: the one the guard's
// condition compares the row's last sequence with.
func (g *RowGuard) From() int64 { return g.Msgs[0].Seq }

// To is the sequence of the last message: the write stores it as the row's
// last applied sequence.
func (g *RowGuard) To() int64 { return g.Msgs[len(g.Msgs)-1].Seq }

// Admits reports whether a row whose last applied sequence is last must be
// advanced: From = last + 1, or under AllowGap From > last.
func (g *RowGuard) Admits(last int64) bool {
	return admits(g.From(), last, g.AllowGap)
}

func admits(seq, last int64, allowGap bool) bool {
	return seq == last+1 || (allowGap && seq > last)
}

// RowWrite is what an in-row handler reports of its guarded write. idem
// decides the outcome from Prev, and checks Advanced against it.
type RowWrite struct {
	// Advanced is true when the write changed the row: it was created, or
	// its last sequence moved to the guard's To. Rows affected 1, or a
	// row from RETURNING.
	Advanced bool
	// Prev is the row's last applied sequence as the write found it,
	// before changing it; 0 when there was no row. Take it from the row
	// (a locked read, or RETURNING from a locked read), never from the
	// message: it is what lets idem tell Stale from Duplicate from a gap,
	// and catch a guard that let a write through out of order.
	Prev int64
}

// ErrRowGuard matches every *RowGuardError.
var ErrRowGuard = errors.New("idem: in-row guard disagrees with the gap policy")

// RowGuardError reports an in-row handler whose write did not follow its
// guard: it advanced a row the gap policy refuses (Advanced, Final: the
// write was rolled back; fix the guard, then replay the dead letter), or
// it left alone a row the policy admits (a concurrent transaction created
// the row first, or the guard is too strict; retriable).
type RowGuardError struct {
	// Handler and AggregateID name the row.
	Handler     string
	AggregateID string
	// Seq is the first sequence of the write; Prev the row's last applied
	// sequence as the handler reported it.
	Seq, Prev int64
	// Advanced is what the handler reported.
	Advanced bool
	// Final is true when the write advanced out of order. IsPermanent
	// reports Final.
	Final bool
}

// Error implements error.
func (e *RowGuardError) Error() string {
	if e.Advanced {
		return fmt.Sprintf("idem: handler %q, aggregate %q: the write advanced the row from %d for sequence %d, which the gap policy refuses: the write's guard is wrong; rolled back",
			e.Handler, e.AggregateID, e.Prev, e.Seq)
	}
	return fmt.Sprintf("idem: handler %q, aggregate %q: the write did not advance the row from %d for sequence %d, which the gap policy admits (a concurrent creator of the row, or a guard that is too strict)",
		e.Handler, e.AggregateID, e.Prev, e.Seq)
}

// Is makes errors.Is(err, ErrRowGuard) true.
func (e *RowGuardError) Is(target error) bool { return target == ErrRowGuard }

// inRow reports whether h keeps its ordering guard in its own row.
func (h *Handler[TTx]) inRow() bool { return h.ApplyInRow != nil || h.ApplyInRowBatch != nil }

// checkInRow validates an in-row handler's setup.
func (p *Processor[TTx]) checkInRow(h *Handler[TTx]) error {
	if h.Apply != nil || h.ApplyBatch != nil {
		return fmt.Errorf("%w: handler %q sets ApplyInRow or ApplyInRowBatch together with Apply or ApplyBatch: choose one", ErrInvalidConfig, h.Name)
	}
	if h.Ordering == nil {
		return fmt.Errorf("%w: handler %q has ApplyInRow or ApplyInRowBatch but no Ordering (it holds the gap policy)", ErrInvalidConfig, h.Name)
	}
	if h.Ordering.Gap == GapWait && p.seq == nil {
		return fmt.Errorf("%w: handler %q waits for gaps, which needs a driver that implements driver.SequenceGuard to record their sightings", ErrInvalidConfig, h.Name)
	}
	return nil
}

// inRowKey validates msg for an in-row handler and returns its aggregate
// key (normalized if configured).
func inRowKey[TTx any](h *Handler[TTx], msg *Message) (string, error) {
	if msg.Seq == 0 {
		return "", &ValidationError{Field: "Seq", Reason: fmt.Sprintf("is required: handler %q keeps each aggregate's sequence in its own row (in-row guard)", h.Name), err: ErrInvalidMessage}
	}
	agg, _, err := orderingKey(h.Name, h.Ordering, msg)
	return agg, err
}

// classifyRow decides what a guarded write w of a run starting at seq
// means: proceed (the run is applied), or the refused first message's
// outcome (Stale, Duplicate), or an error: a *GapError, a *RowGuardError.
func (p *Processor[TTx]) classifyRow(h *Handler[TTx], agg string, seq int64, w RowWrite) (bool, Outcome, error) {
	o := h.Ordering
	allow := o.Gap == GapAllow
	ok := admits(seq, w.Prev, allow)
	switch {
	case w.Prev < 0:
		return false, OutcomeNone, fmt.Errorf("idem: handler %q, aggregate %q: the write reported previous sequence %d", h.Name, agg, w.Prev)
	case w.Advanced && ok:
		return true, OutcomeNone, nil
	case w.Advanced || ok:
		return false, OutcomeNone, &RowGuardError{Handler: h.Name, AggregateID: agg, Seq: seq, Prev: w.Prev, Advanced: w.Advanced, Final: w.Advanced}
	case seq == w.Prev:
		return false, Duplicate, nil
	case seq < w.Prev:
		return false, Stale, nil
	}
	return false, OutcomeNone, &GapError{Handler: h.Name, AggregateID: agg, Last: w.Prev, Seq: seq, Policy: o.Gap, Final: o.Gap == GapFail}
}

// writeRows calls the handler's guarded write for gs in tx.
func writeRows[TTx any](ctx context.Context, h *Handler[TTx], tx TTx, gs []*RowGuard) (ws []RowWrite, err error) {
	defer recoverPanic(&err)
	if h.ApplyInRowBatch != nil {
		ws, err = h.ApplyInRowBatch(ctx, tx, gs)
		if err == nil && len(ws) != len(gs) {
			err = fmt.Errorf("ApplyInRowBatch returned %d results for %d guards", len(ws), len(gs))
		}
	} else {
		ws = make([]RowWrite, len(gs))
		for k, g := range gs {
			if ws[k], err = h.ApplyInRow(ctx, tx, g); err != nil {
				break
			}
		}
	}
	if err != nil {
		return nil, handlerError(h.Name, err)
	}
	return ws, nil
}

// processInRow is Process (callerTx nil) or ProcessTx for an in-row
// handler: one guarded write, no idem row.
func (p *Processor[TTx]) processInRow(ctx context.Context, callerTx *TTx, h *Handler[TTx], msg *Message) (Outcome, error) {
	if err := p.checkInRow(h); err != nil {
		return OutcomeNone, err
	}
	agg, err := inRowKey(h, msg)
	if err != nil {
		return OutcomeNone, err
	}
	g := &RowGuard{AggregateID: agg, Msgs: []*Message{msg}, AllowGap: h.Ordering.Gap == GapAllow}
	var ws []RowWrite
	if callerTx != nil {
		if ws, err = writeRows(ctx, h, *callerTx, []*RowGuard{g}); err != nil {
			return OutcomeNone, err
		}
		proceed, out, err := p.classifyRow(h, agg, msg.Seq, ws[0])
		if proceed {
			return Applied, nil
		}
		// A gap under GapWait comes back without its first sighting, as
		// from ProcessTx with a separate guard: see SightGap.
		return out, err
	}
	tx, err := p.beginDeferred(ctx)
	if err != nil {
		return OutcomeNone, err
	}
	if err := p.callOwned(ctx, tx, func() error {
		var err error
		ws, err = writeRows(ctx, h, tx, []*RowGuard{g})
		return err
	}); err != nil {
		p.rollback(ctx, tx)
		return OutcomeNone, err
	}
	proceed, out, err := p.classifyRow(h, agg, msg.Seq, ws[0])
	if !proceed {
		p.rollback(ctx, tx)
		if err != nil {
			return OutcomeNone, p.sight(ctx, h, err)
		}
		return out, nil
	}
	if err := p.drv.Commit(ctx, tx); err != nil {
		return OutcomeNone, fmt.Errorf("idem: commit: %w", err)
	}
	return Applied, nil
}

// beginDeferred opens a transaction whose first statement needs no
// round trip of its own before it (an in-row handler's write, a
// version-only batch's guard): with the driver's deferred BEGIN when it
// has one.
func (p *Processor[TTx]) beginDeferred(ctx context.Context) (TTx, error) {
	var (
		tx  TTx
		err error
	)
	if p.beginLater != nil {
		tx, err = p.beginLater.BeginDeferred(ctx)
	} else {
		tx, err = p.drv.Begin(ctx)
	}
	if err != nil {
		return tx, fmt.Errorf("idem: begin: %w", err)
	}
	return tx, nil
}

// rowState is what a batch knows of one aggregate's row.
type rowState struct {
	key     string
	all     []int // the aggregate's messages, by sequence, then batch order
	pending []int // those not decided yet
	last    int64 // the row's last sequence, when known
	known   bool
	blocked error // the gap (or guard error) that holds the aggregate
}

// processBatchInRow is processBatch for an in-row handler. The handler's
// guarded writes run in rounds, each one write per aggregate at most: a
// run of the aggregate's messages that the row's last sequence may admit.
// Usually one round decides everything; another follows only for an
// aggregate whose run was refused as stale while later messages of it
// remain, or that has two messages with one sequence.
func (p *Processor[TTx]) processBatchInRow(ctx context.Context, callerTx *TTx, owned bool, h *Handler[TTx], msgs []*Message) ([]Outcome, map[int]error, error) {
	if err := p.checkInRow(h); err != nil {
		return nil, nil, err
	}
	keys := make([]string, len(msgs))
	order := make([]int, len(msgs))
	for i, m := range msgs {
		agg, err := inRowKey(h, m)
		if err != nil {
			return nil, nil, fmt.Errorf("idem: batch message %d: %w", i, err)
		}
		keys[i], order[i] = agg, i
	}
	// One order for all batches, so that set-based writes lock rows in
	// it; each aggregate's messages by sequence, and one sequence twice:
	// the first delivered applies.
	slices.SortFunc(order, func(a, b int) int {
		if c := strings.Compare(keys[a], keys[b]); c != 0 {
			return c
		}
		if c := cmp.Compare(msgs[a].Seq, msgs[b].Seq); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	pending := slices.Clone(order) // cut into each aggregate's pending
	distinct := 0
	for k, i := range order {
		if k == 0 || keys[i] != keys[order[k-1]] {
			distinct++
		}
	}
	rows := make([]rowState, 0, distinct)
	for lo := 0; lo < len(order); {
		hi := lo + 1
		for hi < len(order) && keys[order[hi]] == keys[order[lo]] {
			hi++
		}
		rows = append(rows, rowState{key: keys[order[lo]], all: order[lo:hi:hi], pending: pending[lo:hi:hi]})
		lo = hi
	}

	var tx TTx
	if owned {
		tx = *callerTx
	} else {
		var err error
		if tx, err = p.beginDeferred(ctx); err != nil {
			return nil, nil, err
		}
	}
	fail := func(err error) ([]Outcome, map[int]error, error) {
		if !owned {
			p.rollback(ctx, tx)
		}
		return nil, nil, err
	}
	outs := make([]Outcome, len(msgs))
	var errs map[int]error
	setErr := func(i int, err error) {
		if errs == nil {
			errs = make(map[int]error)
		}
		errs[i] = err
	}
	allow := h.Ordering.Gap == GapAllow
	applied := 0
	for {
		// This round's guards, their messages (indexes into msgs, and
		// the messages), and the aggregate of each.
		var (
			guards = make([]RowGuard, 0, len(rows))
			gs     []*RowGuard
			runs   = make([]int, 0, len(msgs))
			gmsgs  = make([]*Message, 0, len(msgs))
			ends   = make([]int, 0, len(rows)) // where each guard's run ends in runs
			of     = make([]*rowState, 0, len(rows))
		)
		for r := range rows {
			st := &rows[r]
			p.settleRow(h, st, msgs, outs, setErr)
			if len(st.pending) == 0 {
				continue
			}
			first := len(runs)
			runs, gmsgs = append(runs, st.pending[0]), append(gmsgs, msgs[st.pending[0]])
			for _, i := range st.pending[1:] {
				prev := msgs[runs[len(runs)-1]].Seq
				if msgs[i].Seq == prev {
					continue // a second message with one sequence: decided once the first is
				}
				if !admits(msgs[i].Seq, prev, allow) {
					break
				}
				runs, gmsgs = append(runs, i), append(gmsgs, msgs[i])
			}
			guards = append(guards, RowGuard{AggregateID: st.key, Msgs: gmsgs[first:len(gmsgs):len(gmsgs)], AllowGap: allow})
			ends, of = append(ends, len(runs)), append(of, st)
		}
		if len(guards) == 0 {
			break
		}
		gs = make([]*RowGuard, len(guards))
		for k := range guards {
			gs[k] = &guards[k]
		}
		var ws []RowWrite
		call := func() error {
			var err error
			ws, err = writeRows(ctx, h, tx, gs)
			return err
		}
		var err error
		if owned {
			err = call()
		} else {
			err = p.callOwned(ctx, tx, call)
		}
		if err != nil {
			return fail(err)
		}
		for k, st := range of {
			run := runs[ends[k]-len(guards[k].Msgs) : ends[k]]
			proceed, _, err := p.classifyRow(h, st.key, msgs[run[0]].Seq, ws[k])
			switch {
			case proceed:
				for _, i := range run {
					outs[i] = Applied
				}
				applied += len(run)
				st.pending = slices.DeleteFunc(st.pending, func(i int) bool { return outs[i] == Applied })
				st.last, st.known = gs[k].To(), true
			case err != nil && ws[k].Advanced:
				// Written, but not applied (out of order, or a report
				// idem cannot read): nothing of the batch may commit.
				return fail(err)
			case err != nil && !errors.Is(err, ErrGap):
				st.blocked = err
			default:
				// Refused: its outcome follows from the row's last
				// sequence, as do the later messages'.
				st.last, st.known = ws[k].Prev, true
			}
		}
	}
	if owned {
		return outs, errs, nil
	}
	if applied == 0 {
		p.rollback(ctx, tx)
		return outs, errs, nil
	}
	if err := p.drv.Commit(ctx, tx); err != nil {
		return nil, nil, fmt.Errorf("idem: commit: %w", err)
	}
	return outs, errs, nil
}

// settleRow decides the pending messages of st that its known last
// sequence decides without a write: those at or below it (Duplicate,
// Stale) and, under strict order, those past a gap after it, which hold
// the rest of the aggregate (OutcomeNone with the *GapError).
func (p *Processor[TTx]) settleRow(h *Handler[TTx], st *rowState, msgs []*Message, outs []Outcome, setErr func(int, error)) {
	o := h.Ordering
	for len(st.pending) > 0 {
		i := st.pending[0]
		seq := msgs[i].Seq
		switch {
		case st.blocked != nil:
			outs[i] = OutcomeNone
			setErr(i, st.blocked)
		case !st.known || admits(seq, st.last, o.Gap == GapAllow):
			return
		case seq == st.last || appliedSeq(st, msgs, outs, seq):
			// The last applied sequence again, or one this batch applied
			// under another copy.
			outs[i] = Duplicate
		case seq < st.last:
			outs[i] = Stale
		default:
			st.blocked = &GapError{Handler: h.Name, AggregateID: st.key, Last: st.last, Seq: seq, Policy: o.Gap, Final: o.Gap == GapFail}
			outs[i] = OutcomeNone
			setErr(i, st.blocked)
		}
		st.pending = st.pending[1:]
	}
}

// appliedSeq reports whether this batch applied a message of st with
// sequence seq.
func appliedSeq(st *rowState, msgs []*Message, outs []Outcome, seq int64) bool {
	for _, i := range st.all {
		if msgs[i].Seq == seq && outs[i] == Applied {
			return true
		}
	}
	return false
}
