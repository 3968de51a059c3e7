package jetstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
)

// Publisher publishes messages to JetStream and waits for each
// acknowledgement before sending the next: the outbox relay's Publisher
// (see idem's outbox package). The subject is the message's Stream; the ID
// travels as Nats-Msg-Id, so the stream's duplicate window drops a
// republished copy inside it, and the consumer's markers catch the rest.
// NATS trims white space around header values and turns line breaks inside
// them into spaces, so IDs that differ only so arrive, and are deduplicated,
// as one.
// The aggregate, sequence, type and time go in the headers DefaultMap
// reads, with the message's own Headers.
//
// Give js a connection that reconnects for ever (nats.MaxReconnects(-1)).
// nats.go closes one for good after 60 failed reconnects by default, about
// two minutes of outage; a relay over a closed connection stops
// (Relay.Run returns the probe's error) and must be started again on a new
// connection.
type Publisher struct {
	js jetstream.JetStream
}

// NewPublisher returns a Publisher on js.
func NewPublisher(js jetstream.JetStream) (*Publisher, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: jetstream: NewPublisher needs a JetStream", idem.ErrInvalidConfig)
	}
	return &Publisher{js: js}, nil
}

// ErrStatusHeader is returned by Publisher.Publish for a message with an
// empty payload and a Status header: nats.go takes such a message for one
// of the server's status messages and drops it before any consumer sees
// it, so it would be lost. Give it a payload, or another header name.
var ErrStatusHeader = errors.New("jetstream: an empty message with a Status header never reaches a consumer")

// Unavailable reports whether err, returned by Publish, may come from the
// server being out of reach rather than from a message or the stream's
// refusal (an invalid message, ErrStatusHeader, or an answer of the
// server's JetStream API, such as a full stream): the outbox relay then
// probes the server (Probe) and, if the probe fails too, pauses its
// publishes without counting an attempt on the rows (outbox.BrokerProber).
func (p *Publisher) Unavailable(err error) bool {
	var api *jetstream.APIError
	return err != nil && !errors.Is(err, idem.ErrInvalidMessage) && !errors.Is(err, ErrStatusHeader) && !errors.As(err, &api)
}

// Probe returns nil when the connection is up and JetStream answers (an
// account info request); see Unavailable. A closed connection is a
// permanent error (idem.IsPermanent matching nats.ErrConnectionClosed): a
// relay stops on it rather than wait for ever.
func (p *Publisher) Probe(ctx context.Context) error {
	if nc := p.js.Conn(); nc != nil {
		switch s := nc.Status(); s {
		case nats.CONNECTED:
		case nats.CLOSED:
			// Closed, or nats.go gave up reconnecting: it never
			// answers again, so a relay waiting on it would wait for ever.
			return idem.Permanent(fmt.Errorf("jetstream: probe: %w (nats.go stops reconnecting after MaxReconnects, 60 by default: connect with nats.MaxReconnects(-1))", nats.ErrConnectionClosed))
		default:
			return fmt.Errorf("jetstream: probe: connection %s", s)
		}
	}
	if _, err := p.js.AccountInfo(ctx); err != nil {
		return fmt.Errorf("jetstream: probe: %w", err)
	}
	return nil
}

// Publish sends msgs in order, each once the previous one is stored. It
// refuses the call, publishing nothing, if any message is invalid
// (Message.ValidatePublish; Stream is the subject), has a header the
// server acts on (a name beginning with Nats-, see serverHeaderPrefix), or
// has an empty payload and a Status header (ErrStatusHeader): a consumer
// could only dead-letter it. A Stream that is no subject to publish to (a
// wildcard, an empty token, white space, a subject of the server's own
// API such as $JS.API.STREAM.DELETE.<name>) is an invalid message too.
func (p *Publisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	for _, m := range msgs {
		if err := m.ValidatePublish(); err != nil {
			return fmt.Errorf("jetstream: publish: %w", err)
		}
		for k := range m.Headers {
			if strings.HasPrefix(k, serverHeaderPrefix) {
				return fmt.Errorf("jetstream: publish %q: %w: header %q is the JetStream server's: it acts on such headers at publish "+
					"(Nats-Rollup purges the subject's earlier messages, Nats-Expected-* fails a republished copy, Nats-Schedule* stores a schedule, not the message); "+
					"give it another name", m.ID, idem.ErrInvalidMessage, k)
			}
		}
		if reason := badSubject(m.Stream); reason != "" {
			return fmt.Errorf("jetstream: publish %q: %w: Stream %q is no subject to publish to: %s", m.ID, idem.ErrInvalidMessage, m.Stream, reason)
		}
		if len(m.Payload) > 0 {
			continue
		}
		if v := m.Headers["Status"]; v != "" { // NATS header names are case-sensitive
			return fmt.Errorf("%w: message %q, Status %q", ErrStatusHeader, m.ID, v)
		}
	}
	for _, m := range msgs {
		nm := &nats.Msg{Subject: m.Stream, Data: m.Payload, Header: nats.Header{}}
		for k, v := range m.Headers {
			nm.Header.Set(k, v)
		}
		if !m.Time.IsZero() {
			nm.Header.Set(HeaderTime, m.Time.Format(time.RFC3339Nano))
		}
		nm.Header.Set(HeaderMsgID, m.ID)
		if m.AggregateID != "" {
			nm.Header.Set(HeaderAggregate, m.AggregateID)
		}
		if m.Seq > 0 {
			nm.Header.Set(HeaderSeq, strconv.FormatInt(m.Seq, 10))
		}
		if m.Type != "" {
			nm.Header.Set(HeaderType, m.Type)
		}
		if _, err := p.js.PublishMsg(ctx, nm, jetstream.WithMsgID(m.ID)); err != nil {
			return fmt.Errorf("jetstream: publish %q to %q: %w", m.ID, m.Stream, err)
		}
	}
	return nil
}

// serverHeaderPrefix begins the names of the headers the JetStream server
// reads on a publish and acts on (Nats-Msg-Id, Nats-Rollup,
// Nats-Expected-Last-Sequence, Nats-TTL, Nats-Schedule, ...), a set that
// grows with server releases. The publisher writes Nats-Msg-Id itself; a
// message's own Headers may hold none of them. NATS header names are
// case-sensitive: the server reads these spellings only.
const serverHeaderPrefix = "Nats-"

// badSubject says why subj cannot be published to, or "": NATS subjects
// are dot-separated tokens, none empty, without white space, and a
// publish names no wildcard (* or >), nor a subject of the server's own
// API (see serverSubject).
func badSubject(subj string) string {
	if strings.ContainsAny(subj, " \t\r\n") {
		return "it holds white space"
	}
	if serverSubject(subj) {
		return "it is in the server's own namespace ($JS, $JSC, $NRG, $SYS), where a publish is an API request the server acts on (deleting or purging a stream, acking a consumer's message) and no stream stores and acknowledges it"
	}
	for _, tok := range strings.Split(subj, ".") {
		switch tok {
		case "":
			return "it has an empty token"
		case "*", ">":
			return "it has a wildcard"
		}
	}
	return ""
}

// serverSubject reports whether subj is in a namespace of the server's
// own API: $JS (the JetStream API, acks, flow control), $JSC, $NRG
// (clustering) and $SYS (the system account). The server acts on a
// publish there, and refuses a stream that acknowledges publishes and
// covers such subjects, but for $JS.EVENT.> and $SYS.ACCOUNT.>.
func serverSubject(subj string) bool {
	for _, ns := range [...]string{"$JS.", "$JSC.", "$NRG.", "$SYS."} {
		if strings.HasPrefix(subj, ns) {
			return !strings.HasPrefix(subj, "$JS.EVENT.") && !strings.HasPrefix(subj, "$SYS.ACCOUNT.")
		}
	}
	return false
}
