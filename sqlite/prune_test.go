package sqlite_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
)

// TestPruneByRange walks a table that mixes old markers with young ones,
// a running lease and a failed one, in batches of 7 rows: every batch
// deletes at most its limit, the cursor moves forward, and when the walk
// is done exactly the old done markers are gone, whatever batch their
// neighbours fell in.
func TestPruneByRange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, drv := openMigrated(t, nil)
	now := time.Now()
	old, young := now.Add(-48*time.Hour).UnixMicro(), now.UnixMicro()
	want := map[string]bool{} // key → kept
	for i := range 100 {
		h, id := fmt.Sprintf("h%d", i%3), fmt.Sprintf("m%03d", i)
		at, status, kept := old, "done", false
		switch {
		case i%5 == 0:
			at, kept = young, true
		case i%17 == 0:
			status, kept = "running", true
		case i%19 == 0:
			status, kept = "failed", true
		}
		if _, err := db.ExecContext(ctx, `INSERT INTO "idem_processed" (handler, message_id, payload_hash, processed_at, status) VALUES (?, ?, x'00', ?, ?)`, h, id, at, status); err != nil {
			t.Fatal(err)
		}
		want[h+"/"+id] = kept
	}
	p := &driver.PruneParams{Before: now.Add(-time.Hour), Limit: 7}
	deleted, batches := 0, 0
	for {
		res, err := drv.PruneMarkers(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		batches++
		if res.Deleted > p.Limit {
			t.Fatalf("batch %d deleted %d, limit %d", batches, res.Deleted, p.Limit)
		}
		deleted += res.Deleted
		if res.Done {
			break
		}
		if k := res.Last; k.Handler < p.After.Handler || (k.Handler == p.After.Handler && k.MessageID <= p.After.MessageID) {
			t.Fatalf("batch %d: cursor %+v did not move past %+v", batches, k, p.After)
		}
		p.After = res.Last
		if batches > 100 {
			t.Fatal("no end after 100 batches of 7 rows over 100 rows")
		}
	}
	rows, err := db.QueryContext(ctx, `SELECT handler || '/' || message_id FROM "idem_processed"`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	left := map[string]bool{}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		left[k] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	gone := 0
	for k, kept := range want {
		if kept != left[k] {
			t.Errorf("%s: kept %v, want %v", k, left[k], kept)
		}
		if !kept {
			gone++
		}
	}
	if deleted != gone || batches < 100/7 {
		t.Fatalf("deleted %d in %d batches, want %d in at least %d", deleted, batches, gone, 100/7)
	}
}

// TestPruneWhileProcessing prunes 20,000 old markers in batches of 2,000
// while a processor applies new messages whose keys fall among the old
// ones: every old marker goes, every new message is applied once with its
// marker kept (young markers inside a batch's range stay), and no message
// waits much longer than the slowest batch (SQLite has one writer: a batch
// holds it, a message waits for it).
func TestPruneWhileProcessing(t *testing.T) {
	t.Parallel()
	const old = 20_000
	ctx := context.Background()
	db, drv := openMigrated(t, nil)
	s := storeOn(t, db, drv)
	if _, err := db.ExecContext(ctx, `INSERT INTO "idem_processed" (handler, message_id, payload_hash, processed_at)
WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < ?)
SELECT 'balances', printf('old-%07d', i), x'00', ? FROM c`, old, time.Now().Add(-30*24*time.Hour).UnixMicro()); err != nil {
		t.Fatal(err)
	}
	// Keys among the old ones, ahead of the pruner and behind it.
	idemtest.CheckPruneWhileProcessing(t, s, old, 2000, func(i int) string { return fmt.Sprintf("old-%07d-new-%d", 1+i*7919%old, i) })
}
