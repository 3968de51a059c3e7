package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/sqlident"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestStatsCountsMirroredMarkersOnce: on PostgreSQL an atomic marker an
// idem from before migration 11 writes to the old table is mirrored into
// the markers table (migration 12), and stats counted it in both: one
// message applied showed as two. A marker written before the mirror
// existed (only in the old table), a lease and a marker of the new layout
// count once each.
func TestStatsCountsMirroredMarkersOnce(t *testing.T) {
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	processed := sqlident.Qualified(schema, "idem_processed")
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// Written by an old process since migration 12: mirrored. A UUID, an
	// ID of 16 bytes and another, as the trigger keys them.
	for _, id := range []string{"0b7c2f3e-5d4a-4c1b-9e8f-7a6b5c4d3e2f", "sixteen-bytes-id", "evt-1"} {
		exec(`INSERT INTO `+processed+` (handler, message_id, payload_hash) VALUES ('billing', $1, '\x01'::bytea)`, id)
	}
	// Written before the mirror: in the old table only.
	exec(`ALTER TABLE ` + processed + ` DISABLE TRIGGER USER`)
	exec(`INSERT INTO ` + processed + ` (handler, message_id, payload_hash) VALUES ('billing', 'evt-old', '\x01'::bytea)`)
	exec(`ALTER TABLE ` + processed + ` ENABLE TRIGGER USER`)
	// A lease done, and a marker of the new layout.
	exec(`INSERT INTO ` + processed + ` (handler, message_id, payload_hash, token) VALUES ('billing', 'evt-lease', '\x01'::bytea, 7)`)
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[postgres.Tx]{Name: "billing", Apply: func(context.Context, postgres.Tx, *idem.Message) error { return nil }}
	if out, err := proc.Process(ctx, h, &idem.Message{ID: "evt-new", Payload: []byte("x")}); err != nil || out != idem.Applied {
		t.Fatalf("process: %v, %v", out, err)
	}

	code, out, errOut := runCLIEnv(t, map[string]string{dsnEnv: testenv.PostgresDSN()}, "stats", "--schema", schema, "--json")
	var list []handlerStats
	if code != exitOK || json.Unmarshal([]byte(out), &list) != nil || len(list) != 1 {
		t.Fatalf("stats: exit %d\n%s%s", code, out, errOut)
	}
	if list[0].Applied != 6 {
		t.Errorf("stats counts %d applied, want 6 (3 mirrored, 1 old, 1 lease, 1 new)\n%s", list[0].Applied, out)
	}
}
