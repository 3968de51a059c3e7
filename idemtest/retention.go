package idemtest

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// RunRetention runs the conformance tests of marker retention. The store's
// Driver must implement driver.MarkerPruner and driver.LeaseDriver (the
// running-lease rows it must never delete are made through it).
func RunRetention[TTx any](t *testing.T, h *Harness[TTx]) {
	t.Run("PrunesOldMarkersInBatches", func(t *testing.T) {
		t.Parallel()
		testPrune(t, h.Open(t))
	})
	t.Run("PrunesGapSightings", func(t *testing.T) {
		t.Parallel()
		testPruneGaps(t, h.Open(t))
	})
	t.Run("ShortRetentionRefused", func(t *testing.T) {
		t.Parallel()
		s := h.Open(t)
		_, err := idem.NewPruner(s.Driver, &idem.RetentionConfig{Retention: time.Hour, RedeliveryHorizon: 24 * time.Hour})
		var re *idem.RetentionError
		if !errors.Is(err, idem.ErrRetentionTooShort) || !errors.As(err, &re) || re.Horizon != 24*time.Hour {
			t.Fatalf("NewPruner with retention 1h < horizon 24h: %v, want a *RetentionError", err)
		}
		if _, err := idem.NewPruner(s.Driver, &idem.RetentionConfig{BatchSize: -1}); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Fatalf("negative batch size: %v, want ErrInvalidConfig", err)
		}
	})
	t.Run("OneInstanceAtATime", func(t *testing.T) {
		t.Parallel()
		s := h.Open(t)
		mp, ok := s.Driver.(driver.MarkerPruner)
		if !ok {
			t.Fatalf("driver %T does not implement driver.MarkerPruner", s.Driver)
		}
		ctx := context.Background()
		unlock, ok, err := mp.TryMaintenanceLock(ctx)
		if err != nil || !ok {
			t.Fatalf("first lock: %v, %v", ok, err)
		}
		p, err := idem.NewPruner(s.Driver, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := p.Prune(ctx); !errors.Is(err, idem.ErrMaintenanceBusy) {
			t.Fatalf("Prune while another holds the lock: %v, want ErrMaintenanceBusy", err)
		}
		unlock()
		if _, err := p.Prune(ctx); err != nil {
			t.Fatalf("Prune after unlock: %v", err)
		}
	})
}

// testPrune processes markers, claims a lease it leaves running and one
// it fails with a retry to come, finishes two more leases (one done, one
// failed for good), leaves an orphan (a retry due an hour from now) and a
// lease running out then, then prunes with a clock 8 days ahead in batches
// of 1,000: every done marker and the done lease go; the running leases
// and the failed ones stay (their fencing tokens go on growing: a replay
// of a failed one's dead letter gets the next token), and a pruned
// message would apply again.
func testPrune[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	p := newProc(t, s)
	var calls sync.Map
	h := CreditHandler(s, "balances", &calls)
	ev := Events(2345)
	msgs := make([]*idem.Message, len(ev))
	for i, e := range ev {
		msgs[i] = e.Message()
	}
	for lo := 0; lo < len(msgs); lo += 500 {
		if _, err := p.ProcessBatch(ctx, h, msgs[lo:min(lo+500, len(msgs))]); err != nil {
			t.Fatal(err)
		}
	}
	ld, ok := any(s.Driver).(driver.LeaseDriver)
	if !ok {
		t.Fatalf("driver %T does not implement driver.LeaseDriver", s.Driver)
	}
	claim := func(id string) int64 {
		t.Helper()
		res, err := ld.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "mailer", MessageID: id,
			PayloadHash: (&idem.Message{ID: id}).PayloadHash(), Owner: "w1", TTL: 30 * 24 * time.Hour})
		if err != nil || !res.Claimed {
			t.Fatalf("claim %s: %+v, %v", id, res, err)
		}
		return res.Token
	}
	fail := func(id string, token int64, permanent bool) {
		t.Helper()
		res, err := ld.LeaseFail(ctx, &driver.LeaseFailParams{Handler: "mailer", MessageID: id, Token: token,
			LastError: "refused", RetryIn: 30 * 24 * time.Hour, Permanent: permanent})
		if err != nil || !res.OK {
			t.Fatalf("fail %s: %+v, %v", id, res, err)
		}
	}
	claim("still-running")
	fail("retrying", claim("retrying"), false)
	// A retry due in an hour, not taken up by the pruning clock's cutoff a
	// day from now, is an orphan; a lease that ran out as long ago is not
	// (its holder may be paused, and must stay fenced off).
	if res, err := ld.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "mailer", MessageID: "paused-running",
		PayloadHash: (&idem.Message{ID: "paused-running"}).PayloadHash(), Owner: "paused", TTL: time.Hour}); err != nil || !res.Claimed {
		t.Fatalf("claim paused-running: %+v, %v", res, err)
	}
	if res, err := ld.LeaseFail(ctx, &driver.LeaseFailParams{Handler: "mailer", MessageID: "orphan-retry", Token: claim("orphan-retry"),
		LastError: "refused", RetryIn: time.Hour}); err != nil || !res.OK {
		t.Fatalf("fail orphan-retry: %+v, %v", res, err)
	}
	fail("failed-for-good", claim("failed-for-good"), true)
	if res, err := ld.LeaseComplete(ctx, &driver.LeaseCompleteParams{Handler: "mailer", MessageID: "done", Token: claim("done")}); err != nil || !res.OK {
		t.Fatalf("complete: %+v, %v", res, err)
	}

	future := func() time.Time { return time.Now().Add(8 * 24 * time.Hour) }
	// BatchTime an hour: the batches are sized by BatchSize alone, so
	// their count is exact however loaded the machine is (a slow batch
	// would otherwise halve the next).
	pr, err := idem.NewPruner(s.Driver, &idem.RetentionConfig{BatchSize: 1000, BatchTime: time.Hour, Now: future})
	if err != nil {
		t.Fatal(err)
	}
	est, err := pr.Prunable(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if est.Markers["balances"] != int64(len(ev)) || est.Markers["mailer"] != 1 || est.Oldest.IsZero() || time.Since(est.Oldest) > time.Hour {
		t.Fatalf("dry run: counts %v, oldest %v; want %d balances markers and the done lease", est.Markers, est.Oldest, len(ev))
	}
	if want := future().Add(-idem.DefaultRetention); est.Cutoff.Sub(want).Abs() > time.Minute {
		t.Fatalf("dry run cutoff %v, want the configured clock's %v", est.Cutoff, want)
	}
	// Nothing is old yet with the real clock.
	now, err := idem.NewPruner(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := now.Prune(ctx); err != nil || st.Deleted != 0 {
		t.Fatalf("prune with a 7-day retention right away: %+v, %v; want nothing deleted", st, err)
	}

	st, err := pr.Prune(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Deleted != len(ev)+1 || st.Batches != (len(ev)+1+999)/1000 {
		t.Fatalf("prune: %+v, want %d deleted in %d batches", st, len(ev)+1, (len(ev)+1+999)/1000)
	}
	if n, err := s.Markers(ctx, "balances"); err != nil || n != 0 {
		t.Fatalf("balances markers left: %d, %v", n, err)
	}
	for id, want := range map[string]driver.LeaseStatus{"still-running": driver.LeaseRunning, "paused-running": driver.LeaseRunning,
		"retrying": driver.LeaseFailed, "failed-for-good": driver.LeaseFailed, "orphan-retry": driver.LeaseFailed} {
		row, err := ld.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: id})
		if err != nil || row == nil || row.Status != want || row.Token != 1 {
			t.Fatalf("lease %s after prune: %+v, %v; want it kept, %s", id, row, err, want)
		}
	}
	if row, err := ld.LeaseGet(ctx, &driver.LeaseGetParams{Handler: "mailer", MessageID: "done"}); err != nil || row != nil {
		t.Fatalf("done lease after prune: %+v, %v; want it pruned", row, err)
	}
	// The oldest marker is a done one: the running and failed leases kept
	// whatever their age would hold it back for good.
	if est, err := pr.Prunable(ctx); err != nil || !est.Oldest.IsZero() {
		t.Fatalf("oldest marker with only running and failed leases left: %v, %v; want none", est.Oldest, err)
	}
	// A replay of the failed one's dead letter rearms its row: the next
	// claim's token is above the failed attempt's.
	if r, ok := ld.(driver.LeaseRearmer); ok {
		if err := r.LeaseRearm(ctx, "mailer", "failed-for-good"); err != nil {
			t.Fatal(err)
		}
		if tok := claim("failed-for-good"); tok != 2 {
			t.Fatalf("claim after the replay's rearm: token %d, want 2", tok)
		}
	}
	// The documented limit: a redelivery older than the retention applies again.
	out, err := p.Process(ctx, h, msgs[0])
	wantOutcome(t, "redelivery after its marker was pruned", out, err, idem.Applied)
	want := Expected(ev)
	want[ev[0].Account] += ev[0].Amount
	wantBalances(t, s, want)
	if st, err := pr.Prune(ctx); err != nil || st.Deleted != 1 {
		t.Fatalf("second prune: %+v, %v; want the one new marker", st, err)
	}
}

// testPruneGaps: the ordering guard's gap sightings go once their
// aggregate's sequence has reached them, and the rest once they are older
// than the retention. A driver that keeps no sightings in a table (no
// driver.GapPruner) has nothing to check.
func testPruneGaps[TTx any](t *testing.T, s *Store[TTx]) {
	ctx := context.Background()
	gp, ok := any(s.Driver).(driver.GapPruner)
	if !ok {
		t.Logf("driver %T keeps no gap sightings to prune", s.Driver)
		return
	}
	sg, ok := any(s.Driver).(driver.SequenceGuard[TTx])
	if !ok {
		t.Fatalf("driver %T implements driver.GapPruner but not driver.SequenceGuard", s.Driver)
	}
	sight := func(agg string, seq int64) time.Time {
		t.Helper()
		r, err := sg.GapSighting(ctx, &driver.GapSightingParams{Handler: "gapped", AggregateID: agg, Seq: seq})
		if err != nil {
			t.Fatal(err)
		}
		return r.FirstSeen
	}
	sight("a", 5)
	firstB := sight("b", 3)
	h := &idem.Handler[TTx]{Name: "gapped", Ordering: &idem.Ordering{Gap: idem.GapAllow},
		Apply: func(context.Context, TTx, *idem.Message) error { return nil }}
	out, err := newProc(t, s).Process(ctx, h, &idem.Message{ID: "a-5", AggregateID: "a", Seq: 5})
	wantOutcome(t, "a/5", out, err, idem.Applied)

	pr, err := idem.NewPruner(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := pr.Prune(ctx); err != nil || st.GapsDeleted != 1 {
		t.Fatalf("prune: %+v, %v; want a/5's sighting deleted, its sequence reached", st, err)
	}
	if got := sight("b", 3); !got.Equal(firstB) {
		t.Fatalf("b/3 first seen %v after the prune, want %v: an open gap's sighting must stay", got, firstB)
	}
	future, err := idem.NewPruner(s.Driver, &idem.RetentionConfig{Now: func() time.Time { return time.Now().Add(8 * 24 * time.Hour) }})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := future.Prune(ctx); err != nil || st.GapsDeleted != 1 {
		t.Fatalf("prune 8 days on: %+v, %v; want b/3's old sighting deleted", st, err)
	}
	if n, err := gp.PruneGaps(ctx, time.Now().Add(24*time.Hour), 10); err != nil || n != 0 {
		t.Fatalf("PruneGaps with nothing left: %d, %v", n, err)
	}
}
