package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/outbox"
)

// The console's outbox page: the unpublished rows by stream and ordering
// key (the aggregate), with their state and last error, and the same
// actions as 'idem outbox retry', 'park' and 'discard', each behind a
// confirmation.

// outboxPage lists unpublished outbox rows.
type outboxPage struct {
	State, Stream, Key string
	States             []string
	Rows               []driver.OutboxEntry
	Counts             driver.OutboxCounts
	After, Next        int64
	NextURL            string
	Command            string
}

// outboxConfirmPage asks before an outbox action.
type outboxConfirmPage struct {
	Action string
	Rows   []driver.OutboxEntry
	IDs    []int64
	Reason string
}

// outboxResultPage says what an outbox action did.
type outboxResultPage struct {
	Action             string
	Done, Busy, Missed int
	Err                string
}

// outboxActions are the outbox actions and the words the pages use.
var outboxActions = map[string]string{"retry": "Retry now", "park": "Park", "discard": "Discard"}

// outboxAdmin returns the store's outbox administration, or why there is
// none.
func (c *console) outboxAdmin(ctx context.Context) (*outbox.Admin, error) {
	if n, version, err := c.s.schemaVersion(ctx); err != nil {
		return nil, err
	} else if n == 0 || version < outboxAdminSchema(c.s.kind) {
		return nil, fmt.Errorf("%s has no outbox administration yet (schema version %d): run 'idem migrate' first", c.s, version)
	}
	return outbox.NewAdmin(c.s.idemDriver(), c.log)
}

func (c *console) outboxList(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	q := r.URL.Query()
	p := outboxPage{State: q.Get("state"), Stream: q.Get("stream"), Key: q.Get("key"), States: []string{"", "pending", "failing", "parked"}}
	if !driver.OutboxState(p.State).Valid() {
		c.fail(w, r, http.StatusBadRequest, fmt.Errorf("state %q: want pending, failing or parked", termText(p.State)))
		return
	}
	if err := c.checkText("stream", p.Stream, "key", p.Key); err != nil {
		c.fail(w, r, http.StatusBadRequest, err)
		return
	}
	if a := q.Get("after"); a != "" {
		var err error
		if p.After, err = strconv.ParseInt(a, 10, 64); err != nil || p.After < 0 {
			c.fail(w, r, http.StatusBadRequest, fmt.Errorf("after %q is not a row ID", termText(a)))
			return
		}
	}
	adm, err := c.outboxAdmin(ctx)
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	page, err := adm.List(ctx, driver.OutboxFilter{State: driver.OutboxState(p.State), Destination: p.Stream, OrderingKey: p.Key, AfterID: p.After, Limit: consolePageSize})
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	p.Rows, p.Counts, p.Next = page.Rows, page.Counts, page.Next
	if p.Next > 0 {
		v := url.Values{"after": {strconv.FormatInt(p.Next, 10)}}
		for k, s := range map[string]string{"state": p.State, "stream": p.Stream, "key": p.Key} {
			if s != "" {
				v.Set(k, s)
			}
		}
		p.NextURL = "/outbox?" + v.Encode()
	}
	cmd := "idem outbox list"
	for _, f := range [][2]string{{"state", p.State}, {"stream", p.Stream}, {"key", p.Key}} {
		if f[1] != "" {
			cmd += " --" + f[0] + " " + shellQuote(f[1])
		}
	}
	p.Command = termText(cmd + c.s.cliStoreFlags())
	c.render(w, r, http.StatusOK, "outbox", "Outbox", p)
}

// outboxForm reads an outbox action's form: the action, the rows and the
// reason.
func outboxForm(r *http.Request) (action string, ids []int64, reason string, err error) {
	action = r.PostFormValue("action")
	if _, ok := outboxActions[action]; !ok {
		return "", nil, "", fmt.Errorf("action %q: want retry, park or discard", termText(action))
	}
	vals := r.PostForm["id"]
	if len(vals) == 0 {
		return "", nil, "", errors.New("no row selected: tick at least one")
	}
	if len(vals) > consoleMaxSelection {
		return "", nil, "", fmt.Errorf("%d rows selected: act on at most %d at once", len(vals), consoleMaxSelection)
	}
	for _, v := range vals {
		id, err := strconv.ParseInt(v, 10, 64)
		if err != nil || id <= 0 {
			return "", nil, "", fmt.Errorf("row ID %q is not a positive number", termText(v))
		}
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return action, ids, strings.TrimSpace(r.PostFormValue("reason")), nil
}

// outboxAction authorizes an outbox form and parses it, answering the
// request itself when either fails (ok false), as action does for dead
// letters.
func (c *console) outboxAction(w http.ResponseWriter, r *http.Request) (actor, action string, ids []int64, reason string, ok bool) {
	if actor, ok = c.authorizeForm(w, r); !ok {
		return "", "", nil, "", false
	}
	action, ids, reason, err := outboxForm(r)
	if err == nil {
		err = c.checkText("reason", reason)
	}
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err)
		return "", "", nil, "", false
	}
	return actor, action, ids, reason, true
}

func (c *console) outboxConfirm(w http.ResponseWriter, r *http.Request) {
	_, action, ids, reason, ok := c.outboxAction(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	adm, err := c.outboxAdmin(ctx)
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	// The rows as they are now: the confirmation names each.
	page, err := adm.List(ctx, driver.OutboxFilter{IDs: ids, Limit: driver.OutboxListMax})
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	p := outboxConfirmPage{Action: action, Reason: reason, Rows: page.Rows}
	for _, e := range page.Rows {
		p.IDs = append(p.IDs, e.ID)
	}
	c.render(w, r, http.StatusOK, "outbox_confirm", "Confirm", p)
}

func (c *console) outboxApply(w http.ResponseWriter, r *http.Request) {
	actor, action, ids, reason, ok := c.outboxAction(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.timeout)
	defer cancel()
	adm, err := c.outboxAdmin(ctx)
	if err != nil {
		c.fail(w, r, http.StatusServiceUnavailable, err)
		return
	}
	var res driver.OutboxActionResult
	switch action {
	case "retry":
		res, err = adm.RetryNow(ctx, ids, actor)
	case "park":
		res, err = adm.Park(ctx, ids, actor, reason)
	case "discard":
		res, err = adm.Discard(ctx, ids, actor, reason)
	}
	p := outboxResultPage{Action: action, Done: len(res.Done), Busy: len(res.Busy), Missed: len(res.Missing)}
	code := http.StatusOK
	switch {
	case errors.Is(err, outbox.ErrInvalidText):
		p.Err, code = err.Error(), http.StatusBadRequest
	case err != nil:
		p.Err, code = err.Error(), http.StatusServiceUnavailable
	}
	c.render(w, r, code, "outbox_result", "Result", p)
}

// outboxURL returns the outbox page's URL selecting state, stream and key.
func outboxURL(state, stream, key string) string {
	v := url.Values{}
	for k, s := range map[string]string{"state": state, "stream": stream, "key": key} {
		if s != "" {
			v.Set(k, s)
		}
	}
	if len(v) == 0 {
		return "/outbox"
	}
	return "/outbox?" + v.Encode()
}
