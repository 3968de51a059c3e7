-- Migration 002's CHECK on the lease status listed its three values with
-- IN. SQLite checks a list of more than two values by building a temporary
-- B-tree each time a row is written: about a third of the cost of inserting
-- an atomic marker. The same constraint as three comparisons builds
-- nothing. Only the table's definition text changes, in place, by SQLite's
-- procedure for a change that leaves every stored row valid as it is
-- (https://sqlite.org/lang_altertable.html#otheralter): no row is read or
-- rewritten, so this is instant on a table of any size. A definition that
-- differs (edited by hand) is left as it is.
PRAGMA writable_schema = ON;
UPDATE sqlite_schema
SET sql = replace(sql,
    'CHECK (status IN (''running'', ''done'', ''failed''))',
    'CHECK (status = ''running'' OR status = ''done'' OR status = ''failed'')')
WHERE type = 'table' AND name = '{{processed_name}}';
-- A schema change of its own bumps the schema version, so every other
-- connection rereads the definitions; RESET rereads them on this one.
CREATE TABLE {{schema_bump}} (x INTEGER);
DROP TABLE {{schema_bump}};
PRAGMA writable_schema = RESET;
