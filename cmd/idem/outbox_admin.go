package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/outbox"
)

// outboxAdminHelp is the part of 'idem outbox --help' on the rows.
const outboxAdminHelp = `Outbox list shows the unpublished rows, oldest first: each row's state
(pending, failing or parked), destination (topic or subject), ordering key
(the aggregate), failed attempts, age, and the last error. NOTE says why a
row waits: "held 12s" (a failed key's backoff), "relay R" (a relay is
publishing its key now), "behind 42" (a parked row of its key comes first).
--state, --stream and --key select; --limit N and --after ID page.

Outbox retry ID... makes rows publishable at once: a parked row is
unparked and a failing key's backoff ends, so the next relay cycle takes
them. --all-failing retries every failing row --stream and --key select;
it lists them and needs --yes.

Outbox park ID... [--reason R] sets rows aside: no relay publishes a
parked row, nor the later rows of its key, until it is retried or
discarded. Use it for a row the broker will never take.

Outbox discard ID... deletes unpublished rows: they are never published,
and their keys' later rows go on (a consumer's ordering guard sees a gap).
It lists the rows and needs --yes.

A row whose key a relay is publishing at that moment is left alone
("busy"): repeat the command. Every retry, park and discard is recorded in
the outbox log table with --actor and --reason.`

// outboxAdminFlags are the flags of list, retry, park and discard.
type outboxAdminFlags struct {
	state, stream, key string
	limit              int
	after              int64
	allFailing, yes    bool
	reason, actor      string
	// given holds the names of the flags given; positional the row IDs.
	given      map[string]bool
	positional []string
	// ids are the positional row IDs, parsed by check.
	ids []int64
}

// outboxAdminFlagNames are the flags defineOutboxAdminFlags defines.
var outboxAdminFlagNames = []string{"state", "stream", "key", "limit", "after", "all-failing", "yes", "reason", "actor"}

// defineOutboxAdminFlags defines them on fs.
func defineOutboxAdminFlags(fs *flag.FlagSet) *outboxAdminFlags {
	f := &outboxAdminFlags{}
	fs.StringVar(&f.state, "state", "", "list: only rows in this `state`: pending, failing or parked")
	fs.StringVar(&f.stream, "stream", "", "list, retry --all-failing: only rows to this `destination` (topic or subject)")
	fs.StringVar(&f.key, "key", "", "list, retry --all-failing: only rows of this ordering `key` (the aggregate ID)")
	fs.IntVar(&f.limit, "limit", driver.OutboxListDefault, "list: at most `N` rows (up to 1000)")
	fs.Int64Var(&f.after, "after", 0, "list: only rows after this `ID` (the next page)")
	fs.BoolVar(&f.allFailing, "all-failing", false, "retry: every failing row --stream and --key select")
	fs.BoolVar(&f.yes, "yes", false, "discard, retry --all-failing: do it (without, the rows are listed and nothing changes)")
	fs.StringVar(&f.reason, "reason", "", "park, discard: why, recorded with the action")
	fs.StringVar(&f.actor, "actor", "", "who is acting, recorded with a retry, park or discard (default: $IDEM_ACTOR, else $USER)")
	return f
}

// outboxAdminSchema is the first schema version with parking, by store.
func outboxAdminSchema(k storeKind) int {
	switch k {
	case kindPostgres:
		return 13
	case kindMySQL:
		return 2
	}
	return 9
}

// runOutboxAdmin runs list, retry, park or discard with f parsed.
func runOutboxAdmin(ctx context.Context, e *env, s *store, sub string, f *outboxAdminFlags, asJSON bool) error {
	if n, version, err := s.schemaVersion(ctx); err != nil {
		return err
	} else if n == 0 {
		return s.errNoTables(ctx)
	} else if version < outboxAdminSchema(s.kind) {
		return fmt.Errorf("%s has no outbox administration yet (schema version %d): run 'idem migrate' first", s, version)
	}
	adm, err := outbox.NewAdmin(s.idemDriver(), slog.New(slog.DiscardHandler))
	if err != nil {
		return fmt.Errorf("%s: %w", s, err)
	}
	actor := resolveActor(f.actor, e)
	ids := f.ids
	switch sub {
	case "list":
		return outboxList(ctx, e.stdout, e.stderr, adm, driver.OutboxFilter{State: driver.OutboxState(f.state), Destination: f.stream, OrderingKey: f.key, AfterID: f.after, Limit: f.limit}, asJSON)
	case "park":
		res, err := adm.Park(ctx, ids, actor, f.reason)
		if err != nil {
			return err
		}
		return reportAction(e.stdout, "parked", "not found, published or parked already", res)
	case "retry":
		if f.allFailing {
			var err error
			if ids, err = outboxPreview(ctx, e.stdout, adm, driver.OutboxFilter{State: driver.OutboxFailing, Destination: f.stream, OrderingKey: f.key}, "retry", f.yes); err != nil || ids == nil {
				return err
			}
		}
		res, err := adm.RetryNow(ctx, ids, actor)
		if err != nil {
			return err
		}
		return reportAction(e.stdout, "retried", "not found or published", res)
	case "discard":
		if !f.yes {
			_, err := outboxPreview(ctx, e.stdout, adm, driver.OutboxFilter{}, "discard", false, ids...)
			return err
		}
		res, err := adm.Discard(ctx, ids, actor, f.reason)
		if err != nil {
			return err
		}
		return reportAction(e.stdout, "discarded", "not found or published", res)
	}
	return usagef("unknown subcommand %q", sub)
}

// check refuses the flags and arguments that do not belong to sub.
func (f *outboxAdminFlags) check(sub string) error {
	belongs := map[string][]string{
		"list":    {"state", "stream", "key", "limit", "after", "json"},
		"retry":   {"all-failing", "stream", "key", "yes", "actor"},
		"park":    {"reason", "actor"},
		"discard": {"reason", "actor", "yes"},
	}[sub]
	for name := range f.given {
		if isStoreFlag(name) || slices.Contains(belongs, name) {
			continue
		}
		return usagef("--%s does not apply to outbox %s", name, sub)
	}
	if !driver.OutboxState(f.state).Valid() {
		return usagef("--state %q: want pending, failing or parked", f.state)
	}
	if f.limit < 1 || f.limit > driver.OutboxListMax {
		return usagef("--limit %d: want 1 to %d", f.limit, driver.OutboxListMax)
	}
	if f.after < 0 {
		return usagef("--after %d: want a row ID", f.after)
	}
	var err error
	if f.ids, err = parseRowIDs(f.positional); err != nil {
		return err
	}
	switch sub {
	case "list":
		if len(f.positional) > 0 {
			return usagef("list takes no IDs (got %s): select with --state, --stream and --key", quoteArgs(f.positional))
		}
	case "retry":
		if f.allFailing == (len(f.positional) > 0) {
			return usagef("retry takes row IDs or --all-failing, one of the two")
		}
		if !f.allFailing && (f.given["stream"] || f.given["key"] || f.given["yes"]) {
			return usagef("--stream, --key and --yes go with --all-failing; named IDs are retried as they are")
		}
	case "park", "discard":
		if len(f.positional) == 0 {
			return usagef("%s needs row IDs ('idem outbox list' shows them)", sub)
		}
	}
	return nil
}

// isStoreFlag reports whether name is one of addStoreFlags' flags.
func isStoreFlag(name string) bool { return name == "dsn" || name == "schema" || name == "prefix" }

// parseRowIDs reads outbox row IDs, each once.
func parseRowIDs(args []string) ([]int64, error) {
	var ids []int64
	for _, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id <= 0 {
			return nil, usagef("row ID %s is not a positive number", quoteArg(a))
		}
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// resolveActor returns who is acting: the flag, else $IDEM_ACTOR, else
// $USER, else "unknown".
func resolveActor(flagValue string, e *env) string {
	actor := flagValue
	for _, v := range []string{"IDEM_ACTOR", "USER"} {
		if actor == "" {
			actor = e.getenv(v)
		}
	}
	if actor == "" {
		actor = "unknown"
	}
	return actor
}

// outboxRowJSON is an unpublished row as list --json prints it.
type outboxRowJSON struct {
	ID           int64      `json:"id"`
	State        string     `json:"state"`
	Destination  string     `json:"destination"`
	OrderingKey  string     `json:"ordering_key"`
	MessageID    string     `json:"message_id"`
	AggregateID  string     `json:"aggregate_id,omitempty"`
	Seq          int64      `json:"seq,omitempty"`
	Type         string     `json:"type,omitempty"`
	CreatedAt    time.Time  `json:"created_at"`
	Attempts     int        `json:"attempts"`
	LastError    string     `json:"last_error,omitempty"`
	HeldUntil    *time.Time `json:"held_until,omitempty"`
	ClaimedBy    string     `json:"claimed_by,omitempty"`
	ClaimedUntil *time.Time `json:"claimed_until,omitempty"`
	ParkedAt     *time.Time `json:"parked_at,omitempty"`
	ParkedBy     string     `json:"parked_by,omitempty"`
	ParkReason   string     `json:"park_reason,omitempty"`
	BlockedBy    int64      `json:"blocked_by,omitempty"`
	PayloadBytes int        `json:"payload_bytes"`
}

// outboxListJSON is what list --json prints.
type outboxListJSON struct {
	Rows   []outboxRowJSON `json:"rows"`
	Counts struct {
		Pending int64 `json:"pending"`
		Failing int64 `json:"failing"`
		Parked  int64 `json:"parked"`
	} `json:"counts"`
	// Next is the --after of the next page; absent on the last.
	Next int64 `json:"next,omitempty"`
}

func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	u := t.UTC()
	return &u
}

func outboxList(ctx context.Context, w, errw io.Writer, adm *outbox.Admin, f driver.OutboxFilter, asJSON bool) error {
	page, err := adm.List(ctx, f)
	if err != nil {
		return err
	}
	if asJSON {
		out := outboxListJSON{Rows: []outboxRowJSON{}, Next: page.Next}
		out.Counts.Pending, out.Counts.Failing, out.Counts.Parked = page.Counts.Pending, page.Counts.Failing, page.Counts.Parked
		for _, r := range page.Rows {
			out.Rows = append(out.Rows, outboxRowJSON{ID: r.ID, State: string(r.State), Destination: r.Destination, OrderingKey: r.OrderingKey,
				MessageID: r.MessageID, AggregateID: r.AggregateID, Seq: r.Seq, Type: r.Type, CreatedAt: r.CreatedAt.UTC(), Attempts: r.Attempts,
				LastError: r.LastError, HeldUntil: timePtr(r.HeldUntil), ClaimedBy: r.ClaimedBy, ClaimedUntil: timePtr(r.ClaimedUntil),
				ParkedAt: timePtr(r.ParkedAt), ParkedBy: r.ParkedBy, ParkReason: r.ParkReason, BlockedBy: r.BlockedBy, PayloadBytes: len(r.Payload)})
		}
		return writeJSON(w, out)
	}
	counts := fmt.Sprintf("%d pending, %d failing, %d parked", page.Counts.Pending, page.Counts.Failing, page.Counts.Parked)
	if len(page.Rows) == 0 {
		fmt.Fprintf(w, "No unpublished rows match (%s).\n", counts)
		return nil
	}
	writeOutboxRows(w, page.Rows, time.Now())
	fmt.Fprintf(w, "\n%s unpublished (%s).\n", plural(len(page.Rows), "row"), counts)
	if page.Next != 0 {
		fmt.Fprintf(errw, "idem outbox list: more match; the next page: --after %d\n", page.Next)
	}
	return nil
}

// writeOutboxRows prints rows as a table, every stored string escaped.
func writeOutboxRows(w io.Writer, rows []driver.OutboxEntry, now time.Time) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tSTREAM\tKEY\tATTEMPTS\tAGE\tNOTE\tLAST ERROR")
	for _, r := range rows {
		note := "-"
		switch {
		case r.State == driver.OutboxParked:
			note = "parked by " + r.ParkedBy
			if r.ParkReason != "" {
				note += ": " + r.ParkReason
			}
		case r.BlockedBy != 0:
			note = "behind " + strconv.FormatInt(r.BlockedBy, 10)
		case r.ClaimedBy != "":
			note = "relay " + r.ClaimedBy
		case !r.HeldUntil.IsZero():
			note = "held " + r.HeldUntil.Sub(now).Round(time.Second).String()
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", r.ID, r.State, termText(clip(r.Destination, 40)), termText(clip(r.OrderingKey, 40)), r.Attempts,
			now.Sub(r.CreatedAt).Round(time.Second), termText(clip(note, 40)), termText(orDash(clip(r.LastError, 80))))
	}
	tw.Flush()
}

// outboxPreview lists the rows an action would change, the rows f
// selects or those named, and returns their IDs when yes is set. Without
// yes it returns a usage error saying how to go on, having changed
// nothing; with nothing to do it returns nil IDs and no error.
func outboxPreview(ctx context.Context, w io.Writer, adm *outbox.Admin, f driver.OutboxFilter, action string, yes bool, named ...int64) ([]int64, error) {
	var rows []driver.OutboxEntry
	if len(named) > 0 {
		f.IDs = named // a row not listed is published or unknown
	}
	f.Limit = driver.OutboxListMax
	for {
		page, err := adm.List(ctx, f)
		if err != nil {
			return nil, err
		}
		rows = append(rows, page.Rows...)
		if page.Next == 0 {
			break
		}
		f.AfterID = page.Next
	}
	if len(rows) == 0 {
		fmt.Fprintf(w, "No unpublished rows to %s.\n", action)
		if len(named) > 0 {
			return nil, fmt.Errorf("none of the %s named is unpublished", plural(len(named), "row"))
		}
		return nil, nil
	}
	writeOutboxRows(w, rows, time.Now())
	fmt.Fprintln(w)
	if !yes {
		return nil, usagef("nothing done: add --yes to %s these %s", action, plural(len(rows), "row"))
	}
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	return ids, nil
}

// reportAction prints what an action did, and fails when it left rows
// alone.
func reportAction(w io.Writer, verb, missing string, res driver.OutboxActionResult) error {
	fmt.Fprintf(w, "%s %s", verb, plural(len(res.Done), "row"))
	if len(res.Done) > 0 {
		fmt.Fprintf(w, ": %s", joinIDs(res.Done))
	}
	fmt.Fprintln(w, ".")
	if len(res.Busy) > 0 {
		fmt.Fprintf(w, "busy, a relay is publishing their key: %s (repeat the command)\n", joinIDs(res.Busy))
	}
	if len(res.Missing) > 0 {
		fmt.Fprintf(w, "%s: %s\n", missing, joinIDs(res.Missing))
	}
	if n := len(res.Busy) + len(res.Missing); n > 0 {
		return fmt.Errorf("%s left unchanged", plural(n, "row"))
	}
	return nil
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ", ")
}
