package driver_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/sqlite"
)

// The contract a driver keeps, seen through SQLite's: a marker inserted in a
// transaction that commits is found by the next insert of the same key,
// which reports the stored payload hash instead of inserting; a marker whose
// transaction rolls back leaves nothing behind.
func Example() {
	ctx := context.Background()
	db, err := sqlite.Open(":memory:", nil)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	s, err := sqlite.New(db, nil)
	if err != nil {
		log.Fatal(err)
	}
	var drv driver.Driver[*sql.Tx] = s
	if err := drv.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	insert := func(id string, commit bool) {
		tx, err := drv.Begin(ctx)
		if err != nil {
			log.Fatal(err)
		}
		res, err := drv.MarkerInsert(ctx, tx, &driver.MarkerInsertParams{Handler: "h", MessageID: id, PayloadHash: []byte("hash-of-" + id)})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s: inserted=%v existing=%q\n", id, res.Inserted, res.ExistingHash)
		if commit {
			err = drv.Commit(ctx, tx)
		} else {
			err = drv.Rollback(ctx, tx)
		}
		if err != nil {
			log.Fatal(err)
		}
	}
	insert("a", true)
	insert("a", true)  // committed before: found
	insert("b", false) // rolled back
	insert("b", true)  // so inserted again
	// Output:
	// a: inserted=true existing=""
	// a: inserted=false existing="hash-of-a"
	// b: inserted=true existing=""
	// b: inserted=true existing=""
}
