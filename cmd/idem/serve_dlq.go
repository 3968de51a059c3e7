package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// The console's dead-letter pages: the groups (one per handler and
// fingerprint), a group's letters a page at a time, one letter, and the
// actions on them with their confirmation and result.

// consolePageSize is how many letters a group's page lists.
const consolePageSize = 50

// consoleMaxGroups bounds the groups listed: each is a distinct failure.
const consoleMaxGroups = 500

// consoleMaxSelection bounds the dead letters one form may name.
const consoleMaxSelection = 1000

// consolePayloadMax bounds the bytes of one payload the letter page shows.
const consolePayloadMax = 256 << 10

// deadLetterStates are the states a page may select, and "all".
var deadLetterStates = []string{driver.DeadLetterParked, driver.DeadLetterReplayRequested, driver.DeadLetterReplaying,
	driver.DeadLetterReplayed, driver.DeadLetterDiscarded, "all"}

// dlGroup is the dead letters of one handler failing one way.
type dlGroup struct {
	Handler, Fingerprint string
	// Class is the group's class, or the classes it holds joined by "/".
	Class       string
	Count       int64
	FirstFailed time.Time
	LastFailed  time.Time
	// Sample is the error of the group's newest dead letter, without the
	// prefix every error of the handler repeats.
	Sample   string
	sampleID int64
}

// stateWhere returns the condition selecting state ("all": every one) as
// SQL with its parameter at $n, and the argument.
func stateWhere(state string, n int) (string, []any) {
	if state == "all" {
		return "TRUE", nil
	}
	return "state = $" + strconv.Itoa(n), []any{state}
}

// microExpr returns the SQL reading a time column's aggregate as Unix
// microseconds: SQLite stores them so, PostgreSQL as timestamptz.
func (s *store) microExpr(agg string) string {
	if s.kind == kindPostgres {
		return `(extract(epoch FROM ` + agg + `) * 1000000)::bigint`
	}
	return agg
}

// deadLetterGroups returns the groups of the dead letters in state, the
// largest first.
func (s *store) deadLetterGroups(ctx context.Context, dl driver.DeadLetterStore, state string) ([]dlGroup, error) {
	where, args := stateWhere(state, 1)
	q := `SELECT handler, fingerprint, min(class), max(class), count(*), ` + s.microExpr("min(first_failed_at)") + `, ` +
		s.microExpr("max(last_failed_at)") + `, max(id) FROM ` + s.table("dead_letters") + ` WHERE ` + where +
		` GROUP BY handler, fingerprint ORDER BY count(*) DESC, handler, fingerprint LIMIT ` + strconv.Itoa(consoleMaxGroups)
	var groups []dlGroup
	err := s.queryRows(ctx, q, func(scan func(...any) error) error {
		var (
			g              dlGroup
			lo, hi         string
			first, last    int64
			handler, print *string
		)
		if err := scan(&handler, &print, &lo, &hi, &g.Count, &first, &last, &g.sampleID); err != nil {
			return err
		}
		g.Handler, g.Fingerprint = deref(handler), deref(print)
		g.Class = lo
		if hi != lo {
			g.Class = lo + "/" + hi
		}
		g.FirstFailed, g.LastFailed = time.UnixMicro(first).UTC(), time.UnixMicro(last).UTC()
		groups = append(groups, g)
		return nil
	}, args...)
	if err != nil {
		return nil, fmt.Errorf("read dead-letter groups: %w", err)
	}
	if len(groups) == 0 {
		return nil, nil
	}
	ids := make([]int64, len(groups))
	for i, g := range groups {
		ids[i] = g.sampleID
	}
	samples, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: ids, Summary: true})
	if err != nil {
		return nil, fmt.Errorf("read dead-letter groups: %w", err)
	}
	byID := make(map[int64]driver.DeadLetter, len(samples))
	for _, d := range samples {
		byID[d.ID] = d
	}
	for i := range groups {
		if d, ok := byID[groups[i].sampleID]; ok {
			groups[i].Sample = shortError(d)
		}
	}
	return groups, nil
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// deadLetterTotals counts the dead letters in state and their groups, for
// when deadLetterGroups lists only the largest consoleMaxGroups.
func (s *store) deadLetterTotals(ctx context.Context, state string) (letters, groups int64, err error) {
	where, args := stateWhere(state, 1)
	t := s.table("dead_letters")
	err = s.queryRows(ctx, `SELECT count(*) FROM `+t+` WHERE `+where, func(scan func(...any) error) error { return scan(&letters) }, args...)
	if err == nil {
		err = s.queryRows(ctx, `SELECT count(*) FROM (SELECT 1 AS one FROM `+t+` WHERE `+where+` GROUP BY handler, fingerprint) g`,
			func(scan func(...any) error) error { return scan(&groups) }, args...)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("count dead letters: %w", err)
	}
	return letters, groups, nil
}

// deadLetterCount counts the dead letters of handler with fingerprint in
// state.
func (s *store) deadLetterCount(ctx context.Context, handler, fingerprint, state string) (int64, error) {
	where, args := stateWhere(state, 3)
	var n int64
	err := s.queryRows(ctx, `SELECT count(*) FROM `+s.table("dead_letters")+` WHERE handler = $1 AND fingerprint = $2 AND `+where,
		func(scan func(...any) error) error { return scan(&n) }, append([]any{handler, fingerprint}, args...)...)
	if err != nil {
		return 0, fmt.Errorf("count dead letters: %w", err)
	}
	return n, nil
}

// shortError is d's error without what every error of its handler
// repeats: the library's `idem: handler "…", message "…": ` and the class
// the table shows beside it (`permanent: `).
func shortError(d driver.DeadLetter) string {
	e := d.Error
	rest, ok := strings.CutPrefix(e, "idem: handler "+strconv.Quote(d.Handler))
	if !ok {
		return e
	}
	if d.MessageID != "" {
		rest = strings.TrimPrefix(rest, ", message "+strconv.Quote(d.MessageID))
	}
	rest, ok = strings.CutPrefix(rest, ": ")
	if !ok {
		return e
	}
	rest = strings.TrimPrefix(rest, d.Class+": ")
	if rest == "" {
		return e
	}
	return rest
}

// payloadView is a payload as the letter page shows it.
type payloadView struct {
	// Kind is "JSON", "text", "binary (hex)" or "empty".
	Kind string
	Text string
	// Size is the payload's length; Shown how many of its bytes Text
	// holds.
	Size, Shown int
}

// renderPayload shows b as indented JSON when it is JSON, as text when it
// is UTF-8 text, else as a hex dump; control and format characters are
// escaped (termBlock), so what shows is what is stored.
func renderPayload(b []byte) payloadView {
	v := payloadView{Size: len(b), Shown: len(b)}
	if len(b) == 0 {
		v.Kind = "empty"
		return v
	}
	if len(b) <= consolePayloadMax && json.Valid(b) {
		var buf bytes.Buffer
		if json.Indent(&buf, b, "", "  ") == nil {
			v.Kind, v.Text = "JSON", termBlock(buf.String())
			return v
		}
	}
	if len(b) > consolePayloadMax {
		b, v.Shown = b[:consolePayloadMax], consolePayloadMax
	}
	if isText(b) {
		v.Kind, v.Text = "text", termBlock(string(b))
		return v
	}
	v.Kind, v.Text = "binary (hex)", hexDump(b)
	return v
}

// isText reports whether b is UTF-8 with few control characters besides
// newlines and tabs (a cut at the bound may split the last character).
func isText(b []byte) bool {
	s := strings.ToValidUTF8(string(b), "\uFFFD")
	if strings.Count(s, "\uFFFD") > 4 {
		return false
	}
	ctl := 0
	for _, r := range s {
		if r < 0x20 && r != '\n' && r != '\t' && r != '\r' {
			ctl++
		}
	}
	return ctl*20 <= len(s)
}

// hexDump writes b as lines of 16 bytes: offset, hex, printable ASCII.
func hexDump(b []byte) string {
	var sb strings.Builder
	for off := 0; off < len(b); off += 16 {
		line := b[off:min(off+16, len(b))]
		fmt.Fprintf(&sb, "%08x ", off)
		for i := range 16 {
			if i < len(line) {
				fmt.Fprintf(&sb, " %02x", line[i])
			} else {
				sb.WriteString("   ")
			}
		}
		sb.WriteString("  ")
		for _, c := range line {
			if c < 0x20 || c > 0x7e {
				c = '.'
			}
			sb.WriteByte(c)
		}
		sb.WriteByte('\n')
	}
	return sb.String()
}

// shellQuote quotes s for a POSIX shell, leaving plain words as they are.
// A string that termText would escape (a line break, a control or format
// character, a byte that is not UTF-8: a multi-line error's fingerprint)
// is quoted as $'…' with those escapes, which the shell turns back into
// the bytes they stand for: in '…' the page would show the escapes, and
// the command copied from it would name another string.
func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("_-./:@%+=,", r))
	}) < 0 {
		return s
	}
	if termText(s) != s {
		return "$'" + termText(strings.NewReplacer(`\`, `\\`, "'", `\'`).Replace(s)) + "'"
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// cliStoreFlags are the flags an equivalent 'idem' command needs to find
// the tables besides the DSN, which it takes from $IDEM_DSN: the page never
// shows the DSN, whose password it would give away.
func (s *store) cliStoreFlags() string {
	var f string
	if s.opts.Schema != "" {
		f += " --schema " + shellQuote(s.opts.Schema)
	}
	if s.opts.Prefix != "" && s.opts.Prefix != defaultPrefix {
		f += " --prefix " + shellQuote(s.opts.Prefix)
	}
	return f
}

// dlqCommandFor returns the 'idem dlq' command line doing sub for one dead
// letter (id > 0) or a group.
func (s *store) dlqCommandFor(sub string, id int64, handler, fingerprint string) string {
	c := "idem dlq " + sub
	if id > 0 {
		c += " " + strconv.FormatInt(id, 10)
	} else {
		c += " --handler " + shellQuote(handler) + " --group " + shellQuote(fingerprint)
	}
	return termText(c + s.cliStoreFlags())
}

// groupsPage is the dead-letter groups page.
type groupsPage struct {
	State  string
	States []string
	Groups []dlGroup
	// Total and NGroups count every dead letter in State and their
	// groups, Groups lists the largest (Capped: not all of them).
	Total, NGroups int64
	Capped         bool
}

// groupPage is one group's letters.
type groupPage struct {
	Handler, Fingerprint, State string
	States                      []string
	Total                       int64
	Letters                     []letterRow
	From, To                    int64
	After, Next                 int64
	Commands                    []string
	Actionable                  bool
}

// letterRow is a dead letter in a list.
type letterRow struct {
	driver.DeadLetter
	Short string
}

// letterPage is one dead letter.
type letterPage struct {
	D          driver.DeadLetter
	Env        *idem.Message
	Payload    payloadView
	Raw        payloadView
	Headers    []keyValue
	History    []driver.DeadLetterEvent
	Commands   []string
	Actionable bool
	// ShowRaw is set when the broker's payload is not the message's.
	ShowRaw bool
}

// keyValue is one header.
type keyValue struct{ Key, Value string }

// confirmPage asks before an action.
type confirmPage struct {
	Action, Scope        string
	Handler, Fingerprint string
	IDs                  []int64
	Count                int64
	Back                 string
	// Until is when the group was counted, in Unix microseconds of the
	// store's clock: the action applies to the group's dead letters that
	// failed before it, those the operator confirmed.
	Until int64
}

// resultPage says what an action did.
type resultPage struct {
	Action        string
	Asked, Moved  int64
	Handler, Back string
	Err           string
}

// deadLetters returns the store's dead-letter store.
func (c *console) deadLetters() (driver.DeadLetterStore, error) {
	dl, ok := c.s.idemDriver().(driver.DeadLetterStore)
	if !ok {
		return nil, fmt.Errorf("%s has no dead-letter store", c.s)
	}
	return dl, nil
}

// pageState reads the state parameter: parked by default.
func pageState(r *http.Request) (string, error) {
	st := r.URL.Query().Get("state")
	if st == "" {
		return driver.DeadLetterParked, nil
	}
	if !slices.Contains(deadLetterStates, st) {
		return "", fmt.Errorf("state %q: want one of %s", termText(st), strings.Join(deadLetterStates, ", "))
	}
	return st, nil
}

func (c *console) groups(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	st, err := pageState(r)
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err)
		return
	}
	dl, err := c.deadLetters()
	if err == nil {
		var p groupsPage
		p.State, p.States = st, deadLetterStates
		if p.Groups, err = c.s.deadLetterGroups(ctx, dl, st); err == nil {
			for _, g := range p.Groups {
				p.Total += g.Count
			}
			p.NGroups = int64(len(p.Groups))
			if p.Capped = len(p.Groups) == consoleMaxGroups; p.Capped {
				p.Total, p.NGroups, err = c.s.deadLetterTotals(ctx, st)
			}
			if err == nil {
				c.render(w, r, http.StatusOK, "groups", "Dead letters", p)
				return
			}
		}
	}
	c.fail(w, r, http.StatusServiceUnavailable, err)
}

func (c *console) group(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	q := r.URL.Query()
	st, err := pageState(r)
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err)
		return
	}
	p := groupPage{Handler: q.Get("handler"), Fingerprint: q.Get("fp"), State: st, States: deadLetterStates}
	if !q.Has("handler") || !q.Has("fp") {
		c.fail(w, r, http.StatusBadRequest, errors.New("a group is named by its handler and fingerprint (handler=…&fp=…)"))
		return
	}
	if err := c.checkText("handler", p.Handler, "fp", p.Fingerprint); err != nil {
		c.fail(w, r, http.StatusBadRequest, err)
		return
	}
	if a := q.Get("after"); a != "" {
		if p.After, err = strconv.ParseInt(a, 10, 64); err != nil || p.After < 0 {
			c.fail(w, r, http.StatusBadRequest, fmt.Errorf("after %q is not a dead-letter ID", termText(a)))
			return
		}
	}
	from, _ := strconv.ParseInt(q.Get("from"), 10, 64)
	dl, err := c.deadLetters()
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	if p.Total, err = c.s.deadLetterCount(ctx, p.Handler, p.Fingerprint, st); err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	f := &driver.DeadLetterFilter{Handler: p.Handler, Fingerprint: p.Fingerprint, AfterID: p.After, Limit: consolePageSize + 1, Summary: true}
	if st != "all" {
		f.State = st
	}
	list, err := dl.DeadLetterList(ctx, f)
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	if len(list) > consolePageSize {
		list = list[:consolePageSize]
		p.Next = list[len(list)-1].ID
	}
	for _, d := range list {
		p.Letters = append(p.Letters, letterRow{DeadLetter: d, Short: shortError(d)})
	}
	p.From = max(from, 0) + 1
	p.To = p.From + int64(len(list)) - 1
	p.Actionable = st == driver.DeadLetterParked && p.Total > 0
	p.Commands = []string{
		termText("idem dlq list --handler " + shellQuote(p.Handler) + " --group " + shellQuote(p.Fingerprint) + c.s.cliStoreFlags()),
		c.s.dlqCommandFor("replay", 0, p.Handler, p.Fingerprint),
		c.s.dlqCommandFor("discard", 0, p.Handler, p.Fingerprint),
	}
	c.render(w, r, http.StatusOK, "group", "Group", p)
}

func (c *console) letter(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		c.fail(w, r, http.StatusNotFound, fmt.Errorf("%q is not a dead-letter ID", termText(r.PathValue("id"))))
		return
	}
	dl, err := c.deadLetters()
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	list, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: []int64{id}})
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	if len(list) == 0 {
		c.fail(w, r, http.StatusNotFound, fmt.Errorf("no dead letter %d", id))
		return
	}
	p := letterPage{D: list[0], Raw: renderPayload(list[0].Raw)}
	if p.History, err = dl.DeadLetterHistory(ctx, id); err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	if p.D.Envelope != nil {
		var m idem.Message
		if json.Unmarshal(p.D.Envelope, &m) == nil {
			p.Env = &m
			p.Payload = renderPayload(m.Payload)
			for k, v := range m.Headers {
				p.Headers = append(p.Headers, keyValue{k, v})
			}
			slices.SortFunc(p.Headers, func(a, b keyValue) int { return strings.Compare(a.Key, b.Key) })
		}
	}
	p.ShowRaw = p.Env == nil || !bytes.Equal(p.D.Raw, p.Env.Payload)
	p.Actionable = p.D.State == driver.DeadLetterParked
	p.Commands = []string{c.s.dlqCommandFor("show", id, "", ""), c.s.dlqCommandFor("replay", id, "", ""), c.s.dlqCommandFor("discard", id, "", "")}
	c.render(w, r, http.StatusOK, "letter", fmt.Sprintf("Dead letter %d", id), p)
}

// actionForm is what an action's form names: the action, and either dead
// letters by ID or a group.
type actionForm struct {
	Action, Scope        string
	IDs                  []int64
	Handler, Fingerprint string
	Back                 string
}

// parseActionForm reads and checks an action's form.
func parseActionForm(r *http.Request) (*actionForm, error) {
	f := &actionForm{Action: r.PostFormValue("action"), Scope: r.PostFormValue("scope"),
		Handler: r.PostFormValue("handler"), Fingerprint: r.PostFormValue("fp")}
	switch f.Action {
	case "replay", "discard":
	default:
		return nil, fmt.Errorf("action %q: want replay or discard", termText(f.Action))
	}
	switch f.Scope {
	case "ids":
		vals := r.PostForm["id"]
		if len(vals) == 0 {
			return nil, errors.New("no dead letter selected: tick at least one")
		}
		if len(vals) > consoleMaxSelection {
			return nil, fmt.Errorf("%d dead letters selected: act on at most %d at once, or on their group", len(vals), consoleMaxSelection)
		}
		for _, v := range vals {
			id, err := strconv.ParseInt(v, 10, 64)
			if err != nil || id <= 0 {
				return nil, fmt.Errorf("dead-letter ID %q is not a positive number", termText(v))
			}
			if !slices.Contains(f.IDs, id) {
				f.IDs = append(f.IDs, id)
			}
		}
	case "group":
		if g, ok := r.PostForm["group"]; ok {
			// The pages' forms name the group in one field, as its page's
			// query: a browser sends every line break of a field as CR
			// LF, which would change a handler or fingerprint holding
			// one (a multi-line error's).
			v, err := url.ParseQuery(g[0])
			if err != nil {
				return nil, fmt.Errorf("group %q: %w", termText(g[0]), err)
			}
			f.Handler, f.Fingerprint = v.Get("handler"), v.Get("fp")
		}
		// The selection leaves out a condition whose value is empty: an
		// empty handler would select the fingerprint's dead letters of
		// every handler, an empty fingerprint every group of the handler,
		// never the group the confirmation counted (none).
		if f.Handler == "" || f.Fingerprint == "" {
			return nil, errors.New("a group is named by its handler and fingerprint, neither of them empty")
		}
	default:
		return nil, fmt.Errorf("scope %q: want ids or group", termText(f.Scope))
	}
	f.Back = "/dlq"
	if f.Scope == "group" {
		f.Back = "/dlq/group?" + url.Values{"handler": {f.Handler}, "fp": {f.Fingerprint}}.Encode()
	} else if len(f.IDs) == 1 {
		f.Back = "/dlq/" + strconv.FormatInt(f.IDs[0], 10)
	}
	if b := r.PostFormValue("back"); strings.HasPrefix(b, "/dlq") && !strings.HasPrefix(b, "//") {
		f.Back = b
	}
	return f, nil
}

// filter returns the selection of the parked dead letters f names.
func (f *actionForm) filter() *driver.DeadLetterFilter {
	if f.Scope == "ids" {
		return &driver.DeadLetterFilter{IDs: f.IDs, State: driver.DeadLetterParked}
	}
	return &driver.DeadLetterFilter{Handler: f.Handler, Fingerprint: f.Fingerprint, State: driver.DeadLetterParked}
}

// count returns how many parked dead letters f names now.
func (c *console) count(ctx context.Context, dl driver.DeadLetterStore, f *actionForm) (int64, error) {
	if f.Scope == "group" {
		return c.s.deadLetterCount(ctx, f.Handler, f.Fingerprint, driver.DeadLetterParked)
	}
	list, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{IDs: f.IDs, State: driver.DeadLetterParked, Summary: true})
	return int64(len(list)), err
}

// action authorizes a dead-letter action request and parses its form; it
// answers a refusal itself and returns ok false then.
func (c *console) action(w http.ResponseWriter, r *http.Request) (actor string, f *actionForm, ok bool) {
	if actor, ok = c.authorizeForm(w, r); !ok {
		return "", nil, false
	}
	f, err := parseActionForm(r)
	if err == nil {
		err = c.checkText("handler", f.Handler, "fp", f.Fingerprint)
	}
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err)
		return "", nil, false
	}
	return actor, f, true
}

func (c *console) confirm(w http.ResponseWriter, r *http.Request) {
	_, f, ok := c.action(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	dl, err := c.deadLetters()
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	// Taken before the count: a dead letter that fails while the count
	// runs is in neither or, at worst, counted and spared.
	until := c.storeNow(ctx).Add(time.Microsecond)
	n, err := c.count(ctx, dl, f)
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	c.render(w, r, http.StatusOK, "confirm", "Confirm", confirmPage{Action: f.Action, Scope: f.Scope, Handler: f.Handler,
		Fingerprint: f.Fingerprint, IDs: f.IDs, Count: n, Back: f.Back, Until: until.UnixMicro()})
}

// storeNow returns the store's time (driver.Clock) where the driver has
// one, else this process's: dead letters carry the time of their last
// failure as the store or the consumer stamped it.
func (c *console) storeNow(ctx context.Context) time.Time {
	if clk, ok := c.s.idemDriver().(driver.Clock); ok {
		if t, err := clk.Now(ctx); err == nil {
			return t
		}
	}
	return time.Now()
}

func (c *console) apply(w http.ResponseWriter, r *http.Request) {
	actor, f, ok := c.action(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	dl, err := c.deadLetters()
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	p := resultPage{Action: f.Action, Back: f.Back, Handler: f.Handler}
	if v, err := strconv.ParseInt(r.PostFormValue("count"), 10, 64); err == nil {
		p.Asked = v
	}
	sel := f.filter()
	if v, err := strconv.ParseInt(r.PostFormValue("until"), 10, 64); err == nil && f.Scope == "group" {
		// Only the group the operator confirmed: a dead letter that
		// failed since (an incident going on) was not counted, and is
		// left parked for a look of its own.
		sel.Until = time.UnixMicro(v)
	}
	var n int
	if f.Action == "replay" {
		n, err = idem.RequestReplay(ctx, dl, sel, actor)
	} else {
		n, err = idem.Discard(ctx, dl, sel, actor)
	}
	p.Moved = int64(n)
	code := http.StatusOK
	if err != nil {
		p.Err, code = err.Error(), http.StatusServiceUnavailable
	}
	c.log.Info("idem serve: dead letters changed from the console", "action", f.Action, "scope", f.Scope, "moved", n, "actor", actor, "error", p.Err)
	c.render(w, r, code, "result", "Result", p)
}
