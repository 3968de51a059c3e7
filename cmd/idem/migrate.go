package main

import (
	"context"
	"flag"
	"fmt"
)

// migrateCommand returns the "migrate" subcommand: create or update idem's
// tables in the database a DSN names.
func migrateCommand() *command {
	return &command{
		name:     "migrate",
		synopsis: "--dsn DSN [--schema S] [--prefix P]",
		summary:  "create or update idem's tables in a PostgreSQL or SQLite database",
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
	if s.kind == kindPostgres {
		// Atomic markers have their own table since migration 11.
		fmt.Fprintf(e.stdout, "tables: %s, %s, %s\n", s.table("markers"), s.table("processed"), s.table("migrations"))
		return nil
	}
	if s.kind == kindMySQL {
		fmt.Fprintf(e.stdout, "tables: %s, %s, %s\n", s.table("markers"), s.table("leases"), s.table("migrations"))
		return nil
	}
	fmt.Fprintf(e.stdout, "tables: %s, %s\n", s.table("processed"), s.table("migrations"))
	return nil
}
