package sqlite_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/sqlite"
)

// Open a database file with the settings idem relies on, migrate idem's
// tables next to the application's, and process a batch: the handler gets
// only the messages not seen before.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idem-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	db, err := sqlite.Open(filepath.Join(dir, "app.db"), nil) // WAL, synchronous=FULL, one writer
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	drv, err := sqlite.New(db, &sqlite.Config{TablePrefix: "idem_"})
	if err != nil {
		log.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE seen (id TEXT PRIMARY KEY)`); err != nil {
		log.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{
		Name: "audit",
		ApplyBatch: func(ctx context.Context, tx *sql.Tx, msgs []*idem.Message) error {
			for _, m := range msgs {
				if _, err := tx.ExecContext(ctx, `INSERT INTO seen (id) VALUES (?)`, m.ID); err != nil {
					return err
				}
			}
			fmt.Println("handler got", len(msgs), "new messages")
			return nil
		},
	}
	batch := func(ids ...string) []*idem.Message {
		msgs := make([]*idem.Message, len(ids))
		for i, id := range ids {
			msgs[i] = &idem.Message{ID: id}
		}
		return msgs
	}
	outs, err := proc.ProcessBatch(ctx, h, batch("a", "b", "c"))
	fmt.Println(outs, err)
	outs, err = proc.ProcessBatch(ctx, h, batch("b", "c", "d", "d"))
	fmt.Println(outs, err)
	// Output:
	// handler got 3 new messages
	// [applied applied applied] <nil>
	// handler got 1 new messages
	// [duplicate duplicate applied duplicate] <nil>
}
