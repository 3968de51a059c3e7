package idem

import "fmt"

// Outcome is what processing did with a delivery. Outcomes are values, not
// errors: a Duplicate is the library working as intended.
type Outcome uint8

const (
	// OutcomeNone is the zero value, returned together with an error: no
	// outcome was recorded and the delivery must be retried.
	OutcomeNone Outcome = iota
	// Applied: the handler ran and its effect committed with the marker
	// (atomic mode), or the handler returned nil and the row was marked
	// done while its fencing token was still current (lease mode).
	Applied
	// Duplicate: the marker existed with the same payload hash; the
	// handler was not called.
	Duplicate
	// Conflict: the marker existed with a different payload hash; the
	// handler was not called.
	Conflict
	// Stale: the ordering guard had already applied a later (or, in
	// version-only mode, the same) sequence of the message's aggregate; the
	// handler was not called. Acknowledge it.
	Stale
	// InFlight (lease mode only): another worker holds a live lease on the
	// message, or its last attempt failed and its next attempt time has
	// not come. The handler was not called. Do not acknowledge the
	// delivery: retry it later.
	InFlight
)

// String returns the outcome's lower-case name.
func (o Outcome) String() string {
	switch o {
	case OutcomeNone:
		return "none"
	case Applied:
		return "applied"
	case Duplicate:
		return "duplicate"
	case Conflict:
		return "conflict"
	case InFlight:
		return "in_flight"
	case Stale:
		return "stale"
	}
	return fmt.Sprintf("outcome(%d)", uint8(o))
}
