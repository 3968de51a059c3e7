package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/postgres"
)

// outboxCommand returns the "outbox" subcommand: the state of the
// transactional outbox, and the check of its sequences.
func outboxCommand() *command {
	return &command{
		name:     "outbox",
		synopsis: "stats|list|retry|park|discard|notify on|notify off|check --dsn DSN [--schema S] [--prefix P] [flags] [ID...]",
		summary:  "outbox state: pending, failing and parked rows; retry, park or discard a row; sequences behind issued IDs",
		help: `Outbox reads and repairs the transactional outbox (docs/outbox.md).

  idem outbox stats   [--json]
  idem outbox list    [--state pending|failing|parked] [--stream S] [--key K] [--limit N] [--after ID] [--json]
  idem outbox retry   (ID... | --all-failing [--stream S] [--key K] [--yes])
  idem outbox park    ID... [--reason R]
  idem outbox discard ID... [--reason R] [--yes]
  idem outbox notify  on|off
  idem outbox check   [--consumer DSN]... [--fix]

Outbox stats prints the state of the transactional outbox (see
docs/outbox.md):

  PENDING         rows committed and not yet acknowledged by the broker
  OLDEST PENDING  when the oldest pending row was added, and its age: the
                  relay's lag. Alert when it grows.
  FAILING         pending rows whose last publish failed, with the most
                  recent error
  PARKED          pending rows an operator parked (below)
  PUBLISHED       rows published and not yet pruned by 'idem cleanup'
  NOTIFY          PostgreSQL: whether relays are woken at commit (below)

Outbox notify on|off (PostgreSQL) installs or removes the trigger that
wakes listening relays at commit, instead of at their next poll. Every
notifying commit takes a database-wide lock until its commit record is
flushed, so concurrent writers of outbox rows commit one at a time: leave
it off unless the outbox has few writers and milliseconds matter. It is
part of the schema, for every process. See docs/outbox.md.

Outbox check finds sequences that are behind message IDs already issued.
A restore from a backup leaves them so. The outbox would then issue those
IDs again with other payloads, and consumers would dead-letter them as
conflicts. The check compares each row of the sequences table (idem_versions
with the default prefix) with the highest sequence in the IDs that
outbox.AddNext made ("<n>:<stream>-<aggregate>-<seq>"). It looks for them
in the outbox table, and in the markers and dead letters of this store and
of every --consumer store (PostgreSQL, SQLite or Redis). --consumer-schema
and --consumer-prefix apply to all consumer stores. It also lists outbox
rows whose ID a consumer holds with another payload. It exits 1 when a
sequence is behind. With --fix it advances those sequences past the issued
IDs instead; it never lowers one. It sees only the markers retention has
kept: name the consumers whose markers are older than the backup.

` + outboxAdminHelp + `

` + dsnHelp,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			sf := addStoreFlags(fs, "outbox stats", false)
			asJSON := fs.Bool("json", false, "print JSON")
			fix := fs.Bool("fix", false, "check: advance the sequences that are behind")
			var consumers []string
			fs.Func("consumer", "check: `DSN` of a consumer's store whose markers and dead letters to read (repeatable)", func(v string) error {
				consumers = append(consumers, v)
				return nil
			})
			consumerSchema := fs.String("consumer-schema", "", "check: PostgreSQL `schema` of idem's tables in the --consumer stores")
			consumerPrefix := fs.String("consumer-prefix", "", "check: `prefix` of idem's tables (Redis: keys) in the --consumer stores")
			af := defineOutboxAdminFlags(fs)
			return func(ctx context.Context, e *env, args []string) error {
				if len(args) == 0 {
					return usagef("missing subcommand: stats, list, retry, park, discard, notify or check")
				}
				sub, rest := args[0], args[1:]
				var notifyOn bool
				switch sub {
				case "list", "retry", "park", "discard":
					ids, err := parseInterspersed(fs, rest)
					if err != nil {
						if errors.Is(err, flag.ErrHelp) {
							return showHelp(e, outboxCommand())
						}
						return err
					}
					af.positional, af.given = ids, map[string]bool{}
					fs.Visit(func(fl *flag.Flag) { af.given[fl.Name] = true })
					if err := af.check(sub); err != nil {
						return err
					}
					sf.command = "outbox " + sub
					s, err := sf.open(ctx, e)
					if err != nil {
						return err
					}
					defer s.Close()
					return runOutboxAdmin(ctx, e, s, sub, af, *asJSON)
				case "stats", "check":
				case "notify":
					if len(rest) == 0 || (rest[0] != "on" && rest[0] != "off") {
						return usagef("notify takes on or off")
					}
					notifyOn, rest = rest[0] == "on", rest[1:]
				default:
					return usagef("unknown subcommand %s: want stats, list, retry, park, discard, notify or check", quoteArg(sub))
				}
				// Flags may follow the subcommand too.
				if err := fs.Parse(rest); err != nil {
					if errors.Is(err, flag.ErrHelp) {
						return showHelp(e, outboxCommand())
					}
					return flagError(err)
				}
				if err := noArgs(fs.Args()); err != nil {
					return err
				}
				if sub != "check" && (*fix || len(consumers) > 0 || *consumerSchema != "" || *consumerPrefix != "") {
					return usagef("--fix, --consumer, --consumer-schema and --consumer-prefix belong to outbox check")
				}
				if (sub == "check" || sub == "notify") && *asJSON {
					return usagef("outbox %s prints text only", sub)
				}
				var adminFlag string
				fs.Visit(func(fl *flag.Flag) {
					if slices.Contains(outboxAdminFlagNames, fl.Name) {
						adminFlag = fl.Name
					}
				})
				if adminFlag != "" {
					return usagef("--%s belongs to outbox list, retry, park or discard", adminFlag)
				}
				sf.command = "outbox " + sub
				s, err := sf.open(ctx, e)
				if err != nil {
					return err
				}
				defer s.Close()
				switch sub {
				case "notify":
					return runOutboxNotify(ctx, e.stdout, s, notifyOn)
				case "check":
					var cs []*store
					defer func() {
						for _, c := range cs {
							c.Close()
						}
					}()
					for _, dsn := range consumers {
						c, err := openStore(ctx, dsn, storeOptions{Schema: *consumerSchema, Prefix: *consumerPrefix})
						if err != nil {
							return fmt.Errorf("consumer store: %w", err)
						}
						cs = append(cs, c)
					}
					return runOutboxCheck(ctx, e.stdout, s, cs, *fix)
				}
				return runOutboxStats(ctx, e.stdout, s, *asJSON, time.Now())
			}
		},
	}
}

// outboxNotifier is implemented by drivers whose relays can be woken at
// commit (postgres.Driver).
type outboxNotifier interface {
	SetOutboxNotify(ctx context.Context, on bool) error
	OutboxNotifyOn(ctx context.Context) (bool, error)
}

// runOutboxNotify turns the store's commit notifications on or off.
func runOutboxNotify(ctx context.Context, w io.Writer, s *store, on bool) error {
	n, ok := s.idemDriver().(outboxNotifier)
	if !ok {
		return fmt.Errorf("%s: only PostgreSQL notifies relays at commit; relays poll every PollInterval", s)
	}
	if err := n.SetOutboxNotify(ctx, on); errors.Is(err, postgres.ErrNotMigrated) {
		return fmt.Errorf("%s is not migrated to this version of idem: run 'idem migrate' first", s)
	} else if err != nil {
		return err
	}
	if on {
		fmt.Fprintln(w, "outbox notify on: listening relays are woken at commit; every notifying commit takes a database-wide lock")
	} else {
		fmt.Fprintln(w, "outbox notify off: relays find new rows at their next poll")
	}
	return nil
}

// outboxReport is what outbox stats prints with --json.
type outboxReport struct {
	Pending       int64      `json:"pending"`
	OldestPending *time.Time `json:"oldest_pending,omitempty"`
	AgeSeconds    int64      `json:"oldest_pending_age_seconds"`
	Failing       int64      `json:"failing"`
	LastError     string     `json:"last_error,omitempty"`
	Parked        int64      `json:"parked"`
	Published     int64      `json:"published"`
	// Notify is whether relays are woken at commit (PostgreSQL only).
	Notify *bool `json:"notify,omitempty"`
}

func runOutboxStats(ctx context.Context, w io.Writer, s *store, asJSON bool, now time.Time) error {
	rep, err := collectOutbox(ctx, s, now)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(w, rep)
	}
	fmt.Fprintf(w, "pending         %d\n", rep.Pending)
	if rep.OldestPending != nil {
		fmt.Fprintf(w, "oldest pending  %s (%s ago)\n", rep.OldestPending.Format(time.RFC3339), time.Duration(rep.AgeSeconds)*time.Second)
	} else {
		fmt.Fprintln(w, "oldest pending  -")
	}
	fmt.Fprintf(w, "failing         %d\n", rep.Failing)
	if rep.LastError != "" {
		// A multi-line error keeps its column.
		fmt.Fprintf(w, "last error      %s\n", strings.ReplaceAll(termBlock(strings.TrimRight(rep.LastError, "\n")), "\n", "\n                "))
	}
	if rep.Parked > 0 {
		fmt.Fprintf(w, "parked          %d ('idem outbox list --state parked' shows them)\n", rep.Parked)
	}
	fmt.Fprintf(w, "published       %d (kept until 'idem cleanup' prunes them)\n", rep.Published)
	if rep.Notify != nil {
		state := "off (relays poll)"
		if *rep.Notify {
			state = "on (relays are woken at commit)"
		}
		fmt.Fprintf(w, "notify          %s\n", state)
	}
	return nil
}

// outboxSchemaVersion is the migration that created the outbox tables.
const outboxSchemaVersion = 6

// hasOutbox reports whether a schema at version has the outbox tables:
// from migration 6 on SQLite and PostgreSQL, from the first on MySQL.
func (s *store) hasOutbox(version int) bool {
	return version >= outboxSchemaVersion || (s.kind == kindMySQL && version >= 1)
}

// collectOutbox reads the outbox's state as of now, after checking the
// schema has it.
func collectOutbox(ctx context.Context, s *store, now time.Time) (*outboxReport, error) {
	if n, version, err := s.schemaVersion(ctx); err != nil {
		return nil, err
	} else if n == 0 {
		return nil, s.errNoTables(ctx)
	} else if !s.hasOutbox(version) {
		return nil, fmt.Errorf("%s has no outbox tables: run 'idem migrate' first", s)
	}
	return readOutbox(ctx, s, now)
}

// readOutbox reads the outbox's state as of now.
func readOutbox(ctx context.Context, s *store, now time.Time) (*outboxReport, error) {
	ob, ok := s.idemDriver().(driver.OutboxRelayStore)
	if !ok {
		return nil, fmt.Errorf("%s: the driver has no outbox", s)
	}
	st, err := ob.OutboxStats(ctx)
	if err != nil {
		return nil, err
	}
	rep := &outboxReport{Pending: st.Pending, Failing: st.Failing, LastError: st.LastError, Parked: st.Parked, Published: st.Published}
	if n, ok := s.idemDriver().(outboxNotifier); ok {
		on, err := n.OutboxNotifyOn(ctx)
		if err != nil {
			return nil, err
		}
		rep.Notify = &on
	}
	if !st.OldestPending.IsZero() {
		o := st.OldestPending.UTC().Truncate(time.Second)
		rep.OldestPending = &o
		rep.AgeSeconds = int64(now.Sub(st.OldestPending).Seconds())
	}
	return rep, nil
}
