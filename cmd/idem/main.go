// Command idem is the command-line tool of the idem library.
//
// Usage:
//
//	idem <command> [flags]
//
// Commands:
//
//	demo      run an account-balance projection over a duplicate-heavy
//	          stream on SQLite and verify every balance
//	migrate   create or update idem's tables in a PostgreSQL, MySQL or
//	          SQLite database
//	stats     per-handler counts: applied, in flight, failed, dead
//	          letters, conflicts, oldest marker
//	dlq       list, show, replay or discard dead letters
//	outbox    outbox state: pending rows, the oldest pending row's age,
//	          failing rows; sequences behind issued IDs
//	cleanup   delete markers older than the retention, in small batches
//	import    import the IDs of a hand-rolled processed-events table as
//	          markers
//	bench     measure idem's throughput as a ratio of the same
//	          transactions without it
//	chaos     kill consumers, relays and broker nodes at random and
//	          verify every effect happened once
//	serve     serve the store's state as Prometheus metrics and an
//	          operator console
//	help      show help for idem or for one command
//
// Exit codes: 0 success, 1 verification or operation failed, 2 usage error.
//
// Every command parses its own flags (idem <command> --help lists them).
// SIGINT and SIGTERM cancel the running command, which then exits with 1.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/operations.md
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"
)

// Exit codes, documented in the help text.
const (
	exitOK     = 0 // the command succeeded
	exitFailed = 1 // verification or an operation failed
	exitUsage  = 2 // unknown command, bad flag or bad argument
)

// exitCodesHelp is appended to every help text.
const exitCodesHelp = `Exit codes:
  0  success
  1  verification or operation failed (including interruption)
  2  usage error: unknown command, bad flag or bad argument
`

// main runs the command line with a context that SIGINT and SIGTERM cancel.
func main() {
	// go-redis logs every failed dial to stderr on its own; the command
	// reports the failure once, with what it was doing.
	redis.SetLogger(quietRedis{})
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// quietMySQL drops go-sql-driver's own log lines.
type quietMySQL struct{}

func (quietMySQL) Print(...any) {}

// quietRedis drops go-redis's own log lines.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

// env is what a command may touch outside its flags: the output streams and
// the process environment.
type env struct {
	stdout, stderr io.Writer
	getenv         func(string) string
}

// command is one subcommand of idem.
type command struct {
	// name is the word after idem.
	name string
	// synopsis follows "idem <name>" in the usage line, for example
	// "--dsn DSN [--schema S]".
	synopsis string
	// summary is the one-line description shown in the command list.
	summary string
	// help is the long description shown by idem <name> --help.
	help string
	// setup defines the command's flags on fs and returns the action that
	// runs once they are parsed; args are the positional arguments left.
	// An action returns a *usageError for exit 2, another error for exit 1.
	setup func(fs *flag.FlagSet) func(ctx context.Context, e *env, args []string) error
}

// commands lists the subcommands in the order help shows them. Adding a
// command is adding an entry here.
func commands() []*command {
	return []*command{
		demoCommand(),
		migrateCommand(),
		statsCommand(),
		dlqCommand(),
		outboxCommand(),
		cleanupCommand(),
		importCommand(),
		benchCommand(),
		chaosCommand(),
		serveCommand(),
	}
}

// findCommand returns the command called name, or nil.
func findCommand(name string) *command {
	for _, c := range commands() {
		if c.name == name {
			return c
		}
	}
	return nil
}

// run executes the command line args (without the program name) and returns
// the process exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runEnv(ctx, &env{stdout: stdout, stderr: stderr, getenv: os.Getenv}, args)
}

// runEnv is run with an explicit environment, so tests can control it.
func runEnv(ctx context.Context, e *env, args []string) int {
	if len(args) == 0 {
		printMainUsage(e.stderr)
		return exitUsage
	}
	switch name := args[0]; name {
	case "help", "-h", "-help", "--help":
		return runHelp(e, args[1:])
	default:
		c := findCommand(name)
		if c == nil {
			fmt.Fprintf(e.stderr, "idem: unknown command %s\nRun 'idem help' for the list of commands.\n", quoteArg(name))
			return exitUsage
		}
		return runCommand(ctx, e, c, args[1:])
	}
}

// runHelp prints the main usage, or the usage of the command named in args.
func runHelp(e *env, args []string) int {
	switch len(args) {
	case 0:
		printMainUsage(e.stdout)
		return exitOK
	case 1:
		if args[0] == "-h" || args[0] == "--help" || args[0] == "-help" {
			// idem <command> --help works for every command: help too.
			printMainUsage(e.stdout)
			return exitOK
		}
		c := findCommand(args[0])
		if c == nil {
			fmt.Fprintf(e.stderr, "idem help: unknown command %s\nRun 'idem help' for the list of commands.\n", quoteArg(args[0]))
			return exitUsage
		}
		fs := newFlagSet(c)
		c.setup(fs)
		printCommandUsage(e.stdout, c, fs)
		return exitOK
	default:
		fmt.Fprintf(e.stderr, "idem help: too many arguments\nUsage: idem help [command]\n")
		return exitUsage
	}
}

// runCommand parses c's flags from args, runs it and maps its error to an
// exit code.
func runCommand(ctx context.Context, e *env, c *command, args []string) int {
	fs := newFlagSet(c)
	action := c.setup(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printCommandUsage(e.stdout, c, fs)
			return exitOK
		}
		fmt.Fprintf(e.stderr, "idem %s: %v\nRun 'idem %s --help' for usage.\n", c.name, flagError(err), c.name)
		return exitUsage
	}
	err := action(ctx, e, fs.Args())
	if err == nil || errors.Is(err, errHelpShown) {
		return exitOK
	}
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(e.stderr, "idem %s: %s\nRun 'idem %s --help' for usage.\n", c.name, errorText(c.name, err), c.name)
		return exitUsage
	}
	if ctx.Err() != nil {
		fmt.Fprintf(e.stderr, "idem %s: interrupted: %s\n", c.name, termBlock(err.Error()))
		return exitFailed
	}
	fmt.Fprintf(e.stderr, "idem %s: %s\n", c.name, errorText(c.name, err))
	return exitFailed
}

// errorText is err's message without the library's "idem: " prefix and,
// after it, the command's own name, which the line already starts with:
// "idem import: read …", not "idem import: idem: import: read …".
func errorText(command string, err error) string {
	msg := termBlock(err.Error())
	if rest, ok := strings.CutPrefix(msg, "idem: "); ok {
		msg = rest
		if rest, ok := strings.CutPrefix(msg, command+": "); ok {
			msg = rest
		}
	}
	return msg
}

// errHelpShown is returned by a command that printed its help because a
// subcommand was given --help: the command succeeded.
var errHelpShown = errors.New("help shown")

// showHelp prints c's usage, as 'idem c --help' does, and returns
// errHelpShown.
func showHelp(e *env, c *command) error {
	fs := newFlagSet(c)
	c.setup(fs)
	printCommandUsage(e.stdout, c, fs)
	return errHelpShown
}

// newFlagSet returns an empty flag set for c that reports errors instead of
// exiting and prints nothing by itself.
func newFlagSet(c *command) *flag.FlagSet {
	fs := flag.NewFlagSet("idem "+c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// printMainUsage writes the top-level help to w.
func printMainUsage(w io.Writer) {
	var b strings.Builder
	b.WriteString(`idem gives event consumers effectively-once processing: the same message ID
leads to at most one applied effect per handler.

Usage:
  idem <command> [flags]

Commands:
`)
	for _, c := range commands() {
		fmt.Fprintf(&b, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(&b, "  %-10s %s\n", "help", "show help for idem or for one command")
	b.WriteString(`
Run 'idem help <command>' or 'idem <command> --help' for a command's flags.
Flags may be written with one dash or two (-events or --events).

`)
	b.WriteString(exitCodesHelp)
	io.WriteString(w, b.String())
}

// printCommandUsage writes the help of c, whose flags are defined on fs, to w.
func printCommandUsage(w io.Writer, c *command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: idem %s %s\n\n%s\n", c.name, c.synopsis, strings.TrimSpace(c.help))
	hasFlags := false
	fs.VisitAll(func(*flag.Flag) { hasFlags = true })
	if hasFlags {
		fmt.Fprintf(w, "\nFlags:\n")
		fs.SetOutput(w)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	fmt.Fprintf(w, "\n%s", exitCodesHelp)
}

// usageError is an error in how the command was called: it exits with
// exitUsage and points at the command's help.
type usageError struct {
	err error
}

// Error implements error.
func (e *usageError) Error() string { return e.err.Error() }

// Unwrap returns the underlying error.
func (e *usageError) Unwrap() error { return e.err }

// usagef returns a *usageError with a formatted message; %w is honoured.
func usagef(format string, args ...any) error {
	return &usageError{err: fmt.Errorf(format, args...)}
}

// noArgs returns a usage error when a command that takes no positional
// arguments got some.
func noArgs(args []string) error {
	if len(args) > 0 {
		return usagef("unexpected argument %s (this command takes only flags)", quoteArg(args[0]))
	}
	return nil
}

// quoteArg quotes a command-line argument for a message. A DSN typed
// where another argument belongs (without --dsn before it, say) is one:
// its password is hidden, as everywhere else.
func quoteArg(s string) string { return strconv.Quote(redactDSN(s)) }

// quoteArgs is quoteArg for a list of arguments, written as %q writes
// a slice.
func quoteArgs(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		q[i] = quoteArg(a)
	}
	return "[" + strings.Join(q, " ") + "]"
}

// flagError is a flag parse error with the value it quotes ("invalid
// value ... for flag -limit") quoted by quoteArg instead; in another
// error, such as an undefined flag's, the name is redacted as a DSN.
func flagError(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return err
	}
	msg := err.Error()
	if i := strings.IndexByte(msg, '"'); i >= 0 {
		if q, qerr := strconv.QuotedPrefix(msg[i:]); qerr == nil {
			if v, uerr := strconv.Unquote(q); uerr == nil {
				return &usageError{err: errors.New(msg[:i] + quoteArg(v) + msg[i+len(q):])}
			}
		}
	}
	return &usageError{err: errors.New(redactDSN(msg))}
}

// writeJSON writes v to w as indented JSON, the form of every --json output.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
