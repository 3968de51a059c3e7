package sqlite

// SetSchemaWritableHook sets f to be called once migration 010 has turned
// writable_schema on, for tests of what follows a failure there.
func SetSchemaWritableHook(d *Driver, f func()) { d.schemaWritable = f }
