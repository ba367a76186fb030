package config

import (
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/handoff-io/handoff/internal/cuda"
	"github.com/handoff-io/handoff/internal/envflag"
	"github.com/handoff-io/handoff/mambacache"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/worker"
)

// ErrInvalid wraps every parse and validation error.
var ErrInvalid = errors.New("config: invalid")

// Default ports.
const (
	DefaultHTTPAddr         = ":8000"
	DefaultPrefillAdminAddr = ":9090"
	DefaultDecodeAdminAddr  = ":9091"
	DefaultDataAddr         = ":7400"
	DefaultNATSURL          = "nats://127.0.0.1:4222"
)

// NATS holds the control-plane connection settings.
type NATS struct {
	URL      string
	Creds    string // credentials file (JWT + seed)
	NKey     string // nkey seed file
	User     string
	Password string
	CA       string // CA certificate file
	Cert     string // client certificate file
	Key      string // client key file
}

// Config is a worker's whole configuration.
type Config struct {
	Role           worker.Role
	NATS           NATS
	Namespace      string
	InstanceID     string
	Model          string
	DPSize         int
	TPSize         int // tensor-parallel shards per rank, each with its own pools and regions
	AttentionDP    bool
	MaxBatchSize   int
	TokensPerBlock int
	KVBlocks       int
	QueueSize      int
	DataAddr       string
	DataAdvertise  string
	Transport      string // auto, tcp, shm, inproc, cuda-ipc
	// Memory is where the caches live: host, or cuda (device memory on
	// CUDADevice, an ordinal or a UUID).
	Memory     string
	CUDADevice string
	TCPLanes   int // connections one large tcp write is striped over
	// DataTLS is the tcp data path's mutual TLS (rdma.Config.TLS): CA,
	// certificate and key files, all or none.
	DataTLS        struct{ CA, Cert, Key string }
	AdminAddr      string
	LogLevel       slog.Level
	LogFormat      string // json, text
	DrainTimeout   time.Duration
	RequestTimeout time.Duration
	// RegistryReplicas is the instance registry bucket's replication; 0:
	// 3 on a NATS cluster that can hold them, else 1.
	RegistryReplicas int
	// Layerwise is when a prefill worker streams a request's cache while
	// prefill computes it: on, off or auto (prompts of LayerwiseMinTokens
	// tokens or more; 0: transfer.DefaultLayerwiseMinTokens). Decode
	// receives either way and hands them to its --standalone prefill.
	Layerwise          string
	LayerwiseMinTokens int
	// PrefillChunkTokens splits each prompt's prefill into chunks of at
	// most this many tokens, one per scheduler step (0: whole prompts).
	PrefillChunkTokens int
	// PrefixCache reuses cached prompt prefixes and conversation state
	// (worker.Config.PrefixCache): on or off. StateCheckpoints is the
	// Mamba state checkpoint rows per rank (-1: DefaultStateCheckpoints);
	// StateCheckpointInterval takes a checkpoint every this many tokens
	// of a prompt too (0: only at the ends of prompts and generations).
	PrefixCache             string
	StateCheckpoints        int
	StateCheckpointInterval int
	// PrefillRouting is how a decode worker picks the prefill instance of a
	// request's first attempt, with the prefix cache on: state (where the
	// instances' cache events say its longest state is, else as affinity),
	// affinity (where it sent the longest remembered prefix, or the
	// request's prompt_cache_key), or load (the least loaded).
	PrefillRouting string
	// StateReturn, with the prefix cache on, moves each conversation's
	// end-of-turn state from the decode worker that generated it back to
	// the prefill instance that prefilled it (on or off): the decode keeps
	// it and offers it, the prefill instance pulls it into its cache.
	StateReturn string
	// Speculative is the speculative decoding method (off, ngram, or mtp:
	// the model's draft head, a model named with ?mtp=1), NumSpeculativeTokens its most
	// draft tokens per step (K), and DraftLenScheduleText its draft length
	// by batch size ("1:4,4:2,8:0"; empty: K at every batch size), parsed
	// into DraftLenSchedule by Validate.
	Speculative          string
	NumSpeculativeTokens int
	DraftLenScheduleText string
	DraftLenSchedule     mambacache.DraftSchedule
	// AcceptanceRateWindow and AcceptanceRateThreshold are the
	// acceptance-rate gate (worker.Speculation.GateWindow and
	// GateThreshold): both 0, no gate.
	AcceptanceRateWindow    int
	AcceptanceRateThreshold float64

	// Decode only.
	HTTPAddr   string
	Prefill    string // remote, local, auto
	Standalone bool
	// AutoMinTokens and AutoMaxQueue are --prefill auto's thresholds
	// (worker.AutoPolicy): prompts shorter than AutoMinTokens are
	// prefilled locally, and so are longer ones while the least-loaded
	// prefill instance has AutoMaxQueue requests waiting beyond its batch.
	AutoMinTokens int
	AutoMaxQueue  int
	// AutoMaxRunning: a short prompt whose rank runs this many requests
	// is prefilled remotely (0: half the rank's rows).
	AutoMaxRunning int
	// WriteTimeout bounds one write of an API response: a client that
	// reads nothing for that long is cut off and its request cancelled.
	WriteTimeout time.Duration
	// PrefillGrace is how long a remote decode stays ready with no usable
	// prefill instance in its namespace (after it saw one).
	PrefillGrace time.Duration
}

// Parse parses args (without the program name) for role. Output of --help
// goes to out. It returns flag.ErrHelp after printing help.
func Parse(role worker.Role, args []string, getenv func(string) string, out io.Writer) (Config, error) {
	if getenv == nil {
		getenv = os.Getenv
	}
	c := Config{Role: role}
	fs := flag.NewFlagSet(string(role), flag.ContinueOnError)
	fs.SetOutput(out)
	tw := envflag.New(fs)
	str := func(p *string, name, envName, def, usage string, decodeOnly bool) {
		if decodeOnly && role != worker.RoleDecode {
			return
		}
		fs.StringVar(p, name, def, usage+tw.Env(name, envName))
	}
	num := func(p *int, name, envName string, def int, usage string) {
		fs.IntVar(p, name, def, usage+tw.Env(name, envName))
	}
	dur := func(p *time.Duration, name, envName string, def time.Duration, usage string) {
		fs.DurationVar(p, name, def, usage+tw.Env(name, envName))
	}
	adminDefault := DefaultPrefillAdminAddr
	if role == worker.RoleDecode {
		adminDefault = DefaultDecodeAdminAddr
	}
	var logLevel, attentionDP string
	str(&c.NATS.URL, "nats-url", "NATS_URL", DefaultNATSURL, "NATS server URL(s), comma-separated", false)
	str(&c.NATS.Creds, "nats-creds", "NATS_CREDS", "", "NATS credentials file", false)
	str(&c.NATS.NKey, "nats-nkey", "NATS_NKEY", "", "NATS nkey seed file", false)
	str(&c.NATS.User, "nats-user", "NATS_USER", "", "NATS user name", false)
	str(&c.NATS.Password, "nats-password", "NATS_PASSWORD", "", "NATS password", false)
	str(&c.NATS.CA, "nats-ca", "NATS_CA", "", "CA certificate file for NATS TLS", false)
	str(&c.NATS.Cert, "nats-cert", "NATS_CERT", "", "client certificate file for NATS TLS", false)
	str(&c.NATS.Key, "nats-key", "NATS_KEY", "", "client key file for NATS TLS", false)
	str(&c.DataTLS.CA, "data-tls-ca", "HANDOFF_DATA_TLS_CA", "", "CA file for mutual TLS on the tcp data path (with --data-tls-cert and --data-tls-key; off when unset)", false)
	str(&c.DataTLS.Cert, "data-tls-cert", "HANDOFF_DATA_TLS_CERT", "", "this worker's certificate file for the tcp data path's mutual TLS", false)
	str(&c.DataTLS.Key, "data-tls-key", "HANDOFF_DATA_TLS_KEY", "", "this worker's key file for the tcp data path's mutual TLS", false)
	str(&c.Namespace, "namespace", "HANDOFF_NAMESPACE", "default", "namespace shared by the prefill and decode workers of one deployment", false)
	str(&c.InstanceID, "instance-id", "HANDOFF_INSTANCE_ID", "", "unique instance id (default $POD_NAME, else hostname-pid)", false)
	str(&c.Model, "model", "HANDOFF_MODEL", "tiny-hybrid", "model name, options as a query (e.g. nemotron-h-8b?delay=2ms)", false)
	num(&c.DPSize, "dp-size", "HANDOFF_DP_SIZE", 1, "attention-DP ranks in this process")
	num(&c.TPSize, "tp-size", "HANDOFF_TP_SIZE", 1, "tensor-parallel shards per rank, each with its own pools and data-path regions holding its KV heads, Mamba heads and conv sections; prefill and decode may differ (the handoff reshards). With attention DP (--dp-size > 1 or --attention-dp) every rank keeps the full state (TP 1): --tp-size > 1 is refused there")
	str(&attentionDP, "attention-dp", "HANDOFF_ATTENTION_DP", "", "step ranks in lockstep with dummy padding (default true when --dp-size > 1)", false)
	num(&c.MaxBatchSize, "max-batch-size", "HANDOFF_MAX_BATCH_SIZE", 8, "requests per rank (real Mamba rows)")
	num(&c.TokensPerBlock, "tokens-per-block", "HANDOFF_TOKENS_PER_BLOCK", 16, "KV block size in tokens (must match the peers)")
	num(&c.KVBlocks, "kv-blocks", "HANDOFF_KV_BLOCKS", 0, "KV blocks per rank (0: enough for max-batch-size full contexts, capped at 512 MiB)")
	num(&c.QueueSize, "queue-size", "HANDOFF_QUEUE_SIZE", worker.DefaultQueueSize, "requests waiting for admission before new ones are refused with 429 and a Retry-After of the queue's expected wait (a queued API request holds about 30-40 KiB: 1024 about 40 MiB)")
	str(&c.Layerwise, "layerwise", "HANDOFF_LAYERWISE", "auto", "stream each request's cache layer by layer while prefill computes it: on, off, or auto (prompts of --layerwise-min-tokens or more); decode receives either way (with --standalone: for its prefill worker)", false)
	num(&c.LayerwiseMinTokens, "layerwise-min-tokens", "HANDOFF_LAYERWISE_MIN_TOKENS", transfer.DefaultLayerwiseMinTokens, "--layerwise auto: shorter prompts go in one write after prefill")
	num(&c.PrefillChunkTokens, "prefill-chunk-tokens", "HANDOFF_PREFILL_CHUNK_TOKENS", 0, "prefill each prompt in chunks of at most this many tokens, one per step, so other requests' steps run between them (0: whole prompts)")
	str(&c.PrefixCache, "prefix-cache", "HANDOFF_PREFIX_CACHE", "on", "reuse cached prompt prefixes: KV blocks by content and Mamba states at exact token counts (on or off; off computes every prompt from its first token)", false)
	num(&c.StateCheckpoints, "state-checkpoints", "HANDOFF_STATE_CHECKPOINTS", -1, "Mamba state checkpoint rows per rank for the prefix cache, beyond the real and reserved rows (-1: 4 per --max-batch-size, within 1 GiB of rows)")
	str(&c.StateReturn, "state-return", "HANDOFF_STATE_RETURN", "on", "with --prefix-cache on: move each conversation's end-of-turn state from the decode worker that generated it back to the prefill instance that prefilled it, when both have room at once, so that the next turn's prefill starts after the reply (on or off; set it alike on both roles)", false)
	str(&c.PrefillRouting, "prefill-routing", "HANDOFF_PREFILL_ROUTING", "state", "decode, with --prefix-cache on: where a request's prefill goes first: state (the instance whose cache events say it holds the prompt's longest state, weighed against load; else as affinity), affinity (the instance that prefilled the longest remembered prefix, or the request's prompt_cache_key), or load (the least loaded instance)", false)
	num(&c.StateCheckpointInterval, "state-checkpoint-interval", "HANDOFF_STATE_CHECKPOINT_INTERVAL", worker.DefaultCheckpointInterval, "also checkpoint the state every this many tokens of a prompt, so a shared prefix (a system prompt) serves prompts that continue it differently (0: only at the ends of prompts and generations)")
	str(&c.Speculative, "speculative", "HANDOFF_SPECULATIVE", "off", "speculative decoding on decode steps: off, or ngram (prompt lookup: drafts the tokens that followed the context's last n-gram earlier in it, verified exactly: the output is unchanged), or mtp (the model's draft head: name the model with ?mtp=1 on prefill and decode, its KV is one more layer in the pool)", false)
	num(&c.NumSpeculativeTokens, "num-speculative-tokens", "HANDOFF_NUM_SPECULATIVE_TOKENS", 3, "with --speculative: the most draft tokens one step verifies (K; 1..16)")
	num(&c.AcceptanceRateWindow, "acceptance-rate-window", "HANDOFF_ACCEPTANCE_RATE_WINDOW", 0, "with --speculative: the acceptance-rate gate's window in verifications (TensorRT-LLM's acceptance_rate_window_size): with --acceptance-rate-threshold, steps stop drafting while fewer than that share of the window's drafts were accepted, but for one probe step per window (0: no gate)")
	fs.Float64Var(&c.AcceptanceRateThreshold, "acceptance-rate-threshold", 0, "with --acceptance-rate-window: the acceptance rate below which drafting stops, in (0, 1]"+tw.Env("acceptance-rate-threshold", "HANDOFF_ACCEPTANCE_RATE_THRESHOLD"))
	str(&c.DraftLenScheduleText, "draft-len-schedule", "HANDOFF_DRAFT_LEN_SCHEDULE", "", "with --speculative: draft length by batch size, batch:len pairs, e.g. 1:4,4:2,8:0 (batch 1 drafts 4, 2..4 draft 2, 5..8 and larger none); each length gets a reserved padding row; empty: --num-speculative-tokens at every batch size", false)
	num(&c.RegistryReplicas, "registry-replicas", "HANDOFF_REGISTRY_REPLICAS", 0, "replicas of the instance registry bucket (0: 3 on a NATS cluster that can hold them, else 1)")
	str(&c.DataAddr, "data-addr", "HANDOFF_DATA_ADDR", DefaultDataAddr, "data-plane TCP listen address", false)
	str(&c.DataAdvertise, "data-advertise", "HANDOFF_DATA_ADVERTISE", "", "data-plane address peers dial (default $POD_IP:<port> when POD_IP is set; else, with --memory cuda and a wildcard --data-addr, the GPU's NIC:<port>; else the listener's)", false)
	str(&c.Transport, "transport", "HANDOFF_TRANSPORT", "auto", "data-plane transport: auto, tcp, shm, inproc, cuda-ipc or ucx (UCX active messages; needs a build with -tags ucx; auto never picks it)", false)
	str(&c.Memory, "memory", "HANDOFF_MEMORY", "host", "where the caches live: host, or cuda (GPU memory through libcuda.so.1, loaded at run time)", false)
	str(&c.CUDADevice, "cuda-device", "HANDOFF_CUDA_DEVICE", "0", "with --memory cuda: the GPU, by CUDA ordinal or UUID (GPU-...)", false)
	num(&c.TCPLanes, "tcp-lanes", "HANDOFF_TCP_LANES", 4, "tcp connections one large cache write is striped over (1: one)")
	str(&c.AdminAddr, "admin-addr", "HANDOFF_ADMIN_ADDR", adminDefault, "admin HTTP address (/livez, /readyz, /metrics); empty disables", false)
	str(&logLevel, "log-level", "HANDOFF_LOG_LEVEL", "info", "log level: debug (or trace), info, warn, error", false)
	str(&c.LogFormat, "log-format", "HANDOFF_LOG_FORMAT", "json", "log format: json or text", false)
	dur(&c.DrainTimeout, "drain-timeout", "HANDOFF_DRAIN_TIMEOUT", 30*time.Second, "how long SIGTERM waits for in-flight requests")
	dur(&c.RequestTimeout, "request-timeout", "HANDOFF_REQUEST_TIMEOUT", 30*time.Second, "deadline of one cache handoff")
	if role == worker.RoleDecode {
		str(&c.HTTPAddr, "http-addr", "HANDOFF_HTTP_ADDR", DefaultHTTPAddr, "OpenAI-compatible API address", true)
		str(&c.Prefill, "prefill", "HANDOFF_PREFILL", "remote", "where prefill runs: remote (prefill workers over NATS), local (in process, no transfer) or auto (local for short prompts and while the prefill workers are busy or gone, remote otherwise)", true)
		fs.IntVar(&c.AutoMinTokens, "prefill-auto-min-tokens", worker.DefaultAutoMinRemoteTokens,
			"--prefill auto: prompts with fewer tokens are prefilled locally"+tw.Env("prefill-auto-min-tokens", "HANDOFF_PREFILL_AUTO_MIN_TOKENS"))
		fs.IntVar(&c.AutoMaxQueue, "prefill-auto-max-queue", worker.DefaultAutoMaxPrefillQueue,
			"--prefill auto: prefill locally while the least-loaded prefill worker has this many requests waiting beyond its batch"+tw.Env("prefill-auto-max-queue", "HANDOFF_PREFILL_AUTO_MAX_QUEUE"))
		fs.IntVar(&c.AutoMaxRunning, "prefill-auto-max-running", 0,
			"--prefill auto: a short prompt whose rank already runs this many requests is prefilled remotely, as a local prefill would stall all their decodes (0: half the rank's rows)"+tw.Env("prefill-auto-max-running", "HANDOFF_PREFILL_AUTO_MAX_RUNNING"))
		fs.DurationVar(&c.WriteTimeout, "write-timeout", 30*time.Second,
			"how long one API response write may wait for a client that stopped reading before the response is cut and the request cancelled"+tw.Env("write-timeout", "HANDOFF_WRITE_TIMEOUT"))
		fs.DurationVar(&c.PrefillGrace, "prefill-grace", 30*time.Second,
			"remote prefill: how long readiness stays 200 with no usable prefill instance known (it is 503 until the first one is seen)"+tw.Env("prefill-grace", "HANDOFF_PREFILL_GRACE"))
		fs.BoolVar(&c.Standalone, "standalone", false, "run an embedded NATS server and an in-process prefill worker: one command, the whole pipeline"+tw.Env("standalone", "HANDOFF_STANDALONE"))
	}
	fs.Usage = func() {
		fmt.Fprintf(out, "Usage: %s [flags]\n       %s version\n       %s healthcheck [--url URL]\n\nFlags (each with its environment variable):\n",
			role, role, role)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return Config{}, err
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("%w: unexpected argument %q", ErrInvalid, fs.Arg(0))
	}
	if err := tw.Apply(getenv); err != nil {
		return Config{}, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	var err error
	if c.LogLevel, err = parseLevel(logLevel); err != nil {
		return Config{}, err
	}
	if attentionDP == "" {
		c.AttentionDP = c.DPSize > 1
	} else if c.AttentionDP, err = strconv.ParseBool(attentionDP); err != nil {
		return Config{}, fmt.Errorf("%w: --attention-dp %q: want true or false", ErrInvalid, attentionDP)
	}
	if c.InstanceID == "" {
		c.InstanceID = defaultInstance(getenv)
	}
	if c.DataAdvertise == "" {
		if ip := getenv("POD_IP"); ip != "" {
			_, port, err := net.SplitHostPort(c.DataAddr)
			if err != nil {
				return Config{}, fmt.Errorf("%w: --data-addr %q: %v", ErrInvalid, c.DataAddr, err)
			}
			c.DataAdvertise = net.JoinHostPort(ip, port)
		}
	}
	return c, c.Validate()
}

// listenAddr checks the form of a TCP listen address: host:port, the
// port a number up to 65535 or a service name.
func listenAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	_, err = net.LookupPort("tcp", port)
	return err
}

func (c *Config) validateSpeculative(bad func(string, ...any)) {
	sched, err := mambacache.ParseDraftSchedule(c.DraftLenScheduleText)
	if err != nil {
		bad("--draft-len-schedule %q: %v", c.DraftLenScheduleText, err)
	}
	c.DraftLenSchedule = sched
	switch c.Speculative {
	case "off":
		if sched.Len() > 0 {
			bad("--draft-len-schedule %q without --speculative", c.DraftLenScheduleText)
		}
		if c.AcceptanceRateWindow != 0 || c.AcceptanceRateThreshold != 0 {
			bad("--acceptance-rate-window or --acceptance-rate-threshold without --speculative")
		}
		return
	case "ngram":
	case "mtp":
		if e, err := model.Lookup(c.Model); err == nil && !model.HasDraftHead(e) {
			m := c.Model
			bad("--speculative mtp: model %q has no draft head (name it with ?mtp=1, on the prefill workers too: the head's KV is a layer of the pool)", m)
		}
	default:
		bad("--speculative %q: want off, ngram or mtp", c.Speculative)
		return
	}
	if c.NumSpeculativeTokens < 1 || c.NumSpeculativeTokens > worker.MaxSpeculativeTokens {
		bad("--num-speculative-tokens %d: want 1..%d", c.NumSpeculativeTokens, worker.MaxSpeculativeTokens)
	}
	for _, e := range sched.Steps() {
		if e.DraftLen > c.NumSpeculativeTokens {
			bad("--draft-len-schedule %q: entry %s drafts more than --num-speculative-tokens %d", c.DraftLenScheduleText, e, c.NumSpeculativeTokens)
		}
	}
	if c.AcceptanceRateWindow < 0 || c.AcceptanceRateWindow > 1<<20 || (c.AcceptanceRateWindow > 0) != (c.AcceptanceRateThreshold > 0) ||
		!(c.AcceptanceRateThreshold >= 0 && c.AcceptanceRateThreshold <= 1) {
		bad("--acceptance-rate-window %d --acceptance-rate-threshold %v: want both 0 (no gate), or a window of 1..%d verifications and a threshold in (0, 1]",
			c.AcceptanceRateWindow, c.AcceptanceRateThreshold, 1<<20)
	}

}

// AcceptanceGating reports whether the acceptance-rate gate is on.
func (c *Config) AcceptanceGating() bool { return c.SpecTokens() > 0 && c.AcceptanceRateWindow > 0 }

// SpecTokens is the draft tokens the pools are sized for: 0 with
// speculation off.
func (c *Config) SpecTokens() int {
	if c.Speculative == "off" || c.Speculative == "" {
		return 0
	}
	return c.NumSpeculativeTokens
}

// Validate checks a Config.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	if c.DPSize < 1 {
		bad("--dp-size %d: want ≥ 1", c.DPSize)
	}
	if c.TPSize < 1 || c.TPSize > 64 {
		bad("--tp-size %d: want 1..64", c.TPSize)
	} else if c.TPSize > 1 && (c.DPSize > 1 || c.AttentionDP) {
		bad("--tp-size %d with attention DP (--dp-size %d): not supported; with attention DP every rank keeps the full state (TP 1)", c.TPSize, c.DPSize)
	}
	if c.MaxBatchSize < 1 {
		bad("--max-batch-size %d: want ≥ 1", c.MaxBatchSize)
	}
	if c.TokensPerBlock < 2 || c.TokensPerBlock&(c.TokensPerBlock-1) != 0 {
		bad("--tokens-per-block %d: want a power of two ≥ 2", c.TokensPerBlock)
	}
	if c.KVBlocks < 0 {
		bad("--kv-blocks %d: want ≥ 0", c.KVBlocks)
	}
	// Listen addresses are checked now, not when each listener opens: the
	// API's opens after NATS and the registry, which may wait for long.
	for _, a := range []struct{ flag, addr string }{{"--data-addr", c.DataAddr}, {"--admin-addr", c.AdminAddr}, {"--http-addr", c.HTTPAddr}} {
		if a.addr == "" {
			continue // admin disabled, or no API (prefill)
		}
		if err := listenAddr(a.addr); err != nil {
			bad("%s %q: %v", a.flag, a.addr, err)
		}
	}
	if c.DataAdvertise != "" {
		// What peers dial: a host (no wildcard) and a port (0: the
		// listener's).
		h, _, err := net.SplitHostPort(c.DataAdvertise)
		if err == nil {
			err = listenAddr(c.DataAdvertise)
		}
		if err == nil && (h == "" || net.ParseIP(h) != nil && net.ParseIP(h).IsUnspecified()) {
			err = errors.New("a host peers can dial is needed")
		}
		if err != nil {
			bad("--data-advertise %q: %v", c.DataAdvertise, err)
		}
	}
	if c.TCPLanes < 1 || c.TCPLanes > 64 {
		bad("--tcp-lanes %d: want 1..64", c.TCPLanes)
	}
	if c.QueueSize < 1 {
		bad("--queue-size %d: want ≥ 1", c.QueueSize)
	}
	if c.RegistryReplicas < 0 || c.RegistryReplicas > 5 {
		bad("--registry-replicas %d: want 0 (auto) to 5", c.RegistryReplicas)
	}
	if _, err := transfer.ParseLayerwise(c.Layerwise); err != nil {
		bad("--layerwise %q: want on, off or auto", c.Layerwise)
	}
	if c.LayerwiseMinTokens < 0 {
		bad("--layerwise-min-tokens %d: want ≥ 0", c.LayerwiseMinTokens)
	}
	if c.PrefillChunkTokens < 0 {
		bad("--prefill-chunk-tokens %d: want ≥ 0", c.PrefillChunkTokens)
	}
	if c.PrefixCache != "on" && c.PrefixCache != "off" {
		bad("--prefix-cache %q: want on or off", c.PrefixCache)
	}
	if c.StateReturn != "on" && c.StateReturn != "off" {
		bad("--state-return %q: want on or off", c.StateReturn)
	}
	if c.PrefillRouting != "state" && c.PrefillRouting != "affinity" && c.PrefillRouting != "load" {
		bad("--prefill-routing %q: want state, affinity or load", c.PrefillRouting)
	}
	if c.StateCheckpoints < -1 {
		bad("--state-checkpoints %d: want ≥ 0, or -1 for the default", c.StateCheckpoints)
	}
	if c.StateCheckpointInterval < 0 {
		bad("--state-checkpoint-interval %d: want ≥ 0", c.StateCheckpointInterval)
	}
	c.validateSpeculative(bad)
	switch c.Transport {
	case "auto", "tcp", "shm", "inproc", "cuda-ipc", "ucx":
	default:
		bad("--transport %q: want auto, tcp, shm, inproc, cuda-ipc or ucx", c.Transport)
	}
	if m, err := cuda.ParseMemory(c.Memory); err != nil {
		bad("--memory %q: want host or cuda", c.Memory)
	} else {
		c.Memory = string(m)
	}
	if c.Transport == "cuda-ipc" && c.Memory != string(cuda.MemoryCUDA) {
		bad("--transport cuda-ipc needs --memory cuda")
	}
	if c.Memory == string(cuda.MemoryCUDA) {
		// Any role: a prefill worker drafts with its model's head too.
		if e, err := model.Lookup(c.Model); err == nil && model.HasDraftHead(e) {
			bad("--model %q with --memory cuda: the draft head reads the pool's host bytes, not device memory yet", c.Model)
		}
	}
	switch c.LogFormat {
	case "json", "text":
	default:
		bad("--log-format %q: want json or text", c.LogFormat)
	}
	if c.DrainTimeout < 0 {
		bad("--drain-timeout %v: want ≥ 0", c.DrainTimeout)
	}
	if c.RequestTimeout <= 0 {
		bad("--request-timeout %v: want > 0", c.RequestTimeout)
	}
	// Both name NATS subject tokens and the registry bucket: transfer
	// refuses at start-up what its ValidToken refuses, so refuse it here, by
	// flag name.
	if !validToken(c.Namespace) {
		bad("--namespace %q: want 1-%d letters, digits, '-' or '_'", c.Namespace, maxTokenLen)
	}
	if !validToken(c.InstanceID) {
		bad("--instance-id %q: want 1-%d letters, digits, '-' or '_'", c.InstanceID, maxTokenLen)
	}
	if c.Model == "" {
		bad("--model is empty")
	}
	if (c.NATS.Cert == "") != (c.NATS.Key == "") {
		bad("--nats-cert and --nats-key go together")
	}
	if t := c.DataTLS; (t.CA == "") != (t.Cert == "") || (t.CA == "") != (t.Key == "") {
		bad("--data-tls-ca, --data-tls-cert and --data-tls-key go together")
	} else if t.CA != "" && c.Transport == "ucx" {
		// TLS wraps the tcp data path only: an operator who asked for it
		// must not have the caches cross hosts in the clear.
		bad("--data-tls-* with --transport ucx: the ucx data path is not encrypted; use --transport tcp (or auto) for TLS")
	}
	if c.NATS.Password != "" && c.NATS.User == "" {
		bad("--nats-password needs --nats-user")
	}
	if c.Role == worker.RoleDecode {
		switch c.Prefill {
		case "remote", "local", "auto":
		default:
			bad("--prefill %q: want remote, local or auto", c.Prefill)
		}
		if c.AutoMinTokens < 0 {
			bad("--prefill-auto-min-tokens %d: want ≥ 0", c.AutoMinTokens)
		}
		if c.AutoMaxQueue < 1 {
			bad("--prefill-auto-max-queue %d: want ≥ 1", c.AutoMaxQueue)
		}
		if c.AutoMaxRunning < 0 {
			bad("--prefill-auto-max-running %d: want ≥ 0", c.AutoMaxRunning)
		}
		if c.WriteTimeout <= 0 {
			bad("--write-timeout %v: want > 0", c.WriteTimeout)
		}
		if c.PrefillGrace < 0 {
			bad("--prefill-grace %v: want ≥ 0", c.PrefillGrace)
		}
		if c.Standalone && c.Prefill == "local" {
			bad("--standalone runs a prefill worker; it cannot be combined with --prefill local")
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
	}
	return nil
}

// Logger builds the process logger (to w) from the config.
func (c *Config) Logger(w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.LogLevel}
	var h slog.Handler
	if c.LogFormat == "text" {
		h = slog.NewTextHandler(w, opts)
	} else {
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(h).With("role", string(c.Role), "instance", c.InstanceID)
}

func parseLevel(s string) (slog.Level, error) {
	switch strings.ToLower(s) {
	case "debug", "trace": // trace: handoff-nats's protocol trace, which shares HANDOFF_LOG_LEVEL
		return slog.LevelDebug, nil
	case "info", "":
		return slog.LevelInfo, nil
	case "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("%w: --log-level %q: want debug, info, warn or error", ErrInvalid, s)
}

// maxTokenLen is the longest namespace or instance id wire.ValidToken
// accepts.
const maxTokenLen = 64

// validToken is wire.ValidToken (1-64 characters of [A-Za-z0-9_-]),
// written again so that config does not import the data path: the manifest
// tests of deploy/k8s build config into a binary that links kustomize's
// plugin loader, which binds every symbol at start-up, and go-nvml's are
// resolved only once NVML is loaded. TestValidTokenMatchesTransfer keeps the
// two equal.
func validToken(s string) bool {
	if len(s) == 0 || len(s) > maxTokenLen {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

// defaultInstance is $POD_NAME, else hostname-pid, made a valid token.
func defaultInstance(getenv func(string) string) string {
	if p := getenv("POD_NAME"); p != "" {
		return sanitize(p)
	}
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "handoff"
	}
	return sanitize(fmt.Sprintf("%s-%d", h, os.Getpid()))
}

// sanitize replaces every byte outside [A-Za-z0-9_-] with '-' and cuts a name
// longer than maxTokenLen to its head, a '-' and 8 hex digits of a hash of
// the whole name: pod names may run to 253 characters, and the ones that
// differ only in their tail (a ReplicaSet's random suffix) must stay apart.
func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '-'
		}
	}
	if len(b) <= maxTokenLen {
		return string(b)
	}
	h := fnv.New32a()
	h.Write([]byte(s))
	return fmt.Sprintf("%s-%08x", b[:maxTokenLen-9], h.Sum32())
}

// AdminDial returns the address healthcheck dials for role's admin
// listener as configured by the environment (HANDOFF_ADMIN_ADDR), else the
// role's default: its host, or loopback for a wildcard or none, and its
// port. (A --admin-addr given to the worker as a flag is not seen by the
// healthcheck subcommand, another process: pass it the environment, or
// --url.)
func AdminDial(role worker.Role, getenv func(string) string) string {
	addr := DefaultPrefillAdminAddr
	if role == worker.RoleDecode {
		addr = DefaultDecodeAdminAddr
	}
	if getenv != nil {
		if v := getenv("HANDOFF_ADMIN_ADDR"); v != "" {
			addr = v
		}
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		host, port = "", strings.TrimPrefix(addr, ":")
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port)
}
