package mysql

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"syscall"

	gomysql "github.com/go-sql-driver/mysql"
)

// Server errors that mean the server cannot serve now, whatever the
// statement.
var unavailableErrors = map[uint16]bool{
	1040: true, // too many connections
	1053: true, // server shutdown in progress
	1077: true, // normal shutdown
	1079: true, // shutdown complete
	1152: true, // connection aborted
	1205: true, // lock wait timeout: a lock held past the server's wait
	1290: true, // --read-only (a replica after a failover) and similar options
	1792: true, // cannot execute statement in a READ ONLY transaction
	1836: true, // running in read-only mode
	1927: true, // connection was killed (MariaDB)
	2006: true, // server has gone away
	2013: true, // lost connection during query
}

// Unavailable implements driver.Prober: err is a failure to connect or a
// connection that broke (connection refused or reset, the driver's invalid
// connection, database/sql's bad connection), or one of the server's
// answers for a server that cannot serve now: shutting down, too many
// connections, read-only (a replica after a failover), a lock wait
// timeout.
func (d *Driver) Unavailable(err error) bool {
	if err == nil {
		return false
	}
	if n := errNumber(err); n != 0 {
		return unavailableErrors[n]
	}
	var opErr *net.OpError
	var netErr net.Error
	return errors.Is(err, driver.ErrBadConn) || errors.Is(err, gomysql.ErrInvalidConn) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.As(err, &opErr) || (errors.As(err, &netErr) && netErr.Timeout())
}

// Probe implements driver.Prober: the server answers and takes writes (a
// replica after a failover answers, read-only).
func (d *Driver) Probe(ctx context.Context) error {
	var readOnly, innodbReadOnly int
	if err := d.db.QueryRowContext(ctx, `SELECT @@global.read_only, @@global.innodb_read_only`).Scan(&readOnly, &innodbReadOnly); err != nil {
		return fmt.Errorf("mysql: probe: %w", err)
	}
	if readOnly != 0 || innodbReadOnly != 0 {
		return errors.New("mysql: probe: the server is read-only")
	}
	return nil
}
