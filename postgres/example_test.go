package postgres_test

import (
	"context"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/postgres"
)

// Wire idem to a pgx pool: idem's tables live in their own schema, and the
// handler writes through the postgres.Tx it is given, so its writes commit
// with the marker. (This example needs a server, so it is compiled but not
// run; the package's tests run the same code against IDEM_POSTGRES_DSN.)
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	drv, err := postgres.New(pool, &postgres.Config{Schema: "idem"})
	if err != nil {
		log.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil { // or: idem migrate --dsn … --schema idem
		log.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	credit := &idem.Handler[postgres.Tx]{
		Name: "balances",
		Apply: func(ctx context.Context, tx postgres.Tx, msg *idem.Message) error {
			_, err := tx.Exec(ctx, `UPDATE balances SET amount = amount + 1 WHERE account = $1`, msg.AggregateID)
			return err
		},
	}
	out, err := proc.Process(ctx, credit, &idem.Message{ID: "evt-1", AggregateID: "alice"})
	if err != nil {
		log.Fatal(err)
	}
	log.Println(out) // applied; a redelivery of evt-1 is a duplicate
}
