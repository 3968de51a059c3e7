package jetstream

import "time"

// SetWatchEvery sets how often c's Run reads the durable's info, for tests
// that count what arrives on the consumer's connection.
func SetWatchEvery(c *Consumer, d time.Duration) { c.watchEvery = d }
