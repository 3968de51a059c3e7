package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"unicode/utf8"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/errtext"
)

// ErrNoActor is returned by an Admin action given no actor: every retry,
// park and discard is logged with who did it.
var ErrNoActor = errors.New("outbox: an action needs an actor")

// ErrInvalidText is returned by an Admin action whose actor or reason is
// not text every store keeps as given: valid UTF-8 without a NUL byte, at
// most MaxActionText bytes. Nothing is changed.
var ErrInvalidText = errors.New("outbox: an actor or reason must be UTF-8 text without a NUL byte")

// MaxActionText bounds an Admin action's actor and reason, in bytes.
const MaxActionText = 4096

// checkAction returns ErrNoActor or ErrInvalidText for what an action is
// given, or nil.
func checkAction(actor, reason string) error {
	if actor == "" {
		return ErrNoActor
	}
	for _, f := range [...]struct{ name, v string }{{"actor", actor}, {"reason", reason}} {
		switch {
		case !utf8.ValidString(f.v) || strings.ContainsRune(f.v, 0):
			return fmt.Errorf("%w: the %s %s is not", ErrInvalidText, f.name, errtext.Quote(f.v))
		case len(f.v) > MaxActionText:
			return fmt.Errorf("%w: the %s has %d bytes, more than %d", ErrInvalidText, f.name, len(f.v), MaxActionText)
		}
	}
	return nil
}

// Admin lets an operator see the outbox's unpublished rows and act on
// them: retry a failing row now, park one the broker will never take (a
// subject no JetStream stream covers) so that it stops being retried, or
// discard one so that it is never published. The store logs every action
// with its actor in the outbox log table; Admin logs it too. It is safe
// for concurrent use.
//
// A parked row keeps its ordering key: its later rows wait behind it
// until it is retried or discarded, so an aggregate's events are never
// published out of order. Park and Discard leave alone (report as Busy)
// the rows of a key a relay is publishing at that moment; once they
// return, no relay publishes what they parked or deleted. Relays of an
// idem version without parking publish parked rows: upgrade them first.
type Admin struct {
	store  driver.OutboxAdmin
	logger *slog.Logger
}

// NewAdmin returns an Admin over drv, which must implement
// driver.OutboxAdmin (the sqlite, postgres and mysql drivers do). logger
// receives one line per action; nil means slog.Default().
func NewAdmin(drv any, logger *slog.Logger) (*Admin, error) {
	s, ok := drv.(driver.OutboxAdmin)
	if !ok || s == nil {
		return nil, fmt.Errorf("%w: %T does not implement driver.OutboxAdmin", idem.ErrInvalidConfig, drv)
	}
	if logger == nil {
		logger = slog.Default()
	}
	return &Admin{store: s, logger: logger}, nil
}

// List returns one page of the unpublished rows f selects, in ID order,
// and their counts by state. Pass the page's Next as f.AfterID for the
// next page.
func (a *Admin) List(ctx context.Context, f driver.OutboxFilter) (driver.OutboxPage, error) {
	p, err := a.store.OutboxList(ctx, f)
	if err != nil {
		return p, fmt.Errorf("outbox: list: %w", err)
	}
	return p, nil
}

// RetryNow makes the rows ids publishable at once: parked ones are
// unparked, and a failing key's backoff ends, so that the next relay
// cycle takes them (within the relay's PollInterval).
func (a *Admin) RetryNow(ctx context.Context, ids []int64, actor string) (driver.OutboxActionResult, error) {
	if err := checkAction(actor, ""); err != nil {
		return driver.OutboxActionResult{}, err
	}
	r, err := a.store.OutboxRetryNow(ctx, ids, actor)
	return a.logged(ctx, "retry", actor, "", r, err)
}

// Park sets the rows ids aside, with the actor and a reason: no relay
// publishes them, nor the later rows of their ordering keys, until they
// are retried or discarded.
func (a *Admin) Park(ctx context.Context, ids []int64, actor, reason string) (driver.OutboxActionResult, error) {
	if err := checkAction(actor, reason); err != nil {
		return driver.OutboxActionResult{}, err
	}
	r, err := a.store.OutboxPark(ctx, ids, actor, reason)
	return a.logged(ctx, "park", actor, reason, r, err)
}

// Discard deletes the unpublished rows ids: they are never published.
// Their keys' later rows go on at the next relay cycle; a consumer whose
// ordering guard expects every sequence sees a gap where a discarded row
// was.
func (a *Admin) Discard(ctx context.Context, ids []int64, actor, reason string) (driver.OutboxActionResult, error) {
	if err := checkAction(actor, reason); err != nil {
		return driver.OutboxActionResult{}, err
	}
	r, err := a.store.OutboxDiscard(ctx, ids, actor, reason)
	return a.logged(ctx, "discard", actor, reason, r, err)
}

// logged logs an action's result and wraps its error.
func (a *Admin) logged(ctx context.Context, action, actor, reason string, r driver.OutboxActionResult, err error) (driver.OutboxActionResult, error) {
	if err != nil {
		return r, fmt.Errorf("outbox: %s: %w", action, err)
	}
	if len(r.Done) > 0 || len(r.Busy) > 0 {
		a.logger.LogAttrs(ctx, slog.LevelInfo, "outbox: "+action, slog.String("actor", actor), slog.String("reason", reason),
			slog.Any("rows", r.Done), slog.Any("busy", r.Busy), slog.Any("missing", r.Missing))
	}
	return r, nil
}
