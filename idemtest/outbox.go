package idemtest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/outbox"
)

// OutboxStore is an outbox store under test.
type OutboxStore struct {
	// Driver implements driver.OutboxRelayStore and driver.OutboxAdmin,
	// on a migrated schema with an empty outbox. Required.
	Driver any
	// Add commits msgs to the outbox in one transaction, in order (as
	// outbox.Outbox.Add does in the caller's transaction). Required.
	Add func(ctx context.Context, msgs ...*idem.Message) error
	// LogEntries counts the rows of the outbox log (the operators'
	// actions). Optional: without it the log's retention is not checked.
	LogEntries func(ctx context.Context) (int, error)
}

// OutboxHarness tells RunOutboxAdmin how to get an OutboxStore.
type OutboxHarness struct {
	// Open returns a store on a fresh schema; it is called once per
	// test. Register clean-up with t.Cleanup. Required.
	Open func(t testing.TB) *OutboxStore
}

// RunOutboxAdmin checks a store's outbox administration
// (driver.OutboxAdmin) through outbox.Relay: failing rows are listed with
// their error, a parked row is published by no relay and holds its key's
// later rows, a retried one is published once and in order, a discarded
// one never; an action leaves a key a relay holds alone; and parks racing
// running relays never let a parked row out nor a key out of order. It
// also checks that a claim stops at its byte bound.
//
// The relays publish to a stand-in broker that acknowledges in memory and
// refuses the destinations a test names: the store is what is under test.
func RunOutboxAdmin(t *testing.T, h *OutboxHarness) {
	tests := []struct {
		name string
		fn   func(t *testing.T, s *OutboxStore)
	}{
		{"ParkHoldsKeyRetryPublishesInOrder", testOutboxParkRetry},
		{"DiscardNeverPublishes", testOutboxDiscard},
		{"ActionsLeaveRelaysKeysAlone", testOutboxBusy},
		{"ListFiltersAndPages", testOutboxList},
		{"ParksRacingRelays", testOutboxParkRace},
		{"PruneAgesTheLog", testOutboxPruneAgesTheLog},
		{"ClaimStopsAtMaxBytes", testOutboxClaimBytes},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, h.Open(t))
		})
	}
}

// standInBroker acknowledges publishes in memory, refusing the
// destinations in refuse.
type standInBroker struct {
	mu     sync.Mutex
	refuse map[string]bool
	acked  []*idem.Message
	delay  time.Duration
}

var errRefused = errors.New("no stream covers the subject")

// Publish implements outbox.Publisher: the messages before the first
// refused one are acknowledged.
func (b *standInBroker) Publish(ctx context.Context, msgs []*idem.Message) error {
	if b.delay > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(b.delay):
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range msgs {
		if b.refuse[m.Stream] {
			return fmt.Errorf("publish %q to %q: %w", m.ID, m.Stream, errRefused)
		}
		b.acked = append(b.acked, m)
	}
	return nil
}

func (b *standInBroker) setRefused(dest string, on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.refuse == nil {
		b.refuse = map[string]bool{}
	}
	b.refuse[dest] = on
}

// ackedIDs returns the acknowledged message IDs in order.
func (b *standInBroker) ackedIDs() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var ids []string
	for _, m := range b.acked {
		ids = append(ids, m.ID)
	}
	return ids
}

// outboxMsg is the message of key's seq-th event to dest.
func outboxMsg(dest, key string, seq int64) *idem.Message {
	return &idem.Message{ID: outbox.MessageID(dest, key, seq), Stream: dest, AggregateID: key, Seq: seq, Payload: []byte(fmt.Sprint(seq))}
}

func outboxAdmin(t *testing.T, s *OutboxStore) (driver.OutboxAdmin, driver.OutboxRelayStore) {
	t.Helper()
	a, ok := s.Driver.(driver.OutboxAdmin)
	if !ok {
		t.Fatalf("%T does not implement driver.OutboxAdmin", s.Driver)
	}
	r, ok := s.Driver.(driver.OutboxRelayStore)
	if !ok {
		t.Fatalf("%T does not implement driver.OutboxRelayStore", s.Driver)
	}
	return a, r
}

// slowBackoff keeps a failed key held far longer than any test runs, so
// only an operator's action releases it early.
var slowBackoff = idem.Backoff{Base: time.Hour, Max: time.Hour}

func newTestRelay(t *testing.T, s *OutboxStore, b *standInBroker, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	cfg.Logger = discardLogger()
	r, err := outbox.NewRelay(s.Driver, b, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// listAll returns every unpublished row f selects, page after page.
func listAll(t *testing.T, a driver.OutboxAdmin, f driver.OutboxFilter) ([]driver.OutboxEntry, driver.OutboxCounts) {
	t.Helper()
	var (
		all    []driver.OutboxEntry
		counts driver.OutboxCounts
	)
	for {
		p, err := a.OutboxList(context.Background(), f)
		if err != nil {
			t.Fatal(err)
		}
		all, counts = append(all, p.Rows...), p.Counts
		if p.Next == 0 {
			return all, counts
		}
		f.AfterID = p.Next
	}
}

// rowIDs finds the outbox row IDs of message IDs.
func rowIDs(t *testing.T, a driver.OutboxAdmin, msgIDs ...string) []int64 {
	t.Helper()
	rows, _ := listAll(t, a, driver.OutboxFilter{})
	var ids []int64
	for _, id := range msgIDs {
		i := slices.IndexFunc(rows, func(e driver.OutboxEntry) bool { return e.MessageID == id })
		if i < 0 {
			t.Fatalf("no unpublished row for message %q", id)
		}
		ids = append(ids, rows[i].ID)
	}
	return ids
}

func wantResult(t *testing.T, what string, got driver.OutboxActionResult, done, busy, missing []int64) {
	t.Helper()
	if !slices.Equal(got.Done, done) || !slices.Equal(got.Busy, busy) || !slices.Equal(got.Missing, missing) {
		t.Fatalf("%s: done %v busy %v missing %v; want %v %v %v", what, got.Done, got.Busy, got.Missing, done, busy, missing)
	}
}

func runCycle(t *testing.T, r *outbox.Relay) outbox.CycleResult {
	t.Helper()
	res, _ := r.RunOnce(context.Background()) // refusals are expected; the tests check the rows
	return res
}

func testOutboxParkRetry(t *testing.T, s *OutboxStore) {
	ctx := context.Background()
	a, rs := outboxAdmin(t, s)
	b := &standInBroker{}
	b.setRefused("nowhere.a", true)
	// Key A's first event goes where no stream listens; its second would
	// be fine but must wait. Key B is healthy.
	a1, a2 := outboxMsg("nowhere.a", "A", 1), outboxMsg("orders.a", "A", 2)
	b1, b2 := outboxMsg("orders.b", "B", 1), outboxMsg("orders.b", "B", 2)
	if err := s.Add(ctx, a1, a2, b1, b2); err != nil {
		t.Fatal(err)
	}
	r := newTestRelay(t, s, b, outbox.RelayConfig{Owner: "relay-1", Backoff: slowBackoff})
	runCycle(t, r)
	if got := b.ackedIDs(); !slices.Equal(got, []string{b1.ID, b2.ID}) {
		t.Fatalf("published %v, want key B only: %v", got, []string{b1.ID, b2.ID})
	}

	failing, counts := listAll(t, a, driver.OutboxFilter{State: driver.OutboxFailing})
	if len(failing) != 1 || failing[0].MessageID != a1.ID || failing[0].Attempts != 1 || !strings.Contains(failing[0].LastError, errRefused.Error()) {
		t.Fatalf("failing rows %+v: want %q with 1 attempt and the refusal", failing, a1.ID)
	}
	if failing[0].HeldUntil.IsZero() || failing[0].ClaimedBy != "" || failing[0].State != driver.OutboxFailing {
		t.Fatalf("failing row: held until %v, claimed by %q, state %q; want held, unclaimed, failing", failing[0].HeldUntil, failing[0].ClaimedBy, failing[0].State)
	}
	if counts != (driver.OutboxCounts{Pending: 1, Failing: 1}) {
		t.Fatalf("counts %+v, want 1 pending, 1 failing", counts)
	}
	if string(failing[0].Payload) != "1" || failing[0].Destination != "nowhere.a" || failing[0].AggregateID != "A" || failing[0].Seq != 1 {
		t.Fatalf("failing row lost its message: %+v", failing[0].OutboxRow)
	}
	ids := rowIDs(t, a, a1.ID, a2.ID)

	res, err := a.OutboxPark(ctx, ids[:1], "alice", "subject has no stream")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "park", res, ids[:1], nil, nil)
	res, err = a.OutboxPark(ctx, ids[:1], "bob", "again")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "park of a parked row", res, nil, nil, ids[:1])
	parked, _ := listAll(t, a, driver.OutboxFilter{State: driver.OutboxParked})
	if len(parked) != 1 || parked[0].ID != ids[0] || parked[0].ParkedBy != "alice" || parked[0].ParkReason != "subject has no stream" || parked[0].ParkedAt.IsZero() {
		t.Fatalf("parked rows %+v: want row %d parked by alice with the reason", parked, ids[0])
	}
	pending, _ := listAll(t, a, driver.OutboxFilter{State: driver.OutboxPending})
	if len(pending) != 1 || pending[0].ID != ids[1] || pending[0].BlockedBy != ids[0] {
		t.Fatalf("pending rows %+v: want row %d blocked by %d", pending, ids[1], ids[0])
	}
	st, err := rs.OutboxStats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Parked != 1 || st.Failing != 0 || st.Pending != 2 {
		t.Fatalf("stats %+v: want 2 pending of which 1 parked, none failing", st)
	}

	// The broker would take key A now, and the hold is gone once
	// parked... but a parked row and its key's later rows stay put, while
	// other keys go on, whichever relay runs.
	b.setRefused("nowhere.a", false)
	a3, c1 := outboxMsg("orders.a", "A", 3), outboxMsg("orders.c", "C", 1)
	if err := s.Add(ctx, a3, c1); err != nil {
		t.Fatal(err)
	}
	if err := rs.OutboxRelease(ctx, ""); err != nil { // end the failure's hold: only the park may keep A back
		t.Fatal(err)
	}
	r2 := newTestRelay(t, s, b, outbox.RelayConfig{Owner: "relay-2", Backoff: slowBackoff})
	runCycle(t, r2)
	runCycle(t, r)
	if got := b.ackedIDs(); !slices.Equal(got, []string{b1.ID, b2.ID, c1.ID}) {
		t.Fatalf("published %v; want B's and C's only, none of parked key A", got)
	}

	res, err = a.OutboxRetryNow(ctx, ids[:1], "carol")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "retry", res, ids[:1], nil, nil)
	runCycle(t, r)
	want := []string{b1.ID, b2.ID, c1.ID, a1.ID, a2.ID, a3.ID}
	if got := b.ackedIDs(); !slices.Equal(got, want) {
		t.Fatalf("published %v, want %v: each once, key A in order", got, want)
	}
	if rows, counts := listAll(t, a, driver.OutboxFilter{}); len(rows) != 0 || counts != (driver.OutboxCounts{}) {
		t.Fatalf("after the retry %d rows are unpublished (%+v), want none", len(rows), counts)
	}
	res, err = a.OutboxRetryNow(ctx, ids[:1], "carol")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "retry of a published row", res, nil, nil, ids[:1])
}

func testOutboxDiscard(t *testing.T, s *OutboxStore) {
	ctx := context.Background()
	a, _ := outboxAdmin(t, s)
	b := &standInBroker{}
	b.setRefused("nowhere.d", true)
	d1, d2, e1 := outboxMsg("nowhere.d", "D", 1), outboxMsg("orders.d", "D", 2), outboxMsg("orders.e", "E", 1)
	if err := s.Add(ctx, d1, d2, e1); err != nil {
		t.Fatal(err)
	}
	ids := rowIDs(t, a, d1.ID, d2.ID, e1.ID)
	r := newTestRelay(t, s, b, outbox.RelayConfig{Owner: "relay-1", Backoff: slowBackoff})
	runCycle(t, r)
	if got := b.ackedIDs(); !slices.Equal(got, []string{e1.ID}) {
		t.Fatalf("published %v, want only %q", got, e1.ID)
	}
	// d1 is failing, its key held for an hour: discarding it lets d2 out
	// at the next cycle.
	res, err := a.OutboxDiscard(ctx, []int64{ids[0], ids[2], 1 << 40}, "alice", "sent to a subject that does not exist")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "discard", res, ids[:1], nil, []int64{ids[2], 1 << 40})
	runCycle(t, r)
	b.setRefused("nowhere.d", false)
	runCycle(t, r)
	if got := b.ackedIDs(); !slices.Equal(got, []string{e1.ID, d2.ID}) {
		t.Fatalf("published %v, want %v: the discarded row never", got, []string{e1.ID, d2.ID})
	}
	if rows, _ := listAll(t, a, driver.OutboxFilter{}); len(rows) != 0 {
		t.Fatalf("%d rows left unpublished, want none", len(rows))
	}
	res, err = a.OutboxDiscard(ctx, ids[:1], "alice", "")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "second discard", res, nil, nil, ids[:1])
	for _, f := range []func() (driver.OutboxActionResult, error){
		func() (driver.OutboxActionResult, error) { return a.OutboxDiscard(ctx, nil, "x", "") },
		func() (driver.OutboxActionResult, error) { return a.OutboxPark(ctx, []int64{}, "x", "") },
		func() (driver.OutboxActionResult, error) { return a.OutboxRetryNow(ctx, nil, "x") },
	} {
		if res, err := f(); err != nil || len(res.Done)+len(res.Busy)+len(res.Missing) > 0 {
			t.Fatalf("an action on no rows: %+v, %v; want nothing done and no error", res, err)
		}
	}
}

func testOutboxBusy(t *testing.T, s *OutboxStore) {
	ctx := context.Background()
	a, rs := outboxAdmin(t, s)
	f1, f2, g1 := outboxMsg("orders.f", "F", 1), outboxMsg("orders.f", "F", 2), outboxMsg("orders.g", "G", 1)
	if err := s.Add(ctx, f1, f2); err != nil {
		t.Fatal(err)
	}
	ids := rowIDs(t, a, f1.ID, f2.ID)
	// A relay claims key F and is publishing it.
	claimed, _, err := rs.OutboxClaim(ctx, "relay-busy", 10, 0, time.Hour)
	if err != nil || len(claimed) != 2 {
		t.Fatalf("claim: %d rows, %v; want 2", len(claimed), err)
	}
	if err := s.Add(ctx, g1); err != nil {
		t.Fatal(err)
	}
	gid := rowIDs(t, a, g1.ID)[0]
	rows, _ := listAll(t, a, driver.OutboxFilter{OrderingKey: "F"})
	if len(rows) != 2 || rows[0].ClaimedBy != "relay-busy" || rows[0].ClaimedUntil.IsZero() {
		t.Fatalf("key F's rows %+v: want both claimed by relay-busy", rows)
	}
	res, err := a.OutboxPark(ctx, append([]int64{gid}, ids...), "alice", "")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "park during a claim", res, []int64{gid}, ids, nil)
	res, err = a.OutboxDiscard(ctx, ids[1:], "alice", "")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "discard during a claim", res, nil, ids[1:], nil)
	// Retrying takes no key from a relay: it may go on at once.
	res, err = a.OutboxRetryNow(ctx, []int64{gid}, "alice")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "retry", res, []int64{gid}, nil, nil)
	if err := rs.OutboxRelease(ctx, "relay-busy"); err != nil {
		t.Fatal(err)
	}
	res, err = a.OutboxPark(ctx, ids[1:], "alice", "")
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, "park after the release", res, ids[1:], nil, nil)
	// Key F's first row goes out; its second is parked.
	b := &standInBroker{}
	runCycle(t, newTestRelay(t, s, b, outbox.RelayConfig{Owner: "relay-2"}))
	if got := b.ackedIDs(); !slices.Equal(sorted(got), sorted([]string{f1.ID, g1.ID})) {
		t.Fatalf("published %v, want %v in any order", got, []string{f1.ID, g1.ID})
	}
}

func testOutboxList(t *testing.T, s *OutboxStore) {
	ctx := context.Background()
	a, _ := outboxAdmin(t, s)
	var msgs []*idem.Message
	for i := range 7 {
		msgs = append(msgs, outboxMsg([]string{"orders.x", "orders.y"}[i%2], []string{"K1", "K2", "K3"}[i%3], int64(i+1)))
	}
	msgs = append(msgs, &idem.Message{ID: "no-aggregate", Stream: "orders.x", Payload: []byte("{}")})
	if err := s.Add(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	all, counts := listAll(t, a, driver.OutboxFilter{Limit: 3})
	if len(all) != 8 || counts.Pending != 8 {
		t.Fatalf("listed %d rows in pages of 3 (counts %+v), want 8", len(all), counts)
	}
	for i := range all {
		if i > 0 && all[i].ID <= all[i-1].ID {
			t.Fatalf("rows out of ID order: %d after %d", all[i].ID, all[i-1].ID)
		}
		if all[i].MessageID != msgs[i].ID || all[i].State != driver.OutboxPending {
			t.Fatalf("row %d is %q (%s), want %q pending", i, all[i].MessageID, all[i].State, msgs[i].ID)
		}
	}
	if all[7].OrderingKey != "msg:no-aggregate" {
		t.Fatalf("the message without aggregate has key %q, want its own", all[7].OrderingKey)
	}
	p, err := a.OutboxList(ctx, driver.OutboxFilter{Limit: 8})
	if err != nil || p.Next != 0 || len(p.Rows) != 8 {
		t.Fatalf("a page exactly as long as the rows: %d rows, next %d, %v; want 8 rows and no next", len(p.Rows), p.Next, err)
	}
	byDest, counts := listAll(t, a, driver.OutboxFilter{Destination: "orders.y", Limit: 2})
	for _, e := range byDest {
		if e.Destination != "orders.y" {
			t.Fatalf("destination filter let %q through", e.Destination)
		}
	}
	if len(byDest) != 3 || counts.Pending != 3 {
		t.Fatalf("%d rows to orders.y (counts %+v), want 3", len(byDest), counts)
	}
	byID, counts := listAll(t, a, driver.OutboxFilter{IDs: []int64{all[6].ID, all[1].ID, 1 << 40}})
	if len(byID) != 2 || byID[0].ID != all[1].ID || byID[1].ID != all[6].ID || counts.Pending != 2 {
		t.Fatalf("rows by ID: %+v (counts %+v), want rows %d and %d", byID, counts, all[1].ID, all[6].ID)
	}
	if none, _ := listAll(t, a, driver.OutboxFilter{IDs: []int64{}}); len(none) != 0 {
		t.Fatalf("an empty ID list selected %d rows, want none", len(none))
	}
	byKey, _ := listAll(t, a, driver.OutboxFilter{OrderingKey: "K2", Destination: "orders.x"})
	if len(byKey) != 1 || byKey[0].MessageID != msgs[4].ID {
		t.Fatalf("key K2 to orders.x: %+v, want only %q", byKey, msgs[4].ID)
	}
	if _, err := a.OutboxPark(ctx, []int64{all[0].ID}, "alice", ""); err != nil {
		t.Fatal(err)
	}
	parked, counts := listAll(t, a, driver.OutboxFilter{State: driver.OutboxParked, Destination: "orders.x"})
	if len(parked) != 1 || counts != (driver.OutboxCounts{Pending: 4, Parked: 1}) {
		t.Fatalf("parked to orders.x: %d rows, counts %+v; want 1, with 4 pending and 1 parked", len(parked), counts)
	}
	for _, f := range []driver.OutboxFilter{{State: "published"}, {Limit: -1}, {AfterID: -1}} {
		if _, err := a.OutboxList(ctx, f); !errors.Is(err, driver.ErrInvalidOutboxFilter) {
			t.Fatalf("filter %+v: %v, want ErrInvalidOutboxFilter", f, err)
		}
	}
}

// testOutboxParkRace parks rows while relays publish, with real
// concurrency: a park reported done must never be published, and each
// key's published rows must be in order and come before its first parked
// row. Whether a park wins against the relays is up to the machine's
// timing; a round in which none did checked nothing and runs again, up to
// five rounds.
func testOutboxParkRace(t *testing.T, s *OutboxStore) {
	for round := range 5 {
		if outboxParkRound(t, s, round) > 0 {
			return
		}
	}
	t.Fatal("no park won against the relays in five rounds; the race checked nothing")
}

// outboxParkRound runs one round of testOutboxParkRace on rows of its own
// destination and returns how many parks won.
func outboxParkRound(t *testing.T, s *OutboxStore, round int) int {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a, _ := outboxAdmin(t, s)
	const keys, perKey = 20, 20
	dest := fmt.Sprintf("orders.race%d", round)
	var msgs []*idem.Message
	for seq := int64(1); seq <= perKey; seq++ {
		for k := range keys {
			msgs = append(msgs, outboxMsg(dest, fmt.Sprintf("key-%02d", k), seq))
		}
	}
	if err := s.Add(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	rows, _ := listAll(t, a, driver.OutboxFilter{Destination: dest})
	rowOf := map[string]driver.OutboxEntry{}
	for _, e := range rows {
		rowOf[e.MessageID] = e
	}
	b := &standInBroker{delay: time.Millisecond}
	var wg sync.WaitGroup
	for i := range 2 {
		r := newTestRelay(t, s, b, outbox.RelayConfig{Owner: fmt.Sprintf("relay-%d", i), BatchSize: 15, Concurrency: 4, PollInterval: 5 * time.Millisecond})
		wg.Add(1)
		go func() { defer wg.Done(); _ = r.Run(ctx) }()
	}
	// Once the relays publish, park a random row of the later half of
	// every key, retrying the busy ones.
	for len(b.ackedIDs()) == 0 {
		time.Sleep(time.Millisecond)
	}
	rng := rand.New(rand.NewPCG(1, uint64(round)))
	parked := map[string]int64{} // key → parked row
	busy := 0
	for k := range keys {
		key := fmt.Sprintf("key-%02d", k)
		id := rowOf[outbox.MessageID(dest, key, perKey/2+1+rng.Int64N(perKey-perKey/2))].ID
		for {
			res, err := a.OutboxPark(ctx, []int64{id}, "racer", "")
			if err != nil {
				t.Fatal(err)
			}
			if len(res.Busy) == 0 {
				if len(res.Done) == 1 {
					parked[key] = id
				}
				break // done, or published before the park
			}
			busy++
			time.Sleep(time.Millisecond)
		}
	}
	t.Logf("round %d: %d of %d keys parked while relays ran; %d parks found their key busy", round, len(parked), keys, busy)
	// Wait until every row not held back by a park is published.
	deadline := time.Now().Add(30 * time.Second)
	for {
		left, _ := listAll(t, a, driver.OutboxFilter{Destination: dest})
		out := 0
		for _, e := range left {
			if p, ok := parked[e.OrderingKey]; !ok || e.ID < p {
				out++
			}
		}
		if out == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d rows not held back by a park are still unpublished", out)
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	last := map[string]int64{}
	seen := map[string]bool{}
	for _, id := range b.ackedIDs() {
		e, ok := rowOf[id]
		if !ok {
			continue // an earlier round's row, published late
		}
		if p, ok := parked[e.OrderingKey]; ok && e.ID >= p {
			t.Fatalf("row %d of key %s was published although row %d was parked first", e.ID, e.OrderingKey, p)
		}
		if e.ID < last[e.OrderingKey] {
			t.Fatalf("key %s: row %d published after row %d", e.OrderingKey, e.ID, last[e.OrderingKey])
		}
		last[e.OrderingKey] = e.ID
		seen[id] = true
	}
	for _, m := range msgs {
		e := rowOf[m.ID]
		if p, ok := parked[e.OrderingKey]; (!ok || e.ID < p) && !seen[m.ID] {
			t.Fatalf("row %d (%s) was never published", e.ID, m.ID)
		}
	}
	return len(parked)
}

// discardLogger drops the relays' log lines: refusals are the point of
// these tests.
func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// sorted returns a sorted copy of ids: keys publish concurrently, so the
// order across keys is free.
func sorted(ids []string) []string { return slices.Sorted(slices.Values(ids)) }

// testOutboxPruneAgesTheLog: the outbox log of operators' actions ages out
// with the published rows: the first OutboxPrune call of a pass deletes its
// entries made before the cut-off, and keeps the later ones.
func testOutboxPruneAgesTheLog(t *testing.T, s *OutboxStore) {
	if s.LogEntries == nil {
		t.Log("the store under test counts no log entries (OutboxStore.LogEntries); not checked")
		return
	}
	ctx := context.Background()
	drv := s.Driver.(interface {
		driver.OutboxAdmin
		driver.OutboxRelayStore
	})
	if err := s.Add(ctx, &idem.Message{ID: "m1", Type: "t", Stream: "orders.created", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	page, err := drv.OutboxList(ctx, driver.OutboxFilter{})
	if err != nil || len(page.Rows) != 1 {
		t.Fatalf("list: %d rows, %v", len(page.Rows), err)
	}
	if r, err := drv.OutboxPark(ctx, []int64{page.Rows[0].ID}, "alice", "no stream"); err != nil || len(r.Done) != 1 {
		t.Fatalf("park: %+v, %v", r, err)
	}
	count := func() int {
		t.Helper()
		n, err := s.LogEntries(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n != 1 {
		t.Fatalf("%d log entries after a park, want 1", n)
	}
	if _, _, err := drv.OutboxPrune(ctx, time.Now().Add(-time.Hour), 0, 100); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 1 {
		t.Fatalf("%d log entries after pruning what is older than an hour, want the new entry kept", n)
	}
	if _, _, err := drv.OutboxPrune(ctx, time.Now().Add(time.Hour), 0, 100); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 0 {
		t.Fatalf("%d log entries after pruning up to an hour ahead, want 0", n)
	}
}

// testOutboxClaimBytes: OutboxClaim stops before the first row whose
// payload would take its claim over maxBytes, but always takes one row,
// however large, and says it cut the claim; the rows left out stay
// pending and come, in order, to the next claims; and a key the cut left
// without a row is not kept from the other relays.
func testOutboxClaimBytes(t *testing.T, s *OutboxStore) {
	ctx := context.Background()
	_, rs := outboxAdmin(t, s)
	sizes := []int{400, 400, 400, 2000, 10}
	var msgs []*idem.Message
	for i, n := range sizes {
		m := outboxMsg("orders.f", "F", int64(i+1))
		m.Payload = []byte(strings.Repeat("x", n))
		msgs = append(msgs, m)
	}
	if err := s.Add(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	next := 0
	for i, c := range []struct {
		maxBytes, want int
		cut            bool
	}{
		{1000, 2, true}, // 800 bytes; the third would make 1,200
		{1000, 1, true}, // 400; the 2,000-byte row would not fit beside it
		{1000, 1, true}, // the 2,000-byte row, alone
		{0, 1, false},   // no bound
	} {
		owner := fmt.Sprint("relay-", i)
		rows, cut, err := rs.OutboxClaim(ctx, owner, 10, c.maxBytes, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		ids := make([]int64, len(rows))
		for j, r := range rows {
			got = append(got, r.MessageID)
			ids[j] = r.ID
			if len(r.Payload) != sizes[next+j] {
				t.Fatalf("claim %d: row %s has a %d-byte payload, want %d", i, r.MessageID, len(r.Payload), sizes[next+j])
			}
		}
		var want []string
		for _, m := range msgs[next:min(next+c.want, len(msgs))] {
			want = append(want, m.ID)
		}
		if !slices.Equal(got, want) || cut != c.cut {
			t.Fatalf("claim %d under %d bytes: %v, cut %v; want %v, cut %v", i, c.maxBytes, got, cut, want, c.cut)
		}
		next += len(rows)
		if err := rs.OutboxMarkPublished(ctx, ids); err != nil {
			t.Fatal(err)
		}
		if err := rs.OutboxRelease(ctx, owner); err != nil {
			t.Fatal(err)
		}
	}
	if rows, _, err := rs.OutboxClaim(ctx, "relay-last", 10, 1, time.Minute); err != nil || len(rows) != 0 {
		t.Fatalf("a claim after every row was published: %d rows, %v; want none", len(rows), err)
	}

	// Keys G and H, a row of 900 bytes each: a claim under 1,000 bytes
	// takes G's row, and leaves H to the next relay at once.
	g, h := outboxMsg("orders.g", "G", 1), outboxMsg("orders.h", "H", 1)
	g.Payload, h.Payload = []byte(strings.Repeat("g", 900)), []byte(strings.Repeat("h", 900))
	if err := s.Add(ctx, g, h); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ owner, want string }{{"relay-g", g.ID}, {"relay-h", h.ID}} {
		rows, cut, err := rs.OutboxClaim(ctx, c.owner, 10, 1000, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) != 1 || rows[0].MessageID != c.want {
			t.Fatalf("%s's claim under 1,000 bytes: %d rows (%v), want %s alone", c.owner, len(rows), rows, c.want)
		}
		if c.owner == "relay-g" && !cut {
			t.Fatal("relay-g's claim left H's row out but does not say it was cut")
		}
	}
}
