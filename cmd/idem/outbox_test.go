package main

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/sqlite"
)

// TestOutboxStatsGolden: outbox stats on a database holding three rows:
// one published, one failing, one waiting.
func TestOutboxStatsGolden(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "outbox.db")
	db, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	drv, err := sqlite.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if code, _, errOut := runCLIEnv(t, map[string]string{dsnEnv: path}, "outbox", "stats"); code != exitFailed {
		t.Fatalf("outbox stats before migrate: exit %d, want %d: %s", code, exitFailed, errOut)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	addToOutbox(t, db, drv, "a", "b", "c")
	var rs driver.OutboxRelayStore = drv
	if err := rs.OutboxMarkPublished(ctx, []int64{1}); err != nil {
		t.Fatal(err)
	}
	if err := rs.OutboxFailed(ctx, "relay-1", 2, "jetstream: publish \"b\": nats: no responders available for request", time.Second); err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		name string
		args []string
	}{
		{"outbox_stats", []string{"outbox", "stats"}},
		{"outbox_stats_json", []string{"outbox", "stats", "--json"}},
	} {
		code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: path}, step.args...)
		if code != exitOK {
			t.Fatalf("%v: exit %d: %s", step.args, code, errOut)
		}
		golden(t, step.name, path, out+errOut)
	}
}

// addToOutbox adds one message per ID (payload = ID) to the outbox of the
// migrated SQLite database db, in one transaction.
func addToOutbox(t *testing.T, db *sql.DB, drv *sqlite.Driver, ids ...string) {
	t.Helper()
	ctx := context.Background()
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if err := ob.Add(ctx, tx, &idem.Message{ID: id, Stream: "credits", Payload: []byte(id)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// TestOutboxStatsMultiLineError: a last error of several lines keeps its
// column in the table; its second line started at the margin.
func TestOutboxStatsMultiLineError(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "outbox.db")
	db, drv := testenv.SQLite(t, path, nil)
	addToOutbox(t, db, drv, "a")
	if err := drv.OutboxFailed(ctx, "relay-1", 1, "publish failed:\nbroker said no", time.Second); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: path}, "outbox", "stats")
	if code != exitOK || !strings.Contains(out, "last error      publish failed:\n                broker said no\n") {
		t.Fatalf("exit %d:\n%s%s", code, out, errOut)
	}
}
