package kvevents

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"

	"github.com/handoff-io/handoff/internal/msgpackcheck"
)

// Encode returns b's encoding (see the package doc).
func Encode(b *Batch) ([]byte, error) {
	var buf bytes.Buffer
	w := writer{enc: msgpack.NewEncoder(&buf)}
	w.enc.UseCompactInts(true)
	w.batch(b)
	if w.err != nil {
		return nil, fmt.Errorf("kvevents: encode: %w", w.err)
	}
	return buf.Bytes(), nil
}

// writer encodes with a sticky error: after the first, it writes nothing.
type writer struct {
	enc *msgpack.Encoder
	err error
}

func (w *writer) do(f func() error) {
	if w.err == nil {
		w.err = f()
	}
}

func (w *writer) arrayLen(n int) { w.do(func() error { return w.enc.EncodeArrayLen(n) }) }
func (w *writer) int(v int64)    { w.do(func() error { return w.enc.EncodeInt(v) }) }
func (w *writer) str(s string)   { w.do(func() error { return w.enc.EncodeString(s) }) }
func (w *writer) bytes(b []byte) { w.do(func() error { return w.enc.EncodeBytes(b) }) }
func (w *writer) null()          { w.do(w.enc.EncodeNil) }

func (w *writer) hashes(hs []Hash) {
	w.arrayLen(len(hs))
	for i := range hs {
		w.bytes(hs[i][:])
	}
}

func (w *writer) tokens(ts []int32) {
	w.arrayLen(len(ts))
	for _, t := range ts {
		w.int(int64(t))
	}
}

func (w *writer) batch(b *Batch) {
	w.arrayLen(7)
	w.do(func() error { return w.enc.EncodeFloat64(b.TS) })
	w.arrayLen(len(b.Events))
	for i := range b.Events {
		w.event(&b.Events[i])
	}
	w.int(int64(b.Rank))
	w.do(func() error { return w.enc.EncodeUint(b.Seq) })
	w.str(b.Instance)
	w.bytes(b.Root[:])
	w.do(func() error { return w.enc.EncodeBool(b.Snapshot) })
}

func (w *writer) event(e *Event) {
	switch e.Kind {
	case BlockStored:
		w.arrayLen(11)
		w.str(e.Kind.String())
		w.hashes(e.Hashes)
		if e.HasParent {
			w.bytes(e.Parent[:])
		} else {
			w.null()
		}
		w.tokens(e.Tokens)
		w.int(int64(e.BlockSize))
		w.null() // lora_id
		w.str(e.Medium)
		w.null() // lora_name
		w.null() // extra_keys
		w.int(GroupKV)
		w.str(KindAttention)
	case BlockRemoved:
		w.arrayLen(4)
		w.str(e.Kind.String())
		w.hashes(e.Hashes)
		w.str(e.Medium)
		w.int(GroupKV)
	case AllBlocksCleared:
		w.arrayLen(1)
		w.str(e.Kind.String())
	case StateStored, StateRemoved:
		w.arrayLen(8)
		w.str(e.Kind.String())
		w.bytes(e.PrefixHash[:])
		w.bytes(e.Parent[:])
		w.tokens(e.Tokens)
		w.int(int64(e.NumTokens))
		w.int(GroupState)
		w.str(KindMamba)
		w.str(e.Medium)
	default:
		w.do(func() error { return fmt.Errorf("unknown event kind %d", e.Kind) })
	}
}

// Decode decodes a batch. Errors wrap ErrBadBatch.
func Decode(data []byte) (Batch, error) {
	// Unknown fields are skipped by msgpack, which recurses without a
	// bound: a batch of a few MiB nested a million deep would take a GiB
	// of stack. Batches nest four deep.
	if err := msgpackcheck.Check(data); err != nil {
		return Batch{}, fmt.Errorf("%w: %w", ErrBadBatch, err)
	}
	r := bytes.NewReader(data)
	d := decoder{dec: msgpack.NewDecoder(r), r: r}
	b, err := d.batch()
	if err != nil {
		return Batch{}, fmt.Errorf("%w: %w", ErrBadBatch, err)
	}
	return b, nil
}

type decoder struct {
	dec *msgpack.Decoder
	r   *bytes.Reader
}

// arrayLen reads an array header of at least min and at most max elements.
func (d *decoder) arrayLen(what string, min, max int) (int, error) {
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	if n < min || n > max {
		return 0, fmt.Errorf("%s: %d elements, want %d to %d", what, n, min, max)
	}
	return n, nil
}

// skip discards the n fields after those the decoder knows.
func (d *decoder) skip(n int) error {
	for range n {
		if err := d.dec.Skip(); err != nil {
			return err
		}
	}
	return nil
}

func (d *decoder) isNil() (bool, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return false, err
	}
	if c == msgpcode.Nil {
		return true, d.dec.DecodeNil()
	}
	return false, nil
}

func (d *decoder) hash(what string) (Hash, error) {
	var h Hash
	b, err := d.dec.DecodeBytes()
	if err != nil {
		return h, fmt.Errorf("%s: %w", what, err)
	}
	if len(b) != len(h) {
		return h, fmt.Errorf("%s: %d bytes, want %d", what, len(b), len(h))
	}
	copy(h[:], b)
	return h, nil
}

func (d *decoder) int(what string, min, max int64) (int64, error) {
	v, err := d.dec.DecodeInt64()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	if v < min || v > max {
		return 0, fmt.Errorf("%s: %d out of [%d, %d]", what, v, min, max)
	}
	return v, nil
}

func (d *decoder) str(what string) (string, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return "", fmt.Errorf("%s: %w", what, err)
	}
	if !msgpcode.IsString(c) && c != msgpcode.Nil {
		return "", fmt.Errorf("%s: not a string", what)
	}
	s, err := d.dec.DecodeString()
	if err != nil {
		return "", fmt.Errorf("%s: %w", what, err)
	}
	if len(s) > maxStringLength {
		return "", fmt.Errorf("%s: %d bytes", what, len(s))
	}
	return s, nil
}

func (d *decoder) hashes(what string) ([]Hash, error) {
	n, err := d.arrayLen(what, 0, MaxHashes)
	if err != nil {
		return nil, err
	}
	hs := make([]Hash, n)
	for i := range hs {
		if hs[i], err = d.hash(what); err != nil {
			return nil, err
		}
	}
	return hs, nil
}

func (d *decoder) tokens(what string) ([]int32, error) {
	n, err := d.arrayLen(what, 0, MaxTokens)
	if err != nil {
		return nil, err
	}
	ts := make([]int32, n)
	for i := range ts {
		v, err := d.int(what, 0, 1<<31-1)
		if err != nil {
			return nil, err
		}
		ts[i] = int32(v)
	}
	return ts, nil
}

func (d *decoder) batch() (Batch, error) {
	var b Batch
	n, err := d.arrayLen("batch", 7, 64)
	if err != nil {
		return b, err
	}
	if b.TS, err = d.dec.DecodeFloat64(); err != nil {
		return b, fmt.Errorf("ts: %w", err)
	}
	ne, err := d.arrayLen("events", 0, MaxEvents)
	if err != nil {
		return b, err
	}
	b.Events = make([]Event, 0, min(ne, 64)) // grown as events decode, not as claimed
	for i := range ne {
		var e Event
		if err := d.event(&e); err != nil {
			return b, fmt.Errorf("event %d: %w", i, err)
		}
		// An event of a kind this revision does not know is skipped here,
		// not kept: a few bytes each, they would otherwise cost a whole
		// Event apiece (a batch of them 300 times its size).
		if e.Kind != 0 {
			b.Events = append(b.Events, e)
		}
	}
	rank, err := d.int("data_parallel_rank", 0, 1<<16)
	if err != nil {
		return b, err
	}
	b.Rank = int(rank)
	if b.Seq, err = d.dec.DecodeUint64(); err != nil {
		return b, fmt.Errorf("seq: %w", err)
	}
	if b.Seq == 0 {
		return b, fmt.Errorf("seq 0")
	}
	if b.Instance, err = d.str("instance"); err != nil {
		return b, err
	}
	if b.Root, err = d.hash("root"); err != nil {
		return b, err
	}
	if b.Snapshot, err = d.dec.DecodeBool(); err != nil {
		return b, fmt.Errorf("snapshot: %w", err)
	}
	if err := d.skip(n - 7); err != nil {
		return b, err
	}
	if d.r.Len() != 0 {
		return b, fmt.Errorf("trailing bytes")
	}
	return b, nil
}

func (d *decoder) event(e *Event) error {
	n, err := d.arrayLen("event", 1, 64)
	if err != nil {
		return err
	}
	tag, err := d.str("tag")
	if err != nil {
		return err
	}
	known := 1
	need := func(k int) error {
		if n < k {
			return fmt.Errorf("%s: %d fields, want at least %d", tag, n, k)
		}
		known = k
		return nil
	}
	switch tag {
	case "BlockStored":
		e.Kind = BlockStored
		if err := need(7); err != nil {
			return err
		}
		if e.Hashes, err = d.hashes("block_hashes"); err != nil {
			return err
		}
		null, err := d.isNil()
		if err != nil {
			return err
		}
		if !null {
			if e.Parent, err = d.hash("parent_block_hash"); err != nil {
				return err
			}
			e.HasParent = true
		}
		if e.Tokens, err = d.tokens("token_ids"); err != nil {
			return err
		}
		bs, err := d.int("block_size", 1, MaxTokens)
		if err != nil {
			return err
		}
		e.BlockSize = int(bs)
		if len(e.Tokens) != len(e.Hashes)*e.BlockSize {
			return fmt.Errorf("BlockStored: %d tokens for %d blocks of %d", len(e.Tokens), len(e.Hashes), e.BlockSize)
		}
		if err := d.dec.Skip(); err != nil { // lora_id
			return err
		}
		if e.Medium, err = d.str("medium"); err != nil {
			return err
		}
	case "BlockRemoved":
		e.Kind = BlockRemoved
		if err := need(3); err != nil {
			return err
		}
		if e.Hashes, err = d.hashes("block_hashes"); err != nil {
			return err
		}
		if e.Medium, err = d.str("medium"); err != nil {
			return err
		}
	case "AllBlocksCleared":
		e.Kind = AllBlocksCleared
	case "StateStored", "StateRemoved":
		e.Kind = StateStored
		if tag == "StateRemoved" {
			e.Kind = StateRemoved
		}
		if err := need(5); err != nil {
			return err
		}
		if e.PrefixHash, err = d.hash("prefix_hash"); err != nil {
			return err
		}
		if e.Parent, err = d.hash("parent_block_hash"); err != nil {
			return err
		}
		e.HasParent = true
		if e.Tokens, err = d.tokens("token_ids"); err != nil {
			return err
		}
		nt, err := d.int("num_tokens", 1, 1<<40)
		if err != nil {
			return err
		}
		e.NumTokens = int(nt)
		if len(e.Tokens) > e.NumTokens {
			return fmt.Errorf("%s: %d tokens after the parent of a %d-token prefix", tag, len(e.Tokens), e.NumTokens)
		}
		if n >= 8 {
			if err := d.skip(2); err != nil { // group_idx, kv_cache_spec_kind
				return err
			}
			if e.Medium, err = d.str("medium"); err != nil {
				return err
			}
			known = 8
		}
	default:
		// A kind of a later revision: its fields are skipped and the
		// batch leaves it out.
		e.Kind = 0
	}
	return d.skip(n - known)
}
