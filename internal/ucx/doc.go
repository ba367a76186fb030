// Package ucx binds UCX's UCP active messages for a receiver-driven data
// path: a writer sends each contiguous run as one message whose header
// names what it is; the receiver's admission function sees the header
// first and either pulls the payload into a destination it chooses or
// refuses it. A writer never learns a destination address or key, and a
// fence (Fence) says when every receive filed under a token has ended, so
// that nothing lands after a revoke. Package rdma builds its ucx transport
// on this.
//
// # Build
//
// The binding is cgo behind the ucx build tag (the *_ucx.go files and a small C
// shim, shim.c): go build -tags ucx, with gcc and UCX's headers and
// libraries (scripts/install-ucx installs Debian's libucx0, libucx-dev and
// ucx-utils; UCX 1.13.1 on Debian 12; another prefix through CGO_CFLAGS and
// CGO_LDFLAGS). Other builds (CGO_ENABLED=0, no tag, not linux) get a stub
// whose New returns ErrUnavailable, which wraps errors.ErrUnsupported; the
// types, errors and Defaults are the same in both.
//
// Why cgo and not purego (which this module uses for CUDA): UCX calls back
// into the program on the hot path (the AM handler for every message, the
// completion and error handlers), and purego's callbacks are a fixed pool
// of 2000 trampolines dispatched by reflection under a mutex; a cgo call
// costs 50-90 ns and no allocation, a purego call 0.15-1.1 µs and 1-3.
// Through cgo the real headers lay out UCP's parameter structs (which grow
// between releases, with inline functions such as ucp_init) instead of a
// Go mirror that would drift from 1.13 to 1.20. And linking libucs puts
// Go's signal handlers in front of UCX's: with purego's dlopen after the
// Go runtime started, UCX's SIGSEGV handler turned a Go nil dereference
// into a crash unless UCX_ERROR_SIGNALS was emptied first; linked, a
// recoverable panic stays recoverable with nothing set
// (TestGoPanicStillRecovers), and a fault inside UCX still reaches UCX's
// handler through Go's forwarding. The price is gcc and libucx-dev where
// the tag is built; the default build stays pure Go.
//
// # Threads
//
// A Worker is one UCP context and one worker in UCS_THREAD_MODE_SINGLE,
// owned by one goroutine locked to its OS thread: every UCP call, and so
// every callback, runs there. Other goroutines hand it work through a
// queue and wake it with an eventfd. When UCX has nothing to do the owner
// arms the worker (ucp_worker_arm) and sleeps in poll(2) on the worker's
// event fd (ucp_worker_get_efd, which also carries UCX's keepalive timer)
// and the eventfd, at most Config.MaxSleep (100 ms) at a time against a
// missed wakeup: an idle worker costs about 10 wakeups a second and ~1 ms
// of CPU (TestIdleDoesNotSpin). Admit, Done and OnPeerError run on the
// owner and must not block; the blocking methods called from them return
// ErrOwner instead of deadlocking. Every blocking method takes a context.
//
// # Sending
//
// Connect makes an endpoint to a peer's Address (carried by the control
// plane; it must come from a peer's Address: UCX parses it) in peer
// error-handling mode, UCP_ERR_HANDLING_MODE_PEER, with an error handler:
// a peer that dies, resets its connection or misses keepalive
// (UCX_KEEPALIVE_INTERVAL, 20 s by default; a killed process on a live
// host shows at once, as its connection closes) fails the endpoint, which
// the worker then closes by force, failing its operations with errors
// wrapping ErrPeerFailed, and reports through Config.OnPeerError. Peer
// mode admits only transports that detect peer failure: tcp and cma do,
// posix and sysv shared memory do not unless UCX_POSIX_ERROR_HANDLING /
// UCX_SYSV_ERROR_HANDLING are set.
//
// Post sends a header (up to MaxHeader, about 8 KiB) and a payload with
// ucp_am_send_nbx, by rendezvous for any payload (UCP_AM_SEND_FLAG_RNDV):
// the payload moves only when the receiver asks for it, and a refusal
// reaches the sender as ErrRejected. The header and payload must not
// change until the Op is done. A send's completion is not delivery: over
// tcp it completes once the fragments are sent, and a receiver may have
// dropped them; only the receiver's own answer (a commit ack) is. A
// receiver that stops progressing holds an Op until its Wait's deadline;
// CloseEndpoint with CloseForce then ends it (ErrCanceled).
//
// # Receiving and fencing
//
// Config.Admit sees each arriving message's header and length before any
// payload byte moves. It returns an Admission (a destination, a Token to
// file the receive under, a Done callback) or an error, which refuses the
// message. An admitted rendezvous payload is pulled by this worker into
// the destination with ucp_am_recv_data_nbx: by GET where the transport
// has one (cma: this process's process_vm_readv), otherwise by asking for
// fragments that this worker copies out itself (tcp). Either way bytes land
// only through this worker's own progress. An eager payload (small
// messages from senders that do not force rendezvous) is copied before
// Admit's caller returns.
//
// Fence(tok) returns when every receive filed under tok by an admission
// that ran before the call has ended, its Done included: landed, or failed
// with the status UCX gave it. That is the one fence that holds on every
// UCX transport; UCX cannot cancel a receive (ucp_request_cancel does
// nothing to AM receives), and unmapping memory or closing an endpoint
// does not stop a GET in flight. The revoke recipe: make Admit refuse tok
// (a dead grant), then Fence(tok); when Fence returns nil nothing of tok
// is in flight and nothing more will land. A receive whose sender froze
// mid-transfer over tcp holds Fence; Abort(tok) then force-closes the
// connections tok's receives came by, which ends those receives with
// ErrCanceled. It closes only the receiver's own endpoints (senders set
// UCP_AM_SEND_FLAG_REPLY, and a receiver that connected back to a sender
// before it sent gets its messages by that endpoint: UCX pairs the two);
// one UCX made for a peer can be destroyed by UCX at any time, so its
// handle is never kept. A receive that came by such an endpoint (one that
// arrived before the receiver connected back), or by one of ours already
// closing in flush mode (UCX closes an endpoint once), cannot be cut.
// TestAbortEndsStalledReceive: nothing lands afterwards, even once the
// sender resumes. A sender that dies ends its receives in error within
// milliseconds (tcp: ErrEndpointTimeout; cma: ErrIOError).
//
// Close force-closes every endpoint, which cuts the receives in flight
// that came by them, waits up to 2 s for UCX to finish, destroys the
// worker and ends what is left with ErrClosed; after Close UCX touches no
// memory it was given. A receive that did not end (it came by an endpoint
// UCX made, from a stopped sender) ends with ErrLeaked instead: the worker
// is then left allocated and the receive's destination stays UCX's.
//
// # Environment
//
// New applies Defaults with ucp_config_modify (or, for transport settings,
// by setting the variable in the process environment before the first
// worker; see envKeys) unless the environment sets the same UCX_ variable:
// an operator's setting wins, and Config.Options override Defaults.
//
//   - UCX_RNDV_SCHEME=get_zcopy in every process: a receiver with a GET
//     lane pulls; without it a sender whose peer advertises rma_bw lanes
//     would PUT into the address in the receiver's RTR.
//   - UCX_TCP_PUT_ENABLE=n: tcp loses its PUT capability, so no tcp lane
//     ever writes where a peer says.
//   - UCX_ZCOPY_THRESH=inf: UCX's tcp transport completes a zero-copy send
//     twice when the peer resets the connection mid-send (an assertion that
//     aborts the sending process in Debian's build; see Defaults), so sends
//     copy through UCX's buffers: about 30 % of tcp's loopback throughput,
//     nothing where the receiver GETs.
//   - UCX_TCP_TX_SEG_SIZE=64K, UCX_TCP_RX_SEG_SIZE=256K: with sends copied,
//     a rendezvous over tcp goes as fragments of one send segment each; at
//     the default 8 KiB the fragments' overhead halved throughput.
//   - UCX_WARN_UNUSED_ENV_VARS=n: variables for transports a deployment
//     does not use (UCX_CMA_* under UCX_TLS=tcp) would each log a warning.
//   - UCX_ERROR_SIGNALS is not needed: see Build.
//
// Settings for the operator: UCX_TLS (tcp; cma,tcp on one host),
// UCX_NET_DEVICES, UCX_KEEPALIVE_INTERVAL, and UCX_CMA_MEMORY_INVALIDATE=y,
// without which cma does not serve peer-mode endpoints and same-host
// rendezvous falls back to tcp fragments (the tests set it). UCX 1.16 and
// later turn the rendezvous scheme into a preference (protocol v2); 1.13 to
// 1.15 obey it.
//
// EndpointInfo returns ucp_ep_print_info's text: the lanes UCX chose (1.13,
// UCX_TLS=cma,tcp between two processes: "lane[0]: 0:tcp/lo.0 ... am
// am_bw#0 keepalive wireup" and "lane[1]: 2:cma/memory.0 ... rma_bw#0").
package ucx
