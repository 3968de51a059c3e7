package idem

import (
	"crypto/sha256"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// MaxIDLen is the maximum length of a message ID, in bytes.
const MaxIDLen = 255

// MaxHandlerNameLen is the maximum length of a handler name, in bytes.
const MaxHandlerNameLen = 128

// Message is the envelope idem processes. Broker adapters map their
// deliveries into it; a user-supplied decode function may do it instead.
//
// Only ID is required. The payload hash that detects "same ID, different
// payload" covers Payload alone: metadata such as Headers and Time may differ
// between redeliveries without being a conflict.
type Message struct {
	// ID identifies the message across redeliveries: 1–255 bytes of valid
	// UTF-8 with no NUL byte. Required.
	ID string
	// Stream is the Kafka topic or NATS subject the message came from, or
	// an outbox message's destination. It is not the name of a JetStream
	// stream. Optional when consuming; required to publish.
	Stream string
	// Type names the kind of event, for example "FundsCredited". Optional.
	Type string
	// AggregateID identifies the entity the event belongs to. Optional;
	// compared byte-for-byte.
	AggregateID string
	// Seq is the per-aggregate sequence number (≥ 1), or 0 when absent.
	Seq int64
	// Payload is the message body.
	Payload []byte
	// Headers carries broker metadata.
	Headers map[string]string
	// Time is when the event happened, if known.
	Time time.Time
}

// Validate reports whether m is a well-formed envelope. The error is a
// *ValidationError matching ErrInvalidMessage.
func (m *Message) Validate() error {
	if m == nil {
		return &ValidationError{Field: "message", Reason: "is nil", err: ErrInvalidMessage}
	}
	if reason := checkText(m.ID, MaxIDLen); reason != "" {
		return &ValidationError{Field: "ID", Reason: reason, Value: m.ID, err: ErrInvalidMessage}
	}
	if m.Seq < 0 {
		return &ValidationError{Field: "Seq", Reason: fmt.Sprintf("is %d; must be ≥ 1, or 0 when absent", m.Seq), err: ErrInvalidMessage}
	}
	if m.Seq > 0 && m.AggregateID == "" {
		return &ValidationError{Field: "AggregateID", Reason: "is empty but Seq is set", err: ErrInvalidMessage}
	}
	if m.AggregateID != "" {
		if reason := checkText(m.AggregateID, MaxIDLen); reason != "" {
			return &ValidationError{Field: "AggregateID", Reason: reason, Value: m.AggregateID, err: ErrInvalidMessage}
		}
	}
	return nil
}

// ReservedHeaderPrefix begins the names of the headers the broker
// publishers write from a message's fields (idem-id, idem-seq, ...), which
// the adapters' DefaultMap reads back.
const ReservedHeaderPrefix = "idem-"

// ValidatePublish reports whether m can be sent: what Validate checks,
// plus a Stream (the topic or subject to publish to, 1–255 bytes), and
// Stream, Type and every header name and value as text a store or broker
// keeps as given (valid UTF-8, no NUL byte; ID, AggregateID, Type and
// Stream without line breaks or white space at either end; a header name
// printable ASCII without spaces or colons), and a Time within the years
// 0 to 9999 that RFC 3339 (the idem-time header) can write. A
// header name may not be one
// a publisher writes itself (beginning with
// ReservedHeaderPrefix, or JetStream's Nats-Msg-Id): a consumer would read
// it as the message's own ID, sequence or type. The outbox and the broker
// publishers check it before anything is written or sent. The error is a
// *ValidationError matching ErrInvalidMessage.
func (m *Message) ValidatePublish() error {
	if err := m.Validate(); err != nil {
		return err
	}
	if reason := checkText(m.Stream, MaxIDLen); reason != "" {
		if m.Stream == "" {
			reason = "is empty; it is the topic or subject to publish to"
		}
		return &ValidationError{Field: "Stream", Reason: reason, Value: m.Stream, err: ErrInvalidMessage}
	}
	if m.Type != "" {
		if reason := checkText(m.Type, MaxIDLen); reason != "" {
			return &ValidationError{Field: "Type", Reason: reason, Value: m.Type, err: ErrInvalidMessage}
		}
	}
	// Sent as header values, which NATS trims and whose line breaks it
	// turns into spaces: "evt-1" and "evt-1 " would arrive as one ID.
	for _, f := range [...]struct{ name, v string }{{"ID", m.ID}, {"AggregateID", m.AggregateID}, {"Type", m.Type}, {"Stream", m.Stream}} {
		if f.v != "" && (strings.ContainsAny(f.v, "\r\n") || f.v != strings.TrimSpace(f.v)) {
			return &ValidationError{Field: f.name, Reason: "has a line break, or white space at an end, which a broker's headers do not keep", Value: f.v, err: ErrInvalidMessage}
		}
	}
	if y := m.Time.Year(); y < 0 || y > 9999 {
		return &ValidationError{Field: "Time", Reason: "is outside the years 0 to 9999, which RFC 3339 cannot write: a consumer could not read it back", Value: m.Time.String(), err: ErrInvalidMessage}
	}
	for k, v := range m.Headers {
		if reason := checkText(k, MaxIDLen); reason != "" {
			return &ValidationError{Field: "Headers", Reason: "name " + reason, Value: k, err: ErrInvalidMessage}
		}
		if i := strings.IndexFunc(k, func(r rune) bool { return r <= ' ' || r > '~' || r == ':' }); i >= 0 {
			return &ValidationError{Field: "Headers", Reason: fmt.Sprintf("name has %q at offset %d; header names are printable ASCII without spaces or colons", k[i:i+1], i), Value: k, err: ErrInvalidMessage}
		}
		if strings.HasPrefix(k, ReservedHeaderPrefix) || k == "Nats-Msg-Id" {
			return &ValidationError{Field: "Headers", Reason: "name is a publisher's own: it is written from the message's fields", Value: k, err: ErrInvalidMessage}
		}
		if v == "" {
			continue
		}
		if reason := checkText(v, len(v)); reason != "" {
			return &ValidationError{Field: "Headers", Reason: fmt.Sprintf("value of %q %s", k, reason), Value: v, err: ErrInvalidMessage}
		}
	}
	return nil
}

// PayloadHash returns the SHA-256 of the payload: the value stored with the
// marker and compared on redelivery.
func (m *Message) PayloadHash() []byte {
	sum := sha256.Sum256(m.Payload)
	return sum[:]
}

// checkText returns why s is not an acceptable identifier, or "".
func checkText(s string, maxLen int) string {
	switch {
	case len(s) == 0:
		return "is empty"
	case len(s) > maxLen:
		return fmt.Sprintf("is %d bytes; the maximum is %d", len(s), maxLen)
	case !utf8.ValidString(s):
		return "is not valid UTF-8"
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return fmt.Sprintf("contains a NUL byte at offset %d", i)
		}
	}
	return ""
}

// ValidateHandlerName reports whether name is an acceptable handler name:
// 1–128 bytes of ASCII letters, digits and the punctuation . _ - : /
//
// Handler names are stored with every marker, so they must be stable
// strings chosen by the user, never derived from Go identifiers: a refactor
// must not orphan markers. The error is a *ValidationError matching
// ErrInvalidHandlerName.
func ValidateHandlerName(name string) error {
	if len(name) == 0 {
		return &ValidationError{Field: "handler name", Reason: "is empty", err: ErrInvalidHandlerName}
	}
	if len(name) > MaxHandlerNameLen {
		return &ValidationError{Field: "handler name", Reason: fmt.Sprintf("is %d bytes; the maximum is %d", len(name), MaxHandlerNameLen), Value: name, err: ErrInvalidHandlerName}
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '.' || c == '_' || c == '-' || c == ':' || c == '/'
		if !ok {
			return &ValidationError{Field: "handler name", Reason: fmt.Sprintf("has %q at offset %d; allowed are ASCII letters, digits and . _ - : /", c, i), Value: name, err: ErrInvalidHandlerName}
		}
	}
	return nil
}
