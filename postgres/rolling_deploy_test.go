package postgres_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestOldProcessAfterNarrowMarkers: in a rolling deploy a process running
// an idem from before migration 011 writes atomic markers to the old table
// only. Its inserts are mirrored to the new table in the same
// transaction, so neither version applies what the other applied: the old
// one fails on a message the new one applied (its delivery is retried
// until a new process takes it), the new one finds the old one's marker,
// and two at once wait on one key.
func TestOldProcessAfterNarrowMarkers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 8)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var applied []string
	h := &idem.Handler[postgres.Tx]{Name: "balances", Apply: func(_ context.Context, _ postgres.Tx, m *idem.Message) error {
		applied = append(applied, m.ID)
		return nil
	}}
	processed := pgx.Identifier{schema, "idem_processed"}.Sanitize()
	// oldInsert is the atomic marker insert of idem before migration 011.
	oldInsert := func(tx pgx.Tx, id string, payload []byte) error {
		hash := sha256.Sum256(payload)
		_, err := tx.Exec(ctx, `INSERT INTO `+processed+` (handler, message_id, payload_hash) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`, "balances", id, hash[:])
		return err
	}
	oldApply := func(id string, payload []byte) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if err := oldInsert(tx, id, payload); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}

	// Applied by a new process, redelivered to an old one: refused.
	uuid := "0f8fad5b-d9cb-469f-a165-70867728950e"
	for _, id := range []string{uuid, "order-7", "sixteen-bytes-id"} {
		msg := &idem.Message{ID: id, Payload: []byte("p")}
		if out, err := proc.Process(ctx, h, msg); out != idem.Applied || err != nil {
			t.Fatalf("%s by the new process: %v, %v", id, out, err)
		}
		err := oldApply(id, []byte("p"))
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "P0001" {
			t.Fatalf("%s redelivered to an old process: %v, want it refused", id, err)
		}
	}

	// Applied by an old process, redelivered to a new one: a Duplicate.
	if err := oldApply("order-8", []byte("p")); err != nil {
		t.Fatal(err)
	}
	if out, err := proc.Process(ctx, h, &idem.Message{ID: "order-8", Payload: []byte("p")}); out != idem.Duplicate || err != nil {
		t.Fatalf("order-8 after the old process: %v, %v; want Duplicate", out, err)
	}
	if out, err := proc.Process(ctx, h, &idem.Message{ID: "order-8", Payload: []byte("other")}); out != idem.Conflict {
		t.Fatalf("order-8 with another payload: %v, %v; want Conflict", out, err)
	}

	// Both at once: the new one waits for the old one's transaction.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := oldInsert(tx, "order-9", []byte("p")); err != nil {
		t.Fatal(err)
	}
	done := make(chan idem.Outcome, 1)
	go func() {
		out, _ := proc.Process(ctx, h, &idem.Message{ID: "order-9", Payload: []byte("p")})
		done <- out
	}()
	select {
	case out := <-done:
		t.Fatalf("the new process decided order-9 (%v) while the old one held it", out)
	case <-time.After(300 * time.Millisecond):
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if out := <-done; out != idem.Duplicate {
		t.Fatalf("order-9 after the old process committed: %v, want Duplicate", out)
	}
	if len(applied) != 3 {
		t.Fatalf("the new process applied %v; want the three messages it was first with", applied)
	}
}
