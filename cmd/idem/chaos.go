package main

import (
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"strings"
	"time"
)

// chaosConfig holds the flags of idem chaos.
type chaosConfig struct {
	broker       string
	duration     time.Duration
	seed         uint64
	seedSet      bool
	consumers    int
	relays       int
	killEvery    time.Duration
	rate         int
	accounts     int
	dsn          string
	keep         bool
	drainTimeout time.Duration
	noKill       bool
	measure      bool
	scale        string
	events       int
	runs         int
}

// chaosCommand returns the "chaos" subcommand.
func chaosCommand() *command {
	return &command{
		name:     "chaos",
		synopsis: "[--broker nats|kafka] [--duration D] [--seed N] [--consumers N] [--kill-every D] [--dsn DSN] [--measure]",
		summary:  "kill consumers, relays and broker nodes at random and verify every effect happened once",
		help: `Chaos runs the whole pipeline as separate processes and kills them at random
while events flow, then checks the final state against the unique intended
events.

With --broker nats (the default) it starts a 3-node NATS JetStream cluster
(three processes of this binary on loopback ports, an R3 stream) and, with
--broker kafka, an in-process Kafka-protocol cluster of three brokers with
eight partitions. Against Postgres at --dsn, in a schema of its own that is
dropped at the end unless --keep, a producer writes --rate events a second
over --accounts accounts through the outbox, two relay processes publish
them, and --consumers consumer processes run three handlers each:

  chaos.balances  atomic mode: a balance and a count per account
  chaos.ordered   atomic mode under the ordering guard (GapWait): the last
                  applied sequence per account, and a count of writes that
                  did not follow the one before
  chaos.sink      lease mode: an HTTP call per event, with its idempotency
                  key, to a sink in this process that applies each key once,
                  as a payment API does

Every --kill-every (jittered) it SIGKILLs one consumer, one relay or, with
NATS, one JetStream node (half the time the stream's leader), waits a
moment and starts it again. At most one node is down at a time, and a node
is only killed once the stream's replicas have caught up, so the stream
keeps its quorum.

After --duration it stops producing and killing, waits up to
--drain-timeout for everything to be consumed, and checks: every balance
and count equals the one computed from the intended events; every account's
sequence was applied in order, each exactly once; the sink applied every
event's key exactly once and no other; the outbox is empty; there is no dead
letter; no process died unless it was killed. It prints a summary and exits
1 on any mismatch, with the command that replays the run's seed. The seed
fixes the events and the choice of every kill; the timing is the machine's.

--measure runs no kills: for each consumer count in --scale it writes
--events events to the outbox, lets the relays publish them all, then starts
the consumers and times each handler from its first applied event to its
last (so the processes' start is left out). Each count runs --runs times,
on a fresh schema and broker; it prints each handler's median events/s, the
lowest and highest, and the machine's load average.`,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			cfg := &chaosConfig{}
			fs.StringVar(&cfg.broker, "broker", "nats", "`broker`: nats (a 3-node JetStream cluster, R3 stream) or kafka (an in-process Kafka-protocol cluster)")
			fs.DurationVar(&cfg.duration, "duration", 3*time.Minute, "how long to produce and kill")
			fs.Func("seed", "random `seed` for the events and the kills (default: random, printed)", func(v string) error {
				var err error
				cfg.seed, err = parseUint(v)
				cfg.seedSet = err == nil
				return err
			})
			fs.IntVar(&cfg.consumers, "consumers", 4, "consumer `processes`")
			fs.IntVar(&cfg.relays, "relays", 2, "relay `processes`")
			fs.DurationVar(&cfg.killEvery, "kill-every", 5*time.Second, "mean `interval` between kills")
			fs.IntVar(&cfg.rate, "rate", 50, "events produced per second")
			fs.IntVar(&cfg.accounts, "accounts", 200, "number of `accounts` (aggregates)")
			fs.StringVar(&cfg.dsn, "dsn", "", "PostgreSQL `DSN` (default IDEM_POSTGRES_DSN, else postgres://postgres@127.0.0.1:5432/test)")
			fs.BoolVar(&cfg.keep, "keep", false, "keep the schema and the processes' logs")
			fs.DurationVar(&cfg.drainTimeout, "drain-timeout", 5*time.Minute, "how long to wait for everything produced to be consumed once killing stops")
			fs.BoolVar(&cfg.noKill, "no-kill", false, "kill nothing (a baseline)")
			fs.BoolVar(&cfg.measure, "measure", false, "measure events/s for each consumer count in --scale instead")
			fs.StringVar(&cfg.scale, "scale", "1,2,4", "with --measure: consumer `counts`")
			fs.IntVar(&cfg.events, "events", 2000, "with --measure: events per run")
			fs.IntVar(&cfg.runs, "runs", 3, "with --measure: runs per consumer count")
			return func(ctx context.Context, e *env, args []string) error {
				if spec := e.getenv(chaosChildEnv); spec != "" {
					return runChaosChild(ctx, e, spec)
				}
				if err := noArgs(args); err != nil {
					return err
				}
				if err := cfg.check(); err != nil {
					return err
				}
				if cfg.dsn == "" {
					cfg.dsn = e.getenv("IDEM_POSTGRES_DSN")
				}
				if cfg.dsn == "" {
					cfg.dsn = "postgres://postgres@127.0.0.1:5432/test"
				}
				if !cfg.seedSet {
					var b [8]byte
					_, _ = crand.Read(b[:])
					cfg.seed = binary.LittleEndian.Uint64(b[:]) >> 1
				}
				if cfg.measure {
					return runChaosMeasure(ctx, e, cfg)
				}
				return runChaos(ctx, e, cfg)
			}
		},
	}
}

// parseUint parses a decimal uint64.
func parseUint(v string) (uint64, error) {
	var n uint64
	if _, err := fmt.Sscan(v, &n); err != nil || fmt.Sprint(n) != strings.TrimSpace(v) {
		return 0, fmt.Errorf("not a whole number: %q", v)
	}
	return n, nil
}

// check validates the flags; problems are usage errors.
func (c *chaosConfig) check() error {
	switch {
	case c.broker != "nats" && c.broker != "kafka":
		return usagef("--broker must be nats or kafka, got %q", c.broker)
	case c.duration <= 0:
		return usagef("--duration must be positive, got %s", c.duration)
	case c.consumers < 1 || c.consumers > 16:
		return usagef("--consumers must be between 1 and 16, got %d", c.consumers)
	case c.relays < 1 || c.relays > 8:
		return usagef("--relays must be between 1 and 8, got %d", c.relays)
	case c.killEvery < 100*time.Millisecond:
		return usagef("--kill-every must be at least 100ms, got %s", c.killEvery)
	case c.rate < 1 || c.rate > 100000:
		return usagef("--rate must be between 1 and 100000, got %d", c.rate)
	case c.accounts < 1:
		return usagef("--accounts must be at least 1, got %d", c.accounts)
	case c.drainTimeout <= 0:
		return usagef("--drain-timeout must be positive, got %s", c.drainTimeout)
	case c.events < 1:
		return usagef("--events must be at least 1, got %d", c.events)
	case c.runs < 1:
		return usagef("--runs must be at least 1, got %d", c.runs)
	}
	if _, err := c.scaleCounts(); err != nil {
		return err
	}
	return nil
}

// scaleCounts parses --scale.
func (c *chaosConfig) scaleCounts() ([]int, error) {
	var counts []int
	for _, f := range strings.Split(c.scale, ",") {
		n, err := parseUint(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 16 {
			return nil, usagef("--scale must list consumer counts between 1 and 16, got %q", c.scale)
		}
		counts = append(counts, int(n))
	}
	return counts, nil
}

// replayCommand is the command line that runs cfg's chaos again with its
// seed.
func (c *chaosConfig) replayCommand() string {
	s := fmt.Sprintf("idem chaos --broker %s --seed %d --duration %s --consumers %d --relays %d --kill-every %s --rate %d --accounts %d",
		c.broker, c.seed, c.duration, c.consumers, c.relays, c.killEvery, c.rate, c.accounts)
	if c.noKill {
		s += " --no-kill"
	}
	return s
}

// runChaos runs one chaos run and prints its summary.
func runChaos(ctx context.Context, e *env, cfg *chaosConfig) error {
	logger := slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	h, err := newChaosHarness(ctx, cfg, logger)
	if err != nil {
		return err
	}
	failed := true
	defer func() { h.close(ctx, !failed && !cfg.keep) }()
	fmt.Fprintf(e.stdout, "idem chaos: %s; %d consumer processes, %d relays; Postgres schema %s; seed %d\n",
		h.broker.describe(), cfg.consumers, cfg.relays, h.schema, cfg.seed)
	kinds := "consumers and relays"
	if cfg.broker == "nats" {
		kinds = "consumers, relays and JetStream nodes"
	}
	if cfg.noKill {
		fmt.Fprintf(e.stdout, "  producing %d events/s for %s, killing nothing\n", cfg.rate, cfg.duration)
	} else {
		fmt.Fprintf(e.stdout, "  producing %d events/s for %s, SIGKILLing %s about every %s\n", cfg.rate, cfg.duration, kinds, cfg.killEvery)
	}
	if err := h.startAll(cfg.consumers); err != nil {
		return err
	}
	res, err := h.run(ctx, e.stdout)
	if err == nil && printChaosSummary(e.stdout, cfg, res) {
		failed = false
		if cfg.keep {
			fmt.Fprintf(e.stdout, "kept: schema %s, the processes' logs in %s\n", h.schema, h.dir)
		}
		return nil
	}
	fmt.Fprintf(e.stdout, "replay with: %s\n", cfg.replayCommand())
	fmt.Fprintf(e.stdout, "the processes' logs are kept in %s\n", h.dir)
	if err != nil {
		return err
	}
	return errors.New("verification failed: see the summary above")
}

// chaosRNG returns the run's random source for a purpose: the events and
// the kills draw from separate streams, so a change to one leaves the other
// as it was.
func chaosRNG(seed, purpose uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, purpose)) }

// Purposes of chaosRNG.
const (
	chaosRandEvents = 0xe7e7
	chaosRandKills  = 0x4b11
)

// printRows writes label/value rows of a summary.
func printRows(w io.Writer, rows [][2]string) {
	for _, r := range rows {
		fmt.Fprintf(w, "  %-22s %s\n", r[0], r[1])
	}
}

// chaosChildEnv carries a child process's role, as JSON: a chaos run
// starts this binary again for every node, relay and consumer.
const chaosChildEnv = "IDEM_CHAOS_CHILD"

// exitIfParentGone ends a child process when its standard input, a pipe
// from the chaos run, closes: the run ended or died.
func exitIfParentGone(cancel context.CancelFunc) {
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
		time.Sleep(5 * time.Second)
		os.Exit(exitOK)
	}()
}
