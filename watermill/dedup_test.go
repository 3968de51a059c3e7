package watermill_test

import (
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	idemwm "github.com/idemhq/idem/watermill"
)

// What docs/watermill.md says of Watermill's in-memory Deduplicator,
// next to idem, on the same handler: one that fails once after its write,
// then a restart (a new router and middleware on the same database) that
// receives a republished message.
func TestDeduplicatorComparedWithIdem(t *testing.T) {
	t.Parallel()
	db, drv := testenv.SQLite(t, t.TempDir()+"/idem.db", nil)
	if _, err := db.Exec(`CREATE TABLE credits (id TEXT, via TEXT)`); err != nil {
		t.Fatal(err)
	}
	count := func(via string) int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM credits WHERE via = ?`, via).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// The handler writes, then fails on its first call.
	var calls atomic.Int64
	write := func(msg *message.Message, exec func(query string, args ...any) (sql.Result, error), via string) error {
		if _, err := exec(`INSERT INTO credits VALUES (?, ?)`, msg.UUID, via); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return errors.New("failed after its write")
		}
		return nil
	}

	// Deduplicator: the handler's write is its own; the failure Nacks,
	// the redelivery is dropped as a duplicate of the key recorded at the
	// first check.
	dedupRun := func(id string) {
		ch := blockingChannel(t)
		dedup := &middleware.Deduplicator{}
		stop := runRouter(t, ch, "in", func(msg *message.Message) error {
			tx, err := db.Begin()
			if err != nil {
				return err
			}
			defer tx.Rollback()
			if err := write(msg, tx.Exec, "dedup"); err != nil {
				return err
			}
			return tx.Commit()
		}, dedup.Middleware)
		publishAcked(t, ch, "in", message.NewMessage(id, []byte("x")), 10*time.Second)
		stop()
	}
	calls.Store(0)
	dedupRun("evt-1")
	if n := count("dedup"); n != 0 {
		t.Fatalf("Deduplicator: %d credits, want 0: the failed attempt rolled back and the redelivery was dropped", n)
	}
	calls.Store(1) // no more failures
	dedupRun("evt-2")
	dedupRun("evt-2") // after a restart: the map is new
	if n := count("dedup"); n != 2 {
		t.Fatalf("Deduplicator: %d credits, want 2: evt-2 applied again after the restart", n)
	}

	// idem: the write commits with the marker; the failure rolls both
	// back, the redelivery applies, and the restarted router sees a
	// Duplicate.
	idemRun := func(id string) {
		p, err := idem.NewProcessor(drv, nil)
		if err != nil {
			t.Fatal(err)
		}
		c, err := idem.NewConsumer(p, &idem.Handler[*sql.Tx]{Name: "credits", Apply: idemwm.Apply[*sql.Tx](func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := idemwm.Tx[*sql.Tx](msg)
			return nil, write(msg, tx.Exec, "idem")
		})}, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t), Backoff: idem.Backoff{Base: time.Millisecond, Max: 5 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		h, err := idemwm.New(c, nil)
		if err != nil {
			t.Fatal(err)
		}
		ch := blockingChannel(t)
		stop := runRouter(t, ch, "in", h.Handle)
		publishAcked(t, ch, "in", message.NewMessage(id, []byte("x")), 10*time.Second)
		stop()
	}
	calls.Store(0)
	idemRun("evt-1")
	if n := count("idem"); n != 1 {
		t.Fatalf("idem: %d credits, want 1: the failed attempt rolled back, the redelivery applied", n)
	}
	idemRun("evt-2")
	idemRun("evt-2") // after a restart: the marker is in the database
	if n := count("idem"); n != 2 {
		t.Fatalf("idem: %d credits, want 2: evt-1 and evt-2 once each", n)
	}
}
