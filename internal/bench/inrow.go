package bench

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/idemhq/idem"
)

// InRowTarget is implemented by targets that can run both variants with
// the in-row guard (Handler.ApplyInRow): a balances table whose rows also
// hold each account's last applied sequence, written by an upsert that
// carries the guard (latest wins, as GapAllow). The plain variant runs the
// same guarded writes in its own transactions; the idempotent one runs
// them as an in-row handler, so the ratio is what idem adds to the
// projection's own guard. idem writes no row of its own here.
type InRowTarget interface {
	// PlainOneInRow applies msg's guarded write in its own transaction
	// without idem.
	PlainOneInRow(ctx context.Context, msg *idem.Message) error
	// IdemOneInRow applies msg with Processor.Process and an in-row
	// handler. An outcome other than Applied is an error.
	IdemOneInRow(ctx context.Context, msg *idem.Message) error
	// PlainBatchInRow applies msgs' guarded writes, one guard per
	// account, in one transaction without idem.
	PlainBatchInRow(ctx context.Context, msgs []*idem.Message) error
	// IdemBatchInRow applies msgs with Processor.ProcessBatch and an
	// in-row handler whose batch write is set-based. An outcome other
	// than Applied is an error.
	IdemBatchInRow(ctx context.Context, msgs []*idem.Message) error
}

// InRow returns t with both variants running the in-row guard, or an error
// if t does not support it.
func InRow(t Target) (Target, error) {
	it, ok := t.(InRowTarget)
	if !ok {
		return nil, fmt.Errorf("%w: %s does not support the in-row guard", ErrUnsupported, t.Name())
	}
	return inRow{Target: t, it: it}, nil
}

type inRow struct {
	Target
	it InRowTarget
}

func (r inRow) Name() string { return r.Target.Name() + "/in-row" }

func (r inRow) PlainOne(ctx context.Context, msg *idem.Message) error {
	return r.it.PlainOneInRow(ctx, msg)
}

func (r inRow) IdemOne(ctx context.Context, msg *idem.Message) error {
	return r.it.IdemOneInRow(ctx, msg)
}

func (r inRow) PlainBatch(ctx context.Context, msgs []*idem.Message) error {
	return r.it.PlainBatchInRow(ctx, msgs)
}

func (r inRow) IdemBatch(ctx context.Context, msgs []*idem.Message) error {
	return r.it.IdemBatchInRow(ctx, msgs)
}

// inRowHandler returns the in-row handler over a target's guarded writes.
func inRowHandler[TTx any](write func(ctx context.Context, tx TTx, gs []*idem.RowGuard) ([]idem.RowWrite, error)) *idem.Handler[TTx] {
	return &idem.Handler[TTx]{
		Name:            handlerName + ".in_row",
		Ordering:        &idem.Ordering{Gap: idem.GapAllow},
		ApplyInRowBatch: write,
	}
}

// rowGuards groups msgs as idem does for an in-row batch under GapAllow:
// one guard per account, in account order, its messages in sequence
// order. The plain variant writes the same guards.
func rowGuards(msgs []*idem.Message) []*idem.RowGuard {
	by := make(map[string]*idem.RowGuard, len(msgs))
	gs := make([]*idem.RowGuard, 0, len(msgs))
	for _, m := range msgs {
		g := by[m.AggregateID]
		if g == nil {
			g = &idem.RowGuard{AggregateID: m.AggregateID, AllowGap: true}
			by[m.AggregateID] = g
			gs = append(gs, g)
		}
		g.Msgs = append(g.Msgs, m)
	}
	slices.SortFunc(gs, func(a, b *idem.RowGuard) int { return cmp.Compare(a.AggregateID, b.AggregateID) })
	for _, g := range gs {
		slices.SortFunc(g.Msgs, func(a, b *idem.Message) int { return cmp.Compare(a.Seq, b.Seq) })
	}
	return gs
}

// guardAmount returns the sum of the amounts g's messages carry.
func guardAmount(g *idem.RowGuard) (int64, error) {
	var sum int64
	for _, m := range g.Msgs {
		_, n, err := Decode(m)
		if err != nil {
			return 0, err
		}
		sum += n
	}
	return sum, nil
}

// checkAdvanced reports an error unless every write advanced: every
// benchmark event is newer than its account's last one.
func checkAdvanced(gs []*idem.RowGuard, ws []idem.RowWrite) error {
	if len(ws) != len(gs) {
		return fmt.Errorf("bench: %d writes for %d guards", len(ws), len(gs))
	}
	for i, w := range ws {
		if !w.Advanced {
			return fmt.Errorf("bench: account %q: sequence %d did not advance past %d", gs[i].AggregateID, gs[i].From(), w.Prev)
		}
	}
	return nil
}

// oneGuard returns msg's guard: the batch of one.
func oneGuard(msg *idem.Message) []*idem.RowGuard {
	return []*idem.RowGuard{{AggregateID: msg.AggregateID, Msgs: []*idem.Message{msg}, AllowGap: true}}
}
