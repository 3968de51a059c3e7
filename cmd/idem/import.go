package main

import (
	"context"
	"flag"
	"fmt"
	"strings"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/errtext"
	"github.com/idemhq/idem/internal/sqlident"
)

// importCommand returns the "import" subcommand: take over a hand-rolled
// processed-events table as markers.
func importCommand() *command {
	return &command{
		name:     "import",
		synopsis: "--dsn DSN --handler NAME --from [SCHEMA.]TABLE.COLUMN [--batch N] [--json]",
		summary:  "import the IDs of a hand-rolled processed-events table as markers",
		help: `Import takes over a table your code kept its processed message IDs in: for
every value of --from's column it stores a marker of --handler, in the same
database as idem's tables, so that idem treats a redelivery of any of those
messages as a duplicate. The payloads they stood for are unknown, so these
markers never report a payload conflict. It reads the column in ascending
order, --batch IDs per transaction, and can run again at any time: markers
already there are kept. Run it before the consumers switch to idem and once
more after, for IDs recorded in between.

The column may be of any type whose text form is the message ID: text, a
UUID (its canonical lowercase form), an integer; it is read in its own
order, so an index on it serves every page. Values that are not valid
message IDs (more than 255 bytes, not UTF-8, holding NUL) are listed and
skipped, and the command then exits 1. NULL and empty values are not read.

The DSN comes from --dsn, or from the IDEM_DSN environment variable.

` + dsnHelp + `

Examples:
  idem import --dsn postgres://app@db/app --handler billing.credits --from processed_events.event_id
  idem import --dsn app.db --handler mailer --from sent_emails.message_id --json`,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			sf := addStoreFlags(fs, "import", false)
			var (
				handler, from string
				batch         int
				asJSON        bool
			)
			fs.StringVar(&handler, "handler", "", "the idem handler `name` the markers are for (required)")
			fs.StringVar(&from, "from", "", "the hand-rolled table's ID column: `[schema.]table.column` (required)")
			fs.IntVar(&batch, "batch", 10_000, "IDs per transaction (`rows`)")
			fs.BoolVar(&asJSON, "json", false, "print JSON instead of text")
			return func(ctx context.Context, e *env, args []string) error {
				if err := noArgs(args); err != nil {
					return err
				}
				if handler == "" || from == "" {
					return usagef("--handler and --from are required")
				}
				if err := idem.ValidateHandlerName(handler); err != nil {
					return &usageError{err: err}
				}
				src, err := parseImportSource(from)
				if err != nil {
					return err
				}
				if batch < 1 {
					return usagef("--batch must be positive")
				}
				s, err := sf.open(ctx, e)
				if err != nil {
					return err
				}
				defer s.Close()
				return runImport(ctx, e, s, handler, src, batch, asJSON)
			}
		},
	}
}

// parseImportSource splits --from into schema, table and column.
func parseImportSource(from string) (*driver.ImportSource, error) {
	parts := strings.Split(from, ".")
	var src *driver.ImportSource
	switch len(parts) {
	case 2:
		src = &driver.ImportSource{Table: parts[0], Column: parts[1]}
	case 3:
		src = &driver.ImportSource{Schema: parts[0], Table: parts[1], Column: parts[2]}
	default:
		return nil, usagef("--from %s: want table.column or schema.table.column", quoteArg(from))
	}
	// The drivers check the names as well, but only once the store is
	// open, and their error would then read as a failed import (exit 1)
	// rather than the bad flag it is. The message quotes the whole value
	// as arguments are, not the part: a DSN typed here by mistake would
	// have its password split across the parts.
	for _, p := range []struct{ what, v string }{{"schema", src.Schema}, {"table", src.Table}, {"column", src.Column}} {
		if sqlident.Check(p.what, p.v, p.what == "schema") != nil {
			return nil, usagef("--from %s: the import %s is not a plain name: lower-case letters, digits and _, not starting with a digit, at most %d bytes",
				quoteArg(from), p.what, sqlident.MaxLen)
		}
	}
	return src, nil
}

// importReport is what import prints with --json.
type importReport struct {
	Handler  string   `json:"handler"`
	From     string   `json:"from"`
	Read     int64    `json:"read"`
	Imported int64    `json:"imported"`
	Existing int64    `json:"existing"`
	Invalid  int64    `json:"invalid"`
	Skipped  []string `json:"skipped,omitempty"` // the first invalid values, quoted (a long one cut short)
}

// maxListedInvalid bounds the invalid values import lists.
const maxListedInvalid = 10

// runImport imports src's IDs as markers of handler.
func runImport(ctx context.Context, e *env, s *store, handler string, src *driver.ImportSource, batch int, asJSON bool) error {
	if n, _, err := s.schemaVersion(ctx); err != nil {
		return err
	} else if n == 0 {
		return s.errNoTables(ctx)
	}
	if s.kind == kindSQLite && src.Schema != "" {
		return usagef("--from %s.%s.%s: SQLite has no schemas; name the table and column only", src.Schema, src.Table, src.Column)
	}
	imp, ok := s.idemDriver().(driver.MarkerImporter)
	if !ok {
		return fmt.Errorf("%s cannot import markers", s)
	}
	from := src.Table + "." + src.Column
	if src.Schema != "" {
		from = src.Schema + "." + from
	}
	rep := importReport{Handler: handler, From: from}
	res, err := idem.ImportMarkers(ctx, imp, handler, src, &idem.ImportOptions{Batch: batch, Invalid: func(v string, err error) {
		if len(rep.Skipped) < maxListedInvalid {
			rep.Skipped = append(rep.Skipped, fmt.Sprintf("%s: %v", errtext.Quote(v), err))
		}
	}})
	rep.Read, rep.Imported, rep.Existing, rep.Invalid = res.Read, res.Imported, res.Existing, res.Invalid
	if err != nil {
		return fmt.Errorf("%w (imported %d markers before stopping)", err, res.Imported)
	}
	if asJSON {
		if err := writeJSON(e.stdout, rep); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(e.stdout, "Imported %s of handler %q from %s on %s: %d read, %d already there, %d invalid.\n",
			plural(int(rep.Imported), "marker"), handler, from, s, rep.Read, rep.Existing, rep.Invalid)
		for _, v := range rep.Skipped {
			fmt.Fprintf(e.stderr, "skipped %s\n", v)
		}
	}
	if rep.Invalid > 0 {
		return fmt.Errorf("%d value(s) of %s are not valid message IDs and were not imported", rep.Invalid, from)
	}
	return nil
}
