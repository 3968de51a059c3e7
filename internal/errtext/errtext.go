// Package errtext formats values that come from outside (a record's
// headers, a message's ID) for error texts, which are logged and stored
// with dead letters: quoted, and cut short.
package errtext

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Max bounds the bytes of a value Quote shows.
const Max = 80

// Quote returns v quoted as Go quotes a string, cut after Max bytes with
// its length told: such a value is bounded only by the message's size.
func Quote[T ~string | ~[]byte](v T) string {
	if len(v) <= Max {
		return strconv.Quote(string(v))
	}
	return fmt.Sprintf("%q… (%d bytes)", string(v[:Max]), len(v))
}

// Storable returns s as every store's text column takes it: valid UTF-8
// without a NUL byte (Postgres refuses either), cut on a character
// boundary after limit bytes with "…" (a MySQL TEXT holds 64 KiB). An
// error's text carries whatever a broker or library said; one the store
// refused would leave a failure unrecorded.
func Storable(s string, limit int) string {
	s = strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
	if len(s) <= limit {
		return s
	}
	cut := limit
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
