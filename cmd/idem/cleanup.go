package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/idemhq/idem"
)

// cleanupCommand returns the "cleanup" subcommand: delete markers older
// than the retention, in bounded batches.
func cleanupCommand() *command {
	return &command{
		name:     "cleanup",
		synopsis: "--dsn DSN [--retention D] [--horizon D] [--batch N] [--dry-run] [--json]",
		summary:  "delete markers older than the retention, in small batches",
		help: `Cleanup deletes the markers of messages processed longer ago than --retention,
in batches of at most --batch rows, each its own short transaction, so
processors keep running meanwhile; a batch slower than 40 ms halves the
next one, a fast one doubles it back. Leases still running or failed are never deleted,
whatever their age (a failed one's dead letter may be replayed). On
PostgreSQL only one cleanup runs at a time per schema and prefix (an
advisory lock), on MySQL per database and prefix (GET_LOCK): a second
one exits with code 1 and says so. On SQLite,
which has one writer, concurrent cleanups take turns batch by batch.
Outbox rows published before the same cut-off are deleted too.

A message redelivered after its marker is deleted is applied again. Set
--horizon to the longest time your broker may still redeliver (Kafka topic
retention, JetStream MaxAge, the longest replay you allow): a --retention
below it is refused.

--dry-run deletes nothing: it counts, per handler, the markers a cleanup
would delete now, and shows the oldest marker.

The DSN comes from --dsn, or from the IDEM_DSN environment variable.

` + dsnHelp + `

Examples:
  idem cleanup --dsn postgres://app@db/app --schema idem --dry-run
  idem cleanup --retention 14d --horizon 7d
  idem cleanup --json`,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			sf := addStoreFlags(fs, "cleanup", false)
			var (
				retention, horizon time.Duration
				batch              int
				dryRun, asJSON     bool
			)
			durationVar(fs, &retention, "retention", idem.DefaultRetention, "keep markers this `long` after processing")
			durationVar(fs, &horizon, "horizon", 0, "longest `time` after processing at which a message may still be redelivered; a shorter --retention is refused")
			fs.IntVar(&batch, "batch", idem.DefaultPruneBatch, "most markers deleted per transaction (`rows`)")
			fs.BoolVar(&dryRun, "dry-run", false, "count what would be deleted; delete nothing")
			fs.BoolVar(&asJSON, "json", false, "print JSON instead of text")
			return func(ctx context.Context, e *env, args []string) error {
				if err := noArgs(args); err != nil {
					return err
				}
				if retention <= 0 || horizon < 0 || batch < 1 {
					return usagef("--retention and --batch must be positive, --horizon not negative")
				}
				cfg := &idem.RetentionConfig{Retention: retention, RedeliveryHorizon: horizon, BatchSize: batch,
					Logger: slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
				if _, err := idem.NewPruner(nil, cfg); err != nil {
					var re *idem.RetentionError
					if errors.As(err, &re) {
						return &usageError{err: err}
					}
				}
				s, err := sf.open(ctx, e)
				if err != nil {
					return err
				}
				defer s.Close()
				return runCleanup(ctx, e, s, cfg, dryRun, asJSON)
			}
		},
	}
}

// idemDriver returns the store's idem driver.
func (s *store) idemDriver() any {
	switch s.kind {
	case kindSQLite:
		return s.sqliteDrv
	case kindRedis:
		return s.redisDrv
	case kindMySQL:
		return s.mysqlDrv
	}
	return s.pgDrv
}

// cleanupReport is what cleanup prints with --json. A dry run reports
// what a cleanup now would delete (would_delete, outbox_would_delete, and
// per handler in prunable) and nothing under the names of a real run's
// counts; a real run reports what it deleted.
type cleanupReport struct {
	DryRun            bool             `json:"dry_run"`
	Cutoff            time.Time        `json:"cutoff"`
	Prunable          map[string]int64 `json:"prunable,omitempty"`
	OldestMarker      *time.Time       `json:"oldest_marker,omitempty"`
	WouldDelete       *int             `json:"would_delete,omitempty"`
	OutboxWouldDelete *int             `json:"outbox_would_delete,omitempty"`
	Deleted           *int             `json:"deleted,omitempty"`
	Batches           *int             `json:"batches,omitempty"`
	OutboxDeleted     *int             `json:"outbox_deleted,omitempty"`
	DurationMS        *int64           `json:"duration_ms,omitempty"`
	LongestBatchMS    *int64           `json:"longest_batch_ms,omitempty"`
}

// runCleanup counts or deletes the markers past the retention.
func runCleanup(ctx context.Context, e *env, s *store, cfg *idem.RetentionConfig, dryRun, asJSON bool) error {
	if n, _, err := s.schemaVersion(ctx); err != nil {
		return err
	} else if n == 0 {
		return s.errNoTables(ctx)
	}
	pr, err := idem.NewPruner(s.idemDriver(), cfg)
	if err != nil {
		return err
	}
	rep := cleanupReport{DryRun: dryRun}
	var deleted, outboxDeleted int
	if dryRun {
		est, err := pr.Prunable(ctx)
		if err != nil {
			return err
		}
		rep.Cutoff = est.Cutoff.UTC().Truncate(time.Second)
		rep.Prunable = est.Markers
		if !est.Oldest.IsZero() {
			o := est.Oldest.UTC().Truncate(time.Second)
			rep.OldestMarker = &o
		}
		for _, n := range est.Markers {
			deleted += int(n)
		}
		outboxDeleted = int(est.Outbox)
		rep.WouldDelete, rep.OutboxWouldDelete = &deleted, &outboxDeleted
	} else {
		st, err := pr.Prune(ctx)
		rep.Cutoff = st.Cutoff.UTC().Truncate(time.Second)
		deleted, outboxDeleted = st.Deleted, st.OutboxDeleted
		batches, took, longest := st.Batches, st.Duration.Milliseconds(), st.LongestBatch.Milliseconds()
		rep.Deleted, rep.Batches, rep.OutboxDeleted, rep.DurationMS, rep.LongestBatchMS = &deleted, &batches, &outboxDeleted, &took, &longest
		if errors.Is(err, idem.ErrMaintenanceBusy) {
			return fmt.Errorf("another cleanup is running on %s; nothing deleted", s)
		}
		if err != nil {
			return fmt.Errorf("%w (deleted %d markers before stopping)", err, st.Deleted)
		}
	}
	if asJSON {
		return writeJSON(e.stdout, rep)
	}
	if !dryRun {
		fmt.Fprintf(e.stdout, "Deleted %s processed before %s in %d batch(es) (%s, slowest batch %s).\n",
			plural(deleted, "marker"), rep.Cutoff.Format(time.RFC3339), *rep.Batches,
			time.Duration(*rep.DurationMS)*time.Millisecond, time.Duration(*rep.LongestBatchMS)*time.Millisecond)
		if outboxDeleted > 0 {
			fmt.Fprintf(e.stdout, "Deleted %s published before %s.\n", plural(outboxDeleted, "outbox row"), rep.Cutoff.Format(time.RFC3339))
		}
		return nil
	}
	fmt.Fprintf(e.stdout, "Dry run on %s: markers processed before %s (retention %s)\n\n", s, rep.Cutoff.Format(time.RFC3339), cfg.Retention)
	handlers := make([]string, 0, len(rep.Prunable))
	for h := range rep.Prunable {
		handlers = append(handlers, h)
	}
	sort.Strings(handlers)
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "HANDLER\tWOULD DELETE")
	for _, h := range handlers {
		fmt.Fprintf(tw, "%s\t%d\n", termText(h), rep.Prunable[h])
	}
	fmt.Fprintf(tw, "total\t%d\n", deleted)
	if err := tw.Flush(); err != nil {
		return err
	}
	if outboxDeleted > 0 {
		fmt.Fprintf(e.stdout, "\nAnd %s published before then.\n", plural(outboxDeleted, "outbox row"))
	}
	if rep.OldestMarker != nil {
		fmt.Fprintf(e.stdout, "\nOldest marker: %s\n", rep.OldestMarker.Format(time.RFC3339))
	} else {
		fmt.Fprintln(e.stdout, "\nNo markers stored.")
	}
	return nil
}
