package main

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Stored strings (message IDs, sources, handler names, errors, groups) come
// from broker data and from whoever wrote the tables. Printed raw, an ESC
// sequence among them would drive the operator's terminal (clear the
// screen, print a fake line) and a bidi override would show a different
// text than the one stored. Human output therefore passes every stored
// string through termText or termBlock; --json output stays exact.

// termText returns s fit for one line of a terminal: every control
// character (C0, DEL, C1, so newline and tab too), every format character
// (bidi embeddings, overrides and isolates, U+200E/U+200F marks, zero-width
// joiners, U+FEFF…), the line and paragraph separators and every byte that
// is not UTF-8 are written as a Go escape (\x1b, \u202e, \xff). Other text,
// backslashes included, is kept as it is, so a plain string prints
// unchanged.
func termText(s string) string {
	return termEscape(s, false)
}

// termBlock is termText for text that may span lines, such as an error
// message: it keeps newlines (and tabs, for the indentation of multi-line
// errors) and escapes the rest as termText does.
func termBlock(s string) string {
	return termEscape(s, true)
}

// termEscape implements termText and termBlock.
func termEscape(s string, keepLines bool) string {
	i := 0
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		if termUnsafe(r, size) && !(keepLines && (r == '\n' || r == '\t')) {
			break
		}
		i += size
	}
	if i == len(s) {
		return s // the common case: nothing to escape, no copy
	}
	var b strings.Builder
	b.Grow(len(s) + 8)
	b.WriteString(s[:i])
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case keepLines && (r == '\n' || r == '\t'):
			b.WriteRune(r)
		case r == utf8.RuneError && size <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case !termUnsafe(r, size):
			b.WriteString(s[i : i+size])
		case r < 0x80:
			fmt.Fprintf(&b, `\x%02x`, r)
		case r <= 0xFFFF:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			fmt.Fprintf(&b, `\U%08x`, r)
		}
		i += size
	}
	return b.String()
}

// termUnsafe reports whether the rune r, decoded from size bytes, must not
// reach a terminal as it is.
func termUnsafe(r rune, size int) bool {
	if r == utf8.RuneError && size <= 1 {
		return true // not UTF-8
	}
	if r < 0x20 || r == 0x7f {
		return true
	}
	if r < 0x80 {
		return false
	}
	return unicode.IsControl(r) || unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp)
}
