// Package transfer is handoff's control plane: the per-request protocol that
// moves a request's cache (its prompt's KV runs and its Mamba row) from a
// prefill worker into a decode worker, over NATS for control and package rdma
// for the bytes.
//
// # Layers
//
//   - package wire (transfer/wire): every NATS message (msgpack maps,
//     explicit keys, version "v"; tokens, extents and manifests packed as
//     little-endian bytes), its Encode and Decode functions (encoders refuse
//     a message over the server's max payload with ErrPayloadTooLarge
//     before anything is published, decoders a bad one with ErrBadMessage),
//     and Subject, which builds every subject:
//     <prefix>.<ns>.prefill (queue group "prefill": any free worker takes it),
//     <prefix>.<ns>.inst.<id>.prefill (one instance, for targeted retries),
//     <prefix>.<ns>.inst.<id>.cancel and <prefix>.<ns>.cancel (cancels).
//     It does no IO: the drivers below send and receive its bytes.
//   - package session (transfer/session): RecvSession and WriteSession, pure
//     state machines (events in, actions out, time passed in; no IO, no
//     goroutines, held to it by its TestDeps). One terminal state per
//     session; events after it are ignored, so cleanup is idempotent.
//   - the drivers, which execute the sessions' actions on NATS and rdma:
//     decoder.go (the Decoder's lifecycle: its inbox, reconnect notices,
//     registry watch, reply routing) and decoder_handoff.go (one Handoff's
//     driver: its session, grant, sends and wake-ups); writergone.go (a
//     writer whose data path closed is checked on the control plane);
//     load.go (the decoder's view of each prefill instance's load);
//     prefiller.go (the Prefiller's lifecycle: intake, cancels, drain),
//     prefiller_task.go (one request's driver) and prefiller_executor.go
//     (the seam to the worker that computes: PrefillExecutor);
//     layerwise.go (a prefill streamed layer by layer); msgbuf.go (the
//     message buffers the drivers reuse); trace.go (OpenTelemetry spans and
//     header propagation); errors.go (the sentinels and their codes).
//   - registry.go: the instance directory in a JetStream KV bucket.
//   - rank.go: CacheExtents, where one request's cache lives in registered
//     memory, and RankRegions, which resolves the resources a request holds
//     in a rank's hybrid.Manager to extents of its two registered regions;
//     reshard.go: the pieces a write is cut into when the two sides' TP
//     sizes differ.
//
// # One handoff (happy path: one NATS request and its reply)
//
//  1. The caller (the decode worker's scheduler) prepares the request's KV
//     blocks and one real Mamba row and resolves them to a CacheExtents
//     (RankRegions.Resolve). Decoder.Handoff refuses dummies (id 0, padding
//     sentinels: session.IsDummyID), opens an rdma grant over exactly those
//     extents and publishes a wire.PrefillRequest (tokens, sampling,
//     deadline, layout fingerprint, its rdma descriptor, the grant's
//     ticket) to the queue group.
//  2. A Prefiller checks the request (dummy id, layout fingerprint, deadline:
//     refused by name before any byte moves), admits it through the
//     PrefillExecutor or refuses at once (ErrCapacityRefused), runs prefill,
//     checks the source byte counts against the destination's, writes the KV
//     runs and the Mamba row into the grant with rdma.Engine.Write (which
//     commits with a manifest: bytes and crc32c per extent) and, once the
//     commit was accepted, replies with the first token and the manifest, then
//     releases its lease.
//  3. The Decoder accepts only when the reply succeeded, the grant's commit
//     arrived and both manifests agree with the granted sizes. The request
//     is ready to decode from its destination; the caller frees the blocks
//     and row when it finishes.
//
// The commit travels on the data plane, not on NATS, so a handoff costs one
// NATS request-reply; cancels are published only on failure, heartbeats are
// periodic and per instance, not per request.
//
// # Failures
//
// Every Handoff error wraps one sentinel (ErrNoPrefillWorker, ErrTimeout,
// ErrPayloadTooLarge, ErrLayoutMismatch, ErrCapacityRefused, ErrPeerFailed,
// ErrCancelled, ErrDummyRequest, ErrIntegrity, ErrPrefillFailed, ErrClosed);
// refusals from the peer are *RemoteError, whose Is matches the sentinel of
// its Code. On any failure the decoder publishes a cancel if a request is
// outstanding, revokes the grant (after Revoke returns no byte lands, so a
// late write or commit is refused by the data plane) and returns: the caller
// frees the blocks and row then. A retry happens only within the deadline
// and DecoderConfig.MaxAttempts, and is one of two kinds. Each rule below
// names the session scripts (transfer/session/testdata) that pin it.
//
//   - Plain resend, when nothing can have been written: a capacity refusal
//     (recv_capacity_refused_then_served) or no responder. Sends that found
//     no responder spend no attempt; they are bounded by NoResponderWait
//     (recv_quiet_then_served, recv_quiet_past_wait,
//     recv_quiet_then_write_failure_retried, recv_no_responders_*).
//   - Fenced retry, when the serving instance may have written: the
//     decoder publishes it a cancel, revokes the grant (its late writes and
//     commit are refused from then on), opens a fresh grant over the same
//     blocks and row, and sends the next attempt to another instance where
//     it knows one. The cases follow.
//   - Fenced, on a death: the serving instance is reported dead before a
//     commit was accepted:
//     its registry entry expired or was taken over by a new incarnation
//     (see Registry), or, at once, every one of its data-path connections
//     to this decoder closed (rdma.Engine.OnWriterGone, which a killed
//     worker's kernel triggers) and its micro service did not answer a
//     ping; one that answered is pinged every 200 ms until it connects
//     again, so its death in that window is known as fast (watchWriters).
//     An instance reported dead has its replies ignored and is never asked
//     again through the queue group (which could route back to it): with
//     no other live instance known the request fails with ErrPeerFailed
//     (recv_peer_death_*, recv_peer_gone_after_commit_*).
//   - Fenced, on a failed write: the grant fails because the writer's
//     connection closed mid-write, or
//     the serving instance replies peer_failed first (its own write failed
//     so; the receiver's end may learn of the cut later, or never): it may
//     only be partitioned, so it is excluded but not taken for dead, and
//     may take the retry from the queue group when it is the only one
//     (recv_peer_failed_reply_*, recv_peer_death_data_path*).
//   - Fenced, on a drain cut short: the serving instance's Shutdown ran
//     out of time and aborted the request, maybe mid-write, replying
//     closed: retried as after a failed write (recv_closed_reply_retried).
//   - Fenced, at the queue group: a request outstanding there names no
//     instance until its reply. After a failed write on the only instance
//     the retry goes there and may come back to that instance, so the
//     death of an instance the request excluded is taken as the serving
//     one's: it is retried fenced as above, not left waiting for its
//     deadline. Other deaths leave it alone: one death must not re-grant
//     every request at the group (recv_queue_group_death*).
//   - Fenced, after a lost control connection: see below
//     (recv_control_lost_*).
//
// A NATS connection that drops loses what it carried: a request routed to a
// worker, or a reply published while the decoder was away. The decoder notes
// its own reconnects (nats.Conn.StatusChanged) and a prefiller publishes
// <prefix>.<ns>.inst.<id>.reconnected after its own; every handoff still
// waiting for an answer from that side is resent at once, fenced the same way
// but without excluding the instance (it is alive). A request the queue group
// has no responder for (workers restarting, or not yet resubscribed after a
// reconnect) is sent again after 50 ms, doubling to 1 s, for up to
// DecoderConfig.NoResponderWait (5 s) within its deadline. Deadlines travel
// as the time left (wire.PrefillRequest.Budget), and the prefiller turns
// them into its own monotonic deadline on receipt: no two hosts' wall
// clocks are compared. A grant the decoder revokes while a live shm writer is stopped
// inside a copy is quarantined (rdma.Grant.Quarantined): the handoff fails
// at once with a *QuarantinedError, and the caller frees the destination
// only when it is Released.
//
// The prefiller stops on a cancel, on the deadline, on a failed write
// (receiver revoked or died) or when the decode instance leaves the
// registry; it releases its lease only after the step in flight returned.
//
// # Registry
//
// Every Decoder and Prefiller announces itself in the JetStream KV bucket
// <prefix>_<ns> (key "<role>.<id>": rdma descriptor, layout fingerprint,
// capacity), refreshed every Heartbeat and expiring after TTL; a watcher
// counts an entry live for TTL after it received it (its own monotonic
// clock). The bucket is kept in memory, replicated 3 ways on a cluster
// (RegistryConfig.Replicas), so a lone or restarted NATS server has lost it:
// announcers recreate it on a failed heartbeat and watchers, which check it
// every heartbeat, watch the new one (entries reappear within a heartbeat or
// two). A watch whose consumer fell silent (a stream leader died) while the
// bucket moved on is restarted. An instance restarted under the same id (a
// pod keeps $POD_NAME) before its entry expired keeps its key, but its
// entry names another micro service, or for a decode instance another
// reply inbox (wire.Instance.Service, one per process): watchers take that
// for the old incarnation's death, then see the new one, usable at once. A
// decoder tells the handoffs served by the old one (a fenced retry, as for
// any death), not those it addressed to the new one; a prefiller stops the
// old one's requests, not those whose replies go to the new one's inbox.
// An entry whose value names another id or role than its key is refused.
// Decoders watch
// prefill instances (targeted retries; a watched instance that disappears
// moves the handoffs addressed to it to another instance, fenced as above, or
// fails them with ErrPeerFailed; a request taken through the queue group
// names its instance only in the reply, so any death moves it, as above);
// prefillers watch decode
// instances, pre-connect their data plane to each one as it appears (so no
// handoff pays the connection set-up) and stop work for one that disappears.
// A prefiller that shuts down stays registered until its requests are done
// but re-announces itself draining at once, and decoders stop addressing it;
// a request that still reaches a starting or draining prefiller is refused as
// capacity, so it is retried elsewhere. Its micro service stops taking
// requests at once, but until they are done it still hears cancels and its
// service's ping is answered (metadata "draining"), so a data-path reset
// during a rolling update takes no draining worker for dead. A cancel names its decoder: request
// and grant ids are unique per decoder only. Prefill workers are also NATS
// micro services (wire.ServiceName), so `nats micro ls|info|stats` lists them.
//
// # Symmetry
//
// The sessions are named by data-path role, not by serving role:
// session.RecvSession opens a grant and accepts a commit, session.WriteSession
// writes into a grant. Handing
// a finished conversation's state back from decode to a prefill worker
// (multi-turn continuation without recompute) is the same exchange with the
// roles swapped: the prefill side runs a RecvSession over a destination it
// prepared and a grant, the decode side a WriteSession over the request's
// extents, with a
// new request message on its own subject. The messages' parts (wire.Peer,
// rdma's Ticket, Manifest and Extent) and both machines are reused
// unchanged.
//
// # Caller duties
//
//  1. Build one RankRegions per ADP rank; register its arenas as rdma
//     regions first. NewRankRegions forbids the reserved rows at the data
//     plane.
//  2. Decode: NewDecoder once per process; Handoff per request from any
//     goroutine, with Request.Dest resolved from the resources the scheduler
//     prepared (hybrid.Manager.Prepare, RankRegions.Resolve); free them once
//     Handoff returned: on failure the grant is already revoked then, so
//     nothing can land in them any more (a *QuarantinedError: once it is
//     Released); on success when the request finishes. Close on exit. Set
//     DirectFirst to address a chosen instance from the first attempt: the
//     decoder then knows its peer at once and fails fast if it disappears.
//  3. Prefill: implement PrefillExecutor (Admit must not block; AdmittedJob.Prefill
//     must honour ctx and returns the source, RankRegions.Resolve of the
//     resources it holds; Release is called once, after every use of the
//     extents); NewPrefiller, Start, Shutdown on exit.
//
// Lock order: Prefiller.mu, Decoder.mu and Registry.mu are leaves: no IO and
// no other lock is taken while one is held.
package transfer
