// Command kafka-projection keeps a stock-level read model from a Kafka
// topic, in SQLite, in version-only mode: each SKU's events carry a
// sequence, and the ordering guard alone deduplicates, one row per SKU and
// no marker rows.
//
//	go run ./examples/kafka-projection                      # an in-process Kafka (kfake)
//	go run ./examples/kafka-projection -brokers host:9092   # your Kafka; a new topic per run
//	go run ./examples/kafka-projection -check               # kill a group member mid-stream
//
// It produces stock movements keyed by SKU, a tenth of them twice, and
// consumes them through idem.Consumer. With -check a worker process joins
// the consumer group first and is killed (SIGKILL) after processing a
// poll and before committing its offsets; a second member finishes. The
// stock levels and each SKU's last sequence are then compared with those
// computed from the unique intended events, and any difference exits with
// status 1.
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
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/sqlite"
)

const (
	handlerName = "stock-levels" // the handler's name, and the consumer group
	partitions  = 4
	skus        = 12
)

// Environment of a worker process started by -check.
const (
	envWorker   = "KAFKA_PROJECTION_WORKER" // applied messages after which the worker dies at its next offset commit
	envBrokers  = "KAFKA_PROJECTION_BROKERS"
	envTopic    = "KAFKA_PROJECTION_TOPIC"
	envDatabase = "KAFKA_PROJECTION_DB"
)

func main() {
	if n := os.Getenv(envWorker); n != "" {
		os.Exit(workerMain(n))
	}
	brokers := flag.String("brokers", "", "Kafka seed brokers, comma-separated; empty: an in-process cluster")
	check := flag.Bool("check", false, "kill a worker process mid-stream, then verify")
	events := flag.Int("events", 2000, "unique events to produce")
	flag.Parse()
	if err := run(context.Background(), *brokers, *events, *check, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kafka-projection:", err)
		os.Exit(1)
	}
}

// event is one intended stock movement of a SKU, with its sequence.
type event struct {
	id, typ, sku string
	seq, qty     int64
}

// intended returns n unique events, the same every run, numbered per SKU.
func intended(n int) []event {
	r := rand.New(rand.NewPCG(3, 4))
	next := map[string]int64{}
	evs := make([]event, n)
	for i := range evs {
		sku := fmt.Sprintf("sku-%02d", r.IntN(skus))
		next[sku]++
		typ := "StockReceived"
		if r.IntN(3) == 0 {
			typ = "StockShipped"
		}
		evs[i] = event{id: fmt.Sprintf("%s-%d", sku, next[sku]), typ: typ, sku: sku, seq: next[sku], qty: 1 + r.Int64N(50)}
	}
	return evs
}

func run(ctx context.Context, brokers string, n int, check bool, out io.Writer) error {
	start := time.Now()
	dir, err := os.MkdirTemp("", "idem-kafka-projection-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	// The brokers: yours, or an in-process Kafka-protocol cluster.
	topic := "inventory"
	var seeds []string
	if brokers == "" {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topic),
			kfake.GroupMinSessionTimeout(time.Second))
		if err != nil {
			return err
		}
		defer cluster.Close()
		seeds = cluster.ListenAddrs()
	} else {
		seeds = strings.Split(brokers, ",")
		topic = fmt.Sprintf("idem-example-inventory-%d", time.Now().UnixNano()) // a fresh topic, so old records do not count
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		return err
	}
	defer cl.Close()
	if brokers != "" {
		if err := createTopic(ctx, cl, topic); err != nil {
			return err
		}
	}

	dbPath := filepath.Join(dir, "stock.db")
	db, drv, err := openStore(ctx, dbPath)
	if err != nil {
		return err
	}
	defer db.Close()

	// Produce every event keyed by SKU (one partition per SKU, so its
	// events stay in order), a tenth of them twice, right after the first.
	evs := intended(n)
	var recs []*kgo.Record
	for i, e := range evs {
		copies := 1
		if i%10 == 3 {
			copies = 2
		}
		for range copies {
			recs = append(recs, &kgo.Record{Key: []byte(e.sku), Value: []byte(strconv.FormatInt(e.qty, 10)), Headers: []kgo.RecordHeader{
				{Key: kafka.HeaderID, Value: []byte(e.id)},
				{Key: kafka.HeaderType, Value: []byte(e.typ)},
				{Key: kafka.HeaderSeq, Value: []byte(strconv.FormatInt(e.seq, 10))},
			}})
		}
	}
	res := cl.ProduceSync(ctx, recs...)
	if err := res.FirstErr(); err != nil {
		return err
	}
	end := map[int32]int64{} // the next offset of each partition
	for _, r := range res {
		end[r.Record.Partition] = max(end[r.Record.Partition], r.Record.Offset+1)
	}
	fmt.Fprintf(out, "produced %d records of %d unique events to topic %s\n", len(recs), n, topic)

	var before map[string]int64 // each SKU's last sequence when the worker died
	if check {
		cmd := exec.CommandContext(ctx, os.Args[0])
		cmd.Env = append(os.Environ(), envWorker+"="+strconv.Itoa(n/4), envBrokers+"="+strings.Join(seeds, ","),
			envTopic+"="+topic, envDatabase+"="+dbPath)
		cmd.Stdout, cmd.Stderr = out, os.Stderr
		err := cmd.Run()
		ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
		if runtime.GOOS != "windows" && !(ws.Signaled() && ws.Signal() == syscall.SIGKILL) {
			return fmt.Errorf("the worker was to die of SIGKILL before an offset commit; it ended with %v", err)
		}
		if before, err = lastSeqs(ctx, db); err != nil {
			return err
		}
		var applied int64
		for _, s := range before {
			applied += s
		}
		fmt.Fprintf(out, "worker 1 killed by SIGKILL after applying %d events, before committing its offsets\n", applied)
	}

	// The last worker, in this process, until the group has committed
	// every partition's end.
	cnt := &counter{before: before}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- consume(cctx, seeds, topic, drv, cnt, 0) }()
	if err := waitCommitted(ctx, cl, end, done); err != nil {
		return err
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	if check {
		if cnt.redelivered.Load() == 0 {
			return errors.New("no record the killed worker had applied came back to the group")
		}
		fmt.Fprintf(out, "worker 2 got back %d records of events the killed worker had applied: none applied again\n", cnt.redelivered.Load())
	}
	return verify(ctx, db, drv, evs, out, fmt.Sprintf("the last worker applied %d, skipped %d as already applied; %s",
		cnt.applied.Load(), cnt.skipped.Load(), time.Since(start).Round(time.Millisecond)))
}

// createTopic creates topic on a real cluster.
func createTopic(ctx context.Context, cl *kgo.Client, topic string) error {
	req := kmsg.NewPtrCreateTopicsRequest()
	t := kmsg.NewCreateTopicsRequestTopic()
	t.Topic, t.NumPartitions, t.ReplicationFactor = topic, partitions, -1
	req.Topics = append(req.Topics, t)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return err
	}
	for _, t := range resp.Topics {
		if t.ErrorCode != 0 {
			return fmt.Errorf("create topic %s: error code %d", topic, t.ErrorCode)
		}
	}
	return nil
}

// openStore opens and migrates the SQLite store and creates the read model.
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
		_, err = db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, on_hand INTEGER NOT NULL)`)
	}
	if err != nil {
		db.Close()
		return nil, nil, err
	}
	return db, drv, nil
}

// stockLevels is the projection. Version-only: the guard row per SKU is
// the deduplication, so a redelivered or repeated event is Duplicate or
// Stale, and a gap (an event missing before this one) is a dead letter.
func stockLevels() *idem.Handler[*sql.Tx] {
	move := func(sign int64) func(context.Context, *sql.Tx, *idem.Message) error {
		return func(ctx context.Context, tx *sql.Tx, msg *idem.Message) error {
			qty, err := strconv.ParseInt(string(msg.Payload), 10, 64)
			if err != nil {
				return idem.Permanent(err)
			}
			_, err = tx.ExecContext(ctx, `INSERT INTO stock (sku, on_hand) VALUES (?, ?)
				ON CONFLICT (sku) DO UPDATE SET on_hand = on_hand + excluded.on_hand`, msg.AggregateID, sign*qty)
			return err
		}
	}
	return &idem.Handler[*sql.Tx]{
		Name: handlerName,
		Apply: idem.ByType(idem.Routes[*sql.Tx]{
			"StockReceived": move(+1),
			"StockShipped":  move(-1),
		}),
		Ordering: &idem.Ordering{VersionOnly: true, Gap: idem.GapFail},
	}
}

// consume runs one group member until ctx ends. With dieAfter > 0 the
// process kills itself at the first offset commit after it applied that
// many events: what it processed since its last commit comes back to the
// group.
func consume(ctx context.Context, seeds []string, topic string, drv *sqlite.Driver, cnt *counter, dieAfter int64) error {
	quiet := slog.New(slog.DiscardHandler)
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{cnt}, Logger: quiet})
	if err != nil {
		return err
	}
	consumer, err := idem.NewConsumer(proc, stockLevels(), drv, &idem.ConsumerConfig{Logger: quiet})
	if err != nil {
		return err
	}
	c, err := kafka.New(&kafka.Config{Brokers: seeds, Group: handlerName, Topics: []string{topic}, Handler: consumer,
		MaxPoll: 100, Logger: quiet,
		Options: []kgo.Opt{kgo.SessionTimeout(2 * time.Second), kgo.HeartbeatInterval(300 * time.Millisecond)},
		FaultHook: func(point string) {
			if dieAfter > 0 && point == kafka.FaultBeforeCommit && cnt.applied.Load() >= dieAfter {
				p, _ := os.FindProcess(os.Getpid())
				_ = p.Kill() // SIGKILL: the offsets are never committed
				select {}
			}
		}})
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// counter counts a worker's outcomes. With before set (the SKUs' last
// sequences when a worker was killed), it counts the deliveries of events
// that worker had applied.
type counter struct {
	applied, skipped, redelivered atomic.Int64
	before                        map[string]int64 // read-only
}

func (c *counter) OnOutcome(_ context.Context, ev *idem.OutcomeEvent) {
	switch ev.Outcome {
	case idem.Applied:
		c.applied.Add(1)
	case idem.Duplicate, idem.Stale:
		c.skipped.Add(1)
		// IDs are "<sku>-<seq>".
		if i := strings.LastIndexByte(ev.MessageID, '-'); i > 0 && c.before != nil {
			if seq, err := strconv.ParseInt(ev.MessageID[i+1:], 10, 64); err == nil && seq <= c.before[ev.MessageID[:i]] {
				c.redelivered.Add(1)
			}
		}
	}
}

// waitCommitted waits until the group's committed offsets reach end.
func waitCommitted(ctx context.Context, cl *kgo.Client, end map[int32]int64, done <-chan error) error {
	deadline := time.After(60 * time.Second)
	for {
		select {
		case err := <-done:
			return fmt.Errorf("the worker stopped: %v", err)
		case <-deadline:
			return errors.New("the group did not commit every record within 60 s")
		case <-time.After(100 * time.Millisecond):
		}
		req := kmsg.NewPtrOffsetFetchRequest()
		req.Group = handlerName
		resp, err := req.RequestWith(ctx, cl)
		if err != nil {
			return err
		}
		committed := map[int32]int64{}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				committed[p.Partition] = p.Offset
			}
		}
		caughtUp := true
		for p, e := range end {
			caughtUp = caughtUp && committed[p] >= e
		}
		if caughtUp {
			return nil
		}
	}
}

// lastSeqs reads the guard's last applied sequence of each SKU.
func lastSeqs(ctx context.Context, db *sql.DB) (map[string]int64, error) {
	rows, err := db.QueryContext(ctx, `SELECT aggregate_id, last_seq FROM idem_sequences WHERE handler = ?`, handlerName)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[string]int64{}
	for rows.Next() {
		var sku string
		var seq int64
		if err := rows.Scan(&sku, &seq); err != nil {
			return nil, err
		}
		m[sku] = seq
	}
	return m, rows.Err()
}

// verify compares the store with the unique intended events.
func verify(ctx context.Context, db *sql.DB, drv *sqlite.Driver, evs []event, out io.Writer, note string) error {
	wantStock, wantSeq := map[string]int64{}, map[string]int64{}
	for _, e := range evs {
		if e.typ == "StockShipped" {
			wantStock[e.sku] -= e.qty
		} else {
			wantStock[e.sku] += e.qty
		}
		wantSeq[e.sku] = max(wantSeq[e.sku], e.seq)
	}
	gotStock := map[string]int64{}
	rows, err := db.QueryContext(ctx, `SELECT sku, on_hand FROM stock`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var sku string
		var n int64
		if err := rows.Scan(&sku, &n); err != nil {
			rows.Close()
			return err
		}
		gotStock[sku] = n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	gotSeq, err := lastSeqs(ctx, db)
	if err != nil {
		return err
	}
	var problems []string
	for sku := range wantStock {
		if gotStock[sku] != wantStock[sku] {
			problems = append(problems, fmt.Sprintf("%s: %d on hand, want %d", sku, gotStock[sku], wantStock[sku]))
		}
		if gotSeq[sku] != wantSeq[sku] {
			problems = append(problems, fmt.Sprintf("%s: last sequence %d, want %d", sku, gotSeq[sku], wantSeq[sku]))
		}
	}
	if len(gotStock) != len(wantStock) || len(gotSeq) != len(wantSeq) {
		problems = append(problems, fmt.Sprintf("%d SKUs in stock and %d guard rows, want %d", len(gotStock), len(gotSeq), len(wantStock)))
	}
	var markers int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_processed`).Scan(&markers); err != nil {
		return err
	}
	if markers != 0 {
		problems = append(problems, fmt.Sprintf("%d marker rows, want none in version-only mode", markers))
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
	fmt.Fprintf(out, "verified: %d stock levels and their sequences match the unique intended events, with no marker rows (%s)\n", len(wantStock), note)
	return nil
}

// workerMain is a worker process started by -check.
func workerMain(dieAfter string) int {
	die, err := strconv.ParseInt(dieAfter, 10, 64)
	if err != nil || die < 1 {
		log.Printf("worker: %s=%q: want a positive count", envWorker, dieAfter)
		return 2
	}
	ctx := context.Background()
	db, drv, err := openStore(ctx, os.Getenv(envDatabase))
	if err != nil {
		log.Print("worker: ", err)
		return 1
	}
	defer db.Close()
	err = consume(ctx, strings.Split(os.Getenv(envBrokers), ","), os.Getenv(envTopic), drv, &counter{}, die)
	log.Print("worker: the consumer stopped before its planned death: ", err)
	return 1
}
