package rabbitmq

import (
	"fmt"
	"math"
	"strconv"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
)

// Headers the default mapping reads. A producer (or Publisher) sets them;
// the message ID travels in the AMQP message-id property, and idem-id is
// read when that property is empty.
const (
	HeaderID        = "idem-id"
	HeaderAggregate = "idem-aggregate"
	HeaderSeq       = "idem-seq"
	HeaderType      = "idem-type" // read when the type property is empty
	HeaderTime      = "idem-time" // RFC 3339, as Publisher writes Message.Time
	// HeaderAttempt is the delivery attempt a retry copy is for (2, 3,
	// ...). The consumer writes it when it republishes a message for a
	// retry; a message without it is on its first attempt.
	HeaderAttempt = "idem-attempt"
	// HeaderRoutingKey keeps the routing key a message was first
	// published with on its retry copies, whose own routing key is the
	// work queue's name once the retry queue dead-letters them back.
	HeaderRoutingKey = "idem-routing-key"
)

// headerDeliveryCount is the header quorum queues set on a message they
// deliver again: how many times it was returned before (nacked with
// requeue, or left unacknowledged on a closed channel).
const headerDeliveryCount = "x-delivery-count"

// DefaultMap reads the message ID from the AMQP message-id property, else
// the idem-id header; the aggregate from idem-aggregate, the sequence from
// idem-seq (an integer, or a string of one), the type from the type
// property, else idem-type, and the time from idem-time (RFC 3339), else
// the timestamp property. The payload is the body, and Stream the routing
// key the message was first published with. Every other header whose
// value is text, a number or a boolean goes to Headers, so metadata such as
// a producer's trace context (traceparent) reaches the handler and the
// hooks; tables, arrays and RabbitMQ's own x- headers do not.
//
// A message with neither ID is a decode failure, dead-lettered with the
// reason: RabbitMQ's delivery tag names a delivery, not a message, so it
// cannot stand in for a producer's ID.
func DefaultMap(d *amqp.Delivery) (*idem.Message, error) {
	return mapMessage(d.MessageId, d.Type, d.RoutingKey, d.Timestamp, d.Headers, d.Body)
}

// mapMessage is DefaultMap on a delivery's parts.
func mapMessage(messageID, typ, routingKey string, ts time.Time, h amqp.Table, body []byte) (*idem.Message, error) {
	id := messageID
	if id == "" {
		s, err := textHeader(h, HeaderID)
		if err != nil {
			return nil, err
		}
		id = s
	}
	if id == "" {
		return nil, fmt.Errorf("%w: rabbitmq: message routed by %q has no message-id property and no %s header", idem.ErrInvalidMessage, routingKey, HeaderID)
	}
	msg := &idem.Message{ID: id, Stream: routingKey, Type: typ, Payload: body}
	var err error
	if msg.AggregateID, err = textHeader(h, HeaderAggregate); err != nil {
		return nil, err
	}
	if rk, err := textHeader(h, HeaderRoutingKey); err != nil {
		return nil, err
	} else if rk != "" {
		msg.Stream = rk
	}
	if msg.Type == "" {
		if msg.Type, err = textHeader(h, HeaderType); err != nil {
			return nil, err
		}
	}
	if v, ok := h[HeaderSeq]; ok {
		seq, ok := intValue(v)
		if !ok || seq < 1 {
			return nil, fmt.Errorf("%w: rabbitmq: message %q: %s header %v (%T) is not a positive integer", idem.ErrInvalidMessage, id, HeaderSeq, v, v)
		}
		msg.Seq = seq
	}
	switch v := h[HeaderTime].(type) {
	case nil:
		msg.Time = ts
	case time.Time:
		msg.Time = v
	default:
		s, ok := text(v)
		t, err := time.Parse(time.RFC3339Nano, s)
		if !ok || err != nil {
			return nil, fmt.Errorf("%w: rabbitmq: message %q: %s header %v is not an RFC 3339 time", idem.ErrInvalidMessage, id, HeaderTime, v)
		}
		msg.Time = t
	}
	for k, v := range h {
		switch k {
		case HeaderID, HeaderAggregate, HeaderSeq, HeaderType, HeaderTime, HeaderAttempt, HeaderRoutingKey:
			continue
		}
		if len(k) >= 2 && k[:2] == "x-" {
			continue
		}
		s, ok := scalar(v)
		if !ok {
			continue
		}
		if msg.Headers == nil {
			msg.Headers = make(map[string]string, len(h))
		}
		msg.Headers[k] = s
	}
	if err := msg.Validate(); err != nil {
		return nil, err
	}
	return msg, nil
}

// textHeader returns header name of h as text: "" when absent, an error
// when it holds something else (a number, a table).
func textHeader(h amqp.Table, name string) (string, error) {
	v, ok := h[name]
	if !ok || v == nil {
		return "", nil
	}
	s, ok := text(v)
	if !ok {
		return "", fmt.Errorf("%w: rabbitmq: %s header is a %T, not text", idem.ErrInvalidMessage, name, v)
	}
	return s, nil
}

// text returns v as a string when it is one, or bytes of valid UTF-8.
func text(v any) (string, bool) {
	switch v := v.(type) {
	case string:
		return v, true
	case []byte:
		if utf8.Valid(v) {
			return string(v), true
		}
	}
	return "", false
}

// intValue returns v as an int64 when it is an integer of any AMQP width,
// or a string of one.
func intValue(v any) (int64, bool) {
	switch v := v.(type) {
	case int8:
		return int64(v), true
	case int16:
		return int64(v), true
	case int32:
		return int64(v), true
	case int64:
		return v, true
	case int:
		return int64(v), true
	case uint8:
		return int64(v), true
	case uint16:
		return int64(v), true
	case uint32:
		return int64(v), true
	case uint64:
		if v > math.MaxInt64 {
			return 0, false
		}
		return int64(v), true
	}
	s, ok := text(v)
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}

// scalar returns v as text when it is text, a number or a boolean.
func scalar(v any) (string, bool) {
	if s, ok := text(v); ok {
		return s, true
	}
	if n, ok := intValue(v); ok {
		return strconv.FormatInt(n, 10), true
	}
	switch v := v.(type) {
	case bool:
		return strconv.FormatBool(v), true
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32), true
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64), true
	}
	return "", false
}

// attemptOf returns the attempt a delivery is: its idem-attempt header (1
// without one) plus the times the queue returned it since (x-delivery-count
// on quorum queues; on classic queues only the redelivered flag is known,
// counted as one). A delivery not flagged redelivered was never returned,
// whatever x-delivery-count it carries; and only a quorum queue writes that
// header: on a classic queue it is the producer's (a message moved from a
// quorum queue, by a shovel or by hand from a dead-letter queue, keeps the
// count it had there), which would make a first delivery a late attempt,
// or the last.
func attemptOf(h amqp.Table, redelivered, quorum bool) int {
	attempt := int64(1)
	if n, ok := intValue(h[HeaderAttempt]); ok && n > 1 {
		attempt = n
	}
	if !redelivered {
		return int(min(attempt, math.MaxInt32))
	}
	if n, ok := intValue(h[headerDeliveryCount]); ok && n > 0 && quorum {
		attempt += n
	} else {
		attempt++
	}
	return int(min(attempt, math.MaxInt32))
}
