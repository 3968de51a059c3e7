package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idemhq/idem/internal/sqlident"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/postgres"
	"github.com/idemhq/idem/redisstore"
	"github.com/idemhq/idem/sqlite"
)

// dsnEnv is the environment variable that supplies the DSN when --dsn is
// not given; schemaEnv and prefixEnv supply --schema and --prefix.
const (
	dsnEnv    = "IDEM_DSN"
	schemaEnv = "IDEM_SCHEMA"
	prefixEnv = "IDEM_PREFIX"
)

// defaultPrefix is the table prefix the drivers use when none is configured.
const defaultPrefix = "idem_"

// pingTimeout bounds the first connection to PostgreSQL.
const pingTimeout = 15 * time.Second

// dsnHelp describes the accepted DSN forms, for help texts and errors.
const dsnHelp = `DSN forms:
  postgres://user:pass@host:5432/db?sslmode=disable   PostgreSQL (also postgresql://)
  mysql://user:pass@host:3306/db?param=value          MySQL or MariaDB
  user:pass@tcp(host:3306)/db?param=value             the same, in go-sql-driver/mysql's form
  sqlite:PATH or file:PATH                            SQLite file (migrate creates it if missing)
  PATH ending in .db, .sqlite or .sqlite3             SQLite file
  redis://[:pass@]host:6379/0 (also rediss://)        Redis (redisstore; dlq, migrate, bench, outbox check --consumer)`

// storeKind says which driver a DSN selects.
type storeKind int

const (
	kindPostgres storeKind = iota + 1
	kindSQLite
	kindRedis
	kindMySQL
)

// String returns the database's name.
func (k storeKind) String() string {
	switch k {
	case kindPostgres:
		return "PostgreSQL"
	case kindSQLite:
		return "SQLite"
	case kindRedis:
		return "Redis"
	case kindMySQL:
		return "MySQL"
	}
	return "unknown"
}

// target is a parsed DSN.
type target struct {
	kind storeKind
	// dsn is the connection string passed to pgx (PostgreSQL) or go-redis
	// (Redis), or the mysql:// URL (MySQL).
	dsn string
	// path is the database file (SQLite only).
	path string
}

// resolveDSN returns the DSN from the --dsn flag value, or from IDEM_DSN
// when the flag is empty, or a usage error when neither is set.
func resolveDSN(flagValue string, getenv func(string) string) (string, error) {
	if dsn := strings.TrimSpace(flagValue); dsn != "" {
		return dsn, nil
	}
	if dsn := strings.TrimSpace(getenv(dsnEnv)); dsn != "" {
		return dsn, nil
	}
	return "", usagef("no database given: pass --dsn or set %s, for example\n"+
		"  --dsn postgres://user@localhost:5432/app?sslmode=disable\n"+
		"  --dsn sqlite:idem.db", dsnEnv)
}

// parseDSN recognises a PostgreSQL, Redis or MySQL URL, a MySQL DSN in
// go-sql-driver/mysql's form, or a SQLite path. It returns a usage error
// for anything else.
func parseDSN(dsn string) (target, error) {
	lower := strings.ToLower(dsn)
	switch {
	case strings.HasPrefix(lower, "postgres://"), strings.HasPrefix(lower, "postgresql://"):
		return target{kind: kindPostgres, dsn: dsn}, nil
	case strings.HasPrefix(lower, "redis://"), strings.HasPrefix(lower, "rediss://"):
		return target{kind: kindRedis, dsn: dsn}, nil
	case strings.HasPrefix(lower, "mysql://"):
		return target{kind: kindMySQL, dsn: dsn}, nil
	case strings.HasPrefix(lower, "sqlite:"):
		// sqlite:///abs/path and sqlite://rel/path are accepted too.
		return sqliteTarget(dsn, strings.TrimPrefix(dsn[len("sqlite:"):], "//"))
	case strings.HasPrefix(lower, "file:"):
		return sqliteTarget(dsn, dsn[len("file:"):])
	case isMySQLDriverDSN(dsn):
		return target{kind: kindMySQL, dsn: dsn}, nil
	case isSQLitePath(dsn):
		return sqliteTarget(dsn, dsn)
	}
	return target{}, usagef("unrecognised DSN %q\n%s", redactDSN(dsn), dsnHelp)
}

// sqliteTarget checks the path part of a SQLite DSN.
func sqliteTarget(dsn, path string) (target, error) {
	if path == "" {
		return target{}, usagef("DSN %q names no SQLite file\n%s", redactDSN(dsn), dsnHelp)
	}
	if r := redactURLOrSettings(dsn); r != dsn {
		// The driver's errors would print the path, password and all.
		return target{}, usagef("DSN %q: a SQLite file takes no user name or password", r)
	}
	if before, _, ok := strings.Cut(dsn, "?"); ok {
		// The query is not printed: it may hold a key or a password.
		return target{}, usagef("DSN %q: query parameters are not supported for SQLite; idem sets the pragmas it relies on itself", redactDSN(before)+"?…")
	}
	return target{kind: kindSQLite, path: path}, nil
}

// redactDSN hides the passwords in a DSN before it is printed, whatever
// its shape. In a URL (anything with "://", so also redis://, rediss:// and
// sqlite://) the userinfo password runs up to the last '@' of the whole
// string: a raw '@', '/', '?' or '#' in a password ends it earlier for a URL
// parser, but hiding too much beats printing a password's tail. A
// password=… or sslpassword=… setting in a URL's query is hidden with the
// rest of the query, since a raw '&' or '#' in its value leaves its end
// unknown. In a key/value DSN (host=… password=…) the value ends as libpq
// ends it: a quoted value at its closing quote, an unquoted one at the first
// unescaped space.
func redactDSN(dsn string) string {
	if !strings.Contains(dsn, "://") {
		dsn = redactDriverUserinfo(dsn)
	}
	return redactURLOrSettings(dsn)
}

// redactURLOrSettings is redactDSN without go-sql-driver/mysql's form: a
// URL's password, or the password settings of anything else.
func redactURLOrSettings(dsn string) string {
	scheme, rest, isURL := strings.Cut(dsn, "://")
	if !isURL {
		return redactPasswordSettings(dsn, false)
	}
	if at := strings.LastIndex(rest, "@"); at >= 0 {
		if user, _, hasPass := strings.Cut(rest[:at], ":"); hasPass {
			rest = user + ":xxxxx" + rest[at:]
		}
	}
	return scheme + "://" + redactPasswordSettings(rest, true)
}

// redactDriverUserinfo hides the password of go-sql-driver/mysql's own DSN
// form, user:password@protocol(address)/database?params (the protocol and
// the address may each be left out). The user information ends at the
// last '@' that a protocol's '(' or '/', or a '(' or '/' alone, follows:
// as the driver reads it, or later, which hides more. A "user" holding a
// space or an '=' is a key/value DSN's, not this form's, and is left to
// redactPasswordSettings.
func redactDriverUserinfo(dsn string) string {
	at := driverUserinfoEnd(dsn)
	if at < 0 {
		return dsn
	}
	user, _, hasPass := strings.Cut(dsn[:at], ":")
	if !hasPass || strings.ContainsAny(user, " \t=") {
		return dsn
	}
	return user + ":xxxxx" + dsn[at:]
}

// driverUserinfoEnd returns the index of the '@' that ends the user
// information of a DSN in go-sql-driver/mysql's form (see
// redactDriverUserinfo), or -1.
func driverUserinfoEnd(dsn string) int {
	for at := strings.LastIndex(dsn, "@"); at >= 0; at = strings.LastIndex(dsn[:at], "@") {
		after := dsn[at+1:]
		proto := len(after) - len(strings.TrimLeft(after, "abcdefghijklmnopqrstuvwxyz0123456789"))
		if proto < len(after) && (after[proto] == '(' || after[proto] == '/') {
			return at
		}
	}
	return -1
}

// isMySQLDriverDSN reports whether dsn is in go-sql-driver/mysql's own
// form: user[:password]@tcp(host:port)/database, @unix(/path)/database,
// @(host:port)/database, @tcp/database or @/database (the last two on the
// default address), or tcp(…)/database or unix(…)/database without the
// user. A path ending as a SQLite file's does is not taken for "@/".
func isMySQLDriverDSN(dsn string) bool {
	at := driverUserinfoEnd(dsn)
	if at < 0 {
		return strings.HasPrefix(dsn, "tcp(") || strings.HasPrefix(dsn, "unix(")
	}
	rest := dsn[at+1:]
	for _, p := range []string{"tcp(", "unix(", "(", "tcp/"} {
		if strings.HasPrefix(rest, p) {
			return true
		}
	}
	return strings.HasPrefix(rest, "/") && !isSQLitePath(dsn)
}

// isSQLitePath reports whether dsn ends as a SQLite file's name does.
func isSQLitePath(dsn string) bool {
	lower := strings.ToLower(dsn)
	return strings.HasSuffix(lower, ".db") || strings.HasSuffix(lower, ".sqlite") || strings.HasSuffix(lower, ".sqlite3")
}

// passwordKeys are the settings whose values redactPasswordSettings hides:
// libpq's password and sslpassword (the client key's passphrase).
var passwordKeys = [...]string{"password", "sslpassword"}

// redactPasswordSettings masks the value of every password setting (see
// passwordKeys): in a URL's query (inURL), where it hides everything up to
// the end, or in a key/value DSN, where the value is quoted ('…', with
// backslash escapes) or runs to the first space or tab not escaped by a
// backslash. A setting starts the string or follows a space, tab, ? or &.
func redactPasswordSettings(s string, inURL bool) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		key := ""
		if i == 0 || strings.ContainsRune(" \t?&", rune(s[i-1])) {
			for _, k := range passwordKeys {
				if len(s)-i >= len(k) && strings.EqualFold(s[i:i+len(k)], k) {
					key = k
				}
			}
		}
		if key == "" {
			b.WriteByte(s[i])
			i++
			continue
		}
		j := i + len(key)
		for j < len(s) && (s[j] == ' ' || s[j] == '\t') {
			j++
		}
		if j == len(s) || s[j] != '=' {
			b.WriteString(s[i:j])
			i = j
			continue
		}
		j++
		for j < len(s) && (s[j] == ' ' || s[j] == '\t') {
			j++
		}
		b.WriteString(s[i:j])
		k := j
		switch {
		case inURL:
			k = len(s)
		case k < len(s) && s[k] == '\'':
			for k++; k < len(s) && s[k] != '\''; k++ {
				if s[k] == '\\' {
					k++
				}
			}
			k = min(k+1, len(s))
		default:
			for ; k < len(s) && s[k] != ' ' && s[k] != '\t'; k++ {
				if s[k] == '\\' {
					k++
				}
			}
			k = min(k, len(s))
		}
		if k > j {
			b.WriteString("xxxxx")
		}
		i = k
	}
	return b.String()
}

// dsnError is a DSN that cannot be used, described without its secrets.
// A parser's own message may quote the raw DSN (net/url's does) or a piece
// of it (an "invalid port" that is a password's head, a database name that
// is its tail), so it is kept for errors.Is and errors.As but never
// printed.
type dsnError struct {
	// kind is the store the DSN is for.
	kind storeKind
	// redacted is the DSN with its passwords hidden.
	redacted string
	// reason says what is wrong, in words that quote nothing of the DSN.
	reason string
	// err is the parser's error, if any.
	err error
}

// Error implements error.
func (e *dsnError) Error() string {
	return fmt.Sprintf("bad %s DSN %s: %s", e.kind, e.redacted, e.reason)
}

// Unwrap returns the parser's error.
func (e *dsnError) Unwrap() error { return e.err }

// dsnEncodingHint ends the reason of a DSN that does not parse as a URL.
const dsnEncodingHint = "percent-encode the reserved characters in the user name and password (@ as %40, / as %2F, ? as %3F, # as %23, % as %25, : in the user name as %3A)"

// checkURLDSN refuses a URL DSN whose meaning is ambiguous: an '@' after
// the host (in the path, query or fragment) means a password held a raw
// '/', '?' or '#', so the URL parser has taken part of the password for
// the host, the database or a setting, and would print it in its errors.
func checkURLDSN(kind storeKind, dsn string) error {
	_, rest, _ := strings.Cut(dsn, "://")
	if end := strings.IndexAny(rest, "/?#"); end >= 0 && strings.Contains(rest[end:], "@") {
		return usageErr(&dsnError{kind: kind, redacted: redactDSN(dsn), reason: "an '@' follows the host; " + dsnEncodingHint})
	}
	return nil
}

// usageErr wraps err as a *usageError.
func usageErr(err error) error { return &usageError{err: err} }

// parsePostgresDSN parses a PostgreSQL URL for pgx. Its errors never quote
// the DSN's passwords.
func parsePostgresDSN(dsn string) (*pgxpool.Config, error) {
	if err := checkURLDSN(kindPostgres, dsn); err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, usageErr(&dsnError{kind: kindPostgres, redacted: redactDSN(dsn), err: err,
			reason: "it does not parse as postgres://user:password@host:port/database?setting=value; " + dsnEncodingHint})
	}
	for _, h := range append([]string{cfg.ConnConfig.Host}, fallbackHosts(cfg)...) {
		if strings.Contains(h, "@") {
			// The host is then a password's tail, and would be printed.
			return nil, usageErr(&dsnError{kind: kindPostgres, redacted: redactDSN(dsn), reason: "its host holds an '@'; " + dsnEncodingHint})
		}
	}
	return cfg, nil
}

// parseRedisDSN parses a Redis URL for go-redis. Its errors never quote the
// DSN's passwords.
func parseRedisDSN(dsn string) (*redis.Options, error) {
	if err := checkURLDSN(kindRedis, dsn); err != nil {
		return nil, err
	}
	opts, err := redis.ParseURL(dsn)
	if err != nil {
		return nil, usageErr(&dsnError{kind: kindRedis, redacted: redactDSN(dsn), err: err,
			reason: "it does not parse as redis://[user:password@]host:port/db; " + dsnEncodingHint})
	}
	return opts, nil
}

// parseMySQLDSN turns a mysql://user:password@host:port/database?param=value
// URL, or a DSN in go-sql-driver/mysql's own form, into the driver's
// configuration. Of a URL: the user name and password
// percent-decoded, the port 3306 when none is given, the parameters those of
// the driver's own DSN (tls, timeout, charset, or a session variable).
// Statements' parameters are interpolated client-side, one round trip each.
// Its errors never quote the DSN's passwords.
func parseMySQLDSN(dsn string) (*gomysql.Config, error) {
	bad := func(err error, reason string) error {
		return usageErr(&dsnError{kind: kindMySQL, redacted: redactDSN(dsn), err: err, reason: reason})
	}
	if !strings.HasPrefix(strings.ToLower(dsn), "mysql://") {
		// The driver's own form. Its parse errors name what is wrong,
		// not the DSN.
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return nil, bad(err, "it does not parse as user:password@tcp(host:port)/database?param=value")
		}
		return withCLIDefaults(cfg), nil
	}
	if err := checkURLDSN(kindMySQL, dsn); err != nil {
		return nil, err
	}
	u, err := url.Parse(dsn)
	if err != nil {
		return nil, bad(err, "it does not parse as mysql://user:password@host:port/database?param=value; "+dsnEncodingHint)
	}
	if u.Host == "" || strings.Contains(u.Host, "@") {
		return nil, bad(nil, "it names no host, or its host holds an '@'; "+dsnEncodingHint)
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "3306")
	}
	db := strings.TrimPrefix(u.Path, "/")
	if strings.Contains(db, "/") {
		return nil, bad(nil, "the database name holds a '/'")
	}
	cfg, err := gomysql.ParseDSN("tcp(" + host + ")/" + db + "?" + u.RawQuery)
	if err != nil {
		return nil, bad(err, "its host or parameters are not those of a MySQL DSN")
	}
	cfg.User = u.User.Username()
	cfg.Passwd, _ = u.User.Password()
	return withCLIDefaults(cfg), nil
}

// withCLIDefaults sets what the command line's MySQL connections share.
func withCLIDefaults(cfg *gomysql.Config) *gomysql.Config {
	cfg.InterpolateParams = true
	// go-sql-driver writes a line to stderr of its own for every broken
	// connection; the command reports a failure itself, once, with what
	// it was doing (and serve's banner and metrics show an outage).
	cfg.Logger = quietMySQL{}
	if cfg.Params == nil {
		cfg.Params = map[string]string{}
	}
	// A command waiting on a row lock fails after this, naming the lock,
	// rather than hanging for InnoDB's default 50 seconds.
	if _, ok := cfg.Params["innodb_lock_wait_timeout"]; !ok {
		cfg.Params["innodb_lock_wait_timeout"] = cliLockWaitSeconds
	}
	return cfg
}

// cliLockWaitSeconds is the MySQL innodb_lock_wait_timeout of the command
// line's connections, unless the DSN sets one.
const cliLockWaitSeconds = "10"

// storeFlags are the flags shared by every command that opens a store.
type storeFlags struct {
	dsn, schema string
	prefix      prefixFlag
	// redisOK is set by the commands that work on a Redis store too.
	redisOK bool
	// command names the command, for the error that refuses Redis.
	command string
	// create is set by the command that may create a SQLite file
	// (migrate); the others refuse a file that does not exist rather than
	// leave an empty database behind a mistyped path.
	create bool
}

// addStoreFlags defines --dsn, --schema and --prefix on fs for command,
// which accepts a Redis DSN if redisOK is set.
func addStoreFlags(fs *flag.FlagSet, command string, redisOK bool) *storeFlags {
	f := &storeFlags{command: command, redisOK: redisOK}
	fs.StringVar(&f.dsn, "dsn", "", "database `DSN` (default: $"+dsnEnv+")")
	schemaHelp := "PostgreSQL `schema` of idem's tables (default: $" + schemaEnv + ", else the connection's search_path); MySQL: the database in the DSN holds them"
	if command == "migrate" {
		schemaHelp = "PostgreSQL `schema` for idem's tables, created if missing (default: $" + schemaEnv + ", else the connection's search_path); MySQL: the database in the DSN holds them"
	}
	fs.StringVar(&f.schema, "schema", "", schemaHelp)
	fs.Var(&f.prefix, "prefix", "`prefix` of idem's table names: lower-case letters, digits and _, at most 40 bytes (default: $"+prefixEnv+", else \"idem_\"; Redis: of its keys, default \"idem:\")")
	return f
}

// prefixFlag is --prefix: it remembers whether it was given, so that the
// default can depend on the store (idem_ for SQL tables, idem: for Redis
// keys) while an explicit --prefix idem_ on Redis means just that.
type prefixFlag struct {
	value string
	set   bool
}

// String implements flag.Value. Unset it is empty: the default depends on
// the store, and the usage text gives both.
func (p *prefixFlag) String() string {
	if p == nil {
		return ""
	}
	return p.value
}

// Set implements flag.Value.
func (p *prefixFlag) Set(v string) error {
	p.value, p.set = v, true
	return nil
}

// open resolves the DSN (flag, then environment), validates the flags and
// opens the store. The caller must Close it.
func (f *storeFlags) open(ctx context.Context, e *env) (*store, error) {
	dsn, err := resolveDSN(f.dsn, e.getenv)
	if err != nil {
		return nil, err
	}
	if f.prefix.set && f.prefix.value == "" {
		return nil, usagef("--prefix is empty: idem's tables always carry a prefix (the default is %q)", defaultPrefix)
	}
	// The environment fills in what the flags leave out, as for the DSN.
	opts := storeOptions{Schema: f.schema, Prefix: f.prefix.value, Create: f.create}
	if opts.Schema == "" {
		opts.Schema = strings.TrimSpace(e.getenv(schemaEnv))
		opts.schemaFromEnv = opts.Schema != ""
	}
	if !f.prefix.set {
		opts.Prefix = strings.TrimSpace(e.getenv(prefixEnv))
		opts.prefixFromEnv = opts.Prefix != ""
	}
	if !f.redisOK {
		if t, err := parseDSN(dsn); err == nil && t.kind == kindRedis {
			return nil, usagef("%s reads SQL stores (SQLite, PostgreSQL, MySQL) only; on Redis, use dlq, migrate or bench", f.command)
		}
	}
	return openStore(ctx, dsn, opts)
}

// storeOptions are the table-layout settings shared by the commands that
// open a store.
type storeOptions struct {
	// Schema is the PostgreSQL schema holding idem's tables; empty means
	// the connection's search_path. Not allowed for SQLite.
	Schema string
	// Prefix is prepended to every table name, or Redis key; empty means
	// the store's default: "idem_" for SQL tables, "idem:" for Redis.
	Prefix string
	// Create allows opening a SQLite file that does not exist yet (which
	// creates it).
	Create bool
	// schemaFromEnv and prefixFromEnv say the values came from
	// IDEM_SCHEMA and IDEM_PREFIX, for the errors that name them.
	schemaFromEnv, prefixFromEnv bool
}

// schemaName and prefixName name where the schema and prefix came from.
func (o *storeOptions) schemaName() string {
	if o.schemaFromEnv {
		return "$" + schemaEnv
	}
	return "--schema"
}

func (o *storeOptions) prefixName() string {
	if o.prefixFromEnv {
		return "$" + prefixEnv
	}
	return "--prefix"
}

// check validates the options against the target before anything is
// opened, so that a bad flag is a usage error rather than a half-created
// database.
func (o *storeOptions) check(t target) error {
	if t.kind == kindRedis {
		if o.Schema != "" {
			return usagef("%s applies only to PostgreSQL; Redis keys take a --prefix", o.schemaName())
		}
		return nil // redisstore.New checks the prefix; empty is its default, "idem:"
	}
	if o.Prefix == "" {
		o.Prefix = defaultPrefix
	}
	if err := sqlident.Check(o.prefixName(), o.Prefix, false); err != nil {
		return &usageError{err: err}
	}
	if err := sqlident.Check(o.schemaName(), o.Schema, true); err != nil {
		return &usageError{err: err}
	}
	if o.Schema != "" && t.kind != kindPostgres {
		return usagef("%s applies only to PostgreSQL; on %s use --prefix (MySQL: the DSN names the database)", o.schemaName(), t.kind)
	}
	return nil
}

// store is an opened idem store. Exactly one of the driver groups is set,
// according to kind.
type store struct {
	target
	opts storeOptions

	sqliteDB  *sql.DB
	sqliteDrv *sqlite.Driver

	pgPool *pgxpool.Pool
	pgDrv  *postgres.Driver

	redisClient *redis.Client
	redisDrv    *redisstore.Driver

	mysqlDB  *sql.DB
	mysqlDrv *mysql.Driver
	// mysqlWhere is user@host:port/database, for messages.
	mysqlWhere string
}

// openStore parses dsn, validates opts and opens the database with idem's
// driver for it. Usage problems (a bad DSN or option) are *usageError;
// connection failures are plain errors. The caller must Close the store.
func openStore(ctx context.Context, dsn string, opts storeOptions) (*store, error) {
	t, err := parseDSN(dsn)
	if err != nil {
		return nil, err
	}
	if err := opts.check(t); err != nil {
		return nil, err
	}
	s := &store{target: t, opts: opts}
	switch t.kind {
	case kindSQLite:
		if !opts.Create {
			if _, err := os.Stat(t.path); errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("%s does not exist (idem migrate creates it)", s)
			}
		}
		if s.sqliteDB, err = sqlite.Open(t.path, nil); err != nil {
			return nil, fmt.Errorf("open SQLite database: %w", err)
		}
		if s.sqliteDrv, err = sqlite.New(s.sqliteDB, &sqlite.Config{TablePrefix: opts.Prefix}); err != nil {
			s.Close()
			return nil, fmt.Errorf("SQLite driver: %w", err)
		}
	case kindPostgres:
		cfg, err := parsePostgresDSN(t.dsn)
		if err != nil {
			return nil, err
		}
		// A command waiting on a lock (a table another session locked, a
		// migration behind busy transactions) fails after this, naming
		// the lock, rather than hanging without a word.
		if _, ok := cfg.ConnConfig.RuntimeParams["lock_timeout"]; !ok {
			cfg.ConnConfig.RuntimeParams["lock_timeout"] = cliLockTimeout
		}
		if s.pgPool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
			return nil, fmt.Errorf("connect to %s: %w", s, err)
		}
		pctx, cancel := context.WithTimeout(ctx, pingTimeout)
		err = s.pgPool.Ping(pctx)
		cancel()
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("connect to %s: %w", s, err)
		}
		if s.pgDrv, err = postgres.New(s.pgPool, &postgres.Config{Schema: opts.Schema, TablePrefix: opts.Prefix}); err != nil {
			s.Close()
			return nil, fmt.Errorf("PostgreSQL driver: %w", err)
		}
	case kindMySQL:
		cfg, err := parseMySQLDSN(t.dsn)
		if err != nil {
			return nil, err
		}
		s.mysqlWhere = cfg.User + "@" + cfg.Addr + "/" + cfg.DBName
		pctx, cancel := context.WithTimeout(ctx, pingTimeout)
		s.mysqlDB, err = mysql.Open(pctx, cfg)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("connect to %s: %w", s, err)
		}
		if s.mysqlDrv, err = mysql.New(s.mysqlDB, &mysql.Config{TablePrefix: opts.Prefix, SessionIsolation: true}); err != nil {
			s.Close()
			return nil, fmt.Errorf("MySQL driver: %w", err)
		}
	case kindRedis:
		ropts, err := parseRedisDSN(t.dsn)
		if err != nil {
			return nil, err
		}
		ropts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled} // see docs/redis.md
		s.redisClient = redis.NewClient(ropts)
		if s.redisDrv, err = redisstore.New(s.redisClient, &redisstore.Config{Prefix: opts.Prefix}); err != nil {
			s.Close()
			return nil, &usageError{err: err}
		}
		// A ping, not the driver's Migrate: that also refuses a server
		// that may evict markers, which `idem migrate` reports, but an
		// operator must still reach the dead letters on it.
		pctx, cancel := context.WithTimeout(ctx, pingTimeout)
		err = s.redisClient.Ping(pctx).Err()
		cancel()
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("connect to %s: redisstore: ping: %w", s, err)
		}
	}
	return s, nil
}

// Close releases the database handles.
func (s *store) Close() {
	if s.sqliteDB != nil {
		s.sqliteDB.Close()
	}
	if s.pgPool != nil {
		s.pgPool.Close()
	}
	if s.redisClient != nil {
		s.redisClient.Close()
	}
	if s.mysqlDB != nil {
		s.mysqlDB.Close()
	}
}

// String describes the database without secrets, for messages.
func (s *store) String() string {
	switch s.kind {
	case kindSQLite:
		return "SQLite " + s.path
	case kindPostgres:
		where := "PostgreSQL " + redactDSN(s.dsn)
		if s.pgPool != nil {
			c := s.pgPool.Config().ConnConfig
			where = fmt.Sprintf("PostgreSQL %s@%s:%d/%s", c.User, c.Host, c.Port, c.Database)
		}
		if s.opts.Schema != "" {
			// Naming it: a wrong --schema is the usual reason for "no idem tables".
			where += " (schema " + s.opts.Schema + ")"
		}
		return where
	case kindRedis:
		if s.redisClient != nil {
			o := s.redisClient.Options()
			return fmt.Sprintf("Redis %s/%d", o.Addr, o.DB)
		}
		return "Redis " + redactDSN(s.dsn)
	case kindMySQL:
		if s.mysqlWhere != "" {
			return "MySQL " + s.mysqlWhere
		}
		return "MySQL " + redactDSN(s.dsn)
	}
	return "unknown store"
}

// Migrate brings idem's schema up to date with the store's driver.
func (s *store) Migrate(ctx context.Context) error {
	switch s.kind {
	case kindSQLite:
		return s.sqliteDrv.Migrate(ctx)
	case kindPostgres:
		return s.pgDrv.Migrate(ctx)
	case kindRedis:
		return s.redisDrv.Migrate(ctx)
	case kindMySQL:
		return s.mysqlDrv.Migrate(ctx)
	}
	return fmt.Errorf("migrate: unsupported store %s", s)
}

// table returns the quoted, schema-qualified name of idem's table with the
// given suffix ("processed", "migrations").
func (s *store) table(suffix string) string {
	if s.kind == kindMySQL {
		return "`" + s.opts.Prefix + suffix + "`" // the prefix passed sqlident.Check
	}
	return sqlident.Qualified(s.opts.Schema, s.opts.Prefix+suffix)
}

// schemaVersion returns how many migrations are recorded and the highest
// version, both 0 when the migrations table does not exist yet.
func (s *store) schemaVersion(ctx context.Context) (count, version int, err error) {
	name := s.opts.Prefix + "migrations"
	q := `SELECT count(*), coalesce(max(version), 0) FROM ` + s.table("migrations")
	switch s.kind {
	case kindSQLite:
		var n int
		if err := s.sqliteDB.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?`, name).Scan(&n); err != nil {
			return 0, 0, fmt.Errorf("read schema version: %w", err)
		}
		if n == 0 {
			return 0, 0, nil
		}
		err = s.sqliteDB.QueryRowContext(ctx, q).Scan(&count, &version)
	case kindPostgres:
		var exists bool
		if err := s.pgPool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.table("migrations")).Scan(&exists); err != nil {
			return 0, 0, fmt.Errorf("read schema version: %w", err)
		}
		if !exists {
			return 0, 0, nil
		}
		err = s.pgPool.QueryRow(ctx, q).Scan(&count, &version)
	case kindMySQL:
		var n int
		if err := s.mysqlDB.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?`, name).Scan(&n); err != nil {
			return 0, 0, fmt.Errorf("read schema version: %w", err)
		}
		if n == 0 {
			return 0, 0, nil
		}
		err = s.mysqlDB.QueryRowContext(ctx, q).Scan(&count, &version)
	default:
		return 0, 0, fmt.Errorf("read schema version: unsupported store %s", s)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("read schema version: %w", err)
	}
	return count, version, nil
}

// plural returns "n word" or "n words".
func plural(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return strconv.Itoa(n) + " " + word + "s"
}

// cliLockTimeout is the PostgreSQL lock_timeout of the command line's
// connections, unless the DSN sets one.
const cliLockTimeout = "10s"

// fallbackHosts returns the hosts of cfg's fallbacks.
func fallbackHosts(cfg *pgxpool.Config) []string {
	var hs []string
	for _, f := range cfg.ConnConfig.Fallbacks {
		hs = append(hs, f.Host)
	}
	return hs
}

// errNoTables is the error for a store without idem's tables. Running
// 'idem migrate' there would create an empty second set beside the real
// one, so it names where idem's tables are instead, when it finds them:
// the other PostgreSQL schemas, or the other table prefixes, holding a
// migrations table and a processed table of the same prefix.
func (s *store) errNoTables(ctx context.Context) error {
	here, found, err := s.findTables(ctx)
	if err != nil {
		// The hint is a courtesy: without it, say what is known.
		return fmt.Errorf("%s has no idem tables: run 'idem migrate' first", s)
	}
	if len(found) == 0 {
		return fmt.Errorf("%s has no idem tables (%s), nor has any other %s: run 'idem migrate' first", s, here, map[bool]string{true: "schema", false: "prefix"}[s.kind == kindPostgres])
	}
	set := "--prefix or $" + prefixEnv
	if s.kind == kindPostgres {
		set = "--schema or $" + schemaEnv
		for _, f := range found {
			if !strings.HasSuffix(f, fmt.Sprintf("prefix %q", s.opts.Prefix)) {
				set += " (and --prefix or $" + prefixEnv + ")"
				break
			}
		}
	}
	if len(found) > 5 {
		found = append(found[:5], fmt.Sprintf("and %d more", len(found)-5))
	}
	return fmt.Errorf("no idem tables in %s; found them in %s: set %s ('idem migrate' here would create a second, empty set)", here, strings.Join(found, "; "), set)
}

// findTables describes where this store looks for idem's tables, and
// lists where idem's tables are in the database: schema and prefix on
// PostgreSQL, prefix on SQLite and in MySQL's database.
func (s *store) findTables(ctx context.Context) (here string, found []string, err error) {
	switch s.kind {
	case kindPostgres:
		schema := s.opts.Schema
		if schema == "" {
			if err := s.pgPool.QueryRow(ctx, `SELECT coalesce(current_schema(), '')`).Scan(&schema); err != nil {
				return "", nil, err
			}
		}
		here = fmt.Sprintf("schema %q, prefix %q", schema, s.opts.Prefix)
		rows, err := s.pgPool.Query(ctx, `SELECT m.table_schema, left(m.table_name, length(m.table_name) - 10) FROM information_schema.tables m
WHERE right(m.table_name, 10) = 'migrations' AND length(m.table_name) > 10
  AND EXISTS (SELECT 1 FROM information_schema.tables p WHERE p.table_schema = m.table_schema
    AND p.table_name = left(m.table_name, length(m.table_name) - 10) || 'processed')
ORDER BY 1, 2`)
		if err != nil {
			return "", nil, err
		}
		defer rows.Close()
		for rows.Next() {
			var sc, prefix string
			if err := rows.Scan(&sc, &prefix); err != nil {
				return "", nil, err
			}
			found = append(found, fmt.Sprintf("schema %q, prefix %q", sc, prefix))
		}
		return here, found, rows.Err()
	case kindSQLite:
		here = fmt.Sprintf("prefix %q", s.opts.Prefix)
		rows, err := s.sqliteDB.QueryContext(ctx, `SELECT substr(m.name, 1, length(m.name) - 10) FROM sqlite_master m
WHERE m.type = 'table' AND m.name LIKE '%migrations' AND length(m.name) > 10
  AND EXISTS (SELECT 1 FROM sqlite_master p WHERE p.type = 'table' AND p.name = substr(m.name, 1, length(m.name) - 10) || 'processed')
ORDER BY 1`)
		found, err = quotedPrefixes(rows, err)
		return here, found, err
	case kindMySQL:
		// The DSN names the database; other prefixes in it are found.
		here = fmt.Sprintf("prefix %q", s.opts.Prefix)
		rows, err := s.mysqlDB.QueryContext(ctx, `SELECT LEFT(m.table_name, CHAR_LENGTH(m.table_name) - 10) FROM information_schema.tables m
WHERE m.table_schema = DATABASE() AND m.table_name LIKE '%migrations' AND CHAR_LENGTH(m.table_name) > 10
  AND EXISTS (SELECT 1 FROM information_schema.tables p WHERE p.table_schema = m.table_schema
    AND p.table_name = CONCAT(LEFT(m.table_name, CHAR_LENGTH(m.table_name) - 10), 'markers'))
ORDER BY 1`)
		found, err = quotedPrefixes(rows, err)
		return here, found, err
	}
	return "", nil, fmt.Errorf("find tables: unsupported store %s", s)
}

// quotedPrefixes reads the table prefixes a query of findTables returned,
// each as `prefix "…"`.
func quotedPrefixes(rows *sql.Rows, err error) ([]string, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var found []string
	for rows.Next() {
		var prefix string
		if err := rows.Scan(&prefix); err != nil {
			return nil, err
		}
		found = append(found, fmt.Sprintf("prefix %q", prefix))
	}
	return found, rows.Err()
}
