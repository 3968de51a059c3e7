package postgres_test

import (
	"context"
	"errors"
	"math"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestSequenceAdvanceMany drives the one-statement advance directly: runs
// of consecutive sequences, gaps, stale sequences, the largest bigint, and
// rows that do not exist yet, under both gap policies.
func TestSequenceAdvanceMany(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 2)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		aggs          []string
		seqs          [][]int64
		allowGap      bool
		before, after []int64
	}{
		// New rows: a run from 1 advances, one that starts later does not.
		{[]string{"a", "b", "c"}, [][]int64{{1, 2, 4}, {2, 3}, {1}}, false, []int64{0, 0, 0}, []int64{2, 0, 1}},
		// The run holding last+1 wins; stale sequences are ignored.
		{[]string{"a", "b"}, [][]int64{{1, 2, 3, 4, 5, 9}, {1, 2, 3}}, false, []int64{2, 0}, []int64{5, 3}},
		// A gap policy that allows gaps takes the largest, if newer.
		{[]string{"a", "c", "d"}, [][]int64{{7, 8}, {1}, {3}}, true, []int64{5, 1, 0}, []int64{8, 1, 3}},
		// The largest bigint, without overflow, both ways.
		{[]string{"e", "f"}, [][]int64{{math.MaxInt64}, {math.MaxInt64}}, true, []int64{0, 0}, []int64{math.MaxInt64, math.MaxInt64}},
		{[]string{"e", "f"}, [][]int64{{math.MaxInt64 - 1, math.MaxInt64}, {1}}, false, []int64{math.MaxInt64, math.MaxInt64}, []int64{math.MaxInt64, math.MaxInt64}},
		// A redelivery moves nothing: the rows are read, not rewritten.
		{[]string{"a", "b"}, [][]int64{{3, 4}, {1, 2, 3}}, false, []int64{8, 3}, []int64{8, 3}},
		{[]string{"a", "c"}, [][]int64{{8}, {1}}, true, []int64{8, 1}, []int64{8, 1}},
		// Aggregate IDs that need quoting in JSON.
		{[]string{"\"q\"", "a\\b", "é\n"}, [][]int64{{1}, {1, 2}, {2}}, false, []int64{0, 0, 0}, []int64{1, 2, 0}},
	}
	for i, st := range steps {
		tx, err := drv.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		before, after, err := drv.SequenceAdvanceMany(ctx, tx, &driver.SequenceAdvanceManyParams{
			Handler: "h", AggregateIDs: st.aggs, Seqs: st.seqs, AllowGap: st.allowGap,
		})
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if err := drv.Commit(ctx, tx); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(before, st.before) || !slices.Equal(after, st.after) {
			t.Fatalf("step %d: before %v after %v, want %v and %v", i, before, after, st.before, st.after)
		}
	}
	// A redelivery leaves the row version as it was.
	version := func() string {
		var v string
		if err := pool.QueryRow(ctx, `SELECT xmin::text FROM `+pgx.Identifier{schema, "idem_sequences"}.Sanitize()+` WHERE handler = 'h' AND aggregate_id = 'a'`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	v := version()
	tx, err := drv.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := drv.SequenceAdvanceMany(ctx, tx, &driver.SequenceAdvanceManyParams{Handler: "h", AggregateIDs: []string{"a"}, Seqs: [][]int64{{7, 8}}}); err != nil {
		t.Fatal(err)
	}
	if err := drv.Commit(ctx, tx); err != nil {
		t.Fatal(err)
	}
	if w := version(); w != v {
		t.Fatalf("a redelivery rewrote the sequence row: xmin %s, then %s", v, w)
	}
}

// lyingDriver advances as the Postgres driver does but reports one
// aggregate one further than it went: a driver bug the core must catch.
type lyingDriver struct{ *postgres.Driver }

func (d lyingDriver) SequenceAdvanceMany(ctx context.Context, tx postgres.Tx, p *driver.SequenceAdvanceManyParams) ([]int64, []int64, error) {
	before, after, err := d.Driver.SequenceAdvanceMany(ctx, tx, p)
	if err == nil && len(after) > 0 {
		after[len(after)-1]++
	}
	return before, after, err
}

// TestSequenceMismatchRollsBack shows that an ordered batch whose store
// decided otherwise than idem fails with ErrSequenceMismatch and leaves
// nothing behind: no state, no marker, no sequence.
func TestSequenceMismatchRollsBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := openStore(t)
	proc, err := idem.NewProcessor[postgres.Tx](lyingDriver{s.Driver.(*postgres.Driver)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[postgres.Tx]{Name: "chain", Ordering: &idem.Ordering{Gap: idem.GapFail},
		Apply: func(ctx context.Context, tx postgres.Tx, m *idem.Message) error {
			return s.Put(ctx, tx, m.AggregateID, m.ID)
		}}
	msgs := []*idem.Message{
		{ID: "a-1", AggregateID: "a", Seq: 1},
		{ID: "b-1", AggregateID: "b", Seq: 1},
	}
	_, err = proc.ProcessBatch(ctx, h, msgs)
	if !errors.Is(err, idem.ErrSequenceMismatch) {
		t.Fatalf("ProcessBatch: %v, want ErrSequenceMismatch", err)
	}
	states, err := s.States(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(states) != 0 {
		t.Fatalf("states after a rolled-back batch: %v", states)
	}
	if n, err := s.Markers(ctx, "chain"); err != nil || n != 0 {
		t.Fatalf("markers after a rolled-back batch: %d, %v", n, err)
	}
	// The honest driver then applies the same batch.
	honest, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	outs, err := honest.ProcessBatch(ctx, h, msgs)
	if err != nil || !slices.Equal(outs, []idem.Outcome{idem.Applied, idem.Applied}) {
		t.Fatalf("honest ProcessBatch: %v, %v", outs, err)
	}
}
