package redisstore_test

import (
	"context"
	"fmt"
	"log"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/redisstore"
)

// A read model in Redis: each credit increments an account's balance in a
// hash. The increment is queued on the transaction and runs in one
// MULTI/EXEC with the message's marker, so a redelivery is a Duplicate and
// the balance moves once. (This example needs a server, so it is compiled
// but not run; TestExampleFlow runs the same steps against IDEM_REDIS_URL.)
func Example() {
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{
		Addr: "127.0.0.1:6379",
		// Redis before 8 has no maintenance notifications: see the
		// package documentation.
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	})
	defer client.Close()
	const prefix = "app:"

	drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		log.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	h := &idem.Handler[*redisstore.Tx]{
		Name: "balances",
		Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
			return tx.Queue().HIncrBy(ctx, prefix+"balances", m.AggregateID, 25).Err()
		},
	}
	msg := &idem.Message{ID: "credit-1", AggregateID: "acct-7", Payload: []byte("25")}
	for range 2 { // delivered twice
		out, err := proc.Process(ctx, h, msg)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(out)
	}
	balance, err := client.HGet(ctx, prefix+"balances", "acct-7").Int64()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("balance", balance)
	// Prints:
	// applied
	// duplicate
	// balance 25
}

// A handler that only queues writes can take the write-only path: its
// marker is checked and its increment applied in one script call, one
// round trip a message. A handler that reads through its transaction
// needs a driver without WriteOnly. (Compiled but not run, as Example;
// TestWriteOnlyConformance runs the path against IDEM_REDIS_URL.)
func ExampleConfig_writeOnly() {
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{
		Addr:                     "127.0.0.1:6379",
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	})
	defer client.Close()
	const prefix = "app:"

	drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix, WriteOnly: true})
	if err != nil {
		log.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		log.Fatal(err)
	}
	h := &idem.Handler[*redisstore.Tx]{
		Name: "balances",
		Apply: func(ctx context.Context, tx *redisstore.Tx, m *idem.Message) error {
			return tx.Queue().HIncrBy(ctx, prefix+"balances", m.AggregateID, 25).Err()
		},
	}
	msg := &idem.Message{ID: "credit-1", AggregateID: "acct-7", Payload: []byte("25")}
	for range 2 { // delivered twice: the second runs the handler, and writes nothing
		out, err := proc.Process(ctx, h, msg)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(out)
	}
	// Prints:
	// applied
	// duplicate
}
