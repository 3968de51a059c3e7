package mysql_test

import (
	"database/sql"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
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
