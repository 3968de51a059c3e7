package postgres

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/testenv"
)

// TestByteaArrayEncodesAsSliceDoes sends byteaArray and the [][]byte it
// wraps in every exec mode of pgx and reads back what the server got:
// the same elements, NULL for a nil one, an empty bytea for an empty one.
func TestByteaArrayEncodesAsSliceDoes(t *testing.T) {
	ctx := context.Background()
	cases := [][][]byte{
		{},
		{{1, 2, 0xff}, nil, {}, []byte(`a"b\c,{} NULL`), {0}},
		{{}},
		{nil},
	}
	for _, mode := range []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
		pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	} {
		pool := testenv.PostgresPoolWith(t, 1, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
		for _, want := range cases {
			for _, arg := range []any{want, byteaArray(want)} {
				var got [][]byte
				var nulls []bool
				if err := pool.QueryRow(ctx, `SELECT array_agg(e), array_agg(e IS NULL) FROM unnest($1::bytea[]) WITH ORDINALITY AS u(e, n)`, arg).Scan(&got, &nulls); err != nil {
					t.Fatalf("%v, %T %q: %v", mode, arg, want, err)
				}
				if len(got) != len(want) {
					t.Fatalf("%v, %T %q: got %q", mode, arg, want, got)
				}
				for i := range want {
					if nulls[i] != (want[i] == nil) || string(got[i]) != string(want[i]) {
						t.Errorf("%v, %T %q: element %d is %q (NULL: %v)", mode, arg, want, i, got[i], nulls[i])
					}
				}
			}
		}
	}
}
