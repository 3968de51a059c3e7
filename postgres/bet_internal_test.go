package postgres

import (
	"context"
	"slices"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// A lost bet (a plain INSERT meeting an existing marker) turns the bet off
// for a while: the redeliveries that follow go conflict-aware, so a burst of
// them logs no unique violation each and redoes no transaction, and the
// outcomes are the same on both paths.
func TestLostBetPausesBetting(t *testing.T) {
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 4)
	d, err := New(pool, &Config{Schema: testenv.FreshSchema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(d, nil)
	if err != nil {
		t.Fatal(err)
	}
	applied := map[string]int{}
	h := &idem.Handler[Tx]{Name: "bet", Apply: func(_ context.Context, _ Tx, m *idem.Message) error {
		applied[m.ID]++
		return nil
	}}
	msg := func(id, payload string) *idem.Message { return &idem.Message{ID: id, Payload: []byte(payload)} }
	one := func(id, payload string, want idem.Outcome, lost int64) {
		t.Helper()
		out, err := proc.Process(ctx, h, msg(id, payload))
		if out != want || (err != nil) != (want == idem.Conflict) {
			t.Fatalf("%s: %v, %v; want %v", id, out, err, want)
		}
		if got := d.lostBets.Load(); got != lost {
			t.Fatalf("after %s: %d lost bets, want %d", id, got, lost)
		}
	}
	batch := func(ids []string, want []idem.Outcome, lost int64) {
		t.Helper()
		msgs := make([]*idem.Message, len(ids))
		for i, id := range ids {
			msgs[i] = msg(id, "p")
		}
		outs, err := proc.ProcessBatch(ctx, h, msgs)
		if err != nil || !slices.Equal(outs, want) {
			t.Fatalf("%v: %v, %v; want %v", ids, outs, err, want)
		}
		if got := d.lostBets.Load(); got != lost {
			t.Fatalf("after %v: %d lost bets, want %d", ids, got, lost)
		}
	}

	if !d.betting() {
		t.Fatal("a new driver does not bet")
	}
	one("a", "p", idem.Applied, 0)
	one("a", "p", idem.Duplicate, 1) // the bet lost
	if d.betting() {
		t.Fatal("the driver still bets right after a lost bet")
	}
	one("a", "p", idem.Duplicate, 1) // conflict-aware from the start
	one("a", "other", idem.Conflict, 1)
	batch([]string{"a", "b"}, []idem.Outcome{idem.Duplicate, idem.Applied}, 1)

	d.noBetUntil.Store(0) // the pause is over
	one("c", "p", idem.Applied, 1)
	batch([]string{"b", "d"}, []idem.Outcome{idem.Duplicate, idem.Applied}, 2) // the batch's bet lost
	batch([]string{"d", "e"}, []idem.Outcome{idem.Duplicate, idem.Applied}, 2)

	for _, id := range []string{"a", "b", "c", "d", "e"} {
		if applied[id] != 1 {
			t.Errorf("%s applied %d times, want once", id, applied[id])
		}
	}
}
