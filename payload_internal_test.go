package idem

import (
	"crypto/sha256"
	"testing"
)

// TestSamePayloadPrefix: a store may keep a prefix of the SHA-256 of at
// least MinStoredHash bytes; the prefix is compared, a shorter one or one
// that differs is a conflict, an empty one (an imported marker) accepts
// any payload.
func TestSamePayloadPrefix(t *testing.T) {
	a, b := sha256.Sum256([]byte("a")), sha256.Sum256([]byte("b"))
	for _, c := range []struct {
		name   string
		stored []byte
		want   bool
	}{
		{"whole hash", a[:], true},
		{"16-byte prefix", a[:16], true},
		{"20-byte prefix", a[:20], true},
		{"15-byte prefix", a[:15], false},
		{"other payload's prefix", b[:16], false},
		{"other payload", b[:], false},
		{"imported, no hash", nil, true},
		{"longer than the hash", append(a[:], 0), false},
	} {
		if got := samePayload(a[:], c.stored); got != c.want {
			t.Errorf("%s: samePayload = %v, want %v", c.name, got, c.want)
		}
	}
}
