package redisstore

import (
	"strconv"
	"strings"
	"testing"
)

// FuzzDecodeDeadLetter: a dead letter's hash as Redis holds it, whatever
// its fields say (written by another version, or by hand), decodes or
// fails with an error naming the dead letter and quoting the bad field
// short, never a panic; the fields it decodes keep their values.
func FuzzDecodeDeadLetter(f *testing.F) {
	f.Add("balances", "m-1", "00ff", "3", "1764291723000000", "1764291723000001", []byte("raw"))
	f.Add("", "", "", "", "", "", []byte(nil))
	f.Add("h", "m", "zz", "x", "-1", "9223372036854775807", []byte("\xff"))
	f.Add("h", "m", "0", "99999999999999999999", "1e3", "", []byte{})
	f.Add("h", "m", "", strings.Repeat("x", 4096), "1", "1", []byte("v"))
	f.Fuzz(func(t *testing.T, handler, messageID, hash, attempts, first, last string, raw []byte) {
		m := map[string]string{"handler": handler, "message_id": messageID, "payload_hash": hash,
			"attempts": attempts, "first": first, "last": last, "raw": string(raw)}
		dl, err := decodeDeadLetter(7, m)
		if err != nil {
			if len(err.Error()) > 512 {
				t.Fatalf("error of %d bytes: a bad field must be quoted short", len(err.Error()))
			}
			return
		}
		if dl.ID != 7 || dl.Handler != handler || dl.MessageID != messageID || string(dl.Raw) != string(raw) {
			t.Fatalf("decoded %+v from %v", dl, m)
		}
		if n, _ := strconv.Atoi(attempts); dl.Attempts != n {
			t.Fatalf("attempts %d from %q", dl.Attempts, attempts)
		}
	})
}
