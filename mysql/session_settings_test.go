package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// TestClientFoundRows runs the ordering guard's suite, the conformance
// suite and the dead letters on a pool with clientFoundRows=true, where
// an UPDATE (or the update of an upsert) reports the rows it matched
// rather than the rows it changed: a guard that read "one row" as "it
// advanced" would apply a stale event.
func TestClientFoundRows(t *testing.T) {
	t.Parallel()
	open := func(t testing.TB) *idemtest.Store[*sql.Tx] {
		cfg, err := gomysql.ParseDSN(testenv.MySQLDatabase(t))
		if err != nil {
			t.Fatal(err)
		}
		cfg.ClientFoundRows = true
		return storeOn(t, testenv.MySQL(t, cfg.FormatDSN(), 40), nil)
	}
	h := &idemtest.Harness[*sql.Tx]{Open: open, Goroutines: 16, IDs: 300, Aggregates: 30}
	t.Run("Ordering", func(t *testing.T) { idemtest.RunOrdering(t, h) })
	t.Run("Conformance", func(t *testing.T) { idemtest.Run(t, h) })
	t.Run("DeadLetters", func(t *testing.T) { idemtest.RunDeadLetters(t, h) })
}

// TestMigrateRefusesAutocommitOff: on a pool whose sessions run with
// autocommit=0 (or a completion_type that chains or disconnects) the
// driver's statements outside a transaction would never commit, holding
// their locks; Migrate says so instead, naming the setting.
func TestMigrateRefusesAutocommitOff(t *testing.T) {
	t.Parallel()
	base := testenv.MySQLDatabase(t)
	for _, param := range []string{"autocommit=0", "completion_type=CHAIN"} {
		cfg, err := gomysql.ParseDSN(base + "&" + param)
		if err != nil {
			t.Fatal(err)
		}
		drv, err := mysql.New(testenv.MySQL(t, cfg.FormatDSN(), 2), nil)
		if err != nil {
			t.Fatal(err)
		}
		name := strings.SplitN(param, "=", 2)[0]
		if err := drv.Migrate(context.Background()); !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), name) {
			t.Errorf("Migrate on sessions with %s: %v; want ErrInvalidConfig naming %s", param, err, name)
		}
	}
}

// TestOpenRefusesUnsafeSettings: Open interpolates parameters on the
// client, which is unsafe in character sets where a backslash can end a
// character (a quote in a message ID would end the string), and it needs
// the server's default completion_type and manages autocommit itself
// (Migrate's refusal of those on any pool: TestMigrateRefusesAutocommitOff).
func TestOpenRefusesUnsafeSettings(t *testing.T) {
	t.Parallel()
	base := testenv.MySQLDatabase(t)
	for _, param := range []string{"charset=gbk", "charset=sjis", "completion_type=CHAIN", "autocommit=0"} {
		cfg, err := gomysql.ParseDSN(base + "&" + param)
		if err != nil {
			t.Fatal(err)
		}
		db, err := mysql.Open(context.Background(), cfg)
		if err == nil {
			db.Close()
		}
		if !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("Open with %s: %v; want ErrInvalidConfig", param, err)
		}
	}
}
