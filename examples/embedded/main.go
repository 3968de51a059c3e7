// Command embedded runs idem with no services to install: a SQLite file
// holds an account-balance projection and idem's markers, and an embedded
// NATS JetStream server carries the events.
//
//	go run ./examples/embedded          # publish, consume, verify
//	go run ./examples/embedded -check   # the same, killing a worker mid-stream
//
// It publishes credits and debits, a tenth of them twice, and consumes
// them through idem.Consumer into the balances table. With -check a worker
// process consumes first and is killed (SIGKILL) right after a commit,
// before its acknowledgement; a second worker finishes. Either way the
// balances are then compared with those computed from the unique intended
// events, and any difference exits with status 1.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/sqlite"
)

const (
	streamName = "LEDGER"    // the JetStream stream; this program creates it
	subject    = "ledger.v1" // the subject the events are published to
	durable    = "balances"  // the durable consumer, and the handler's name
	accounts   = 20
)

// Environment of a worker process started by -check.
const (
	envWorker   = "EMBEDDED_WORKER" // the number of commits after which the worker kills itself
	envNATSURL  = "EMBEDDED_NATS_URL"
	envDatabase = "EMBEDDED_DB"
)

func main() {
	if n := os.Getenv(envWorker); n != "" {
		os.Exit(workerMain(n))
	}
	check := flag.Bool("check", false, "kill a worker process mid-stream, then verify")
	events := flag.Int("events", 2000, "unique events to publish")
	flag.Parse()
	if err := run(context.Background(), *events, *check, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "embedded:", err)
		os.Exit(1)
	}
}

// event is one intended event: a credit or debit of an account.
type event struct {
	id, typ, account string
	amount           int64
}

// intended returns n unique events, the same every run.
func intended(n int) []event {
	r := rand.New(rand.NewPCG(1, 2))
	evs := make([]event, n)
	for i := range evs {
		typ := "FundsCredited"
		if r.IntN(3) == 0 {
			typ = "FundsDebited"
		}
		evs[i] = event{id: fmt.Sprintf("evt-%05d", i), typ: typ, account: fmt.Sprintf("acct-%02d", r.IntN(accounts)), amount: 1 + r.Int64N(100)}
	}
	return evs
}

// expected folds the unique intended events, never the delivered stream.
func expected(evs []event) map[string]int64 {
	want := map[string]int64{}
	for _, e := range evs {
		if e.typ == "FundsDebited" {
			want[e.account] -= e.amount
		} else {
			want[e.account] += e.amount
		}
	}
	return want
}

func run(ctx context.Context, n int, check bool, out io.Writer) error {
	start := time.Now()
	dir, err := os.MkdirTemp("", "idem-embedded-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	// The embedded NATS server, with JetStream storing in dir.
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true,
		StoreDir: filepath.Join(dir, "nats"), NoLog: true, NoSigs: true})
	if err != nil {
		return err
	}
	go ns.Start()
	defer ns.Shutdown()
	if !ns.ReadyForConnections(10 * time.Second) {
		return errors.New("the embedded NATS server did not start")
	}
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := natsjs.New(nc)
	if err != nil {
		return err
	}
	// idem never creates JetStream streams: the application does.
	if _, err := js.CreateOrUpdateStream(ctx, natsjs.StreamConfig{Name: streamName, Subjects: []string{"ledger.>"}}); err != nil {
		return err
	}

	// The SQLite database: idem's tables and the projection's.
	dbPath := filepath.Join(dir, "ledger.db")
	db, drv, err := openStore(ctx, dbPath)
	if err != nil {
		return err
	}
	defer db.Close()

	// Publish every event, a tenth of them twice. The ID travels in the
	// idem-id header rather than Nats-Msg-Id, so that JetStream's own
	// duplicate window does not drop the copies: the consumer must.
	evs := intended(n)
	published := 0
	for i, e := range evs {
		copies := 1
		if i%10 == 3 {
			copies = 2
		}
		for range copies {
			m := nats.NewMsg(subject)
			m.Header.Set("idem-id", e.id)
			m.Header.Set("idem-type", e.typ)
			m.Header.Set("idem-aggregate", e.account)
			m.Data = []byte(strconv.FormatInt(e.amount, 10))
			if _, err := js.PublishMsg(ctx, m); err != nil {
				return err
			}
			published++
		}
	}
	fmt.Fprintf(out, "published %d deliveries of %d unique events to stream %s, subject %s\n", published, n, streamName, subject)

	var committed map[string]bool // what the killed worker committed
	if check {
		// A worker process consumes until its n/4-th commit, then kills
		// itself before acknowledging: JetStream redelivers what it had
		// not acknowledged, committed or not.
		cmd := exec.CommandContext(ctx, os.Args[0])
		cmd.Env = append(os.Environ(), envWorker+"="+strconv.Itoa(n/4), envNATSURL+"="+ns.ClientURL(), envDatabase+"="+dbPath)
		cmd.Stdout, cmd.Stderr = out, os.Stderr
		err := cmd.Run()
		ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
		if runtime.GOOS != "windows" && !(ws.Signaled() && ws.Signal() == syscall.SIGKILL) {
			return fmt.Errorf("the worker was to die of SIGKILL after a commit; it ended with %v", err)
		}
		if committed, err = markerIDs(ctx, db); err != nil {
			return err
		}
		fmt.Fprintf(out, "worker 1 killed by SIGKILL after %d commits, before acknowledging the last\n", len(committed))
	}

	// The (second) worker, in this process: it runs until every delivery
	// is acknowledged.
	var applied, duplicates, recommitted atomic.Int64
	cnt := &counter{applied: &applied, duplicates: &duplicates, committed: committed, recommitted: &recommitted}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- consume(cctx, js, drv, cnt) }()
	if err := waitDrained(ctx, js, done); err != nil {
		return err
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		return err
	}

	// The message the dead worker committed but did not acknowledge came
	// back, and was a Duplicate.
	if check && recommitted.Load() == 0 {
		return errors.New("no message the killed worker had committed was redelivered as a duplicate")
	}
	if check {
		fmt.Fprintf(out, "worker 2 found %d of the killed worker's commits redelivered: each a duplicate, none applied again\n", recommitted.Load())
	}
	// Verify against the unique intended events.
	return verify(ctx, db, drv, evs, out, fmt.Sprintf("the last worker applied %d and found %d duplicates; %s",
		applied.Load(), duplicates.Load(), time.Since(start).Round(time.Millisecond)))
}

// markerIDs returns the IDs of the messages the handler has applied.
func markerIDs(ctx context.Context, db *sql.DB) (map[string]bool, error) {
	rows, err := db.QueryContext(ctx, `SELECT message_id FROM idem_processed WHERE handler = ?`, durable)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	ids := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids[id] = true
	}
	return ids, rows.Err()
}

// openStore opens and migrates the SQLite store and creates the projection.
func openStore(ctx context.Context, path string) (*sql.DB, *sqlite.Driver, error) {
	db, err := sqlite.Open(path, nil)
	if err != nil {
		return nil, nil, err
	}
	drv, err := sqlite.New(db, nil)
	if err == nil {
		err = drv.Migrate(ctx)
	}
	if err == nil {
		_, err = db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL)`)
	}
	if err != nil {
		db.Close()
		return nil, nil, err
	}
	return db, drv, nil
}

// balances is the projection: one handler, a route per event type.
func balances() *idem.Handler[*sql.Tx] {
	add := func(sign int64) func(context.Context, *sql.Tx, *idem.Message) error {
		return func(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
			amount, err := strconv.ParseInt(string(msg.Payload), 10, 64)
			if err != nil {
				return idem.Permanent(err) // never passes: dead-letter it
			}
			_, err = tx.ExecContext(ctx, `INSERT INTO balances (account, amount) VALUES (?, ?)
				ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`, msg.AggregateID, sign*amount)
			return err
		}
	}
	return &idem.Handler[*sql.Tx]{
		Name: durable,
		Apply: idem.ByType(idem.Routes[*sql.Tx]{
			"FundsCredited": add(+1),
			"FundsDebited":  add(-1),
		}),
	}
}

// consume runs a worker until ctx ends: a durable pull consumer feeding
// idem.Consumer, which acknowledges only committed outcomes.
func consume(ctx context.Context, js natsjs.JetStream, drv *sqlite.Driver, hooks ...idem.Hook) error {
	quiet := slog.New(slog.DiscardHandler)
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: hooks, Logger: quiet})
	if err != nil {
		return err
	}
	consumer, err := idem.NewConsumer(proc, balances(), drv, &idem.ConsumerConfig{Logger: quiet})
	if err != nil {
		return err
	}
	c, err := jetstream.New(js, &jetstream.Config{Stream: streamName, Durable: durable, Handler: consumer,
		AckWait: 2 * time.Second, Logger: quiet}) // a dead worker's messages come back after 2 s
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// counter counts this process's outcomes; with die > 0 it kills the
// process at its die-th commit, before the adapter acknowledges it. It
// counts in recommitted the messages in committed that come back as
// duplicates.
type counter struct {
	applied, duplicates *atomic.Int64
	die                 int64
	committed           map[string]bool // read-only
	recommitted         *atomic.Int64
}

func (c *counter) OnOutcome(_ context.Context, ev *idem.OutcomeEvent) {
	switch ev.Outcome {
	case idem.Applied:
		if n := c.applied.Add(1); c.die > 0 && n == c.die {
			p, _ := os.FindProcess(os.Getpid())
			_ = p.Kill() // SIGKILL: no deferred function, no acknowledgement
			select {}
		}
	case idem.Duplicate:
		c.duplicates.Add(1)
		if c.committed[ev.MessageID] {
			c.recommitted.Add(1)
		}
	}
}

// waitDrained waits until the durable has nothing pending and nothing
// unacknowledged.
func waitDrained(ctx context.Context, js natsjs.JetStream, done <-chan error) error {
	deadline := time.After(60 * time.Second)
	for {
		select {
		case err := <-done:
			return fmt.Errorf("the worker stopped: %v", err)
		case <-deadline:
			return errors.New("the stream was not drained within 60 s")
		case <-time.After(100 * time.Millisecond):
		}
		c, err := js.Consumer(ctx, streamName, durable)
		if err != nil {
			continue // not created yet
		}
		info, err := c.Info(ctx)
		if err != nil {
			return err
		}
		if info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0 {
			return nil
		}
	}
}

// verify compares the store with the unique intended events.
func verify(ctx context.Context, db *sql.DB, drv *sqlite.Driver, evs []event, out io.Writer, note string) error {
	want := expected(evs)
	got := map[string]int64{}
	rows, err := db.QueryContext(ctx, `SELECT account, amount FROM balances`)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var a string
		var n int64
		if err := rows.Scan(&a, &n); err != nil {
			return err
		}
		got[a] = n
	}
	if err := rows.Err(); err != nil {
		return err
	}
	var problems []string
	for a, n := range want {
		if got[a] != n {
			problems = append(problems, fmt.Sprintf("%s: %d, want %d", a, got[a], n))
		}
	}
	for a := range got {
		if _, ok := want[a]; !ok {
			problems = append(problems, fmt.Sprintf("%s: unexpected account", a))
		}
	}
	var markers int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_processed WHERE handler = ?`, durable).Scan(&markers); err != nil {
		return err
	}
	if markers != len(evs) {
		problems = append(problems, fmt.Sprintf("%d markers, want one per unique event: %d", markers, len(evs)))
	}
	dls, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		return err
	}
	if len(dls) != 0 {
		problems = append(problems, fmt.Sprintf("%d dead letters, want none (first: %s)", len(dls), dls[0].Error))
	}
	if len(problems) > 0 {
		for _, p := range problems {
			fmt.Fprintln(out, "MISMATCH", p)
		}
		return fmt.Errorf("%d mismatches", len(problems))
	}
	fmt.Fprintf(out, "verified: %d balances and %d markers match the unique intended events (%s)\n", len(want), markers, note)
	return nil
}

// workerMain is a worker process started by -check: it consumes until its
// die-th commit and kills itself there.
func workerMain(dieAfter string) int {
	die, err := strconv.ParseInt(dieAfter, 10, 64)
	if err != nil || die < 1 {
		log.Printf("worker: %s=%q: want a positive count", envWorker, dieAfter)
		return 2
	}
	ctx := context.Background()
	nc, err := nats.Connect(os.Getenv(envNATSURL))
	if err != nil {
		log.Print("worker: ", err)
		return 1
	}
	js, err := natsjs.New(nc)
	if err != nil {
		log.Print("worker: ", err)
		return 1
	}
	db, drv, err := openStore(ctx, os.Getenv(envDatabase))
	if err != nil {
		log.Print("worker: ", err)
		return 1
	}
	defer db.Close()
	var applied, duplicates atomic.Int64
	err = consume(ctx, js, drv, &counter{applied: &applied, duplicates: &duplicates, die: die})
	log.Print("worker: the consumer stopped before its planned death: ", err)
	return 1
}
