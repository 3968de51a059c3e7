package idem

import (
	"bytes"
	"encoding/json"
	"maps"
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// TestEnvelopeVersions: an ordinary message's envelope is json.Marshal of
// it, as before version 2, and an envelope written then still decodes with
// its strings as they are, "base64:" or not; a message version 1 cannot
// carry gets version 2, which still decodes as a Message (the console reads
// it so) and gives the message back; an envelope unmarshalEnvelope cannot
// give back exactly is an error.
func TestEnvelopeVersions(t *testing.T) {
	ordinary := &Message{ID: "evt-1", Stream: "orders", Type: "FundsCredited", AggregateID: "acct-1", Seq: 3, Payload: []byte("{}"),
		Headers: map[string]string{"traceparent": "00-abc-01", "note": "base64:AAE="}, Time: time.Date(2026, 11, 27, 21, 0, 0, 5, time.UTC)}
	got, err := marshalEnvelope(ordinary)
	want, _ := json.Marshal(ordinary)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("ordinary envelope %s (%v), want %s", got, err, want)
	}
	m, err := unmarshalEnvelope(want)
	if err != nil || !sameMessage(m, ordinary) {
		t.Fatalf("version 1 envelope decoded to %+v (%v), want %+v", m, err, ordinary)
	}

	hostile := &Message{ID: "base64:evt", Type: "A\x00B", Payload: []byte{0, 0xff}, Headers: map[string]string{
		"bin": "\x00\xff", "\xfeé": "ok", "plain": "text", "looks": "base64:AAE=", "empty": ""}, Time: time.UnixMilli(300_000_000_000_000)}
	env, err := marshalEnvelope(hostile)
	if err != nil {
		t.Fatal(err)
	}
	checkStorable(t, env)
	var e map[string]any
	if err := json.Unmarshal(env, &e); err != nil || e["EnvelopeVersion"] != float64(2) || e["Type"] != "base64:QQBC" ||
		e["Headers"].(map[string]any)["plain"] != "text" || e["Headers"].(map[string]any)["base64:/sOp"] != "ok" {
		t.Fatalf("version 2 envelope %s (%v)", env, err)
	}
	var shown Message // as the console and idem dlq show read it
	if err := json.Unmarshal(env, &shown); err != nil || shown.Headers["looks"] != "base64:YmFzZTY0OkFBRT0=" {
		t.Fatalf("version 2 envelope read as a Message: %+v (%v)", shown, err)
	}
	if m, err := unmarshalEnvelope(env); err != nil || !sameMessage(m, hostile) {
		t.Fatalf("version 2 envelope %s decoded to %+v (%v), want %+v", env, m, err, hostile)
	}

	for _, bad := range []string{
		`{"EnvelopeVersion":3,"ID":"a"}`,
		`{"EnvelopeVersion":2,"ID":"a","Type":"base64:!!"}`,
		`{"EnvelopeVersion":2,"ID":"a","Headers":{"k":"base64:AAE"}}`, // unpadded
		`{"EnvelopeVersion":2,"ID":"a","Headers":{"a":"1","base64:YQ==":"2"}}`,
		`{"EnvelopeVersion":2,"ID":"a","TimeUnix":[0,1000000000,0]}`,
		`{"ID":`,
	} {
		if m, err := unmarshalEnvelope([]byte(bad)); err == nil {
			t.Errorf("unmarshalEnvelope(%s) = %+v, want an error", bad, m)
		}
	}
}

// FuzzEnvelope: any message's envelope is UTF-8 JSON without a NUL, that
// decodes as a Message, and that unmarshalEnvelope turns back into the
// message byte for byte (Time as the same instant); a message whose strings
// are text and whose Time RFC 3339 keeps gets json.Marshal of itself.
func FuzzEnvelope(f *testing.F) {
	f.Add("evt-1", "orders", "FundsCredited", "acct-1", int64(1), []byte("{}"), []byte("traceparent\x1f00-abc-01"), false, int64(1795813200), int64(5), int32(0))
	f.Add("evt-2", "", "A\x00B", "", int64(0), []byte{0, 0xff}, []byte("bin\x1f\x00\x01\xff\x1enul\x00name\x1fv\x1e\xff\x1f\x1elooks\x1fbase64:AAE="), false, int64(300_000_000_000), int64(0), int32(3600))
	f.Add("base64:x", "s\xff", "", "base64:", int64(-1), []byte(nil), []byte(nil), true, int64(-62135596801), int64(999999999), int32(-45))
	f.Add("", "", "", "", int64(0), []byte(""), []byte("\x1f"), false, int64(math.MaxInt64), int64(-1), int32(math.MaxInt32))
	f.Fuzz(func(t *testing.T, id, stream, typ, agg string, seq int64, payload, headers []byte, nilHeaders bool, sec, nsec int64, off int32) {
		m := &Message{ID: id, Stream: stream, Type: typ, AggregateID: agg, Seq: seq, Payload: payload,
			Time: time.Unix(sec, nsec).In(time.FixedZone("", int(off)))}
		if !nilHeaders {
			m.Headers = map[string]string{}
			if len(headers) > 0 {
				for _, kv := range strings.Split(string(headers), "\x1e") {
					k, v, _ := strings.Cut(kv, "\x1f")
					m.Headers[k] = v
				}
			}
		}
		env, err := marshalEnvelope(m)
		if err != nil {
			t.Fatalf("marshalEnvelope(%+v): %v", m, err)
		}
		checkStorable(t, env)
		var shown Message
		if err := json.Unmarshal(env, &shown); err != nil {
			t.Fatalf("envelope %s does not decode as a Message: %v", env, err)
		}
		back, err := unmarshalEnvelope(env)
		if err != nil || !sameMessage(back, m) {
			t.Fatalf("envelope %s decoded to %+v (%v), want %+v", env, back, err, m)
		}
		if rfc3339Keeps(m.Time) && envelopeText(id) && envelopeText(stream) && envelopeText(typ) && envelopeText(agg) && headersText(m.Headers) {
			if want, _ := json.Marshal(m); !bytes.Equal(env, want) {
				t.Fatalf("ordinary message's envelope %s, want version 1 %s", env, want)
			}
		}
	})
}

// FuzzUnmarshalEnvelope: unmarshalEnvelope never panics, and a message it
// decodes is one whose envelope decodes to it again.
func FuzzUnmarshalEnvelope(f *testing.F) {
	for _, s := range []string{
		`{"ID":"evt-1","Stream":"orders","Type":"T","AggregateID":"","Seq":0,"Payload":"AA==","Headers":{"k":"base64:AAE="},"Time":"2026-11-27T21:00:00Z"}`,
		`{"EnvelopeVersion":2,"ID":"evt-1","Type":"base64:QQBC","Headers":{"base64:AA==":"base64:/w==","k":"v"},"Time":"0001-01-01T00:00:00Z","TimeUnix":[300000000000,0,3600]}`,
		`{"EnvelopeVersion":2,"Headers":{"a":"1","base64:YQ==":"2"}}`,
		`{"EnvelopeVersion":3}`,
		`null`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := unmarshalEnvelope(b)
		if err != nil {
			return
		}
		env, err := marshalEnvelope(m)
		if err != nil {
			t.Fatalf("marshalEnvelope(%+v) of %q: %v", m, b, err)
		}
		checkStorable(t, env)
		if back, err := unmarshalEnvelope(env); err != nil || !sameMessage(back, m) {
			t.Fatalf("%q decoded to %+v; its envelope %s to %+v (%v)", b, m, env, back, err)
		}
	})
}

// checkStorable fails t unless env is what every store keeps: UTF-8 JSON
// without a NUL, raw or escaped (Postgres's jsonb refuses \u0000).
func checkStorable(t *testing.T, env []byte) {
	t.Helper()
	if !utf8.Valid(env) || !json.Valid(env) || bytes.IndexByte(env, 0) >= 0 || bytes.Contains(env, []byte(`\u0000`)) {
		t.Fatalf("envelope %q is not UTF-8 JSON without a NUL", env)
	}
}

// sameMessage reports whether a and b are the same byte for byte, with
// Time the same instant, and Headers and Payload nil in both or in neither.
func sameMessage(a, b *Message) bool {
	return a.ID == b.ID && a.Stream == b.Stream && a.Type == b.Type && a.AggregateID == b.AggregateID && a.Seq == b.Seq &&
		bytes.Equal(a.Payload, b.Payload) && (a.Payload == nil) == (b.Payload == nil) &&
		maps.Equal(a.Headers, b.Headers) && (a.Headers == nil) == (b.Headers == nil) && a.Time.Equal(b.Time)
}
