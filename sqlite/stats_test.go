package sqlite_test

import (
	"context"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// TestStatsFlushFailureKeepsCounts: counts a flush could not store are
// added by the next flush, not lost; the store's table really goes away
// in between.
func TestStatsFlushFailureKeepsCounts(t *testing.T) {
	ctx := context.Background()
	db, drv := openMigrated(t, nil)
	rec, err := idem.NewStatsRecorder(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	dup := &idem.OutcomeEvent{Handler: "h", Outcome: idem.Duplicate}
	rec.OnOutcome(ctx, dup)
	rec.OnOutcome(ctx, dup)
	rec.OnOutcome(ctx, &idem.OutcomeEvent{Handler: "h", Outcome: idem.Applied}) // not counted here: markers count it

	if _, err := db.Exec(`ALTER TABLE idem_handler_stats RENAME TO away`); err != nil {
		t.Fatal(err)
	}
	if err := rec.Flush(ctx); err == nil {
		t.Fatal("flush into a missing table succeeded")
	}
	rec.OnOutcome(ctx, &idem.OutcomeEvent{Handler: "h", Outcome: idem.Stale})
	if _, err := db.Exec(`ALTER TABLE away RENAME TO idem_handler_stats`); err != nil {
		t.Fatal(err)
	}
	if err := rec.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	got, err := drv.StatsRead(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := (driver.StatsDelta{Duplicates: 2, Stale: 1}); got["h"] != want || len(got) != 1 {
		t.Fatalf("stats %v, want h: %+v", got, want)
	}
}
