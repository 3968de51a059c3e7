package jetstream

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemhq/idem"
)

// FuzzDefaultMap: any headers and data map to a valid message or a clear
// error matching idem.ErrInvalidMessage, never a panic; a mapped message
// carries the header's ID, sequence and time, and any other header.
func FuzzDefaultMap(f *testing.F) {
	f.Add("credits.a", "evt-1", "", "acct-1", "3", "Credited", "2026-11-28T04:00:00.5Z", "traceparent", "00-abc", []byte("10"))
	f.Add("credits.a", "", "evt-2", "", "", "", "", "", "", []byte{})
	f.Add("s", "", "", "a", "x", "", "yesterday", "X", "y", []byte("no id"))
	f.Add("s", "e\x00", "", "a", "0", "", "", "Status", "400", []byte(nil))
	f.Add("s", "\xff", "id", "agg", "-1", "t", "10000-01-01T00:00:00Z", "\xff", "\x00", []byte("v"))
	f.Add("s", "id", "", "", "9223372036854775807", "", "2026-02-30T00:00:00Z", "idem-seq", "5", []byte("v"))
	f.Fuzz(func(t *testing.T, subject, msgID, idemID, aggregate, seq, typ, tm, hk, hv string, data []byte) {
		h := nats.Header{}
		if hk != "" {
			h.Set(hk, hv) // before idem's own: a hostile one is overwritten by them
		}
		for k, v := range map[string]string{HeaderMsgID: msgID, HeaderID: idemID, HeaderAggregate: aggregate, HeaderSeq: seq, HeaderType: typ, HeaderTime: tm} {
			if v != "" {
				h.Set(k, v)
			}
		}
		m, err := mapMessage(subject, h, data)
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
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("mapped message invalid: %v", err)
		}
		want := msgID
		if want == "" {
			want = idemID
		}
		if m.ID != want {
			t.Fatalf("ID %q, want %q", m.ID, want)
		}
		if seq != "" {
			if n, _ := strconv.ParseInt(seq, 10, 64); n != m.Seq {
				t.Fatalf("Seq %d from header %q", m.Seq, seq)
			}
		}
		if tm != "" {
			if want, _ := time.Parse(time.RFC3339Nano, tm); !m.Time.Equal(want) {
				t.Fatalf("Time %v from header %q", m.Time, tm)
			}
		}
		if v, ok := h[hk]; ok && len(v) > 0 {
			switch hk {
			case HeaderMsgID, HeaderID, HeaderAggregate, HeaderSeq, HeaderType, HeaderTime:
			default:
				if m.Headers[hk] != v[0] {
					t.Fatalf("header %q is %q, want %q", hk, m.Headers[hk], v[0])
				}
			}
		}
	})
}

// Headers the default mapping does not read reach the message (the first
// value of a repeated key); idem's and JetStream's ID headers do not.
func TestDefaultMapKeepsOtherHeaders(t *testing.T) {
	h := nats.Header{}
	h.Set(HeaderMsgID, "evt-1")
	h.Set(HeaderAggregate, "acct-1")
	h.Set("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
	h.Add("tenant", "a")
	h.Add("tenant", "b")
	m, err := mapMessage("credits.a", h, []byte("10"))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "a"}
	if len(m.Headers) != len(want) {
		t.Fatalf("Headers %v, want %v", m.Headers, want)
	}
	for k, v := range want {
		if m.Headers[k] != v {
			t.Errorf("Headers[%q] = %q, want %q", k, m.Headers[k], v)
		}
	}
	only := nats.Header{}
	only.Set(HeaderID, "evt-2")
	if m, err := mapMessage("s", only, nil); err != nil || m.Headers != nil {
		t.Errorf("message with idem's headers only: Headers %v, %v; want nil", m, err)
	}
}

// A hostile header is quoted in part: the error is logged and stored
// with the dead letter, and a header value is bounded only by the
// message's size.
func TestMapErrorQuotesHeadersInPart(t *testing.T) {
	huge := strings.Repeat("9x", 128<<10)
	for _, k := range []string{HeaderSeq, HeaderTime} {
		h := nats.Header{}
		h.Set(HeaderID, strings.Repeat("i", 255))
		h.Set(k, huge)
		_, err := mapMessage("s", h, []byte("v"))
		if !errors.Is(err, idem.ErrInvalidMessage) {
			t.Fatalf("%s of %d bytes: %v", k, len(huge), err)
		}
		if n := len(err.Error()); n > 600 || !strings.Contains(err.Error(), "(262144 bytes)") {
			t.Errorf("%s of %d bytes: an error of %d bytes: %.300s", k, len(huge), n, err)
		}
	}
}
