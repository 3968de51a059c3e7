package rabbitmq

// CloseConnection closes the consumer's current connection, as a crash
// would from the broker's side: what it had not acknowledged goes back to
// the queue, and its acknowledgements fail from then on.
func (c *Consumer) CloseConnection() {
	if conn := c.conn.Load(); conn != nil {
		_ = conn.Close()
	}
}

// Sessions returns how many connections Run consumed on.
func (c *Consumer) Sessions() int64 { return c.sessions.Load() }

// MapMessage is mapMessage, for the fuzz test.
var MapMessage = mapMessage

// TierOf is tierOf.
var TierOf = tierOf

// AttemptOf is attemptOf.
var AttemptOf = attemptOf
