package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestRefailWhileDiscardInFlight: an operator's discard still uncommitted
// when the message fails again. The new failure waits for it, parks the
// dead letter again and logs that, so state and history agree.
func TestRefailWhileDiscardInFlight(t *testing.T) {
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	drv := storeIn(t, pool, schema).Driver.(*postgres.Driver)
	dl := &driver.DeadLetter{Handler: "h", MessageID: "m-1", Error: "boom", Class: "permanent", Fingerprint: "f", Attempts: 1}
	id, err := drv.DeadLetterPut(ctx, dl)
	if err != nil {
		t.Fatal(err)
	}
	// The discard, as DeadLetterSetState writes it, held open.
	op, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer op.Rollback(ctx)
	table, log := pgx.Identifier{schema, "idem_dead_letters"}.Sanitize(), pgx.Identifier{schema, "idem_dead_letter_log"}.Sanitize()
	if _, err := op.Exec(ctx, `UPDATE `+table+` SET state = 'discarded' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := op.Exec(ctx, `INSERT INTO `+log+` (dead_letter_id, state, actor) VALUES ($1, 'discarded', 'alice')`, id); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		again := *dl
		again.Error, again.Attempts = "boom again", 2
		_, err := drv.DeadLetterPut(ctx, &again)
		done <- err
	}()
	time.Sleep(200 * time.Millisecond) // the put reads the row and waits for its lock
	if err := op.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	hist, err := drv.DeadLetterHistory(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	got, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: []int64{id}})
	if err != nil || len(got) != 1 {
		t.Fatalf("list: %+v, %v", got, err)
	}
	if got[0].State != driver.DeadLetterParked || len(hist) != 2 || hist[1].State != driver.DeadLetterParked || hist[1].Actor != driver.RefailActor {
		t.Fatalf("state %s, history %+v; want parked, and the history ending with the delivery that parked it again", got[0].State, hist)
	}
}
