// Package sqlident validates and quotes SQL identifiers that come from
// configuration (schema names, table prefixes).
package sqlident

import (
	"fmt"
	"strings"
)

// MaxLen bounds a configured identifier part. Postgres truncates identifiers
// at 63 bytes; a prefix must leave room for the longest table suffix.
const MaxLen = 40

// Check reports whether s is a plain lower-case identifier part:
// [a-z_][a-z0-9_]*, at most MaxLen bytes. what names the setting in the error.
// Empty is allowed only when allowEmpty is set.
func Check(what, s string, allowEmpty bool) error {
	if s == "" {
		if allowEmpty {
			return nil
		}
		return fmt.Errorf("%s is empty", what)
	}
	if len(s) > MaxLen {
		return fmt.Errorf("%s %q is %d bytes; the maximum is %d", what, s, len(s), MaxLen)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		ok := c >= 'a' && c <= 'z' || c == '_' || (i > 0 && c >= '0' && c <= '9')
		if !ok {
			return fmt.Errorf("%s %q: byte %d (%q) is not allowed; use lower-case letters, digits and _, not starting with a digit", what, s, i, c)
		}
	}
	return nil
}

// Quote returns s as a double-quoted identifier, doubling embedded quotes.
// Valid identifiers never contain quotes; quoting them anyway keeps reserved
// words (a prefix of "order_", say) working.
func Quote(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// Qualified returns the quoted "schema"."name", or "name" when schema is
// empty.
func Qualified(schema, name string) string {
	if schema == "" {
		return Quote(name)
	}
	return Quote(schema) + "." + Quote(name)
}

// Column validates a schema (optional), table and column named by
// configuration and returns the quoted table, schema-qualified, and the
// quoted column. what prefixes the error ("postgres: import").
func Column(what, schema, table, column string) (qualifiedTable, quotedColumn string, err error) {
	if err := Check(what+" schema", schema, true); err != nil {
		return "", "", err
	}
	if err := Check(what+" table", table, false); err != nil {
		return "", "", err
	}
	if err := Check(what+" column", column, false); err != nil {
		return "", "", err
	}
	return Qualified(schema, table), Quote(column), nil
}
