package idem

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// A dead letter's envelope is its message as JSON, which Replay decodes
// and runs again. It must give back the message byte for byte, and every
// store must be able to keep it: Postgres keeps it as jsonb, which refuses
// a NUL (\u0000), and a JSON string holds only valid UTF-8 (encoding/json
// turns every invalid byte into U+FFFD). A broker's message may carry
// either in a header name or value, or in Type or Stream (Kafka's header
// values are bytes), and its Time may be one RFC 3339 cannot give back
// exactly (a year after 9999, a zone offset with seconds).
//
// So there are two versions, both objects with the Message's field names:
//
//   - Version 1, with no EnvelopeVersion field, is json.Marshal of the
//     Message. Every message whose strings are text and whose Time RFC 3339
//     keeps gets it, as before version 2 existed.
//   - Version 2, "EnvelopeVersion": 2, is for the others. Each string (ID,
//     Stream, Type, AggregateID, and every header name and value) that is
//     not valid UTF-8, holds a NUL, or begins with "base64:" is written as
//     "base64:" and the standard base64 of its bytes; the others as they
//     are. A Time RFC 3339 does not keep is written in TimeUnix, [seconds,
//     nanoseconds, zone offset in seconds], and Time is left zero.
//
// A version 2 envelope still decodes as a Message, with the encoded strings
// readable as base64 and nothing in it that a terminal or page acts on.

// envelopeVersion is the version marshalEnvelope writes for a message
// version 1 cannot carry.
const envelopeVersion = 2

// envelopeBase64 begins a version 2 envelope's string held as base64.
const envelopeBase64 = "base64:"

// envelopeJSON is an envelope's object: a Message's fields, in its order,
// and the version 2 fields.
type envelopeJSON struct {
	EnvelopeVersion int `json:",omitempty"`
	ID              string
	Stream          string
	Type            string
	AggregateID     string
	Seq             int64
	Payload         []byte
	Headers         map[string]string
	Time            time.Time
	TimeUnix        *[3]int64 `json:",omitempty"`
}

// marshalEnvelope returns m's envelope: version 1 when its strings are
// text and its Time survives RFC 3339, version 2 otherwise. The result is
// valid UTF-8 JSON without a NUL, escaped or not, and unmarshalEnvelope
// gives m back.
func marshalEnvelope(m *Message) ([]byte, error) {
	timeKept := rfc3339Keeps(m.Time)
	if timeKept && envelopeText(m.ID) && envelopeText(m.Stream) && envelopeText(m.Type) && envelopeText(m.AggregateID) && headersText(m.Headers) {
		return json.Marshal(m)
	}
	e := envelopeJSON{EnvelopeVersion: envelopeVersion, ID: envelopeString(m.ID), Stream: envelopeString(m.Stream), Type: envelopeString(m.Type),
		AggregateID: envelopeString(m.AggregateID), Seq: m.Seq, Payload: m.Payload, Time: m.Time}
	if m.Headers != nil {
		e.Headers = make(map[string]string, len(m.Headers))
		for k, v := range m.Headers {
			e.Headers[envelopeString(k)] = envelopeString(v)
		}
	}
	if !timeKept {
		_, off := m.Time.Zone()
		e.Time, e.TimeUnix = time.Time{}, &[3]int64{m.Time.Unix(), int64(m.Time.Nanosecond()), int64(off)}
	}
	return json.Marshal(&e)
}

// unmarshalEnvelope decodes an envelope of either version.
func unmarshalEnvelope(b []byte) (*Message, error) {
	var e envelopeJSON
	if err := json.Unmarshal(b, &e); err != nil {
		return nil, err
	}
	m := &Message{ID: e.ID, Stream: e.Stream, Type: e.Type, AggregateID: e.AggregateID, Seq: e.Seq, Payload: e.Payload, Headers: e.Headers, Time: e.Time}
	switch e.EnvelopeVersion {
	case 0, 1:
		return m, nil
	case envelopeVersion:
	default:
		return nil, fmt.Errorf("envelope version %d is newer than this consumer's (%d)", e.EnvelopeVersion, envelopeVersion)
	}
	var err error
	for _, f := range [...]struct {
		name string
		s    *string
	}{{"ID", &m.ID}, {"Stream", &m.Stream}, {"Type", &m.Type}, {"AggregateID", &m.AggregateID}} {
		if *f.s, err = envelopeDecode(*f.s); err != nil {
			return nil, fmt.Errorf("envelope's %s: %w", f.name, err)
		}
	}
	if e.Headers != nil {
		m.Headers = make(map[string]string, len(e.Headers))
		for k, v := range e.Headers {
			dk, err := envelopeDecode(k)
			if err != nil {
				return nil, fmt.Errorf("envelope's header name %q: %w", k, err)
			}
			if _, ok := m.Headers[dk]; ok {
				return nil, fmt.Errorf("envelope's header name %q: another one names the same header", k)
			}
			if m.Headers[dk], err = envelopeDecode(v); err != nil {
				return nil, fmt.Errorf("envelope's header %q value: %w", k, err)
			}
		}
	}
	if u := e.TimeUnix; u != nil {
		if u[1] < 0 || u[1] >= 1e9 {
			return nil, fmt.Errorf("envelope's TimeUnix has %d nanoseconds", u[1])
		}
		m.Time = time.Unix(u[0], u[1]).In(time.FixedZone("", int(u[2])))
		if u[2] == 0 {
			m.Time = m.Time.UTC()
		}
	}
	return m, nil
}

// envelopeText reports whether s can be written as it is in a version 1
// envelope: valid UTF-8 without a NUL.
func envelopeText(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// headersText reports whether every header name and value is envelopeText.
func headersText(h map[string]string) bool {
	for k, v := range h {
		if !envelopeText(k) || !envelopeText(v) {
			return false
		}
	}
	return true
}

// envelopeString is s as a version 2 envelope writes it.
func envelopeString(s string) string {
	if envelopeText(s) && !strings.HasPrefix(s, envelopeBase64) {
		return s
	}
	return envelopeBase64 + base64.StdEncoding.EncodeToString([]byte(s))
}

// envelopeDecode is envelopeString's inverse.
func envelopeDecode(s string) (string, error) {
	enc, ok := strings.CutPrefix(s, envelopeBase64)
	if !ok {
		return s, nil
	}
	b, err := base64.StdEncoding.Strict().DecodeString(enc)
	if err != nil {
		return "", fmt.Errorf("not base64 after %q: %w", envelopeBase64, err)
	}
	return string(b), nil
}

// rfc3339Keeps reports whether t survives JSON (RFC 3339) as the same
// instant.
func rfc3339Keeps(t time.Time) bool {
	b, err := t.MarshalJSON()
	if err != nil {
		return false
	}
	var back time.Time
	return back.UnmarshalJSON(b) == nil && back.Equal(t)
}
