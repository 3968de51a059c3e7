// Package errtext formats values that come from outside (a record's
// headers, a message's ID) for error texts, which are logged and stored
// with dead letters: quoted, and cut short.
package errtext

import (
	"fmt"
	"strconv"
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
