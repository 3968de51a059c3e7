package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/sqlident"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/sqlite"
)

// benchCommand returns the "bench" subcommand: idem's overhead as a ratio
// against the same transactions without the marker.
func benchCommand() *command {
	return &command{
		name:     "bench",
		synopsis: "[--dsn DSN] [--schema S] [--cases C] [--workers N] [--rounds N] [--round D] [--json]",
		summary:  "measure idem's throughput as a ratio of the same transactions without it",
		help: `Bench measures what idem costs on your database. For each case it runs the
same account-balance upsert twice, alternating in rounds: once in a plain
transaction, once through idem (marker insert, duplicate check, commit). It
prints the median events/s of both, the median of the rounds' idem/plain
ratios (each round runs the two back to back, so a pair shares the disk's
state; 1.00 means idem is free) and the lowest and highest of those ratios.
Every event has a new message ID, so every event pays the marker insert. A
round's rate counts the events of its duration only: of a transaction still
running when time is up, the share that ran in time.

Cases:
  per-message  one event per transaction (Processor.Process)
  version-only one event per transaction, deduped by the aggregate's
               sequence alone (Ordering.VersionOnly: no marker row)
  batch-100    100 events per transaction (Processor.ProcessBatch)
  batch-100-ordered
               batch-100 with the ordering guard on (Ordering, GapAllow):
               each account's sequence is advanced in the same transaction
  batch-1000   1,000 events per transaction; the handler applies them with
               one set-based upsert of the summed balances, so the marker
               insert is most of what the transaction writes
  batch-1000-per-event
               1,000 events per transaction, the handler running one upsert
               per event, as a loop over a poll's records does
  batch-1000-version-only
               batch-1000 deduped by each account's sequence alone: the
               batch's accounts' sequences are read and advanced with one
               statement each, and no marker row is written
  version-in-row
               one event per transaction with the in-row guard
               (Handler.ApplyInRow): the balance row holds the account's
               last sequence and its upsert carries the guard; the plain
               variant runs the same guarded writes, so the ratio is what
               idem adds (it writes no row of its own)
  batch-1000-version-in-row
               1,000 events per transaction with the in-row guard: one
               locked read of the batch's rows and one set-based guarded
               write, in both variants
  per-message-vs-hand, batch-1000-per-event-vs-hand
               idem against the dedupe teams write by hand instead of
               against no dedupe: the baseline ("plain") inserts the ID
               into a processed-events table keyed by the ID alone (no
               handler, no payload hash, no retention index) and applies
               the upsert when a row was added; on Redis, a Lua script
               doing SET NX, then HINCRBY. Batches apply one upsert per
               event on both sides
  per-message-write-only, per-message-write-only-vs-hand
               Redis only: per-message and per-message-vs-hand with the
               driver's WriteOnly set, the marker checked and the
               handler's queued increment applied in one script call

Without --dsn (and IDEM_DSN) the benchmark runs on a temporary SQLite file
with idem's defaults (WAL, synchronous=FULL). On a SQLite file the DSN
names, its tables, all prefixed idem_bench_, are dropped afterwards, and a
file it created is removed. On PostgreSQL it creates its
tables, all prefixed idem_bench_, in --schema (default idem_bench), and
drops them afterwards; a schema it created is dropped too. On MySQL they
go in the DSN's database and are dropped afterwards. On Redis the
plain variant is the same writes in a MULTI/EXEC without markers; every
key starts with idem_bench: and is deleted afterwards.

` + dsnHelp + `

Examples:
  idem bench
  idem bench --dsn postgres://postgres@127.0.0.1:5432/test --cases batch-1000
  idem bench --dsn redis://127.0.0.1:6379/0 --cases per-message,batch-100
  idem bench --json --rounds 3 --round 1s`,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			var (
				dsn, schema, cases string
				workers, rounds    int
				round              time.Duration
				asJSON             bool
			)
			fs.StringVar(&dsn, "dsn", "", "database `DSN` (default: $"+dsnEnv+", else a temporary SQLite file)")
			fs.StringVar(&schema, "schema", "idem_bench", "PostgreSQL `schema` for the benchmark's tables")
			fs.StringVar(&cases, "cases", strings.Join(benchCaseNames(), ","), "comma-separated `cases` to run")
			fs.IntVar(&workers, "workers", 4, "concurrent `workers` (connections)")
			fs.IntVar(&rounds, "rounds", 5, "plain/idem round `pairs` per case; the medians are reported")
			durationVar(fs, &round, "round", 500*time.Millisecond, "`duration` of each variant's run in a round")
			fs.BoolVar(&asJSON, "json", false, "print JSON instead of a table")
			return func(ctx context.Context, e *env, args []string) error {
				if err := noArgs(args); err != nil {
					return err
				}
				if workers < 1 || rounds < 1 || round <= 0 {
					return usagef("--workers, --rounds and --round must be positive")
				}
				if workers > benchMaxWorkers {
					return usagef("--workers %d: want at most %d (each is a connection)", workers, benchMaxWorkers)
				}
				selected, err := benchCases(cases)
				if err != nil {
					return err
				}
				if dsn == "" {
					dsn = strings.TrimSpace(e.getenv(dsnEnv))
				}
				if err := benchCheckSchema(fs, dsn, schema); err != nil {
					return err
				}
				return runBench(ctx, e, benchConfig{dsn: dsn, schema: schema, cases: selected,
					workers: workers, rounds: rounds, round: round, json: asJSON})
			}
		},
	}
}

// benchCheckSchema refuses a --schema that is not a plain identifier, and
// one given for another store than PostgreSQL, which would ignore it: the
// operator would believe the tables went where they did not.
func benchCheckSchema(fs *flag.FlagSet, dsn, schema string) error {
	if err := sqlident.Check("--schema", schema, true); err != nil {
		return &usageError{err: err}
	}
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "schema" })
	if !given {
		return nil
	}
	kind := kindSQLite // the temporary file
	if dsn != "" {
		t, err := parseDSN(dsn)
		if err != nil {
			return err
		}
		kind = t.kind
	}
	if kind != kindPostgres {
		return usagef("--schema applies only to PostgreSQL, not to %s, whose benchmark tables (or keys) it would not move", kind)
	}
	return nil
}

// benchMaxWorkers bounds --workers. Each worker holds a connection, and a
// pool sized past what a driver accepts made go-redis panic (and pgx's
// int32 size wrap around).
const benchMaxWorkers = 1000

// benchConfig holds the bench command's flags.
type benchConfig struct {
	dsn, schema     string
	cases           []bench.Case
	workers, rounds int
	round           time.Duration
	json            bool
	warn            io.Writer // where a failed clean-up is told; nil: nowhere
}

// benchCaseNames lists the names of the standard cases.
func benchCaseNames() []string {
	var names []string
	for _, c := range bench.Cases() {
		names = append(names, c.Name)
	}
	return names
}

// benchCases parses the --cases list.
func benchCases(list string) ([]bench.Case, error) {
	var out []bench.Case
	for _, name := range strings.Split(list, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		found := false
		for _, c := range bench.Cases() {
			if c.Name == name {
				out = append(out, c)
				found = true
			}
		}
		if !found {
			return nil, usagef("unknown case %q (known: %s)", name, strings.Join(benchCaseNames(), ", "))
		}
	}
	if len(out) == 0 {
		return nil, usagef("--cases selects no case")
	}
	return out, nil
}

// benchResult is one case's figures, as printed with --json.
type benchResult struct {
	Case      string    `json:"case"`
	Store     string    `json:"store"`
	Workers   int       `json:"workers"`
	BatchSize int       `json:"batch_size"`
	Plain     float64   `json:"plain_events_per_s"`
	Idem      float64   `json:"idem_events_per_s"`
	Ratio     float64   `json:"ratio"`
	PlainRuns []float64 `json:"plain_rounds"`
	IdemRuns  []float64 `json:"idem_rounds"`
	// RoundRatios are the rounds' idem/plain ratios; Ratio is their
	// median.
	RoundRatios []float64 `json:"round_ratios"`
}

// runBench opens the target the DSN names and runs the selected cases.
func runBench(ctx context.Context, e *env, cfg benchConfig) error {
	cfg.warn = e.stderr
	target, closeTarget, err := openBenchTarget(ctx, cfg)
	if err != nil {
		return err
	}
	defer closeTarget()

	var results []benchResult
	for _, c := range cfg.cases {
		if !c.RunsOn(target.Name()) {
			fmt.Fprintf(e.stderr, "idem bench: %s runs on %s only; skipped\n", c.Name, c.Store)
			continue
		}
		if !cfg.json {
			fmt.Fprintf(e.stderr, "idem bench: %s on %s, %d workers, %d rounds of %s...\n",
				c.Name, target.Name(), cfg.workers, cfg.rounds, cfg.round)
		}
		w := bench.Workload{Workers: cfg.workers, BatchSize: c.BatchSize, Duration: cfg.round}
		t, err := c.Target(target)
		if errors.Is(err, bench.ErrUnsupported) {
			fmt.Fprintf(e.stderr, "idem bench: %s: %s has no such variant; skipped\n", c.Name, target.Name())
			continue
		}
		if err != nil {
			return err
		}
		cmp, err := bench.Compare(ctx, t, bench.CompareOptions{Workload: w, Rounds: cfg.rounds, Warmup: cfg.round / 2})
		if err != nil {
			return fmt.Errorf("case %s: %w", c.Name, err)
		}
		r := benchResult{Case: c.Name, Store: target.Name(), Workers: cfg.workers, BatchSize: c.BatchSize,
			Plain: cmp.Plain, Idem: cmp.Idem, Ratio: cmp.Ratio, RoundRatios: cmp.RoundRatios}
		for i := range cmp.PlainRounds {
			r.PlainRuns = append(r.PlainRuns, cmp.PlainRounds[i].Rate())
			r.IdemRuns = append(r.IdemRuns, cmp.IdemRounds[i].Rate())
		}
		results = append(results, r)
	}
	if cfg.json {
		return writeJSON(e.stdout, results)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "case\tstore\tworkers\tplain events/s\tidem events/s\tratio\trounds\t")
	for _, r := range results {
		lo, hi := r.roundRatios()
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%.2f\t%.2f-%.2f\t\n", r.Case, r.Store, r.Workers,
			groupThousands(r.Plain), groupThousands(r.Idem), r.Ratio, lo, hi)
	}
	return tw.Flush()
}

// roundRatios returns the lowest and the highest idem/plain ratio of r's
// rounds: the spread behind the median, printed so that a reader sees the
// noise before trusting a second decimal.
func (r benchResult) roundRatios() (lo, hi float64) {
	if len(r.RoundRatios) == 0 {
		return 0, 0
	}
	return slices.Min(r.RoundRatios), slices.Max(r.RoundRatios)
}

// openBenchTarget opens the benchmark target for cfg.dsn, or a temporary
// SQLite file when it is empty. The returned function releases it.
func openBenchTarget(ctx context.Context, cfg benchConfig) (bench.Target, func(), error) {
	if cfg.dsn == "" {
		dir, err := os.MkdirTemp("", "idem-bench-")
		if err != nil {
			return nil, nil, err
		}
		t, err := bench.OpenSQLite(ctx, filepath.Join(dir, "bench.db"), &bench.SQLiteOptions{RemoveOnClose: true})
		if err != nil {
			os.RemoveAll(dir)
			return nil, nil, err
		}
		return t, func() { t.Close(); os.RemoveAll(dir) }, nil
	}
	tg, err := parseDSN(cfg.dsn)
	if err != nil {
		return nil, nil, err
	}
	switch tg.kind {
	case kindSQLite:
		// The benchmark leaves the file as it found it, as it does a
		// PostgreSQL schema or a MySQL database: a file it created is
		// removed, and from one that was there it drops the tables it
		// added (its own prefix's, not any that were there before).
		_, statErr := os.Stat(tg.path)
		created := errors.Is(statErr, os.ErrNotExist)
		var before map[string]bool
		if !created {
			if before, err = sqliteTables(ctx, tg.path); err != nil {
				return nil, nil, err
			}
		}
		t, err := bench.OpenSQLite(ctx, tg.path, &bench.SQLiteOptions{RemoveOnClose: created})
		if err != nil {
			return nil, nil, err
		}
		return t, func() {
			t.Close()
			if !created {
				if err := dropBenchTables(context.WithoutCancel(ctx), tg.path, before); err != nil && cfg.warn != nil {
					fmt.Fprintf(cfg.warn, "idem bench: the benchmark's tables (%s*) are left in %s: %v\n", bench.TablePrefix, termText(tg.path), err)
				}
			}
		}, nil
	case kindMySQL:
		mcfg, err := parseMySQLDSN(tg.dsn)
		if err != nil {
			return nil, nil, err
		}
		pctx, cancel := context.WithTimeout(ctx, pingTimeout)
		db, err := mysql.Open(pctx, mcfg)
		cancel()
		if err != nil {
			return nil, nil, fmt.Errorf("connect to %s: %w", redactDSN(tg.dsn), err)
		}
		db.SetMaxOpenConns(cfg.workers + 2)
		db.SetMaxIdleConns(cfg.workers + 2)
		t, err := bench.OpenMySQL(ctx, db)
		if err != nil {
			db.Close()
			return nil, nil, err
		}
		return t, func() { t.Close(context.WithoutCancel(ctx)); db.Close() }, nil
	case kindRedis:
		ropts, err := parseRedisDSN(tg.dsn)
		if err != nil {
			return nil, nil, err
		}
		ropts.PoolSize = max(ropts.PoolSize, cfg.workers+2)
		ropts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled} // see docs/redis.md
		client := redis.NewClient(ropts)
		t, err := bench.OpenRedis(ctx, client, "")
		if err != nil {
			client.Close()
			return nil, nil, err
		}
		return t, func() { t.Close(context.WithoutCancel(ctx)); client.Close() }, nil
	default:
		pcfg, err := parsePostgresDSN(tg.dsn)
		if err != nil {
			return nil, nil, err
		}
		pcfg.MaxConns = int32(cfg.workers + 2)
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			return nil, nil, fmt.Errorf("connect to %s: %w", redactDSN(tg.dsn), err)
		}
		t, err := bench.OpenPostgres(ctx, pool, &bench.PostgresOptions{Schema: cfg.schema})
		if err != nil {
			pool.Close()
			return nil, nil, err
		}
		return t, func() { t.Close(context.WithoutCancel(ctx)); pool.Close() }, nil
	}
}

// sqliteTables returns the names of the tables in the SQLite file at path.
func sqliteTables(ctx context.Context, path string) (map[string]bool, error) {
	db, err := sqlite.Open(path, nil)
	if err != nil {
		return nil, fmt.Errorf("open SQLite database: %w", err)
	}
	defer db.Close()
	rows, err := db.QueryContext(ctx, `SELECT name FROM sqlite_master WHERE type = 'table'`)
	if err != nil {
		return nil, fmt.Errorf("list the tables of SQLite %s: %w", path, err)
	}
	defer rows.Close()
	names := map[string]bool{}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, err
		}
		names[n] = true
	}
	return names, rows.Err()
}

// dropBenchTables drops from the SQLite file at path the tables of the
// benchmark's prefix that are not in before, and says which it could not.
func dropBenchTables(ctx context.Context, path string, before map[string]bool) error {
	after, err := sqliteTables(ctx, path)
	if err != nil {
		return err
	}
	db, err := sqlite.Open(path, nil)
	if err != nil {
		return err
	}
	defer db.Close()
	var errs []error
	for name := range after {
		if strings.HasPrefix(name, bench.TablePrefix) && !before[name] {
			if _, err := db.ExecContext(ctx, `DROP TABLE IF EXISTS `+sqlident.Quote(name)); err != nil {
				errs = append(errs, fmt.Errorf("drop %s: %w", name, err))
			}
		}
	}
	return errors.Join(errs...)
}

// groupThousands formats a rate as an integer with thousands separators.
func groupThousands(f float64) string {
	s := strconv.FormatInt(int64(f+0.5), 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
