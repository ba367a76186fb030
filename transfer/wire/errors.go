package wire

import (
	"errors"
	"fmt"
	"math"
	"reflect"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/handoff-io/handoff/transfer/session"
)

// Sentinel errors. Every error a decoder returns wraps ErrBadMessage, every
// error of an encoder given a message too large wraps ErrPayloadTooLarge.
// Package transfer's sentinels of the same names are these.
var (
	// ErrBadMessage: a control message could not be decoded, has an unknown
	// version or is inconsistent.
	ErrBadMessage = errors.New("transfer: bad control message")
	// ErrPayloadTooLarge: an encoded control message exceeds the server's max
	// payload. Checked before publishing; nothing was sent.
	ErrPayloadTooLarge = errors.New("transfer: control message exceeds max payload")
)

// A code on the wire is refused when it is too wide for a Code, which
// msgpack's reflection would truncate into another, valid-looking one.
func init() {
	msgpack.Register(session.Code(0), nil, func(dec *msgpack.Decoder, v reflect.Value) error {
		n, err := dec.DecodeUint64()
		if err != nil {
			return err
		}
		if n > math.MaxUint16 {
			return fmt.Errorf("code %d out of range", n)
		}
		v.SetUint(n)
		return nil
	})
}
