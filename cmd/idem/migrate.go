package main

import (
	"context"
	"flag"
	"fmt"
	"strings"
)

// migrateCommand returns the "migrate" subcommand: create or update idem's
// tables in the database a DSN names.
func migrateCommand() *command {
	return &command{
		name:     "migrate",
		synopsis: "--dsn DSN [--schema S] [--prefix P]",
		summary:  "create or update idem's tables in a PostgreSQL, MySQL or SQLite database",
		help: `Migrate applies idem's embedded schema migrations that the database does not
have yet. It is safe to run repeatedly and from several instances at once
(PostgreSQL serialises concurrent runs with an advisory lock).

The DSN comes from --dsn, or from the IDEM_DSN environment variable.

` + dsnHelp + `

Examples:
  idem migrate --dsn postgres://app@localhost:5432/app --schema idem
  IDEM_DSN=sqlite:/var/lib/app/idem.db idem migrate`,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			sf := addStoreFlags(fs, "migrate", true)
			sf.create = true
			return func(ctx context.Context, e *env, args []string) error {
				if err := noArgs(args); err != nil {
					return err
				}
				s, err := sf.open(ctx, e)
				if err != nil {
					return err
				}
				defer s.Close()
				return runMigrate(ctx, e, s)
			}
		},
	}
}

// runMigrate migrates s and reports what changed.
func runMigrate(ctx context.Context, e *env, s *store) error {
	if s.kind == kindRedis {
		// openStore pinged it already; Redis has no schema.
		fmt.Fprintf(e.stdout, "%s: reachable; Redis needs no migration\n", s)
		return nil
	}
	before, _, err := s.schemaVersion(ctx)
	if err != nil {
		return err
	}
	if err := s.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate %s: %w", s, err)
	}
	after, version, err := s.schemaVersion(ctx)
	if err != nil {
		return err
	}

	fmt.Fprintf(e.stdout, "database: %s (table prefix %q)\n", s, s.opts.Prefix)
	if applied := after - before; applied > 0 {
		fmt.Fprintf(e.stdout, "applied %s; schema is at version %d\n", plural(applied, "migration"), version)
	} else {
		fmt.Fprintf(e.stdout, "already up to date at version %d; nothing to do\n", version)
	}
	names := make([]string, 0, len(managedTables(s.kind)))
	for _, t := range managedTables(s.kind) {
		names = append(names, s.table(t))
	}
	fmt.Fprintf(e.stdout, "tables: %s\n", strings.Join(names, ", "))
	return nil
}

// managedTables are the suffixes of the tables Migrate creates and the
// drivers use, for the store kind: what 'idem migrate' reports. A test
// compares them with the tables a migration leaves.
func managedTables(k storeKind) []string {
	if k == kindMySQL {
		// Narrow markers from the start, and lease claims in a table of
		// their own.
		return []string{"migrations", "handlers", "markers", "leases", "sequences", "gaps", "versions",
			"dead_letters", "dead_letter_log", "handler_stats", "outbox", "outbox_claims", "outbox_log"}
	}
	tables := []string{"migrations", "processed"}
	if k == kindPostgres {
		// Atomic markers have their own table since migration 11.
		tables = append(tables, "markers", "handlers", "marker_layout")
	}
	return append(tables, "sequences", "gaps", "versions", "dead_letters", "dead_letter_log", "handler_stats", "outbox", "outbox_claims", "outbox_log")
}
