// Package dlpages reads a selection of dead letters a page at a time, as
// every reader of a whole selection does (a replay, a discard, the CLI's
// count of what one would change): by ID, each page after the last ID of
// the one before, so that dead letters written meanwhile neither shift
// the pages nor repeat.
package dlpages

import (
	"context"

	"github.com/idemhq/idem/driver"
)

// Each lists the summaries (no envelope, no payload) of the dead letters f
// selects, size at a time, handing each non-empty page to fn; f.Limit,
// when set, bounds how many in all. It stops at fn's first error.
func Each(ctx context.Context, dl driver.DeadLetterStore, f *driver.DeadLetterFilter, size int, fn func([]driver.DeadLetter) error) error {
	sel := *f
	sel.Summary = true
	seen := 0
	for {
		sel.Limit = size
		if f.Limit > 0 {
			sel.Limit = min(size, f.Limit-seen)
		}
		page, err := dl.DeadLetterList(ctx, &sel)
		if err != nil {
			return err
		}
		if len(page) > 0 {
			if err := fn(page); err != nil {
				return err
			}
		}
		seen += len(page)
		if len(page) < sel.Limit || (f.Limit > 0 && seen >= f.Limit) {
			return nil
		}
		sel.AfterID = page[len(page)-1].ID
	}
}
