package watermill_test

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemhq/idem"
	idemwm "github.com/idemhq/idem/watermill"
)

// FuzzDefaultMap: any UUID, metadata and payload map to a valid message
// or to an error that matches idem.ErrInvalidMessage and quotes the
// hostile values short, never a panic; a mapped message carries the UUID
// as its ID and the sequence the metadata says.
func FuzzDefaultMap(f *testing.F) {
	f.Add("evt-1", "acct-1", "3", "Credited", "2026-11-28T01:02:03Z", "tenant", "a", []byte("10"))
	f.Add("", "", "", "", "", "", "", []byte{})
	f.Add("evt-2", "a", "x", "", "", "", "", []byte("no seq"))
	f.Add("evt-3", "a", "0", "", "", "idem-other", "v", []byte(nil))
	f.Add("e\x00", "a", "-1", "t", "yesterday", "", "", []byte("v"))
	f.Add("\xff", "agg", "9223372036854775807", "", "", "k", "\xff", []byte("v"))
	f.Add("evt-4", "", "", "", strings.Repeat("9", 4096), "", "", []byte("v"))
	f.Add(strings.Repeat("u", 4096), "", strings.Repeat("1", 4096), "", "", "", "", []byte("v"))
	f.Fuzz(func(t *testing.T, uuid, aggregate, seq, typ, at, key, value string, payload []byte) {
		msg := message.NewMessage(uuid, payload)
		for k, v := range map[string]string{idemwm.MetadataAggregate: aggregate, idemwm.MetadataSeq: seq, idemwm.MetadataType: typ, idemwm.MetadataTime: at} {
			if v != "" {
				msg.Metadata.Set(k, v)
			}
		}
		if key != "" {
			msg.Metadata.Set(key, value)
		}
		m, err := idemwm.DefaultMap(msg)
		if err != nil {
			if m != nil {
				t.Fatalf("error %v with a message", err)
			}
			if err.Error() == "" {
				t.Fatal("empty error text")
			}
			if !errors.Is(err, idem.ErrInvalidMessage) {
				t.Fatalf("error %v does not match ErrInvalidMessage", err)
			}
			if n := len(err.Error()); n > 1024 {
				t.Fatalf("error of %d bytes: hostile values must be quoted short", n)
			}
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("mapped message invalid: %v", err)
		}
		if m.ID != uuid {
			t.Fatalf("ID %q, want %q", m.ID, uuid)
		}
		if seq != "" {
			if n, _ := strconv.ParseInt(seq, 10, 64); n != m.Seq {
				t.Fatalf("Seq %d from metadata %q", m.Seq, seq)
			}
		}
	})
}
