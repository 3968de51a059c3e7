package mysql

import (
	"context"
	"database/sql"
	"fmt"
	"strings"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
)

// Open opens a pool on cfg with the settings the driver is fastest with:
// every connection at READ COMMITTED from the start (so pass
// Config.SessionIsolation to New, and the driver's transactions skip
// setting it); statements' parameters interpolated client-side, one round
// trip each instead of a prepare, an execute and a close; and the
// transactions the driver begins sending no begin of their own, so that a
// message takes the three round trips and (from a connection's second
// message on; the first also carries SET autocommit=0) three statements
// of a plain transaction (the marker INSERT, the handler's write, COMMIT)
// rather than four. A connection the driver has run a transaction on stays at
// autocommit=0, where the INSERT begins the next one by itself; anything
// else that runs on it outside a transaction first turns autocommit back
// on (in the same packet as an Exec), so to the pool's other users it
// behaves as any pool does. That needs the connections' multi-statement
// capability, which Open turns on: a statement string may then hold
// several statements, so never build one by pasting untrusted text
// (parameters stay safe, they are escaped). Other transactions on the
// pool begin with START TRANSACTION as usual. The
// isolation variable is named after the server: tx_isolation on MariaDB
// before 11.1, transaction_isolation elsewhere, which Open asks the server
// first. A DSN that sets autocommit (Open manages it), completion_type or
// the isolation variable (Open sets it; either name, in any case) is
// refused with an error wrapping idem.ErrInvalidConfig, and so is a
// connection character set in which escaping byte by byte is unsafe
// (big5, cp932, gbk, gb18030, sjis: a backslash can end a character
// there). cfg is not changed.
func Open(ctx context.Context, cfg *gomysql.Config) (*sql.DB, error) {
	for k := range cfg.Params {
		if strings.EqualFold(k, "autocommit") || strings.EqualFold(k, "completion_type") {
			return nil, fmt.Errorf("%w: mysql: open: the DSN sets %s; idem needs the server's default (a pool from Open manages autocommit itself)", idem.ErrInvalidConfig, k)
		}
		// The driver sends the DSN's variables in one SET, in map order:
		// a second spelling of the isolation variable next to Open's
		// would win on some connections and lose on others.
		if strings.EqualFold(k, "tx_isolation") || strings.EqualFold(k, "transaction_isolation") {
			return nil, fmt.Errorf("%w: mysql: open: the DSN sets %s; Open sets the connections' isolation level itself (READ COMMITTED): drop it, or use mysql.New on a pool of your own", idem.ErrInvalidConfig, k)
		}
	}
	probe, err := gomysql.NewConnector(cfg)
	if err != nil {
		return nil, fmt.Errorf("mysql: open: %w", err)
	}
	db := sql.OpenDB(probe)
	var version, charset string
	err = db.QueryRowContext(ctx, `SELECT VERSION(), @@character_set_client`).Scan(&version, &charset)
	db.Close()
	if err != nil {
		return nil, fmt.Errorf("mysql: open: %w", err)
	}
	// Interpolation escapes byte by byte. In these character sets a
	// backslash can be the second byte of a character, which would
	// swallow the escape and let a quote in a message ID end the string.
	switch strings.ToLower(charset) {
	case "big5", "cp932", "gbk", "gb18030", "sjis":
		return nil, fmt.Errorf("%w: mysql: open: the connection's character set %s is not safe for the client-side interpolation Open turns on; use utf8mb4, or mysql.New on a pool of your own", idem.ErrInvalidConfig, charset)
	}
	c := cfg.Clone()
	if c.Params == nil {
		c.Params = map[string]string{}
	}
	c.Params[isolationVariable(version)] = "'READ-COMMITTED'"
	c.InterpolateParams = true
	c.MultiStatements = true
	conn, err := gomysql.NewConnector(c)
	if err != nil {
		return nil, fmt.Errorf("mysql: open: %w", err)
	}
	return sql.OpenDB(foldConnector{inner: conn}), nil
}

// isolationVariable names the session variable of the isolation level on
// the server of the given VERSION().
func isolationVariable(version string) string {
	if !strings.Contains(strings.ToLower(version), "mariadb") {
		return "transaction_isolation"
	}
	var major, minor int
	if _, err := fmt.Sscanf(version, "%d.%d", &major, &minor); err == nil && (major > 11 || (major == 11 && minor >= 1)) {
		return "transaction_isolation"
	}
	return "tx_isolation"
}
