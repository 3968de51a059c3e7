package sqlite_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/sqlite"
)

// TestDeadLettersMigrateForward upgrades a database whose dead letters
// were written before they were keyed by payload hash and before the
// replaying state: its rows, IDs, history and AUTOINCREMENT counter are
// kept; a row is found again by its raw payload and takes the hash; another
// payload of the same message ID is a dead letter of its own; and a replay
// can claim a dead letter.
func TestDeadLettersMigrateForward(t *testing.T) {
	ctx := context.Background()
	db := openFile(t, filepath.Join(t.TempDir(), "old.db"))
	migrateTo(t, db, 7)
	now := time.Now().UnixMicro()
	for _, r := range []struct {
		id        int
		messageID string
		raw       string
	}{{1, "junk-1", "not a credit"}, {2, "junk-2", "nor this"}, {3, "junk-3", "deleted"}} {
		if _, err := db.ExecContext(ctx, `INSERT INTO "idem_dead_letters"
(id, handler, message_id, envelope, raw, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state)
VALUES (?, 'balances', ?, NULL, ?, 'test', 'bad', 'permanent', 'fp', 1, ?, ?, 'parked')`, r.id, r.messageID, []byte(r.raw), now, now); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.ExecContext(ctx, `DELETE FROM "idem_dead_letters" WHERE id = 3;
INSERT INTO "idem_dead_letter_log" (dead_letter_id, at, state, actor) VALUES (1, 1, 'discarded', 'ops');
UPDATE "idem_dead_letters" SET state = 'discarded' WHERE id = 1`); err != nil {
		t.Fatal(err)
	}

	drv, err := sqlite.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	got, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].ID != 1 || got[0].State != driver.DeadLetterDiscarded || string(got[0].Raw) != "not a credit" || got[1].ID != 2 {
		t.Fatalf("after the migration: %+v, want dead letters 1 (discarded) and 2 as they were", got)
	}
	same := &idem.Message{ID: "junk-1", Payload: []byte("not a credit")}
	id, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: same.ID, PayloadHash: same.PayloadHash(), Raw: same.Payload,
		Source: "test", Error: "bad again", Class: "permanent", Fingerprint: "fp", Attempts: 2})
	if err != nil || id != 1 {
		t.Fatalf("the same message again: dead letter %d, %v; want 1", id, err)
	}
	other := &idem.Message{ID: "junk-1", Payload: []byte("another payload")}
	id, err = drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: other.ID, PayloadHash: other.PayloadHash(), Raw: other.Payload,
		Source: "test", Error: "bad", Class: "permanent", Fingerprint: "fp", Attempts: 1})
	if err != nil || id != 4 {
		t.Fatalf("another payload: dead letter %d, %v; want a new one, 4 (3 was handed out before)", id, err)
	}
	got, err = drv.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: []int64{1}})
	if err != nil || len(got) != 1 || string(got[0].PayloadHash) != string(same.PayloadHash()) || got[0].Error != "bad again" || got[0].State != driver.DeadLetterParked {
		t.Fatalf("dead letter 1: %+v, %v; want its hash filled in, parked again with the new error", got, err)
	}
	hist, err := drv.DeadLetterHistory(ctx, 1)
	if err != nil || len(hist) != 2 || hist[0].State != driver.DeadLetterDiscarded || hist[1].State != driver.DeadLetterParked {
		t.Fatalf("history of 1: %+v, %v; want the discard, then parked again", hist, err)
	}
	if n, err := drv.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: []int64{2}, From: []string{driver.DeadLetterParked},
		To: driver.DeadLetterReplaying, Actor: "test"}); err != nil || n != 1 {
		t.Fatalf("claim for a replay after the migration: %d, %v", n, err)
	}
}
