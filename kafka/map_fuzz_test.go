package kafka_test

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/kafka"
)

// FuzzDefaultMap: any record maps to a valid message or a clear error
// matching idem.ErrInvalidMessage, never a panic; two different ID
// headers are refused; a mapped message carries the header's ID and the key as
// its aggregate (or none, for a key no message can carry and no sequence).
func FuzzDefaultMap(f *testing.F) {
	f.Add([]byte("acct-1"), []byte("10"), "evt-1", "3", "Credited", false)
	f.Add([]byte(nil), []byte{}, "", "", "", false)
	f.Add([]byte("k"), []byte("v"), "id\x00", "0", "", true)
	f.Add([]byte("\xff"), []byte("v"), "id", "-2", "t", false)
	f.Add([]byte("k"), []byte("v"), "id", "99999999999999999999", "t", true)
	f.Add([]byte("k"), []byte("v"), "evt-9", "2", "t", true) // two ID headers
	f.Fuzz(func(t *testing.T, key, value []byte, id, seq, typ string, dupHeader bool) {
		r := &kgo.Record{Topic: "credits", Key: key, Value: value}
		if id != "" {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: kafka.HeaderID, Value: []byte(id)})
		}
		if seq != "" {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: kafka.HeaderSeq, Value: []byte(seq)})
		}
		if typ != "" {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: kafka.HeaderType, Value: []byte(typ)})
		}
		ambiguous := false
		if dupHeader { // a repeated header: refused if it says another ID
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: kafka.HeaderID, Value: []byte("last")})
			ambiguous = id != "" && id != "last"
			id = "last"
		}
		m, err := kafka.DefaultMap(r)
		if err != nil {
			if m != nil || err.Error() == "" || !errors.Is(err, idem.ErrInvalidMessage) {
				t.Fatalf("error %v with message %v; want an error matching idem.ErrInvalidMessage", err, m)
			}
			return
		}
		if ambiguous {
			t.Fatalf("two different %s headers mapped to %q", kafka.HeaderID, m.ID)
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("mapped message invalid: %v", err)
		}
		// The key is the aggregate, unless it is none a message can carry
		// and no sequence needs one.
		keyValid := (&idem.Message{ID: "x", AggregateID: string(key)}).Validate() == nil
		if m.ID != id || (keyValid && m.AggregateID != string(key)) || (!keyValid && (m.AggregateID != "" || m.Seq != 0)) {
			t.Fatalf("mapped ID %q aggregate %q seq %d from header %q key %q", m.ID, m.AggregateID, m.Seq, id, key)
		}
		if seq != "" {
			if n, _ := strconv.ParseInt(seq, 10, 64); n != m.Seq {
				t.Fatalf("Seq %d from header %q", m.Seq, seq)
			}
		}
	})
}

// Headers the default mapping does not read reach the message (the last
// value of a repeated key); idem's own do not.
func TestDefaultMapKeepsOtherHeaders(t *testing.T) {
	r := &kgo.Record{Topic: "credits", Key: []byte("acct-1"), Value: []byte("10"), Headers: []kgo.RecordHeader{
		{Key: kafka.HeaderID, Value: []byte("evt-1")},
		{Key: "traceparent", Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")},
		{Key: "tenant", Value: []byte("a")},
		{Key: "tenant", Value: []byte("b")},
		{Key: kafka.HeaderSeq, Value: []byte("3")},
	}}
	m, err := kafka.DefaultMap(r)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "b"}
	if len(m.Headers) != len(want) {
		t.Fatalf("Headers %v, want %v", m.Headers, want)
	}
	for k, v := range want {
		if m.Headers[k] != v {
			t.Errorf("Headers[%q] = %q, want %q", k, m.Headers[k], v)
		}
	}
	plain, err := kafka.DefaultMap(&kgo.Record{Value: []byte("1"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("evt-2")}}})
	if err != nil || plain.Headers != nil {
		t.Errorf("record with idem's headers only: Headers %v, %v; want nil", plain.Headers, err)
	}
}

// A binary key (a big-endian integer) or an overlong one is no aggregate
// ID: without a sequence the record maps with no aggregate rather than
// being dead-lettered; with one it is a decode failure naming the field.
func TestDefaultMapBinaryKey(t *testing.T) {
	for _, key := range [][]byte{{0, 0, 0, 0, 0, 0, 0x30, 0x39}, []byte("\xff\xfe"), make([]byte, 300)} {
		r := &kgo.Record{Topic: "credits", Key: key, Value: []byte("10"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("evt-1")}}}
		m, err := kafka.DefaultMap(r)
		if err != nil || m.ID != "evt-1" || m.AggregateID != "" {
			t.Fatalf("key %q: %+v, %v; want evt-1 with no aggregate", key, m, err)
		}
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: kafka.HeaderSeq, Value: []byte("1")})
		if m, err := kafka.DefaultMap(r); err == nil || !errors.Is(err, idem.ErrInvalidMessage) || !strings.Contains(err.Error(), "AggregateID") {
			t.Fatalf("key %q with idem-seq: %+v, %v; want an invalid AggregateID", key, m, err)
		}
	}
}

// The record's timestamp is the message's Time.
func TestDefaultMapTime(t *testing.T) {
	at := time.UnixMilli(1_764_000_000_123)
	m, err := kafka.DefaultMap(&kgo.Record{Topic: "credits", Value: []byte("10"), Timestamp: at, Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("evt-1")}}})
	if err != nil || !m.Time.Equal(at) {
		t.Fatalf("%+v, %v; want Time %v", m, err, at)
	}
}

// A sequence without a key says where the aggregate comes from, and which
// message it was.
func TestDefaultMapSequenceWithoutKey(t *testing.T) {
	r := &kgo.Record{Topic: "credits", Value: []byte("10"), Headers: []kgo.RecordHeader{
		{Key: kafka.HeaderID, Value: []byte("evt-1")}, {Key: kafka.HeaderSeq, Value: []byte("3")}}}
	if m, err := kafka.DefaultMap(r); err == nil || !strings.Contains(err.Error(), "no key") || !strings.Contains(err.Error(), `"evt-1"`) {
		t.Fatalf("%+v, %v; want an error naming the missing key and the message", m, err)
	}
}

// A decode error quotes a header's value only in part: a value has no
// bound but the record's size (a megabyte by default), and a binary one
// quotes to four times that, so the error, logged and stored with the
// dead letter, would otherwise carry megabytes.
func TestDefaultMapErrorQuotesHeadersInPart(t *testing.T) {
	huge := make([]byte, 256<<10) // NUL bytes: \x00 each, quoted
	for name, hs := range map[string][]kgo.RecordHeader{
		"a sequence that is no integer": {{Key: kafka.HeaderID, Value: []byte("evt-1")}, {Key: kafka.HeaderSeq, Value: huge}},
		"two IDs":                       {{Key: kafka.HeaderID, Value: huge}, {Key: kafka.HeaderID, Value: append([]byte("x"), huge...)}},
		"a sequence and no key":         {{Key: kafka.HeaderID, Value: huge}, {Key: kafka.HeaderSeq, Value: []byte("3")}},
		"an ID too long":                {{Key: kafka.HeaderID, Value: huge}},
	} {
		m, err := kafka.DefaultMap(&kgo.Record{Topic: "credits", Value: []byte("10"), Headers: hs})
		if err == nil || !errors.Is(err, idem.ErrInvalidMessage) {
			t.Fatalf("%s: %+v, %v; want a decode error", name, m, err)
		}
		if n := len(err.Error()); n > 1024 {
			t.Errorf("%s: the error is %d bytes (%.60q…); want the values cut", name, n, err.Error())
		}
	}
}
