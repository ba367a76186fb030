// Package wire is the vocabulary of package transfer's protocol: every
// control-plane message a prefill and a decode worker exchange over NATS,
// its encoding, and the subjects and bucket it travels on. It does no IO
// and starts no goroutines: transfer's Decoder, Prefiller and Registry send
// and receive the bytes (TestDeps keeps NATS out of this package).
//
//   - messages.go: PrefillRequest, PrefillReply, Cancel, Instance and
//     StateOffer,
//     msgpack maps with explicit short keys and a version "v"
//     (WireVersion); unknown keys are ignored so a later minor revision may
//     add fields. A grant's ticket and a commit's manifest travel as
//     rdma.Ticket and rdma.Manifest themselves; a Peer is the wire form of
//     an rdma.Descriptor.
//   - packed.go: bulk fields (tokens, extents, manifests) as packed
//     little-endian byte strings, never as msgpack arrays.
//   - codec.go: the Encode, Append and Decode functions. Encoders refuse a
//     message over the server's max payload with ErrPayloadTooLarge before
//     anything is published; decoders refuse a message that is malformed,
//     inconsistent or of another version with ErrBadMessage. Package
//     transfer's sentinels of those names are these.
//   - msgcodec.go, on msgp.go's byte-level msgpack: the hand-written codecs
//     of the two messages on every handoff's path (PrefillRequest,
//     PrefillReply), byte for byte the format reflection produces with
//     compact ints; Cancel and Instance go through reflection. A
//     PeerCache decodes the peer of a run of requests from one decoder
//     once.
//   - subjects.go: Subject builds every subject, BucketName the registry's
//     JetStream KV bucket, ValidToken checks their tokens:
//     <prefix>.<ns>.prefill (queue group PrefillQueue: any free worker
//     takes it), <prefix>.<ns>.inst.<id>.prefill (one instance, for
//     targeted retries), <prefix>.<ns>.inst.<id>.cancel and
//     <prefix>.<ns>.cancel (cancels), <prefix>.<ns>.inst.<id>.reconnected,
//     <prefix>.<ns>.inst.<id>.state.offer (StateOffer);
//     ServiceName is the prefill workers' NATS micro service.
//
// testdata/golden pins every message's bytes: changing them means a new
// WireVersion. Every decoder has a fuzz target.
package wire
