package driver

import "context"

// MarkerImporter is implemented by drivers that can take over the IDs of a
// hand-rolled processed-events table as markers (see idem.ImportMarkers).
// The markers it writes have an empty payload hash: the payload they stood
// for is unknown, so a redelivery of any payload is a duplicate.
type MarkerImporter interface {
	// ImportIDs returns up to limit values of the source column, as text
	// (NULL and empty values left out), ascending in the column's own
	// order: from the first when after is "", else those greater than
	// after (the text of the last value of the previous page, which the
	// driver reads back as a value of the column's type).
	ImportIDs(ctx context.Context, src *ImportSource, after string, limit int) ([]string, error)
	// InsertImportedMarkers inserts, in one transaction, a marker with an
	// empty payload hash for each ID that has no marker of handler yet,
	// and returns how many it inserted.
	InsertImportedMarkers(ctx context.Context, handler string, ids []string) (int64, error)
}

// ImportSource names the table and column a MarkerImporter reads. Each
// part must match [a-z_][a-z0-9_]* (at most 40 bytes); drivers quote them.
type ImportSource struct {
	// Schema holds Table (Postgres); empty: the search_path.
	Schema string
	// Table is the hand-rolled table.
	Table string
	// Column holds the message IDs. Any type whose text form is the
	// message ID works: text, a UUID (its canonical lowercase form), an
	// integer (decimal).
	Column string
}
