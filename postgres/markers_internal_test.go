package postgres

import (
	"bytes"
	"testing"
)

// TestMessageKeyLossless: every ID reads back from its key exactly, a
// canonical UUID takes 16 bytes, and no two IDs share a key (a 16-byte ID
// is not taken for a UUID, an upper-case UUID is not the lower-case one).
func TestMessageKeyLossless(t *testing.T) {
	ids := []string{
		"6ba7b810-9dad-11d1-80b4-00c04fd430c8",   // canonical: packed
		"6BA7B810-9DAD-11D1-80B4-00C04FD430C8",   // upper case: another ID
		"6ba7b8109dad11d180b400c04fd430c8",       // no hyphens
		"{6ba7b810-9dad-11d1-80b4-00c04fd430c8}", // braces
		"6ba7b810-9dad-11d1-80b4-00c04fd430cg",   // not hex
		"6ba7b810+9dad-11d1-80b4-00c04fd430c8",   // hyphen misplaced
		"0123456789abcdef",                       // 16 bytes, like a packed UUID
		"0123456789abcdef\x01",                   // 17 bytes
		"evt-1", "x", "é日本",
	}
	seen := map[string]string{}
	for _, id := range ids {
		k := messageKey(id)
		if got := messageID(k); got != id {
			t.Errorf("%q: key %x reads back as %q", id, k, got)
		}
		if prev, dup := seen[string(k)]; dup {
			t.Errorf("%q and %q share the key %x", prev, id, k)
		}
		seen[string(k)] = id
	}
	if k := messageKey(ids[0]); len(k) != 16 || !bytes.Equal(k[:4], []byte{0x6b, 0xa7, 0xb8, 0x10}) {
		t.Errorf("canonical UUID key %x, want its 16 bytes", k)
	}
	if k := messageKey(ids[6]); len(k) != 17 || k[16] != 0 {
		t.Errorf("16-byte ID key %x, want the ID and a NUL", k)
	}
}
