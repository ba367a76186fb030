// Package rdma is handoff's data path: registered memory regions, grants
// fenced by epochs, and one-sided writes from a writer's regions into a
// receiver's regions, over several transports (tcp, shm, in-process,
// cuda-ipc) behind two small seams: the writer's link and the receiver's
// fence.
//
// # Model
//
// An Engine is one agent (one per process in production). It registers
// regions (arenas such as the KV block pool and the Mamba state pool) once at
// start-up and describes itself to peers with a Descriptor: plain,
// JSON-serialisable data that the control plane carries.
//
// The receiver (decode) opens a Grant per request over destination extents
// (runs of bytes in its regions, never per-block lists). A grant has an id, a
// request id (never 0: the padding dummy is never transferred), an epoch, a
// random 16-byte token, the expected bytes and a deadline. Its Ticket goes to
// the writer (prefill), which calls Engine.Write: the concatenation of its
// source extents lands in the concatenation of the ticket's extents, and a
// commit carrying a Manifest (bytes and crc32c per destination extent)
// follows. The receiver completes the grant only if the manifest matches
// what landed, byte counts and crc32c computed on its own side. Write returns
// after the receiver accepted or refused the commit: one round trip per
// request, never per byte.
//
// # Fencing
//
// Revoke (explicit, or the deadline timer, or Engine.Close) moves the grant
// to a new epoch and fails it. Every later frame is refused, and Revoke
// returns only when no byte can land any more:
//
//   - tcp and inproc: each data frame is admitted under the grant's lock
//     (token, epoch, state, deadline, extent bounds) and counted in flight
//     until its bytes are in place; Revoke aborts reads in progress (it
//     sets the connection's read deadline) and waits for the count to reach
//     zero.
//   - shm: the grant's slot in a shared table holds a state word
//     epoch<<18 | writer<<2 | state. A writer copies only inside a bracket
//     won by CAS open(e) -> writing(e, w) and ended by a CAS back to
//     open(e); a bracket copies at most 4 MiB, on one goroutine. A fence
//     touches only words of its grant's epoch (a reused slot is another
//     grant's): it CASes open(e) -> closed(e), or writing(e, w) ->
//     fencing(e, w), after which the writer's closing CAS fails and it
//     ends the bracket by closing the slot itself, copying no more. The
//     fence waits up to Config.FenceWait (100 ms) for that, unless writer
//     w's process has exited: the receiver knows each writer's pid
//     (SO_PEERCRED at accept) and holds a pidfd, which polls readable on
//     exit. A connection closing is never taken for a death: the receiver
//     cuts live writers' connections itself (a malformed frame). A live
//     writer that does not end its bracket in time (SIGSTOP, a frozen
//     cgroup) does not hold Revoke: the grant fails at once and is
//     quarantined (Grant.Quarantined, Stats.QuarantinedBytes, a warning
//     in the log): its extents stay busy (OpenGrant refuses them) and Done
//     stays open until the bracket ends or the process exits.
//
// The same questions for each transport: a connection the receiver cuts
// lands nothing more on tcp (data lands only through the receiver's own
// reads) and on inproc (no connection: an in-process writer's landings are
// counted in flight, and Revoke waits for them: one piece's memcpy at most);
// on shm the writer maps the memory, so only the slot protocol above stops
// it. No reply is taken for another: tcp uses a connection for one write at a
// time and drops one whose exchange was cut, shm reconnects a link that may
// be out of step before its next exchange, and both check that a reply names
// the grant and epoch of the frame it answers. A frozen writer holds Revoke
// on no transport: tcp and inproc abort or wait out their landings, shm
// quarantines. Several writers of one grant (the progressive and resharded
// grants to come) each win their brackets by CAS from open, so the fence
// covers every one of them, and any live one still copying quarantines.
//
// A frame never lands outside its grant: every data frame's extent index,
// offset and length are checked against the receiver's own copy of the
// grant, and a shm writer checks its ticket against a digest of the grant's
// extents before its first copy. shm trusts the writer's engine the way a
// GPU IPC handle does: the peer maps whole regions, so the control socket
// is created mode 0600 (same user only).
//
// # The receiver seam
//
// Engine and Grant fence through one small interface, fence (fence.go),
// which each served transport's receiving side implements: tcpServer (tcp,
// and cuda-ipc, whose pulls arrive on its connections), inprocRx and
// shmServer. OpenGrant opens every grant on each (open), Revoke, the
// deadline, a commit and Engine.Close fence it on each (fence, all within
// one Config.FenceWait), and a retired grant is released on each
// (release); shm's table also picks the grant ids it can file (slotted).
// When a receiver's fence method returns true, it guarantees:
//
//   - no byte of the grant lands in its destination through this
//     transport any more, from any writer, whatever the writer does: the
//     writes it admitted have ended or were cut, and it admits none of the
//     grant's old epoch again;
//   - it did not wait on a peer past the wait it was given, and touched
//     nothing of another grant (a slot or resource the next grant reuses
//     is not this grant's to close).
//
// It returns false only when a writer it cannot stop (a live process
// stopped inside a copy into memory it mapped) may still store: the grant
// is quarantined, whichever transport said so, and the fence is asked
// again (wait 0) until it returns true; only then is Done closed. A
// transport whose writers store on their own reports the bytes they
// stored (stored), since the receiver counted none of them.
//
// A receiver that stores every byte itself admits each store through
// Grant.beginLand (token, epoch, state, deadline, extent bounds checked
// under the grant's lock), keeps it counted in flight until Grant.endLand,
// and registers a lander whose abortLanding cuts what the store waits on;
// its fence is landings, which cuts the landings in flight and waits for
// them. tcp, cuda-ipc and inproc do that (inproc registers no lander: a
// piece's memcpy is waited for), and so does a receiver-driven transport
// such as UCX active messages (ucx_linux.go): it admits each incoming
// message against the grant table as one landing, has UCX receive the
// payload into a staging buffer of its own, and copies it into the
// destination once the receive completed. UCX cannot cancel a receive, so
// its lander's abort abandons a receive still under way (it finishes into
// its staging buffer, which stays out of use until then) and Revoke
// returns at once, even with a writer frozen mid-transfer; the only store
// into the destination is the receiver's copy, which the fence waits for.
//
// # Progressive writes
//
// A Stream (Engine.OpenStream) writes one grant in many writes, each into
// byte ranges of the ticket's extents, in any order, then one commit whose
// manifest covers every extent: a prefill worker pushes each layer's cache
// as soon as compute finished it. The receiver treats the writes as the data
// frames of one writer (tcp ends each write with a flush, answered once its
// frames landed; shm copies inside the slot's brackets; inproc copies), so
// fencing is unchanged: after Revoke no byte of any later or in-flight write
// lands, and the commit is refused. Each piece is summed on its own on both
// sides and the sums are joined per extent at the commit (crc32c.Combine),
// so the receiver reads nothing again however the pieces came; an extent
// keeps up to one segment per 16 KiB for that. Stream.WriteRest writes
// whatever is still missing from the whole-grant sources, the way
// Engine.Write would. A stream writes every byte once: a range that
// overlaps one written before is refused, before anything is sent.
//
// # Integrity
//
// The writer sums each destination extent with crc32c (internal/crc32c:
// VPCLMULQDQ folding, AVX-512 or AVX2, where the core has it: with AVX-512
// about twice the speed of the SSE4.2 CRC32 instruction in cache and three
// to four times from memory; else hash/crc32's SSE4.2/ARMv8 instructions).
// tcp: it sends 1 MiB per writev and sums each batch right after the
// kernel copied it, while it is in cache (the manifest is needed only by the
// commit). A tcp receiver sums the data as it lands, chunk by chunk right
// after each read. inproc: one pass (crc32c.CopyUpdate) copies each chunk
// and yields the crc for both the writer's manifest and the receiver's
// landing: in one process they are the same bytes, the case shm's
// receiver also trusts. shm: the writer copies into the mapped destination with
// crc32c.CopyUpdate, which sums the bytes from the registers that store
// them (one pass over memory, as fast as the copy alone), so the manifest
// certifies what landed. One goroutine copies (the copy is bound by memory
// bandwidth; docs/scaling.md has the figures). Writers add the bytes they
// copied to the grant's slot, and the receiver checks that count at commit.
// It takes the writer's sums as they are: a shm writer maps the receiver's
// whole regions (same user only: the control socket is mode 0600), so a
// second pass on the receiver would guard only against a faulty writer, at
// the price of reading every byte again, cold; Config.VerifySHM turns that
// pass on (its cost: docs/scaling.md). A commit
// also fails if any extent did not receive exactly its length. Config.SkipCRC (writer and receiver must both set it)
// leaves the crc out when the bandwidth matters more than end-to-end
// integrity; fencing and byte counts still apply. Engine.Stats counts
// grants, bytes and refused frames.
//
// # Transports
//
// Engine.Connect picks, in order, inproc (the peer engine lives in this
// process: memcpy), shm (same Host: the writer maps the receiver's region
// memfds and copies straight into them; commit over a unix socket) and tcp
// (persistent pooled connections, vectored writes straight from the source
// regions, payloads read straight into the destination extents; a write of
// 2 MiB or more is striped in equal byte ranges over up to Config.TCPLanes
// connections, each lane but one ending with a flush that the receiver
// answers once its frames have landed, and the last lane commits after
// every flush was answered; an extent two lanes share is summed piece by
// piece on each side and the sums joined in order, crc32c.Combine), restricted
// to what both engines serve, with ucx (UCX active messages, ucx_linux.go)
// before tcp when both serve it. ucx is opt-in: only builds with -tags ucx
// (linux, cgo, libucx) have it (others refuse it with ErrUnsupported
// wrapping ucx.ErrUnavailable), and it is never in the default Transports,
// so an engine serves it only where the operator named it; auto never
// picks it. Its writer sends each piece as messages of up to 8 MiB, eight
// in flight, whose headers are data frame headers; the receiver admits
// each as a landing (the checks of a tcp data frame) and UCX pulls the
// payload into a staging buffer itself (cma: process_vm_readv by the
// receiver; tcp: fragments the receiver copies out), which the receiver
// copies into the destination, so its fence is landings; commits, flushes and hellos are header-only messages answered
// by a reply message to the writer's own worker. Descriptor.UCXAddr
// carries the worker address. The choice is logged with slog and reported by
// Engine.TransportFor; a transport that fails to connect is logged as a
// warning with the reason before the next is tried.
//
// # Device memory
//
// RegisterDevice registers a CUDA allocation (internal/cuda's Arena) as a
// region; grants, Forbid and every check above are offsets and apply
// unchanged, so reserved rows are refused in device memory as in host
// memory. tcp stages device bytes through pinned double buffers on either
// end; inproc copies through the driver; shm is not used with device
// regions; cuda-ipc (same host, same IPC namespace, the writer's device
// visible to the receiver, preferred by Connect after inproc) carries tcp's
// frames plus a pull frame: the receiver opens the writer's exported
// allocation once (cached) and copies device to device itself, as a
// landing counted in flight, so the fence is tcp's. device.go has the
// details; docs/gpu-memory.md the plan for GPUDirect RDMA.
//
// # Wire format
//
// Frames (tcp, and the shm control socket) share a 64-byte little-endian
// header: magic "HOF1", type, flags and reserved bytes (zero), an index (data:
// extent index; commit: extent count; reply/abort: status code; hello:
// version), grant id, epoch, token, offset and payload length. Types:
//
//	hello   writer -> receiver "from\nto", answered by hello (tcp: with a
//	        third line naming optional frames it accepts, "flush"; a writer
//	        stripes only over a receiver that announced it. shm: with the
//	        memfds of the slot table and the regions, by SCM_RIGHTS)
//	data    writer -> receiver: payload lands at offset of extent index
//	commit  writer -> receiver: count x (bytes u64, crc32c u32)
//	abort   writer -> receiver: give the grant up with a status code
//	flush   writer -> receiver (tcp): end of one lane of a striped write
//	reply   receiver -> writer: status code and message for a commit, abort
//	        or flush
//
// A refused data frame's payload is skipped and the refusal is reported in
// the commit's reply; a malformed frame is answered with a reply and the
// connection is closed. Small frames arrive through a 64 KiB read buffer
// (many per read(2), one copy out of it); payloads longer than the buffer are
// read straight into the destination, up to 256 KiB per read(2). The writer
// sends headers and payloads with writev straight from the source memory,
// up to 1024 vectors and 1 MiB per call (4 MiB without crc).
//
// # Caller's duties
//
// Receiver (decode):
//
//  1. New, then Register each arena once; Forbid the reserved rows (ADP
//     dummy, padding) so no grant can ever name them.
//  2. Publish Descriptor to peers through the control plane.
//  3. Per request: OpenGrant over the destination runs with a deadline and
//     send Ticket to the writer.
//  4. Wait (or select on Done). Only a nil error means the bytes are all
//     there and verified; then the request may be scheduled.
//  5. On cancel, timeout or a failure reported by the writer: Revoke. It
//     returns within about Config.FenceWait. Once Done is closed the
//     destination may be freed and reused; after Revoke returned that is at
//     once, unless Grant.Quarantined: then keep the destination out of
//     every pool until Done closes. OpenGrant refuses (ErrBusy) bytes that
//     an open or quarantined grant holds.
//  6. Optionally watch OnWriterGone: a writer that closed its last
//     connection was killed or closed its engine, or something between the
//     hosts reset every connection (then it connects again for its next
//     write); fail over what waits for it instead of waiting for its
//     deadline, after checking on another channel where that matters. A
//     live writer always keeps a connection, and the receiver's own cuts
//     are not reported.
//  7. Close at shutdown: open grants are revoked, regions unmapped; Region.Bytes
//     must not be used afterwards.
//
// Writer (prefill):
//
//  1. New, Register the source arenas, and Connect to each peer at
//     discovery, so the first request pays no handshake.
//  2. Per request: Write(ctx, peer, ticket, sources). Keep the source bytes
//     unchanged until Write returns. A *RemoteError carries the receiver's
//     refusal; test it with errors.Is (ErrRevoked, ErrDeadline,
//     ErrStaleEpoch, ErrManifestMismatch, ...).
//  3. Report the outcome on the control plane; the receiver decides from its
//     own Grant.Wait, never from the writer's word alone.
//
// # Concurrency and locks
//
// Engine, Grant and Region methods are safe for concurrent use. Lock order:
// inprocMu -> Engine.mu -> Region.mu, Engine.mu -> devState.mu; Grant.mu
// is never held while taking Engine.mu (finish releases it first);
// shmLink.mu -> shmLink.copying. No lock is held across network IO except
// shmLink.mu around one commit exchange; devState.mu is held across the
// device calls that close a gone writer's cuda-ipc mappings. Every
// goroutine (accept loops, one per connection) is owned by a server and
// stopped by Engine.Close.
package rdma
