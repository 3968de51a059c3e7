package main

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/sqlite"
)

const (
	// demoHandler is the handler name the demo's markers are stored under.
	demoHandler = "demo.balances"
	// demoBurstRate is the fraction of batches handed to 2–3 workers at
	// the same time.
	demoBurstRate = 0.05
	// demoMaxAttempts bounds the attempts at one batch before the demo
	// gives up (it never skips a batch).
	demoMaxAttempts = 5
	// demoRetryDelay is the pause before the first retry; it grows
	// linearly with the attempt.
	demoRetryDelay = 50 * time.Millisecond
	// demoUpsertRows bounds the rows of one upsert statement (SQLite
	// limits the number of bound parameters).
	demoUpsertRows = 500
	// demoShowMismatches is how many mismatching accounts a failure lists.
	demoShowMismatches = 10
	// demoSeedStream decorrelates the stream generator from the events.
	demoSeedStream = 0x1de3
)

// demoConfig holds the demo's flags.
type demoConfig struct {
	events    int
	dupRate   float64
	conflicts int
	accounts  int
	workers   int
	batch     int
	db        string
	seed      uint64
	broker    string // "nats" (embedded JetStream) or "none" (direct batches)
	shuffle   bool   // per-account sequences, reordered delivery, ordering guard
	lease     bool   // lease mode: welcome emails through idem.LeaseConsumer
	window    int    // reordering window of --shuffle
	noGuard   bool   // tests only: run --shuffle without the ordering guard
}

// demoCommand returns the "demo" subcommand.
func demoCommand() *command {
	return &command{
		name:     "demo",
		synopsis: "[flags]",
		summary:  "run an account-balance projection over a duplicate-heavy stream and verify it",
		help: `Demo shows idem's guarantee on a SQLite database: an account-balance projection
receives every intended event at least once, many of them several times, and
still applies each exactly once.

It generates --events unique credits and debits over --accounts accounts from
--seed, with --dup-rate of them delivered again later and --conflicts
deliveries that reuse an existing ID with a different payload (dead-lettered
as conflicts, never applied).

By default (--broker nats) the deliveries are published to an embedded NATS
JetStream server, nothing to install, and consumed by three consumers sharing
one durable through idem.Consumer; two consumers are killed mid-stream by
closing their connections, and JetStream redelivers what they had not
acknowledged to the others and to their replacements. --broker kafka does the
same over an in-process Kafka-protocol cluster, where the killed group
members crash after processing and before committing. --broker rabbitmq uses
the RabbitMQ server at IDEM_RABBITMQ_URL (default amqp://guest:guest@127.0.0.1:5672/)
and a quorum queue of its own, deleted afterwards; killed consumers have their
TCP connections cut. Each message is its own
transaction (synchronous=FULL, so expect a few thousand per second).

With --broker none, --workers goroutines process batches of --batch messages
with Processor.ProcessBatch, some batches handed to 2–3 workers at once
(concurrent duplicate deliveries); a failed batch is retried, never dropped.
--shuffle adds per-account sequences and reorders deliveries (see its flag).
A flag the chosen demo does not read (--workers over a broker, --window
without --shuffle) is refused rather than ignored.

--lease shows lease mode, for effects outside the database: a welcome email
per signup (2,000 by default, --dup-rate of them published twice) sent
through idem.LeaseConsumer to a mail service that refuses every 25th call,
over the broker, with consumers killed as above. It checks that every signup
got exactly one email.

At the end every balance is compared with the one computed from the unique
intended events (not from the delivered stream), and the counts of applied
deliveries and conflicts are checked. Exit 1 if anything differs.

The database lives in a temporary directory that is removed afterwards,
unless --db names a (new) file to keep. SQLite runs with synchronous=FULL:
every commit is durable, which is why --broker none batches.`,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			cfg := &demoConfig{}
			eventsSet := false // else the broker chooses the default
			fs.Func("events", "number of unique intended `events` (default 10,000 over a broker, 100,000 with --broker none or --shuffle, 2,000 with --lease)", func(v string) error {
				n, err := strconv.Atoi(v)
				if err != nil {
					return fmt.Errorf("not a whole number: %q", v)
				}
				cfg.events, eventsSet = n, true
				return nil
			})
			fs.StringVar(&cfg.broker, "broker", "nats", "`broker`: nats (an embedded NATS JetStream server), kafka (an in-process Kafka-protocol cluster), rabbitmq (the RabbitMQ server at IDEM_RABBITMQ_URL, default amqp://guest:guest@127.0.0.1:5672/), or none (batches handed to workers directly); with a broker, consumers are killed mid-stream")
			fs.Float64Var(&cfg.dupRate, "dup-rate", 0.10, "fraction of events redelivered later in the stream, 0 to 1")
			fs.IntVar(&cfg.conflicts, "conflicts", 5, "deliveries that reuse an existing ID with a different payload")
			fs.IntVar(&cfg.accounts, "accounts", 1000, "number of `accounts`")
			fs.IntVar(&cfg.workers, "workers", 4, "concurrent `workers`")
			fs.IntVar(&cfg.batch, "batch", 100, "messages per batch (one transaction each)")
			fs.StringVar(&cfg.db, "db", "", "SQLite database `file` to create and keep (default: a temporary file, removed)")
			fs.Uint64Var(&cfg.seed, "seed", 1, "random `seed`: the same seed gives the same events and stream")
			fs.BoolVar(&cfg.shuffle, "shuffle", false, "give every account's events a sequence, reorder deliveries and let the ordering guard hold early ones; verifies order too (without a broker)")
			fs.IntVar(&cfg.window, "window", 32, "with --shuffle: deliveries are reordered within windows of this `size`")
			fs.BoolVar(&cfg.lease, "lease", false, "lease mode: a welcome email per signup through idem.LeaseConsumer, to a mail service that refuses some calls; verifies one email per signup (--broker nats, kafka or rabbitmq)")
			return func(ctx context.Context, e *env, args []string) error {
				if err := noArgs(args); err != nil {
					return err
				}
				if !eventsSet {
					cfg.events = 10000
					switch {
					case cfg.lease:
						cfg.events = 2000 // two commits per message: claim, done
					case cfg.broker == "none" || cfg.shuffle:
						cfg.events = 100000
					}
				}
				if err := cfg.check(); err != nil {
					return err
				}
				given := map[string]bool{}
				fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
				if cfg.shuffle && given["broker"] && cfg.broker != "none" {
					return usagef("--shuffle hands the reordered deliveries to workers directly, without a broker: drop --broker %s", cfg.broker)
				}
				if err := cfg.checkIgnored(given); err != nil {
					return err
				}
				switch {
				case cfg.lease:
					return runLeaseDemo(ctx, e, cfg)
				case cfg.shuffle:
					return runShuffleDemo(ctx, e, cfg)
				case cfg.broker == "nats", cfg.broker == "kafka", cfg.broker == "rabbitmq":
					return runBrokerDemo(ctx, e, cfg)
				}
				return runDemo(ctx, e, cfg)
			}
		},
	}
}

// check validates the flags; problems are usage errors.
func (c *demoConfig) check() error {
	switch {
	case c.broker != "nats" && c.broker != "kafka" && c.broker != "rabbitmq" && c.broker != "none":
		return usagef("--broker must be nats, kafka, rabbitmq or none, got %q", c.broker)
	case c.events < 1:
		return usagef("--events must be at least 1, got %d", c.events)
	case c.accounts < 1:
		return usagef("--accounts must be at least 1, got %d", c.accounts)
	case c.workers < 1:
		return usagef("--workers must be at least 1, got %d", c.workers)
	case c.batch < 1:
		return usagef("--batch must be at least 1, got %d", c.batch)
	case c.window < 1:
		return usagef("--window must be at least 1, got %d", c.window)
	case c.lease && (c.broker == "none" || c.shuffle):
		return usagef("--lease runs over a broker (--broker nats, kafka or rabbitmq), without --shuffle")
	case math.IsNaN(c.dupRate) || c.dupRate < 0 || c.dupRate > 1:
		return usagef("--dup-rate must be between 0 and 1, got %v", c.dupRate)
	case c.conflicts < 0 || (c.conflicts > c.events && !c.lease && !c.shuffle):
		// --lease and --shuffle inject no conflicts: the default 5 must
		// not refuse their --events 3.
		return usagef("--conflicts must be between 0 and --events (%d), got %d", c.events, c.conflicts)
	}
	if c.db != "" {
		if _, err := os.Stat(c.db); err == nil {
			return usagef("--db %s already exists; the demo needs a new database (remove the file or pick another path)", c.db)
		}
	}
	return nil
}

// checkIgnored refuses the flags in given that the demo c selects does
// not read, rather than run a demo other than the one asked for.
func (c *demoConfig) checkIgnored(given map[string]bool) error {
	var mode string
	var ignored []string
	switch {
	case c.lease:
		mode, ignored = "--lease (one email per signup, three consumers)", []string{"accounts", "conflicts", "batch", "workers", "window"}
	case c.shuffle:
		mode, ignored = "--shuffle (no conflicts, one delivery at a time)", []string{"conflicts", "batch"}
	case c.broker == "none":
		mode, ignored = "--broker none (--window goes with --shuffle)", []string{"window"}
	default:
		mode, ignored = "--broker "+c.broker+" (three consumers share the stream; --window goes with --shuffle)", []string{"workers", "window"}
	}
	for _, name := range ignored {
		if given[name] {
			return usagef("--%s does not apply to %s", name, mode)
		}
	}
	return nil
}

// demoEvent is one intended credit (positive) or debit (negative).
type demoEvent struct {
	ID      string
	Account int
	Amount  int64
}

// demoPayload is the JSON body of a demo message.
type demoPayload struct {
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
}

// demoNames formats account names and event IDs with widths that keep them
// sortable.
type demoNames struct {
	accountWidth, idWidth int
}

// newDemoNames sizes the names for cfg.
func newDemoNames(cfg *demoConfig) demoNames {
	return demoNames{
		accountWidth: max(4, len(strconv.Itoa(cfg.accounts-1))),
		idWidth:      max(6, len(strconv.Itoa(cfg.events-1))),
	}
}

// account returns the name of account i, such as "acct-0042".
func (n demoNames) account(i int) string { return fmt.Sprintf("acct-%0*d", n.accountWidth, i) }

// id returns the ID of event i, such as "evt-000123".
func (n demoNames) id(i int) string { return fmt.Sprintf("evt-%0*d", n.idWidth, i) }

// demoMessage builds a new delivery of the given account and amount.
func demoMessage(names demoNames, id string, account int, amount int64) *idem.Message {
	acct := names.account(account)
	payload, _ := json.Marshal(demoPayload{Account: acct, Amount: amount}) // cannot fail
	typ := "FundsCredited"
	if amount < 0 {
		typ = "FundsDebited"
	}
	return &idem.Message{ID: id, Stream: "demo.accounts", Type: typ, AggregateID: acct, Payload: payload}
}

// demoEvents generates cfg.events unique intended events from cfg.seed.
func demoEvents(cfg *demoConfig, names demoNames) []demoEvent {
	r := rand.New(rand.NewPCG(cfg.seed, 0))
	events := make([]demoEvent, cfg.events)
	for i := range events {
		events[i] = demoEvent{ID: names.id(i), Account: r.IntN(cfg.accounts), Amount: demoAmount(r)}
	}
	return events
}

// demoAmount draws a credit (60%) or a debit (40%).
func demoAmount(r *rand.Rand) int64 {
	if r.IntN(10) < 6 {
		return 1 + r.Int64N(1000)
	}
	return -(1 + r.Int64N(500))
}

// demoBatch is one batch of deliveries as a worker receives it.
type demoBatch struct {
	msgs []*idem.Message
	// copies is how many workers receive the batch at the same time: 1,
	// or 2–3 for a burst of concurrent duplicate deliveries.
	copies int
	// deps are earlier batches that must have committed before this one
	// is handed out: they hold the original of a conflicting delivery in
	// this batch, which must win.
	deps []int
	// done is closed when the first copy of the batch has been processed.
	done     chan struct{}
	doneOnce sync.Once
}

// demoStream is the delivered stream and what it is made of.
type demoStream struct {
	batches       []*demoBatch
	redeliveries  int // later redeliveries with the same payload
	conflicts     int // deliveries of an existing ID with another payload
	burstBatches  int // batches handed to several workers at once
	burstExtra    int // extra deliveries those bursts add
	deliveries    int // every delivery, all of the above included
	conflictIDs   map[string]bool
	firstDelivery int // deliveries that are the first of their event
}

// buildDemoStream lays out the delivered stream deterministically from the
// seed: every event once, a --dup-rate share redelivered later, --conflicts
// conflicting deliveries placed after their original, cut into batches of
// which a few become bursts.
func buildDemoStream(cfg *demoConfig, names demoNames, events []demoEvent) *demoStream {
	r := rand.New(rand.NewPCG(cfg.seed, demoSeedStream))
	n := len(events)
	window := float64(max(n/4, 1)) // how far after its original a redelivery may land

	type delivery struct {
		key      float64 // position in the stream
		origin   int     // index of the intended event
		conflict bool
		msg      *idem.Message
	}
	nDup := int(math.Round(float64(n) * cfg.dupRate))
	dels := make([]delivery, 0, n+nDup+cfg.conflicts)
	for i, ev := range events {
		dels = append(dels, delivery{key: float64(i), origin: i, msg: demoMessage(names, ev.ID, ev.Account, ev.Amount)})
	}
	for _, i := range r.Perm(n)[:nDup] {
		ev := events[i]
		dels = append(dels, delivery{key: float64(i) + 1 + r.Float64()*window, origin: i, msg: demoMessage(names, ev.ID, ev.Account, ev.Amount)})
	}
	s := &demoStream{redeliveries: nDup, conflicts: cfg.conflicts, firstDelivery: n, conflictIDs: make(map[string]bool, cfg.conflicts)}
	for _, i := range r.Perm(n)[:cfg.conflicts] {
		ev := events[i]
		acct, amt := r.IntN(cfg.accounts), demoAmount(r)
		if acct == ev.Account && amt == ev.Amount {
			amt++
		}
		s.conflictIDs[ev.ID] = true
		dels = append(dels, delivery{key: float64(i) + 1 + r.Float64()*window, origin: i, conflict: true, msg: demoMessage(names, ev.ID, acct, amt)})
	}
	slices.SortStableFunc(dels, func(a, b delivery) int { return cmp.Compare(a.key, b.key) })

	// An event's original has the smallest key of its deliveries, so the
	// first batch an origin appears in holds the payload that must win.
	firstBatch := make([]int, n)
	for i := range firstBatch {
		firstBatch[i] = -1
	}
	hasConflict := map[int]bool{}
	for lo := 0; lo < len(dels); lo += cfg.batch {
		bi := len(s.batches)
		b := &demoBatch{copies: 1, done: make(chan struct{})}
		for _, d := range dels[lo:min(lo+cfg.batch, len(dels))] {
			b.msgs = append(b.msgs, d.msg)
			if firstBatch[d.origin] < 0 {
				firstBatch[d.origin] = bi
			}
			if d.conflict {
				hasConflict[bi] = true
				// In the same batch the original comes first, and a
				// batch decides later occurrences against the first.
				if dep := firstBatch[d.origin]; dep < bi && !slices.Contains(b.deps, dep) {
					b.deps = append(b.deps, dep)
				}
			}
		}
		s.batches = append(s.batches, b)
	}

	// Bursts: the same batch to 2–3 workers at once. Batches with a
	// conflicting delivery stay single so each conflict is reported once.
	if cfg.workers >= 2 {
		nBurst := int(math.Round(float64(len(s.batches)) * demoBurstRate))
		for _, bi := range r.Perm(len(s.batches)) {
			if s.burstBatches == nBurst {
				break
			}
			if hasConflict[bi] {
				continue
			}
			b := s.batches[bi]
			b.copies = min(2+r.IntN(2), cfg.workers)
			s.burstBatches++
			s.burstExtra += (b.copies - 1) * len(b.msgs)
		}
	}
	s.deliveries = len(dels) + s.burstExtra
	return s
}

// demoCounts accumulates the outcomes the workers see.
type demoCounts struct {
	applied, duplicates, conflicts, retries atomic.Int64
	deadLetters                             atomic.Int64

	mu          sync.Mutex
	conflictIDs map[string]int
}

// add counts the outcomes of one processed batch.
func (c *demoCounts) add(msgs []*idem.Message, outs []idem.Outcome) error {
	for i, o := range outs {
		switch o {
		case idem.Applied:
			c.applied.Add(1)
		case idem.Duplicate:
			c.duplicates.Add(1)
		case idem.Conflict:
			c.conflicts.Add(1)
			c.mu.Lock()
			c.conflictIDs[msgs[i].ID]++
			c.mu.Unlock()
		default:
			return fmt.Errorf("message %q: unexpected outcome %v", msgs[i].ID, o)
		}
	}
	return nil
}

// burstBarrier releases the copies of a burst together, so that they are
// processed concurrently rather than one after the other.
type burstBarrier struct {
	remaining atomic.Int32
	ready     chan struct{}
}

// newBurstBarrier returns a barrier for n copies.
func newBurstBarrier(n int) *burstBarrier {
	b := &burstBarrier{ready: make(chan struct{})}
	b.remaining.Store(int32(n))
	return b
}

// wait blocks until every copy has arrived; false if ctx ended first.
func (b *burstBarrier) wait(ctx context.Context) bool {
	if b.remaining.Add(-1) == 0 {
		close(b.ready)
	}
	select {
	case <-b.ready:
		return true
	case <-ctx.Done():
		return false
	}
}

// demoJob is one copy of a batch handed to a worker.
type demoJob struct {
	batch   *demoBatch
	barrier *burstBarrier // nil unless the batch is a burst
}

// demoBalancesDDL creates the demo's projection.
const demoBalancesDDL = `CREATE TABLE demo_balances (account TEXT PRIMARY KEY, amount INTEGER NOT NULL) WITHOUT ROWID`

// openDemoDB opens the demo's SQLite database at path with idem's settings,
// migrates idem's tables and creates the demo's own table with ddl.
func openDemoDB(ctx context.Context, path, ddl string) (*sql.DB, *sqlite.Driver, error) {
	db, err := sqlite.Open(path, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("open demo database: %w", err)
	}
	drv, err := sqlite.New(db, nil)
	if err == nil {
		err = drv.Migrate(ctx)
	}
	if err == nil {
		_, err = db.ExecContext(ctx, ddl)
	}
	if err != nil {
		db.Close()
		return nil, nil, fmt.Errorf("set up demo database: %w", err)
	}
	return db, drv, nil
}

// newDemoProcessor returns the demo's processor with a StatsRecorder
// hook, so that `idem stats` on a kept demo database shows duplicates and
// stale deliveries. Flush the recorder before the report.
func newDemoProcessor(drv *sqlite.Driver, logger *slog.Logger) (*idem.Processor[*sql.Tx], *idem.StatsRecorder, error) {
	rec, err := idem.NewStatsRecorder(drv, logger)
	if err != nil {
		return nil, nil, err
	}
	proc, err := idem.NewProcessor(drv, &idem.Config{Logger: logger, Hooks: []idem.Hook{rec}})
	if err != nil {
		return nil, nil, fmt.Errorf("demo processor: %w", err)
	}
	return proc, rec, nil
}

// runDemo runs the demo and prints its report.
func runDemo(ctx context.Context, e *env, cfg *demoConfig) error {
	path := cfg.db
	if path == "" {
		dir, err := os.MkdirTemp("", "idem-demo-")
		if err != nil {
			return fmt.Errorf("create temporary directory: %w", err)
		}
		defer os.RemoveAll(dir)
		path = filepath.Join(dir, "demo.db")
	}
	db, drv, err := openDemoDB(ctx, path, demoBalancesDDL)
	if err != nil {
		return err
	}
	defer db.Close()
	logger := slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	proc, rec, err := newDemoProcessor(drv, logger)
	if err != nil {
		return err
	}

	names := newDemoNames(cfg)
	events := demoEvents(cfg, names)
	stream := buildDemoStream(cfg, names, events)

	fmt.Fprintf(e.stdout, "idem demo: account balances on SQLite (synchronous=FULL) at %s\n", path)
	fmt.Fprintf(e.stdout, "  %d intended events over %d accounts (seed %d)\n", len(events), cfg.accounts, cfg.seed)
	fmt.Fprintf(e.stdout, "  stream: %d first deliveries + %d redeliveries + %d conflicting payloads + %d burst copies = %d deliveries\n",
		stream.firstDelivery, stream.redeliveries, stream.conflicts, stream.burstExtra, stream.deliveries)
	fmt.Fprintf(e.stdout, "  %d workers, batches of %d: %d batches, %d of them handed to 2–3 workers at once\n",
		cfg.workers, cfg.batch, len(stream.batches), stream.burstBatches)

	counts := &demoCounts{conflictIDs: map[string]int{}}
	start := time.Now()
	if err := processDemoStream(ctx, e.stdout, proc, drv, cfg.workers, stream, counts); err != nil {
		return err
	}
	elapsed := time.Since(start)
	if err := rec.Flush(ctx); err != nil {
		return err
	}

	rep, err := verifyDemo(ctx, db, cfg, names, events)
	if err != nil {
		return err
	}
	ok := printDemoReport(e.stdout, cfg, stream, counts, rep, elapsed)
	if cfg.db != "" {
		fmt.Fprintf(e.stdout, "database kept at %s (table demo_balances; markers in idem_processed, handler %q)\n", cfg.db, demoHandler)
	}
	if !ok {
		return errors.New("verification failed: see the report above")
	}
	return nil
}

// processDemoStream hands the stream's batches to workers and waits until
// every batch has been processed, or returns the first error.
func processDemoStream(ctx context.Context, out io.Writer, proc *idem.Processor[*sql.Tx], dl driver.DeadLetterStore, workers int, stream *demoStream, counts *demoCounts) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	h := demoBalanceHandler()
	// Conflicts go through a Consumer, as a broker delivery would: it
	// dead-letters them, so 'idem dlq list' shows them afterwards.
	consumer, err := idem.NewConsumer(proc, h, dl, &idem.ConsumerConfig{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	prog := newProgress(out, int64(stream.deliveries), "deliveries")

	jobs := make(chan demoJob)
	go func() {
		defer close(jobs)
		for _, b := range stream.batches {
			for _, dep := range b.deps {
				select {
				case <-stream.batches[dep].done:
				case <-ctx.Done():
					return
				}
			}
			var bar *burstBarrier
			if b.copies > 1 {
				bar = newBurstBarrier(b.copies)
			}
			for range b.copies {
				select {
				case jobs <- demoJob{batch: b, barrier: bar}:
				case <-ctx.Done():
					return
				}
			}
		}
	}()

	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for job := range jobs {
				if job.barrier != nil && !job.barrier.wait(ctx) {
					return
				}
				b := job.batch
				outs, err := processDemoBatch(ctx, proc, h, b.msgs, counts)
				if err == nil {
					err = counts.add(b.msgs, outs)
				}
				for i, o := range outs {
					if o != idem.Conflict || err != nil {
						continue
					}
					if v := consumer.HandleDelivery(ctx, &idem.Delivery{Msg: b.msgs[i], Source: "demo", Attempt: 1}); v.DeadLettered {
						counts.deadLetters.Add(1)
					} else {
						err = fmt.Errorf("conflict %q was not dead-lettered: %v", b.msgs[i].ID, v.Err)
					}
				}
				if err != nil {
					cancel(err)
					return
				}
				b.doneOnce.Do(func() { close(b.done) })
				prog.Add(len(b.msgs))
			}
		})
	}
	wg.Wait()
	prog.Finish()
	if err := context.Cause(ctx); err != nil {
		return err
	}
	return nil
}

// processDemoBatch processes one batch, retrying it after a short pause
// when it fails with a retriable error. Every attempt is a fresh
// transaction, so a retry never double-applies.
func processDemoBatch(ctx context.Context, proc *idem.Processor[*sql.Tx], h *idem.Handler[*sql.Tx], msgs []*idem.Message, counts *demoCounts) ([]idem.Outcome, error) {
	for attempt := 1; ; attempt++ {
		outs, err := proc.ProcessBatch(ctx, h, msgs)
		if err == nil {
			return outs, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		if idem.IsPermanent(err) || attempt == demoMaxAttempts {
			return nil, fmt.Errorf("batch starting at %q failed after %s: %w", msgs[0].ID, plural(attempt, "attempt"), err)
		}
		counts.retries.Add(1)
		select {
		case <-time.After(time.Duration(attempt) * demoRetryDelay):
		case <-ctx.Done():
			return nil, err
		}
	}
}

// demoBalanceHandler returns the projection: it sums the new messages of a
// batch per account and upserts the sums, in account order, with the
// transaction that holds the markers.
func demoBalanceHandler() *idem.Handler[*sql.Tx] {
	return &idem.Handler[*sql.Tx]{
		Name: demoHandler,
		ApplyBatch: func(ctx context.Context, tx *sql.Tx, msgs []*idem.Message) error {
			sums := make(map[string]int64)
			for _, m := range msgs {
				var p demoPayload
				if err := json.Unmarshal(m.Payload, &p); err != nil {
					return idem.Permanent(fmt.Errorf("message %q: decode payload: %w", m.ID, err))
				}
				if p.Account == "" {
					return idem.Permanent(fmt.Errorf("message %q: payload has no account", m.ID))
				}
				sums[p.Account] += p.Amount
			}
			accounts := make([]string, 0, len(sums))
			for a := range sums {
				accounts = append(accounts, a)
			}
			slices.Sort(accounts)
			return upsertBalances(ctx, tx, accounts, sums)
		},
	}
}

// upsertBalances adds sums[a] to the balance of every account a, with one
// multi-row upsert per demoUpsertRows accounts.
func upsertBalances(ctx context.Context, tx *sql.Tx, accounts []string, sums map[string]int64) error {
	for lo := 0; lo < len(accounts); lo += demoUpsertRows {
		chunk := accounts[lo:min(lo+demoUpsertRows, len(accounts))]
		var q strings.Builder
		q.WriteString(`INSERT INTO demo_balances (account, amount) VALUES `)
		args := make([]any, 0, 2*len(chunk))
		for i, a := range chunk {
			if i > 0 {
				q.WriteString(", ")
			}
			q.WriteString("(?, ?)")
			args = append(args, a, sums[a])
		}
		q.WriteString(` ON CONFLICT (account) DO UPDATE SET amount = amount + excluded.amount`)
		if _, err := tx.ExecContext(ctx, q.String(), args...); err != nil {
			return fmt.Errorf("upsert balances: %w", err)
		}
	}
	return nil
}

// demoVerification is the result of the independent check.
type demoVerification struct {
	accountsChecked int
	mismatches      []string // "acct-0042: got 10, want 7", sorted
	markers         int64
}

// verifyDemo compares every account's stored balance with the balance the
// unique intended events give, and counts the handler's markers.
func verifyDemo(ctx context.Context, db *sql.DB, cfg *demoConfig, names demoNames, events []demoEvent) (*demoVerification, error) {
	want := make([]int64, cfg.accounts)
	for _, ev := range events {
		want[ev.Account] += ev.Amount
	}
	got, err := readBalances(ctx, db)
	if err != nil {
		return nil, err
	}
	v := &demoVerification{}
	for i, w := range want {
		a := names.account(i)
		g := got[a] // an account without a row has balance 0
		delete(got, a)
		v.accountsChecked++
		if g != w {
			v.mismatches = append(v.mismatches, fmt.Sprintf("%s: got %d, want %d", a, g, w))
		}
	}
	for a, g := range got {
		v.mismatches = append(v.mismatches, fmt.Sprintf("%s: got %d, want no such account", a, g))
	}
	slices.Sort(v.mismatches)
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM "idem_processed" WHERE handler = ?`, demoHandler).Scan(&v.markers); err != nil {
		return nil, fmt.Errorf("count markers: %w", err)
	}
	return v, nil
}

// readBalances returns every row of demo_balances.
func readBalances(ctx context.Context, db *sql.DB) (map[string]int64, error) {
	rows, err := db.QueryContext(ctx, `SELECT account, amount FROM demo_balances`)
	if err != nil {
		return nil, fmt.Errorf("read balances: %w", err)
	}
	defer rows.Close()
	m := make(map[string]int64)
	for rows.Next() {
		var a string
		var n int64
		if err := rows.Scan(&a, &n); err != nil {
			return nil, fmt.Errorf("read balances: %w", err)
		}
		m[a] = n
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read balances: %w", err)
	}
	return m, nil
}

// printDemoReport prints the summary table and the verification line, and
// reports whether verification passed.
func printDemoReport(w io.Writer, cfg *demoConfig, s *demoStream, c *demoCounts, v *demoVerification, elapsed time.Duration) bool {
	applied, dups, conflicts := c.applied.Load(), c.duplicates.Load(), c.conflicts.Load()
	rate := float64(s.deliveries) / max(elapsed.Seconds(), 1e-9)
	row := func(label string, value any) { fmt.Fprintf(w, "  %-20s %12v\n", label, value) }
	fmt.Fprintln(w)
	row("events intended", cfg.events)
	row("deliveries", s.deliveries)
	row("applied", applied)
	row("duplicates skipped", dups)
	row("conflicts", conflicts)
	row("dead-lettered", c.deadLetters.Load())
	row("batch retries", c.retries.Load())
	row("markers stored", v.markers)
	row("accounts checked", v.accountsChecked)
	row("mismatches", len(v.mismatches))
	row("elapsed", elapsed.Round(time.Millisecond))
	fmt.Fprintf(w, "  %-20s %12.0f  (deliveries per second)\n", "events/s", rate)
	fmt.Fprintln(w)

	var problems []string
	if n := len(v.mismatches); n > 0 {
		shown := v.mismatches[:min(n, demoShowMismatches)]
		more := ""
		if n > len(shown) {
			more = fmt.Sprintf(", … %d more", n-len(shown))
		}
		problems = append(problems, fmt.Sprintf("%d of %d balances differ from the unique intended events (%s%s)",
			n, v.accountsChecked, strings.Join(shown, "; "), more))
	}
	if applied != int64(cfg.events) {
		problems = append(problems, fmt.Sprintf("applied %d deliveries, want %d (one per intended event)", applied, cfg.events))
	}
	if v.markers != int64(cfg.events) {
		problems = append(problems, fmt.Sprintf("%d markers stored, want %d", v.markers, cfg.events))
	}
	if n := c.deadLetters.Load(); n != conflicts {
		problems = append(problems, fmt.Sprintf("%d conflicts dead-lettered, want all %d", n, conflicts))
	}
	if conflicts != int64(s.conflicts) {
		problems = append(problems, fmt.Sprintf("%d conflicts reported, want the %d injected", conflicts, s.conflicts))
	}
	c.mu.Lock()
	var wrongIDs []string
	for id, n := range c.conflictIDs {
		if !s.conflictIDs[id] || n != 1 {
			wrongIDs = append(wrongIDs, fmt.Sprintf("%s×%d", id, n))
		}
	}
	c.mu.Unlock()
	if len(wrongIDs) > 0 {
		slices.Sort(wrongIDs)
		problems = append(problems, fmt.Sprintf("conflicts reported for IDs other than the injected ones, or more than once: %s",
			strings.Join(wrongIDs[:min(len(wrongIDs), demoShowMismatches)], ", ")))
	}
	if total := applied + dups + conflicts; total != int64(s.deliveries) {
		problems = append(problems, fmt.Sprintf("%d outcomes for %d deliveries", total, s.deliveries))
	}
	if len(problems) > 0 {
		fmt.Fprintf(w, "verification: FAILED — %s\n", strings.Join(problems, "; "))
		return false
	}
	fmt.Fprintln(w, "verification: OK — every balance matches the unique intended events")
	return true
}
