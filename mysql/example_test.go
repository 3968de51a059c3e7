package mysql_test

import (
	"context"
	"database/sql"
	"log"
	"os"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/mysql"
)

// Wire idem to MySQL or MariaDB: Open sets every connection to READ
// COMMITTED, so the driver need not set it per transaction, and the
// handler writes through the *sql.Tx it is given, so its writes commit
// with the marker. (This example needs a server, so it is compiled but
// not run; the package's tests run the same code against IDEM_MYSQL_DSN.)
func Example() {
	ctx := context.Background()
	cfg, err := gomysql.ParseDSN(os.Getenv("MYSQL_DSN")) // app:secret@tcp(db:3306)/app
	if err != nil {
		log.Fatal(err)
	}
	db, err := mysql.Open(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	drv, err := mysql.New(db, &mysql.Config{SessionIsolation: true})
	if err != nil {
		log.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil { // or: idem migrate --dsn mysql://…
		log.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	credit := &idem.Handler[*sql.Tx]{
		Name: "balances",
		Apply: func(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
			_, err := tx.ExecContext(ctx, `UPDATE balances SET amount = amount + 1 WHERE account = ?`, msg.AggregateID)
			return err
		},
	}
	out, err := proc.Process(ctx, credit, &idem.Message{ID: "evt-1", AggregateID: "alice"})
	if err != nil {
		log.Fatal(err)
	}
	log.Println(out) // applied; a redelivery of evt-1 is a duplicate
}
