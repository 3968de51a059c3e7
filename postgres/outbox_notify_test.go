package postgres_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// TestOutboxNotifyIsOptIn: Migrate leaves the outbox without its NOTIFY
// trigger (it serialises concurrent writers' commits); SetOutboxNotify
// installs and removes it, and each is idempotent.
func TestOutboxNotifyIsOptIn(t *testing.T) {
	ctx := context.Background()
	pool := testenv.PostgresPool(t, 10)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema, TablePrefix: "app_"})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	triggers := func() int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger tg JOIN pg_class c ON c.oid = tg.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = 'app_outbox' AND NOT tg.tgisinternal`, schema).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if on, err := drv.OutboxNotifyOn(ctx); err != nil || on != (n == 1) {
			t.Fatalf("OutboxNotifyOn: %t, %v; the catalog has %d triggers", on, err, n)
		}
		return n
	}
	if n := triggers(); n != 0 {
		t.Fatalf("%d triggers on the outbox after Migrate, want none", n)
	}
	for _, step := range []struct {
		on   bool
		want int
	}{{true, 1}, {true, 1}, {false, 0}, {false, 0}, {true, 1}} {
		if err := drv.SetOutboxNotify(ctx, step.on); err != nil {
			t.Fatal(err)
		}
		if n := triggers(); n != step.want {
			t.Fatalf("SetOutboxNotify(%t): %d triggers, want %d", step.on, n, step.want)
		}
	}
	// Instances calling it together at start-up all succeed, whichever
	// way they turn it.
	for round := range 6 {
		on := round%2 == 0
		start := make(chan struct{})
		errs := make(chan error, 8)
		for range 8 {
			go func() {
				<-start
				errs <- drv.SetOutboxNotify(ctx, on)
			}()
		}
		close(start)
		for range 8 {
			if err := <-errs; err != nil {
				t.Fatalf("round %d: concurrent SetOutboxNotify(%t): %v", round, on, err)
			}
		}
		if n, want := triggers(), map[bool]int{true: 1, false: 0}[on]; n != want {
			t.Fatalf("round %d: after concurrent SetOutboxNotify(%t): %d triggers, want %d", round, on, n, want)
		}
	}
	if err := drv.SetOutboxNotify(ctx, true); err != nil {
		t.Fatal(err)
	}
	// Migrate again (a restart) keeps the operator's choice.
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if n := triggers(); n != 1 {
		t.Fatalf("%d triggers after a second Migrate, want the 1 SetOutboxNotify installed", n)
	}

	// On a schema a migration behind (an older idem migrated it), the
	// setting would be undone by that migration: refused.
	migrations := pgx.Identifier{schema, "app_migrations"}.Sanitize()
	if _, err := pool.Exec(ctx, `DELETE FROM `+migrations+` WHERE version = 9`); err != nil {
		t.Fatal(err)
	}
	if err := drv.SetOutboxNotify(ctx, false); !errors.Is(err, postgres.ErrNotMigrated) {
		t.Fatalf("SetOutboxNotify before migration 9: %v, want ErrNotMigrated", err)
	}
	if n := triggers(); n != 1 {
		t.Fatalf("refused call changed the trigger: %d, want 1", n)
	}
}
