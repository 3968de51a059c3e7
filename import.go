package idem

import (
	"context"
	"fmt"

	"github.com/idemhq/idem/driver"
)

// ImportOptions tunes ImportMarkers. The zero value is valid.
type ImportOptions struct {
	// Batch is how many IDs are read and inserted per transaction.
	// Default 10,000.
	Batch int
	// Invalid, when set, is called for every value of the column that is
	// not a valid message ID (see Message.Validate); the value is skipped
	// either way and counted in ImportResult.Invalid.
	Invalid func(value string, err error)
	// Progress, when set, is called after every batch with the totals so
	// far.
	Progress func(ImportResult)
}

// ImportResult counts what ImportMarkers did.
type ImportResult struct {
	// Read is how many values the column held.
	Read int64
	// Imported is how many markers were inserted.
	Imported int64
	// Existing is how many valid IDs had a marker already (an earlier
	// import, or idem applied them since).
	Existing int64
	// Invalid is how many values were not valid message IDs, and skipped.
	Invalid int64
}

// ImportMarkers takes over a hand-rolled processed-events table: for every
// ID in src's column it inserts a marker of handler, so that idem treats a
// redelivery of any of those messages as a Duplicate. The payload each ID
// stood for is unknown, so these markers hold an empty payload hash and
// never report a Conflict. It reads the column in ascending order, Batch
// IDs per transaction, and is safe to run again (existing markers are
// kept) or while consumers run. Markers get the import's time as their
// processing time, so retention prunes them from then on; like any other
// marker, each counts as applied in `idem stats`.
//
// Run it once before the consumers switch to idem, and once more after,
// for IDs the old code recorded in between. Values that are not valid
// message IDs are reported through opts.Invalid and counted, never
// imported; NULL and empty values are not read at all.
func ImportMarkers(ctx context.Context, imp driver.MarkerImporter, handler string, src *driver.ImportSource, opts *ImportOptions) (ImportResult, error) {
	var res ImportResult
	if imp == nil || src == nil {
		return res, fmt.Errorf("%w: ImportMarkers needs a MarkerImporter and a source", ErrInvalidConfig)
	}
	if err := ValidateHandlerName(handler); err != nil {
		return res, err
	}
	if opts == nil {
		opts = &ImportOptions{}
	}
	batch := opts.Batch
	if batch <= 0 {
		batch = 10_000
	}
	after := ""
	for {
		values, err := imp.ImportIDs(ctx, src, after, batch)
		if err != nil {
			from := ""
			if after != "" {
				from = fmt.Sprintf(" after ID %q", after)
			}
			return res, fmt.Errorf("idem: import: read %s.%s%s: %w", src.Table, src.Column, from, err)
		}
		if len(values) == 0 {
			return res, nil
		}
		res.Read += int64(len(values))
		ids := make([]string, 0, len(values))
		for _, v := range values {
			if err := (&Message{ID: v}).Validate(); err != nil {
				res.Invalid++
				if opts.Invalid != nil {
					opts.Invalid(v, err)
				}
				continue
			}
			ids = append(ids, v)
		}
		if len(ids) > 0 {
			n, err := imp.InsertImportedMarkers(ctx, handler, ids)
			if err != nil {
				return res, fmt.Errorf("idem: import: insert markers: %w", err)
			}
			res.Imported += n
			res.Existing += int64(len(ids)) - n
		}
		if opts.Progress != nil {
			opts.Progress(res)
		}
		if len(values) < batch {
			return res, nil
		}
		last := values[len(values)-1]
		if last == after || last == "" {
			// The driver read the cursor back as another value than the
			// one it came from; going on would read the same page again.
			return res, fmt.Errorf("idem: import: read %s.%s: the page after ID %q ends with it again; the column's values must sort the same as text and as themselves", src.Table, src.Column, after)
		}
		after = last
	}
}
