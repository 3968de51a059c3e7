package postgres

import "github.com/jackc/pgx/v5/pgtype"

// byteaArray sends a [][]byte as a bytea[] without pgx's reflection over
// the slice: Index boxes a pointer to the element, which needs no
// allocation, and the element hands pgx its bytes directly. A batch's
// keys and hashes are thousands of elements, and boxing each []byte was
// most of what encoding a batch's markers cost.
type byteaArray [][]byte

// byteaElem is one element of a byteaArray.
type byteaElem []byte

var (
	_ pgtype.ArrayGetter = byteaArray(nil)
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

// BytesValue implements pgtype.BytesValuer.
func (e *byteaElem) BytesValue() ([]byte, error) { return *e, nil }
