package postgres_test

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestDeadLettersMigrateForward upgrades a schema whose dead letters were
// written before they were keyed by payload hash and before the replaying
// state: its rows are kept; a row is found again by its raw payload and
// takes the hash; another payload of the same message ID is a dead letter
// of its own; and a replay can claim a dead letter.
func TestDeadLettersMigrateForward(t *testing.T) {
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	files, err := filepath.Glob("migrations/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	placeholder := regexp.MustCompile(`\{\{([a-z_]+)\}\}`)
	script := `BEGIN; SET LOCAL search_path TO ` + schema + `;
CREATE TABLE idem_migrations (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
`
	for _, f := range files {
		name := filepath.Base(f)
		v, _ := strconv.Atoi(name[:3])
		if v > 9 {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		script += placeholder.ReplaceAllString(string(b), `"idem_$1"`) + ";\nINSERT INTO idem_migrations (version, name) VALUES (" + strconv.Itoa(v) + ", '" + name + "');\n"
	}
	if _, err := pool.Exec(ctx, script+"COMMIT;"); err != nil {
		t.Fatal(err)
	}
	dls := pgx.Identifier{schema, "idem_dead_letters"}.Sanitize()
	if _, err := pool.Exec(ctx, `INSERT INTO `+dls+` (handler, message_id, raw, source, error, class, fingerprint, attempts, state)
VALUES ('balances', 'junk-1', 'not a credit', 'test', 'bad', 'permanent', 'fp', 1, 'discarded'),
       ('balances', 'junk-2', 'nor this', 'test', 'bad', 'permanent', 'fp', 1, 'parked')`); err != nil {
		t.Fatal(err)
	}

	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
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
	if len(got) != 2 || got[0].State != driver.DeadLetterDiscarded || string(got[0].Raw) != "not a credit" || got[1].MessageID != "junk-2" {
		t.Fatalf("after the migration: %+v, want both dead letters as they were", got)
	}
	first := got[0].ID
	same := &idem.Message{ID: "junk-1", Payload: []byte("not a credit")}
	id, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: same.ID, PayloadHash: same.PayloadHash(), Raw: same.Payload,
		Source: "test", Error: "bad again", Class: "permanent", Fingerprint: "fp", Attempts: 2})
	if err != nil || id != first {
		t.Fatalf("the same message again: dead letter %d, %v; want %d", id, err, first)
	}
	other := &idem.Message{ID: "junk-1", Payload: []byte("another payload")}
	id, err = drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: other.ID, PayloadHash: other.PayloadHash(), Raw: other.Payload,
		Source: "test", Error: "bad", Class: "permanent", Fingerprint: "fp", Attempts: 1})
	if err != nil || id == first || id == got[1].ID {
		t.Fatalf("another payload: dead letter %d, %v; want a new one", id, err)
	}
	got, err = drv.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: []int64{first}})
	if err != nil || len(got) != 1 || string(got[0].PayloadHash) != string(same.PayloadHash()) || got[0].Error != "bad again" || got[0].State != driver.DeadLetterParked {
		t.Fatalf("dead letter %d: %+v, %v; want its hash filled in, parked again with the new error", first, got, err)
	}
	if n, err := drv.DeadLetterSetState(ctx, &driver.DeadLetterStateChange{IDs: []int64{first}, From: []string{driver.DeadLetterParked},
		To: driver.DeadLetterReplaying, Actor: "test"}); err != nil || n != 1 {
		t.Fatalf("claim for a replay after the migration: %d, %v", n, err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+dls+` SET state = 'bogus' WHERE id = $1`, first); err == nil {
		t.Fatal("a state outside the five was stored: the CHECK is gone")
	}
}
