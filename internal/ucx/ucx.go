package ucx

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"
)

// Errors. A failed operation's error is a Status, or wraps one, so that
// errors.Is(err, ucx.ErrRejected) and errors.As(err, &status) both work.
var (
	// ErrUnavailable is what New returns in a build without UCX: not linux,
	// CGO_ENABLED=0, or without the ucx build tag. It wraps
	// errors.ErrUnsupported.
	ErrUnavailable = fmt.Errorf("ucx: not built in (needs linux, cgo and -tags ucx): %w", errors.ErrUnsupported)

	// ErrClosed is returned by every method called after Close began, and
	// completes the operations and receives still in flight when Close
	// destroyed the worker.
	ErrClosed = errors.New("ucx: worker closed")

	// ErrLeaked completes a receive that was still in flight when Close
	// gave up on it (one that came by an endpoint UCX made, whose sender
	// stopped): the worker was left allocated and never progressed again,
	// and an RDMA read already posted may still land in the destination,
	// which stays UCX's: never reuse it. It wraps ErrClosed.
	ErrLeaked = fmt.Errorf("%w: receive left in flight; its destination stays UCX's", ErrClosed)

	// ErrPeerFailed wraps the status UCX reported for an endpoint whose
	// peer failed (the error handler fired): sends on it, and the error
	// given to Config.OnPeerError.
	ErrPeerFailed = errors.New("ucx: peer failed")

	// ErrUnknownEndpoint is returned for an EndpointID this worker never
	// made, or one already closed.
	ErrUnknownEndpoint = errors.New("ucx: unknown endpoint")

	// ErrOwner is returned by a blocking method called from a callback
	// (Config.Admit, an Admission's Done, Config.OnPeerError): those run on
	// the worker's owner goroutine, which the method would wait for.
	ErrOwner = errors.New("ucx: blocking call from the worker's own goroutine")

	// ErrHeaderTooLarge is returned by Post for a header longer than
	// Worker.MaxHeader.
	ErrHeaderTooLarge = errors.New("ucx: header exceeds the worker's maximum")
)

// Status is a UCX status code (ucs_status_t) other than UCS_OK, as an error.
type Status int8

// The status codes this package's callers test for (ucs/type/status.h).
const (
	ErrIOError         Status = -3  // UCS_ERR_IO_ERROR: a cma peer that exited mid-GET
	ErrInvalidParam    Status = -5  // UCS_ERR_INVALID_PARAM
	ErrUnreachable     Status = -6  // UCS_ERR_UNREACHABLE: no transport reaches the peer
	ErrTruncated       Status = -9  // UCS_ERR_MESSAGE_TRUNCATED: destination shorter than the payload
	ErrCanceled        Status = -16 // UCS_ERR_CANCELED: the endpoint was closed by force
	ErrTimedOut        Status = -20 // UCS_ERR_TIMED_OUT
	ErrRejected        Status = -23 // UCS_ERR_REJECTED: the receiver's Admit refused the message
	ErrNotConnected    Status = -24 // UCS_ERR_NOT_CONNECTED
	ErrConnectionReset Status = -25 // UCS_ERR_CONNECTION_RESET
	ErrEndpointTimeout Status = -80 // UCS_ERR_ENDPOINT_TIMEOUT: keepalive or a tcp peer that vanished
)

var statusNames = map[Status]string{
	-1: "no pending message", -2: "no resources are available to initiate the operation",
	-3: "input/output error", -4: "out of memory", -5: "invalid parameter",
	-6: "destination is unreachable", -7: "address not valid", -8: "function not implemented",
	-9: "message truncated", -10: "no progress", -11: "provided buffer is too small",
	-12: "no such element", -13: "failed to connect some of the requested endpoints",
	-14: "no such device", -15: "device is busy", -16: "request canceled",
	-17: "shared memory error", -18: "element already exists", -19: "index out of range",
	-20: "operation timed out", -21: "user-defined limit was reached", -22: "unsupported operation",
	-23: "operation rejected by remote peer", -24: "endpoint is not connected",
	-25: "connection reset by remote peer", -80: "endpoint timeout",
}

func (s Status) Error() string {
	if n, ok := statusNames[s]; ok {
		return "ucx: " + n
	}
	switch {
	case s <= -40 && s >= -59:
		return fmt.Sprintf("ucx: link failure (%d)", int(s))
	case s <= -60 && s >= -89:
		return fmt.Sprintf("ucx: endpoint failure (%d)", int(s))
	}
	return fmt.Sprintf("ucx: status %d", int(s))
}

// EndpointID names an endpoint of one Worker, from Connect. IDs start at 1
// and are never reused by a worker.
type EndpointID uint64

// Token is what the receiver files a receive under (Admission.Token), and
// what Fence waits on: a grant id, for example. Its values are the
// caller's; the worker only counts the receives in flight per token.
type Token uint64

// Message is what Config.Admit is shown of an arriving active message.
type Message struct {
	// Header is the sender's header. It points into UCX's memory and is
	// valid only until Admit returns: copy what you keep.
	Header []byte
	// Length is the payload's length in bytes.
	Length int
	// Rendezvous says the payload has not moved yet: an accepted message's
	// bytes are pulled into the destination by this worker after Admit
	// returns (a GET, or fragments this worker copies out), and a refused
	// one's never move. Otherwise the payload came inline (eager) and is
	// copied before Admit's caller returns.
	Rendezvous bool
}

// Admission is Config.Admit's acceptance of a message.
type Admission struct {
	// Dest receives the payload's Length bytes (Dest[:Length]); a shorter
	// Dest refuses the message with ErrTruncated. It must stay valid and
	// untouched until Done is called. Go memory is pinned for that long;
	// memory from mmap is the usual case.
	Dest []byte
	// Token files the receive: Fence(Token) waits for it.
	Token Token
	// Done, when not nil, is called once on the owner goroutine when the
	// receive ended: nil when all Length bytes landed, else the failure
	// (a Status such as ErrEndpointTimeout or ErrIOError when the sender
	// died, ErrClosed when the worker was closed first). After Done no
	// byte of this message lands. It must not block.
	Done func(err error)
}

// AdmitFunc decides an arriving message: an Admission to receive it, or an
// error to refuse it. A refused rendezvous message never moves and its
// sender's operation fails with ErrRejected (or with the Status the error
// is, if it is one); a refused eager message is dropped (its sender has
// already completed). Admit runs on the owner goroutine inside UCX's
// progress: it must not block, nor call the Worker's blocking methods.
type AdmitFunc func(m Message) (Admission, error)

// Config configures a Worker. The zero value is a send-only worker with
// the package's UCX defaults.
type Config struct {
	// Name names the worker in UCX's logs.
	Name string
	// Admit decides every arriving message. Nil refuses them all.
	Admit AdmitFunc
	// OnPeerError, when not nil, is called on the owner goroutine when the
	// error handler of one of this worker's endpoints fires (the peer
	// died, keepalive timed out, the connection was reset). The endpoint
	// is then closed by force; its operations fail. err wraps
	// ErrPeerFailed and the Status. It must not block.
	OnPeerError func(ep EndpointID, err error)
	// Options are UCX settings, named without the UCX_ prefix
	// ("TLS": "tcp"), passed to ucp_config_modify as given, in place of
	// the Defaults of the same name. An option the environment sets
	// (UCX_TLS=...) is left to the environment: the operator wins. UCP and
	// global settings work by their documented names; a transport's
	// settings only by a name that depends on the UCX release (envKeys),
	// so set those in the environment.
	Options map[string]string
	// MaxSleep bounds each sleep of the owner goroutine while it waits for
	// UCX's event fd, as a guard against a missed wakeup (NIXL uses 1 ms
	// for one it saw). Zero means 100 ms; an idle worker wakes that often
	// and finds nothing to do, at a cost of microseconds each time.
	MaxSleep time.Duration
}

// Defaults are the UCX settings New applies unless the environment or
// Config.Options set them (see the package doc).
func Defaults() map[string]string {
	return map[string]string{
		// Rendezvous pulls: the receiver GETs where a GET lane exists, and
		// otherwise asks for fragments it copies out itself. Without it a
		// sender with rma_bw lanes PUTs into the address the receiver's RTR
		// names. Both processes need it.
		"RNDV_SCHEME": "get_zcopy",
		// Drops tcp's PUT capability, so no tcp lane ever lets a peer write
		// to an address of its choosing (a transport setting: see envKeys).
		"TCP_PUT_ENABLE": "n",
		// Sends copy into UCX's buffers instead of handing the socket the
		// caller's memory: UCX's tcp transport (1.13 up to master)
		// completes a zero-copy send twice when the peer resets the
		// connection while the send is part-way through the socket
		// (uct_tcp_ep_sendv calls uct_tcp_ep_handle_send_err, whose purge
		// completes the send, then completes it again), an assertion
		// failure that aborts the process in Debian's build (seen in 1 of
		// 60 -race runs of TestCloseIsClean, none in 270 with this) and a
		// use-after-free without assertions. It costs tcp about 30 % of
		// its loopback throughput and nothing where the receiver GETs
		// (cma, rc, dc): rendezvous payloads then never go by AM
		// fragments.
		"ZCOPY_THRESH": "inf",
		// tcp's send segments, 8 KiB by default: with sends copied into
		// UCX's buffers (ZCOPY_THRESH above) a rendezvous payload goes as
		// AM fragments of one segment each, and at 8 KiB the per-fragment
		// work of both workers bounded handoff-bench's ucx run at about
		// half of what 64 KiB fragments (zero copy's size) reach: 0.63 to
		// 0.78 GB/s against 1.29 to 1.43 (1 MiB extents, loopback, with
		// TCP_RX_SEG_SIZE=256K). A transport setting (envKeys).
		"TCP_TX_SEG_SIZE": "64K",
		// tcp's receive buffer per connection (64 KiB by default): room
		// for several 64 KiB fragments per read.
		"TCP_RX_SEG_SIZE": "256K",
		// The UCX_* variables a deployment sets for one transport (for
		// example UCX_CMA_MEMORY_INVALIDATE under UCX_TLS=tcp) would each
		// log a warning at worker creation.
		"WARN_UNUSED_ENV_VARS": "n",
	}
}

// envKeys are the defaults that New puts in the process environment
// (UCX_<key>, when unset) instead of passing them to ucp_config_modify.
// They are transport (UCT) settings: ucp_config_modify caches those and
// applies them when it opens each transport, but under a name that changed
// between releases (1.13 matches the bare field name, "PUT_ENABLE", and
// accepts "TCP_PUT_ENABLE" with UCS_OK while ignoring it, measured; 1.19
// wants the prefixed name), whereas UCX_TCP_PUT_ENABLE means the same to
// every release.
var envKeys = map[string]bool{"TCP_PUT_ENABLE": true, "TCP_TX_SEG_SIZE": true, "TCP_RX_SEG_SIZE": true}

// settings merges Defaults, the configured options and the environment
// (lookup) into what New applies: modify for ucp_config_modify, env for
// the process environment (full UCX_ names), each sorted by name. A setting
// whose UCX_<NAME> the environment holds is left out (ucp_config_read takes
// it from there), and an option replaces the default of its name.
func settings(opts map[string]string, lookup func(string) (string, bool)) (modify, env [][2]string) {
	inEnv := func(k string) bool { _, ok := lookup("UCX_" + k); return ok }
	given := map[string]bool{}
	for k, v := range opts {
		k = strings.TrimPrefix(strings.ToUpper(k), "UCX_")
		given[k] = true
		if !inEnv(k) {
			modify = append(modify, [2]string{k, v})
		}
	}
	for k, v := range Defaults() {
		switch {
		case given[k] || inEnv(k):
		case envKeys[k]:
			env = append(env, [2]string{"UCX_" + k, v})
		default:
			modify = append(modify, [2]string{k, v})
		}
	}
	sort.Slice(modify, func(i, j int) bool { return modify[i][0] < modify[j][0] })
	sort.Slice(env, func(i, j int) bool { return env[i][0] < env[j][0] })
	return modify, env
}

// Stats counts a worker's activity since New. Every field but Endpoints
// only grows.
type Stats struct {
	Sleeps        uint64 // waits on UCX's event fd
	SleepTimeouts uint64 // of which ended by MaxSleep, not an event
	Progress      uint64 // ucp_worker_progress calls
	Sent          uint64 // Post operations that completed OK
	SendFailed    uint64 // Post operations that failed
	Admitted      uint64 // messages Admit accepted
	Refused       uint64 // messages refused (by Admit, or a short Dest)
	Received      uint64 // receives whose bytes all landed
	ReceiveFailed uint64 // receives that ended in an error
	PeerErrors    uint64 // endpoint error-handler calls
	// Endpoints made by Connect and not yet released: open ones, and those
	// closed when their peer failed until CloseEndpoint forgets them (one
	// closed by CloseEndpoint or by Abort's cut is released once UCX
	// completed its close): what the worker keeps for its caller.
	Endpoints int64
}

// CloseMode says how CloseEndpoint ends an endpoint.
type CloseMode int

const (
	// CloseFlush completes the endpoint's outstanding operations first
	// (ucp_ep_close_nbx in flush mode); it needs the peer to progress.
	CloseFlush CloseMode = iota + 1
	// CloseForce releases the endpoint at once (UCP_EP_CLOSE_FLAG_FORCE):
	// its operations in flight fail with ErrCanceled. That completion
	// does not stop a receiver already pulling a payload (a cma GET runs
	// to its end): it may still read the source for a while, and a source
	// reused meanwhile reaches it mixed, which the receiver's checksum
	// catches. The peer sees the endpoint fail.
	CloseForce
)

// workerAPI and opAPI are the Worker's and Op's methods, the same in every
// build: the compiler checks that the stub keeps up with the binding.
type workerAPI interface {
	Address() []byte
	MaxHeader() int
	Stats() Stats
	Connect(ctx context.Context, addr []byte) (EndpointID, error)
	EndpointInfo(ctx context.Context, ep EndpointID) (string, error)
	CloseEndpoint(ctx context.Context, ep EndpointID, mode CloseMode) error
	Post(ep EndpointID, header, payload []byte) (*Op, error)
	Send(ctx context.Context, ep EndpointID, header, payload []byte) error
	Fence(ctx context.Context, tok Token) error
	Abort(ctx context.Context, tok Token) error
	Close() error
}

type opAPI interface {
	Done() <-chan struct{}
	Err() error
	Wait(ctx context.Context) error
}

var (
	_ workerAPI = (*Worker)(nil)
	_ opAPI     = (*Op)(nil)
)
