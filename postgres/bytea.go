package postgres

import (
	"encoding/hex"

	"github.com/jackc/pgx/v5/pgtype"
)

// byteaArray sends a [][]byte as a bytea[] without pgx's reflection over
// the slice: Index boxes a pointer to the element, which needs no
// allocation, and the element hands pgx its bytes directly. A batch's
// keys and hashes are thousands of elements, and boxing each []byte was
// most of what encoding a batch's markers cost.
//
// In the exec modes that send parameters as text of no known type
// (QueryExecModeExec, the simple protocol), pgx finds no codec for a
// type it has not registered; TextValue writes the array literal then.
// Either way a nil element is NULL and an empty one an empty bytea.
type byteaArray [][]byte

// byteaElem is one element of a byteaArray.
type byteaElem []byte

var (
	_ pgtype.ArrayGetter = byteaArray(nil)
	_ pgtype.TextValuer  = byteaArray(nil)
	_ pgtype.BytesValuer = (*byteaElem)(nil)
)

// Dimensions implements pgtype.ArrayGetter.
func (a byteaArray) Dimensions() []pgtype.ArrayDimension {
	if a == nil {
		return nil
	}
	return []pgtype.ArrayDimension{{Length: int32(len(a)), LowerBound: 1}}
}

// Index implements pgtype.ArrayGetter.
func (a byteaArray) Index(i int) any { return (*byteaElem)(&a[i]) }

// IndexType implements pgtype.ArrayGetter.
func (a byteaArray) IndexType() any { return (*byteaElem)(nil) }

// TextValue implements pgtype.TextValuer: the array in PostgreSQL's text
// form, each element quoted in bytea's hex format ({"\\x0102",NULL}).
func (a byteaArray) TextValue() (pgtype.Text, error) {
	if a == nil {
		return pgtype.Text{}, nil
	}
	n := 2
	for _, e := range a {
		n += 6 + 2*len(e)
	}
	b := make([]byte, 0, n)
	b = append(b, '{')
	for i, e := range a {
		if i > 0 {
			b = append(b, ',')
		}
		if e == nil {
			b = append(b, "NULL"...)
			continue
		}
		b = append(b, `"\\x`...)
		b = hex.AppendEncode(b, e)
		b = append(b, '"')
	}
	b = append(b, '}')
	return pgtype.Text{String: string(b), Valid: true}, nil
}

// BytesValue implements pgtype.BytesValuer.
func (e *byteaElem) BytesValue() ([]byte, error) { return *e, nil }
