package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/dlpages"
)

// dlqCommand returns the "dlq" subcommand: inspect, replay and discard dead
// letters.
func dlqCommand() *command {
	return &command{
		name:     "dlq",
		synopsis: "list|show|replay|discard [flags] [ID...]",
		summary:  "list, show, replay or discard dead letters",
		help: `Dlq works on the dead letters idem.Consumer stored next to the markers:
deliveries that could not succeed by retrying (permanent errors, payload
conflicts, records that did not decode, retries out of attempts).

  idem dlq list    [--handler H] [--group G] [--state S] [--since T] [--until T] [--limit N] [--json]
  idem dlq show    ID [--json]
  idem dlq replay  (ID... | --group G | --all) [--handler H] [--since T] [--until T] [--limit N] [--yes]
  idem dlq discard (ID... | --group G | --all) [--handler H] [--since T] [--until T] [--limit N] [--yes]

list shows parked dead letters by default (--state all for every state).
--group is a fingerprint from list: the error's type and its message with
numbers and quoted values blanked, so alike failures share one. Times are
RFC 3339 (2026-11-22T10:00:00Z) or a duration back from now (36h, 7d).

replay marks parked dead letters "replay requested"; a running consumer of
their handler (Consumer.Run, or Consumer.Replay) runs them through the same
deduplication and ordering guard as a delivery, so replaying a message that
was already applied is a Duplicate, never a second effect (while its
marker is kept). discard marks them discarded: kept for the record, not
replayed. Both act on parked dead letters only; --limit N takes the oldest
N the other filters select. With --group or --all they list the dead
letters they would change, and change them only with --yes.

list's REASON is the error without the handler and message ID that start
it (their own columns); show and --json give the whole error. show --json
gives an envelope that is not JSON as envelope_bytes (base64).

Every subcommand takes --dsn (default $IDEM_DSN), --schema and --prefix.

` + dsnHelp,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			// The flags belong to the subcommands; defining them here too
			// lists them in the help.
			defineDLQFlags(fs)
			return func(ctx context.Context, e *env, args []string) error {
				if fs.NFlag() > 0 {
					return usagef("flags go after the subcommand: idem dlq list --handler H")
				}
				if len(args) == 0 {
					return usagef("missing subcommand: list, show, replay or discard")
				}
				return runDLQ(ctx, e, args[0], args[1:])
			}
		},
	}
}

// dlqFlags are the flags of the dlq subcommands.
type dlqFlags struct {
	store                 *storeFlags
	handler, group, state string
	since, until          string
	limit                 int
	all, json, yes        bool
	actor                 string
	// given holds the names of the flags given on the command line.
	given map[string]bool
}

// runDLQ parses a dlq subcommand's flags and runs it.
func runDLQ(ctx context.Context, e *env, sub string, args []string) error {
	switch sub {
	case "list", "show", "replay", "discard":
	default:
		return usagef("unknown subcommand %s: want list, show, replay or discard", quoteArg(sub))
	}
	fs := flag.NewFlagSet("idem dlq "+sub, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f := defineDLQFlags(fs)
	ids, err := parseInterspersed(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return showHelp(e, dlqCommand())
		}
		return err
	}
	f.given = map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { f.given[fl.Name] = true })
	filter, err := f.filter(ids, sub)
	if err != nil {
		return err
	}
	return runDLQParsed(ctx, e, sub, f, filter)
}

// unmatchedIDs fails a replay or discard that named dead letters by ID and
// changed fewer than it named: those are missing, not parked (already
// replayed or discarded), or outside the other filters.
func unmatchedIDs(f *driver.DeadLetterFilter, changed int) error {
	if len(f.IDs) == 0 || changed >= len(f.IDs) {
		return nil
	}
	verb := "were"
	if len(f.IDs)-changed == 1 {
		verb = "was"
	}
	return fmt.Errorf("%d of the %s named %s not changed: missing, not parked, or outside the filters ('idem dlq show ID' tells which)",
		len(f.IDs)-changed, plural(len(f.IDs), "dead letter"), verb)
}

// parseInterspersed parses fs's flags from args wherever they stand, before
// or after the positional arguments (idem dlq show 42 --json), and returns
// the positional ones in order. Everything after "--" is positional.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, flagError(err)
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		// flag stops at the first positional argument, or after a "--"
		// it consumed: then all that is left is positional.
		if len(rest) < len(args) && args[len(args)-len(rest)-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// defineDLQFlags defines the dlq subcommands' flags on fs.
func defineDLQFlags(fs *flag.FlagSet) *dlqFlags {
	f := &dlqFlags{store: addStoreFlags(fs, "dlq", true)}
	fs.StringVar(&f.handler, "handler", "", "only dead letters of this `handler`")
	fs.StringVar(&f.group, "group", "", "only dead letters with this `fingerprint`")
	fs.StringVar(&f.state, "state", driver.DeadLetterParked, "`state`: parked, replay_requested, replaying, replayed, discarded or all (list only)")
	fs.StringVar(&f.since, "since", "", "only dead letters that last failed at or after `T`")
	fs.StringVar(&f.until, "until", "", "only dead letters that last failed before `T`")
	fs.IntVar(&f.limit, "limit", 100, "list at most `N` (0: all); replay or discard the oldest N (only when given)")
	fs.BoolVar(&f.all, "all", false, "replay/discard every parked dead letter the other filters select")
	fs.BoolVar(&f.json, "json", false, "print JSON")
	fs.StringVar(&f.actor, "actor", "", "who is asking, recorded with a replay or discard (default: $IDEM_ACTOR, else $USER)")
	fs.BoolVar(&f.yes, "yes", false, "replay/discard with --group or --all: do it (without, the dead letters are listed and nothing changes)")
	return f
}

// runDLQParsed runs a dlq subcommand with its parsed flags.
func runDLQParsed(ctx context.Context, e *env, sub string, f *dlqFlags, filter *driver.DeadLetterFilter) error {
	s, err := f.store.open(ctx, e)
	if err != nil {
		return err
	}
	defer s.Close()
	dl, ok := s.idemDriver().(driver.DeadLetterStore)
	if !ok {
		return fmt.Errorf("%s has no dead-letter store", s)
	}
	if s.kind != kindRedis {
		if n, _, err := s.schemaVersion(ctx); err != nil {
			return err
		} else if n == 0 {
			return s.errNoTables(ctx)
		}
	}
	actor := resolveActor(f.actor, e)
	if (sub == "replay" || sub == "discard") && len(filter.IDs) == 0 && !f.yes {
		// A selection, not named dead letters: show it first.
		return dlqPreview(ctx, e, dl, filter, sub)
	}
	switch sub {
	case "list":
		return dlqList(ctx, e, dl, filter, f.json)
	case "show":
		return dlqShow(ctx, e, dl, filter, f.json)
	case "replay":
		n, err := idem.RequestReplay(ctx, dl, filter, actor)
		if err != nil {
			return err
		}
		fmt.Fprintf(e.stdout, "%s marked for replay; a running consumer of their handler replays them.\n", plural(n, "dead letter"))
		return unmatchedIDs(filter, n)
	case "discard":
		n, err := idem.Discard(ctx, dl, filter, actor)
		if err != nil {
			return err
		}
		fmt.Fprintf(e.stdout, "%s discarded.\n", plural(n, "dead letter"))
		return unmatchedIDs(filter, n)
	}
	return nil
}

// dlqPreviewRows bounds the dead letters a preview lists; its count and
// handlers cover the whole selection.
const dlqPreviewRows = 100

// dlqPreview lists the parked dead letters a replay or discard of filter
// would change, and returns a usage error saying how many there are, and
// of which handlers, and that --yes does it. --group names a fingerprint,
// which alike failures of every handler share: the operator who looked at
// one handler's group must learn here, not after the fact, that the
// selection reaches into others.
func dlqPreview(ctx context.Context, e *env, dl driver.DeadLetterStore, filter *driver.DeadLetterFilter, sub string) error {
	sel := *filter
	sel.State = driver.DeadLetterParked
	total, byHandler, err := dlqCount(ctx, dl, &sel)
	if err != nil {
		return err
	}
	if total == 0 {
		fmt.Fprintln(e.stdout, "No parked dead letters match.")
		return usagef("nothing done: no parked dead letter matches")
	}
	shown := sel
	shown.Limit = dlqPreviewRows
	if sel.Limit > 0 {
		shown.Limit = min(sel.Limit, dlqPreviewRows)
	}
	if err := dlqRows(ctx, e, dl, &shown); err != nil {
		return err
	}
	handlers := slices.Sorted(maps.Keys(byHandler))
	var names []string
	for i, h := range handlers {
		if i == 5 {
			names = append(names, fmt.Sprintf("and %d more", len(handlers)-i))
			break
		}
		names = append(names, fmt.Sprintf("%s (%d)", termText(h), byHandler[h]))
	}
	fmt.Fprintln(e.stdout)
	if total > shown.Limit {
		fmt.Fprintf(e.stdout, "The oldest %d of them are listed above.\n", shown.Limit)
	}
	fmt.Fprintf(e.stdout, "%s to %s, of %s: %s.\n", plural(total, "parked dead letter"), sub, plural(len(handlers), "handler"), strings.Join(names, ", "))
	if len(handlers) > 1 && filter.Handler == "" {
		return usagef("nothing done: the selection spans %d handlers; add --handler H to %s one handler's, or --yes to %s the %s selected", len(handlers), sub, sub, plural(total, "dead letter"))
	}
	return usagef("nothing done: add --yes to %s the %s selected", sub, plural(total, "dead letter"))
}

// dlqCountPage is how many summaries dlqCount reads at a time; a
// variable so that tests page through a few dozen.
var dlqCountPage = 1000

// dlqCount counts the dead letters f selects (the oldest f.Limit of them
// when it is set) per handler, paging through them as a replay or discard
// reads them.
func dlqCount(ctx context.Context, dl driver.DeadLetterStore, f *driver.DeadLetterFilter) (total int, byHandler map[string]int, err error) {
	byHandler = map[string]int{}
	err = dlpages.Each(ctx, dl, f, dlqCountPage, func(page []driver.DeadLetter) error {
		for _, d := range page {
			byHandler[d.Handler]++
		}
		total += len(page)
		return nil
	})
	if err != nil {
		return 0, nil, err
	}
	return total, byHandler, nil
}

// filter builds the selection from the flags and the IDs in args.
func (f *dlqFlags) filter(args []string, sub string) (*driver.DeadLetterFilter, error) {
	flt := &driver.DeadLetterFilter{Handler: f.handler, Fingerprint: f.group}
	// A flag the subcommand would ignore is refused: --json on a replay
	// would leave a script parsing text, --all on a list would still list
	// the parked ones only.
	for _, fl := range []struct {
		name string
		subs []string
	}{
		{"json", []string{"list", "show"}},
		{"all", []string{"replay", "discard"}},
		{"yes", []string{"replay", "discard"}},
		{"actor", []string{"replay", "discard"}},
	} {
		if f.given[fl.name] && !slices.Contains(fl.subs, sub) {
			return nil, usagef("--%s does not apply to dlq %s", fl.name, sub)
		}
	}
	for _, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id <= 0 {
			return nil, usagef("dead-letter ID %s is not a positive number", quoteArg(a))
		}
		// Once each: "replay 1 1" changes one dead letter, as asked.
		if !slices.Contains(flt.IDs, id) {
			flt.IDs = append(flt.IDs, id)
		}
	}
	if f.limit < 0 {
		return nil, usagef("--limit %d: want 0 (all) or more", f.limit)
	}
	var err error
	if flt.Since, err = parseWhen(f.since); err != nil {
		return nil, err
	}
	if flt.Until, err = parseWhen(f.until); err != nil {
		return nil, err
	}
	if !flt.Since.IsZero() && !flt.Until.IsZero() && flt.Since.After(flt.Until) {
		return nil, usagef("--since %s is after --until %s: nothing can match", f.since, f.until)
	}
	switch sub {
	case "list":
		if len(args) > 0 {
			return nil, usagef("list takes no IDs (got %s): use 'idem dlq show ID'", quoteArgs(args))
		}
		if f.state != "all" {
			switch f.state {
			case driver.DeadLetterParked, driver.DeadLetterReplayRequested, driver.DeadLetterReplaying, driver.DeadLetterReplayed, driver.DeadLetterDiscarded:
			default:
				return nil, usagef("--state %q: want parked, replay_requested, replaying, replayed, discarded or all", f.state)
			}
			flt.State = f.state
		}
		flt.Limit = f.limit
	case "show":
		if len(args) != 1 {
			return nil, usagef("show takes exactly one dead-letter ID")
		}
		for _, name := range []string{"state", "limit", "handler", "group", "since", "until", "all"} {
			if f.given[name] {
				return nil, usagef("show takes an ID only, not --%s (list selects)", name)
			}
		}
	default:
		if len(flt.IDs) == 0 && flt.Fingerprint == "" && !f.all {
			return nil, usagef("%s needs IDs, --group or --all: it never acts on everything by accident", sub)
		}
		// Only parked dead letters are replayed or discarded.
		if f.given["state"] && f.state != driver.DeadLetterParked {
			return nil, usagef("--state %q: %s acts on parked dead letters only", f.state, sub)
		}
		// --limit's default bounds what list prints; here it applies
		// only when given: the oldest N of the selection.
		if f.given["limit"] {
			if len(flt.IDs) > 0 {
				return nil, usagef("--limit selects among --group or --all, not among named IDs")
			}
			flt.Limit = f.limit
		}
	}
	return flt, nil
}

// parseWhen reads an RFC 3339 time or a duration back from now.
func parseWhen(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if d, err := parseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, usagef("time %s: a duration counts back from now and must not be negative", quoteArg(s))
		}
		return time.Now().Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, usagef("time %s: want RFC 3339 (2026-11-22T10:00:00Z) or a duration (36h, 7d)", quoteArg(s))
	}
	return t, nil
}

// dlqJSON is a dead letter as printed with --json.
type dlqJSON struct {
	ID          int64           `json:"id"`
	Handler     string          `json:"handler"`
	MessageID   string          `json:"message_id"`
	State       string          `json:"state"`
	Class       string          `json:"class"`
	Fingerprint string          `json:"fingerprint"`
	Error       string          `json:"error"`
	Attempts    int             `json:"attempts"`
	FirstFailed time.Time       `json:"first_failed_at"`
	LastFailed  time.Time       `json:"last_failed_at"`
	Source      string          `json:"source,omitempty"`
	Envelope    json.RawMessage `json:"envelope,omitempty"`
	// EnvelopeBytes is an envelope that is not JSON (a corrupt row, one
	// another writer left), as stored: embedded as it is, it would make
	// the whole output invalid.
	EnvelopeBytes []byte        `json:"envelope_bytes,omitempty"`
	Raw           []byte        `json:"raw,omitempty"`
	History       []historyJSON `json:"history,omitempty"`
}

// historyJSON is one entry of a dead letter's log.
type historyJSON struct {
	At      time.Time `json:"at"`
	State   string    `json:"state"`
	Actor   string    `json:"actor"`
	Outcome string    `json:"outcome,omitempty"`
}

func toJSON(d driver.DeadLetter, full bool) dlqJSON {
	j := dlqJSON{ID: d.ID, Handler: d.Handler, MessageID: d.MessageID, State: d.State, Class: d.Class, Fingerprint: d.Fingerprint,
		Error: d.Error, Attempts: d.Attempts, FirstFailed: d.FirstFailed.UTC(), LastFailed: d.LastFailed.UTC(), Source: d.Source}
	if full {
		j.Raw = d.Raw
		if json.Valid(d.Envelope) {
			j.Envelope = d.Envelope
		} else if len(d.Envelope) > 0 {
			j.EnvelopeBytes = d.Envelope
		}
	}
	return j
}

func dlqList(ctx context.Context, e *env, dl driver.DeadLetterStore, f *driver.DeadLetterFilter, asJSON bool) error {
	// One more than the limit, to say whether the list was cut short;
	// summaries only: a list shows no bodies, and their size is not
	// bounded.
	limit := f.Limit
	g := *f
	g.Summary = true
	if limit > 0 {
		g.Limit = limit + 1
	}
	f = &g
	dls, err := dl.DeadLetterList(ctx, f)
	if err != nil {
		return err
	}
	more := limit > 0 && len(dls) > limit
	if more {
		dls = dls[:limit]
		fmt.Fprintf(e.stderr, "idem dlq list: showing the first %d; more match (--limit 0 lists all).\n", limit)
	}
	if asJSON {
		out := make([]dlqJSON, len(dls))
		for i, d := range dls {
			out[i] = toJSON(d, false)
		}
		return writeJSON(e.stdout, out)
	}
	if len(dls) == 0 {
		fmt.Fprintln(e.stdout, "No dead letters match.")
		return nil
	}
	if err := writeDLQRows(e, dls); err != nil {
		return err
	}
	groups := map[string]int{}
	for _, d := range dls {
		groups[d.Fingerprint]++
	}
	shown := plural(len(dls), "dead letter")
	if more {
		shown = "The first " + shown + " (more match; --limit 0 lists all)"
	}
	fmt.Fprintf(e.stdout, "\n%s in %s (select one with --group '<fingerprint>'; --json shows the fingerprints).\n", shown, plural(len(groups), "group"))
	return nil
}

// dlqRows prints the dead letters f selects as list does, without its
// summary.
func dlqRows(ctx context.Context, e *env, dl driver.DeadLetterStore, f *driver.DeadLetterFilter) error {
	g := *f
	g.Summary = true
	dls, err := dl.DeadLetterList(ctx, &g)
	if err != nil {
		return err
	}
	return writeDLQRows(e, dls)
}

// writeDLQRows prints dead letters as a table, every stored string
// escaped.
func writeDLQRows(e *env, dls []driver.DeadLetter) error {
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tHANDLER\tMESSAGE\tCLASS\tATTEMPTS\tLAST FAILED\tSTATE\tREASON")
	for _, d := range dls {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", d.ID, termText(d.Handler), termText(orDash(d.MessageID)), termText(d.Class), d.Attempts,
			d.LastFailed.UTC().Format(time.RFC3339), termText(d.State), termText(clip(dlqReason(&d), 80)))
	}
	return tw.Flush()
}

func dlqShow(ctx context.Context, e *env, dl driver.DeadLetterStore, f *driver.DeadLetterFilter, asJSON bool) error {
	dls, err := dl.DeadLetterList(ctx, f)
	if err != nil {
		return err
	}
	if len(dls) == 0 {
		return fmt.Errorf("no dead letter %d", f.IDs[0])
	}
	d := dls[0]
	hist, err := dl.DeadLetterHistory(ctx, d.ID)
	if err != nil {
		return err
	}
	if asJSON {
		j := toJSON(d, true)
		for _, h := range hist {
			j.History = append(j.History, historyJSON{At: h.At.UTC(), State: h.State, Actor: h.Actor, Outcome: h.Outcome})
		}
		return writeJSON(e.stdout, j)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	for _, kv := range [][2]string{
		{"ID", strconv.FormatInt(d.ID, 10)}, {"Handler", d.Handler}, {"Message ID", orDash(d.MessageID)},
		{"State", d.State}, {"Class", d.Class}, {"Attempts", strconv.Itoa(d.Attempts)},
		{"First failed", d.FirstFailed.UTC().Format(time.RFC3339)}, {"Last failed", d.LastFailed.UTC().Format(time.RFC3339)},
		{"Source", orDash(d.Source)}, {"Group", d.Fingerprint}, {"Error", d.Error},
		{"Envelope", orDash(string(d.Envelope))}, {"Raw", strconv.Quote(clip(string(d.Raw), 400))},
	} {
		fmt.Fprintf(tw, "%s:\t%s\n", kv[0], termText(kv[1]))
	}
	for i, h := range hist {
		label := ""
		if i == 0 {
			label = "History:"
		}
		line := h.At.UTC().Format(time.RFC3339) + "  " + h.State + " by " + h.Actor
		if h.Outcome != "" {
			line += ": " + h.Outcome
		}
		fmt.Fprintf(tw, "%s\t%s\n", label, termText(line))
	}
	return tw.Flush()
}

// dlqReason is a dead letter's error without what its own columns say:
// idem's errors start with the handler and the message ID
// (`idem: handler "h", message "m": …`), which in a list repeats on
// every line and pushes the reason out of its column.
func dlqReason(d *driver.DeadLetter) string {
	msg := strings.TrimPrefix(d.Error, "idem: ")
	for _, p := range []string{
		fmt.Sprintf("handler %q, message %q: ", d.Handler, d.MessageID),
		fmt.Sprintf("handler %q, message %q, ", d.Handler, d.MessageID),
		fmt.Sprintf("handler %q: ", d.Handler),
	} {
		if rest, ok := strings.CutPrefix(msg, p); ok {
			return rest
		}
	}
	return d.Error
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// clip shortens s to n bytes on a rune boundary, on one line.
func clip(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) <= n {
		return s
	}
	for n > 0 && (s[n]&0xC0) == 0x80 {
		n--
	}
	return s[:n] + "…"
}
