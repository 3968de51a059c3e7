// Package sqlfilter builds what the SQL drivers' administration queries
// (dead letters, the outbox) share: the outbox states' conditions and, for
// the database/sql drivers whose placeholders are ?, the WHERE clauses of
// the list filters. Each driver passes its own condition that matches a
// JSON array of IDs held in one parameter (JSONIDs): a list of ? would
// stop at the protocol's or the library's bound on placeholders.
package sqlfilter

import (
	"strconv"

	"github.com/idemhq/idem/driver"
)

// OutboxState is each state's condition on an unpublished outbox row
// aliased o.
var OutboxState = map[driver.OutboxState]string{
	driver.OutboxPending: "o.parked_at IS NULL AND o.attempts = 0",
	driver.OutboxFailing: "o.parked_at IS NULL AND o.attempts > 0",
	driver.OutboxParked:  "o.parked_at IS NOT NULL",
}

// JSONIDs is ids as a JSON array, one parameter however many there are.
func JSONIDs(ids []int64) string {
	b := make([]byte, 0, 2+8*len(ids))
	b = append(b, '[')
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, id, 10)
	}
	return string(append(b, ']'))
}

// DeadLetters returns the conditions and arguments that select the dead
// letters f asks for (all of them for a nil f), times as Unix
// microseconds; idsIn matches the column id against a JSONIDs parameter.
// Limit and Summary are the caller's.
func DeadLetters(f *driver.DeadLetterFilter, idsIn string) (where []string, args []any) {
	where = []string{"1 = 1"}
	if f == nil {
		return where, args
	}
	if f.Handler != "" {
		where, args = append(where, "handler = ?"), append(args, f.Handler)
	}
	if f.Fingerprint != "" {
		where, args = append(where, "fingerprint = ?"), append(args, f.Fingerprint)
	}
	if f.State != "" {
		where, args = append(where, "state = ?"), append(args, f.State)
	}
	if f.IDs != nil {
		if len(f.IDs) == 0 {
			where = append(where, "1 = 0")
		} else {
			where, args = append(where, idsIn), append(args, JSONIDs(f.IDs))
		}
	}
	if !f.Since.IsZero() {
		where, args = append(where, "last_failed_at >= ?"), append(args, f.Since.UnixMicro())
	}
	if !f.Until.IsZero() {
		where, args = append(where, "last_failed_at < ?"), append(args, f.Until.UnixMicro())
	}
	if f.AfterID > 0 {
		where, args = append(where, "id > ?"), append(args, f.AfterID)
	}
	return where, args
}

// OutboxScope returns the conditions and arguments on unpublished outbox
// rows aliased o that f's destination, ordering key and IDs select, the
// scope its counts are over; idsIn matches the column id against a
// JSONIDs parameter. Outbox adds f's state and cursor.
func OutboxScope(f driver.OutboxFilter, idsIn string) (where []string, args []any) {
	where = []string{"o.published_at IS NULL"}
	if f.Destination != "" {
		where, args = append(where, "o.destination = ?"), append(args, f.Destination)
	}
	if f.OrderingKey != "" {
		where, args = append(where, "o.ordering_key = ?"), append(args, f.OrderingKey)
	}
	if f.IDs != nil {
		where, args = append(where, "o."+idsIn), append(args, JSONIDs(f.IDs))
	}
	return where, args
}

// Outbox adds to a scope from OutboxScope the conditions of f's state and
// cursor.
func Outbox(f driver.OutboxFilter, where []string, args []any) ([]string, []any) {
	if f.State != "" {
		where = append(where, OutboxState[f.State])
	}
	if f.AfterID > 0 {
		where, args = append(where, "o.id > ?"), append(args, f.AfterID)
	}
	return where, args
}
