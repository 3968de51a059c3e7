package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"regexp"
	"sort"
	"text/tabwriter"
	"time"
)

// statsCommand returns the "stats" subcommand: per-handler figures from
// the markers and the dead letters.
func statsCommand() *command {
	return &command{
		name:     "stats",
		synopsis: "--dsn DSN [--schema S] [--prefix P] [--json]",
		summary:  "per-handler counts: applied, duplicates, stale, in flight, failed, dead letters, conflicts, oldest marker",
		help: `Stats reads idem's tables and prints, per handler:

  APPLIED        markers stored (messages applied, or done in lease mode),
                 since the last cleanup
  DUPLICATES     redeliveries skipped, and STALE deliveries the ordering
  STALE          guard skipped: counted by an idem.StatsRecorder hook and
                 flushed on its interval (0 when no recorder runs)
  IN FLIGHT      lease-mode messages whose handler is running now
  FAILED         lease-mode messages waiting for a retry or failed for good
  DEAD LETTERS   parked (waiting for an operator) / all
  CONFLICTS      dead letters whose ID arrived with a different payload
  OLDEST MARKER  the oldest marker: about the retention when cleanup runs

` + dsnHelp,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			sf := addStoreFlags(fs, "stats", false)
			asJSON := fs.Bool("json", false, "print JSON")
			return func(ctx context.Context, e *env, args []string) error {
				if err := noArgs(args); err != nil {
					return err
				}
				s, err := sf.open(ctx, e)
				if err != nil {
					return err
				}
				defer s.Close()
				return runStats(ctx, e, s, *asJSON)
			}
		},
	}
}

// handlerStats is one handler's line.
type handlerStats struct {
	Handler      string     `json:"handler"`
	Applied      int64      `json:"applied"`
	Duplicates   int64      `json:"duplicates"`
	Stale        int64      `json:"stale"`
	InFlight     int64      `json:"in_flight"`
	Failed       int64      `json:"failed"`
	DeadParked   int64      `json:"dead_letters_parked"`
	DeadTotal    int64      `json:"dead_letters"`
	Conflicts    int64      `json:"conflicts"`
	OldestMarker *time.Time `json:"oldest_marker,omitempty"`
}

func runStats(ctx context.Context, e *env, s *store, asJSON bool) error {
	list, _, err := collectStats(ctx, s)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(e.stdout, list)
	}
	if len(list) == 0 {
		fmt.Fprintln(e.stdout, "No markers or dead letters stored yet.")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "HANDLER\tAPPLIED\tDUPLICATES\tSTALE\tIN FLIGHT\tFAILED\tDEAD LETTERS\tCONFLICTS\tOLDEST MARKER")
	for _, st := range list {
		old := "-"
		if st.OldestMarker != nil {
			old = st.OldestMarker.Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d / %d\t%d\t%s\n", termText(st.Handler), st.Applied, st.Duplicates, st.Stale, st.InFlight, st.Failed, st.DeadParked, st.DeadTotal, st.Conflicts, old)
	}
	return tw.Flush()
}

// collectStats reads the per-handler counts, sorted by handler name, and
// the schema version it found.
func collectStats(ctx context.Context, s *store) ([]*handlerStats, int, error) {
	n, version, err := s.schemaVersion(ctx)
	if err != nil {
		return nil, 0, err
	} else if n == 0 {
		return nil, 0, s.errNoTables(ctx)
	}
	// Done rows only: running and failed leases are kept whatever their
	// age, and would hold the oldest marker back for good.
	oldest := `min(processed_at) FILTER (WHERE status = 'done')`
	if s.kind == kindPostgres {
		oldest = `(extract(epoch FROM ` + oldest + `) * 1000000)::bigint`
	}
	byHandler := map[string]*handlerStats{}
	get := func(h string) *handlerStats {
		if byHandler[h] == nil {
			byHandler[h] = &handlerStats{Handler: h}
		}
		return byHandler[h]
	}
	done := `count(*) FILTER (WHERE status = 'done')`
	if s.kind == kindPostgres && version >= 12 {
		// Since migration 12 an atomic marker an idem from before
		// migration 11 writes (token 0) is mirrored into the markers
		// table, counted below: counted here too, each such message
		// would be applied twice. The key is the trigger's.
		done = `count(*) FILTER (WHERE status = 'done' AND NOT CASE WHEN p.token = 0 THEN EXISTS (
  SELECT 1 FROM ` + s.table("markers") + ` m JOIN ` + s.table("handlers") + ` h ON h.id = m.handler_id
  WHERE h.name = p.handler AND m.message_key = CASE
    WHEN p.message_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN decode(replace(p.message_id, '-', ''), 'hex')
    WHEN octet_length(p.message_id) = 16 THEN convert_to(p.message_id, 'UTF8') || '\x00'::bytea
    ELSE convert_to(p.message_id, 'UTF8') END) ELSE false END)`
	}
	leases := `SELECT handler, ` + done + `, count(*) FILTER (WHERE status = 'running'),
count(*) FILTER (WHERE status = 'failed'), ` + oldest + ` FROM ` + s.table("processed") + ` p GROUP BY handler`
	deadLetters := `SELECT handler, count(*) FILTER (WHERE state = 'parked'), count(*), count(*) FILTER (WHERE class = 'conflict')
FROM ` + s.table("dead_letters") + ` GROUP BY handler`
	if s.kind == kindMySQL {
		// Lease rows have a table of their own; times are Unix
		// microseconds already.
		leases = `SELECT handler, SUM(status = 'done'), SUM(status = 'running'), SUM(status = 'failed'),
MIN(IF(status = 'done', processed_at, NULL)) FROM ` + s.table("leases") + ` GROUP BY handler`
		deadLetters = `SELECT handler, SUM(state = 'parked'), count(*), SUM(class = 'conflict') FROM ` + s.table("dead_letters") + ` GROUP BY handler`
	}
	err = s.queryRows(ctx, leases,
		func(scan func(...any) error) error {
			var (
				h     string
				a     handlerStats
				micro *int64
			)
			if err := scan(&h, &a.Applied, &a.InFlight, &a.Failed, &micro); err != nil {
				return err
			}
			st := get(h)
			st.Applied, st.InFlight, st.Failed = a.Applied, a.InFlight, a.Failed
			if micro != nil {
				t := time.UnixMicro(*micro).UTC()
				st.OldestMarker = &t
			}
			return nil
		})
	if err != nil {
		return nil, 0, fmt.Errorf("read markers: %w", err)
	}
	if (s.kind == kindPostgres && version >= 11) || s.kind == kindMySQL {
		// Atomic markers have a table of their own (Postgres: since
		// migration 11), keyed by the handler's interned id.
		oldestMarker := `(extract(epoch FROM c.oldest) * 1000000)::bigint`
		if s.kind == kindMySQL {
			oldestMarker = `c.oldest`
		}
		err = s.queryRows(ctx, `SELECT h.name, c.n, `+oldestMarker+`
FROM (SELECT handler_id, count(*) AS n, min(processed_at) AS oldest FROM `+s.table("markers")+` GROUP BY handler_id) c
JOIN `+s.table("handlers")+` h ON h.id = c.handler_id`,
			func(scan func(...any) error) error {
				var (
					h     string
					n     int64
					micro *int64
				)
				if err := scan(&h, &n, &micro); err != nil {
					return err
				}
				st := get(h)
				st.Applied += n
				if micro != nil {
					t := time.UnixMicro(*micro).UTC()
					if st.OldestMarker == nil || t.Before(*st.OldestMarker) {
						st.OldestMarker = &t
					}
				}
				return nil
			})
		if err != nil {
			return nil, 0, fmt.Errorf("read markers: %w", err)
		}
	}
	err = s.queryRows(ctx, deadLetters,
		func(scan func(...any) error) error {
			var (
				h             string
				p, all, confl int64
			)
			if err := scan(&h, &p, &all, &confl); err != nil {
				return err
			}
			st := get(h)
			st.DeadParked, st.DeadTotal, st.Conflicts = p, all, confl
			return nil
		})
	if err != nil {
		return nil, 0, fmt.Errorf("read dead letters (is the schema migrated? run 'idem migrate'): %w", err)
	}
	if version >= 5 || s.kind == kindMySQL { // the counters table came with migration 5 (MySQL: 1)
		err = s.queryRows(ctx, `SELECT handler, duplicates, stale FROM `+s.table("handler_stats"),
			func(scan func(...any) error) error {
				var (
					h        string
					dup, old int64
				)
				if err := scan(&h, &dup, &old); err != nil {
					return err
				}
				st := get(h)
				st.Duplicates, st.Stale = dup, old
				return nil
			})
		if err != nil {
			return nil, 0, fmt.Errorf("read handler counters: %w", err)
		}
	}
	list := make([]*handlerStats, 0, len(byHandler))
	for _, st := range byHandler {
		list = append(list, st)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].Handler < list[j].Handler })
	return list, version, nil
}

// dollarParam matches a $1-style query parameter.
var dollarParam = regexp.MustCompile(`\$[0-9]+`)

// queryRows runs q with args on the store and calls fn per row. q writes
// its parameters as $1, $2…, which SQLite reads as well as PostgreSQL;
// for MySQL they become ? (so each must appear once, in order).
func (s *store) queryRows(ctx context.Context, q string, fn func(scan func(...any) error) error, args ...any) error {
	if db := s.sqlDB(); db != nil {
		if s.kind == kindMySQL {
			q = dollarParam.ReplaceAllString(q, "?")
		}
		rows, err := db.QueryContext(ctx, q, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			if err := fn(rows.Scan); err != nil {
				return err
			}
		}
		return rows.Err()
	}
	rows, err := s.pgPool.Query(ctx, q, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := fn(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

// sqlDB returns the database/sql handle of a SQLite or MySQL store, nil
// for the others.
func (s *store) sqlDB() *sql.DB {
	switch s.kind {
	case kindSQLite:
		return s.sqliteDB
	case kindMySQL:
		return s.mysqlDB
	}
	return nil
}

// markerEstimate returns PostgreSQL's estimate of the rows in the marker
// tables (pg_class.reltuples, kept by autovacuum and ANALYZE; atomic
// markers have their own table since migration 11): a catalog read, free
// however many markers there are, where counting them scans the tables.
// ok is false on other stores, and before any of them was first analysed.
func (s *store) markerEstimate(ctx context.Context) (n int64, ok bool, err error) {
	if s.kind != kindPostgres {
		return 0, false, nil
	}
	var (
		est      *float64
		analysed int
	)
	if err := s.pgPool.QueryRow(ctx, `SELECT sum(reltuples) FILTER (WHERE reltuples >= 0), count(*) FILTER (WHERE reltuples >= 0)
FROM pg_class WHERE oid IN (to_regclass($1), to_regclass($2))`, s.table("processed"), s.table("markers")).Scan(&est, &analysed); err != nil {
		return 0, false, fmt.Errorf("read the marker estimate: %w", err)
	}
	if est == nil || analysed == 0 {
		return 0, false, nil // never analysed
	}
	return int64(*est), true, nil
}
