package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/handoff-io/handoff/internal/envflag"
	"github.com/handoff-io/handoff/internal/size"
)

// errHelp is returned when --help was asked for; the usage has been printed.
var errHelp = errors.New("handoff-nats: help requested")

// errConfig marks a configuration the server refuses to start with.
var errConfig = errors.New("handoff-nats: invalid configuration")

// Defaults. 8 MiB is NATS's recommended ceiling for max_payload; handoff's
// control messages carry token ids and block tables, which pass 1 MiB (the
// server default) for prompts of a few hundred thousand tokens.
const (
	defaultPort        = 4222
	defaultHTTPPort    = 8222
	defaultClusterPort = 6222
	defaultMaxPayload  = 8 << 20
	// A client whose host vanished without closing its TCP connection (a
	// killed container, a lost node) keeps its subscriptions, and so its
	// share of a queue group's requests, until the server gives up pinging
	// it. NATS's default (2 min x 2) is long next to a request timeout;
	// 10 s x 3 bounds it to about 30 s.
	defaultPingInterval = 10 * time.Second
	defaultMaxPingsOut  = 3
)

// config is everything the serve command needs. It is plain data: parse fills
// it, validate checks it, serverOptions turns it into nats-server options.
type config struct {
	Host        string
	Port        int
	HTTPHost    string
	HTTPPort    int
	ServerName  string
	JetStream   bool
	StoreDir    string
	JSMaxMemory int64
	JSMaxStore  int64
	MaxPayload  int64
	User        string
	Password    string
	ClusterName string
	ClusterHost string
	ClusterPort int
	Routes      []string
	LameDuck    time.Duration
	PingEvery   time.Duration
	MaxPingsOut int
	LogLevel    string
	LogFormat   string
}

// sizeValue is a flag.Value holding a byte count written as a plain integer or
// with a unit suffix (KB, MB, GB, KiB, MiB, GiB; "K", "M", "G" mean KiB...).
type sizeValue struct{ n *int64 }

func (v sizeValue) String() string {
	if v.n == nil {
		return "0"
	}
	return strconv.FormatInt(*v.n, 10)
}

func (v sizeValue) Set(s string) error {
	n, err := size.Parse(s)
	if err != nil {
		return err
	}
	*v.n = n
	return nil
}

// listValue is a comma-separated list flag.
type listValue struct{ l *[]string }

func (v listValue) String() string {
	if v.l == nil {
		return ""
	}
	return strings.Join(*v.l, ",")
}

func (v listValue) Set(s string) error {
	*v.l = nil
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			*v.l = append(*v.l, part)
		}
	}
	return nil
}

// defaultServerName is $POD_NAME (a StatefulSet gives stable, unique names),
// else the host name, else "handoff-nats".
func defaultServerName(getenv func(string) string) string {
	if n := getenv("POD_NAME"); n != "" {
		return n
	}
	if h, err := os.Hostname(); err == nil && h != "" {
		return h
	}
	return "handoff-nats"
}

// parseServe reads the serve command's flags, falling back to environment
// variables for flags not given, then validates the result.
func parseServe(args []string, getenv func(string) string, usage io.Writer) (config, error) {
	cfg := config{
		Host:        "0.0.0.0",
		Port:        defaultPort,
		HTTPPort:    defaultHTTPPort,
		JetStream:   true,
		MaxPayload:  defaultMaxPayload,
		ClusterPort: defaultClusterPort,
		PingEvery:   defaultPingInterval,
		MaxPingsOut: defaultMaxPingsOut,
		LogLevel:    "info",
		LogFormat:   "json",
	}
	fs := flag.NewFlagSet("handoff-nats", flag.ContinueOnError)
	fs.SetOutput(usage)
	tw := envflag.New(fs)
	env := tw.Env
	fs.StringVar(&cfg.Host, "host", cfg.Host, "client listen host"+env("host", "HANDOFF_NATS_HOST"))
	fs.IntVar(&cfg.Port, "port", cfg.Port, "client port; -1 picks a free one"+env("port", "HANDOFF_NATS_PORT"))
	fs.StringVar(&cfg.HTTPHost, "http-host", "", "monitoring listen host (default: --host); /healthz, /varz, /jsz are unauthenticated, bind to 127.0.0.1 where that matters"+env("http-host", "HANDOFF_NATS_HTTP_HOST"))
	fs.IntVar(&cfg.HTTPPort, "http-port", cfg.HTTPPort, "monitoring port serving /healthz; 0 disables it, -1 picks a free one"+env("http-port", "HANDOFF_NATS_HTTP_PORT"))
	fs.StringVar(&cfg.ServerName, "server-name", "", "server name, unique in a cluster (default: $POD_NAME, else the host name)"+env("server-name", "HANDOFF_NATS_SERVER_NAME"))
	fs.BoolVar(&cfg.JetStream, "jetstream", cfg.JetStream, "enable JetStream (needed by handoff's discovery buckets)"+env("jetstream", "HANDOFF_NATS_JETSTREAM"))
	fs.StringVar(&cfg.StoreDir, "store-dir", "", "JetStream store directory (default: a directory under the system temp dir, lost on restart)"+env("store-dir", "HANDOFF_NATS_STORE_DIR"))
	fs.Var(sizeValue{&cfg.JSMaxMemory}, "js-max-memory", "JetStream memory storage limit, e.g. 256MiB; 0 lets the server choose"+env("js-max-memory", "HANDOFF_NATS_JS_MAX_MEMORY"))
	fs.Var(sizeValue{&cfg.JSMaxStore}, "js-max-store", "JetStream file storage limit, e.g. 10GiB; 0 lets the server choose"+env("js-max-store", "HANDOFF_NATS_JS_MAX_STORE"))
	fs.Var(sizeValue{&cfg.MaxPayload}, "max-payload", "largest message accepted in bytes (units allowed, e.g. 8MiB), at most 64MiB"+env("max-payload", "HANDOFF_NATS_MAX_PAYLOAD"))
	fs.StringVar(&cfg.User, "user", "", "client user name; requires --password"+env("user", "NATS_USER"))
	fs.StringVar(&cfg.Password, "password", "", "client password; requires --user"+env("password", "NATS_PASSWORD"))
	fs.StringVar(&cfg.ClusterName, "cluster-name", "", "cluster name; setting it (or --routes) enables clustering"+env("cluster-name", "HANDOFF_NATS_CLUSTER_NAME"))
	fs.StringVar(&cfg.ClusterHost, "cluster-host", "", "cluster listen host (default: --host)"+env("cluster-host", "HANDOFF_NATS_CLUSTER_HOST"))
	fs.IntVar(&cfg.ClusterPort, "cluster-port", cfg.ClusterPort, "cluster port, used only when clustering"+env("cluster-port", "HANDOFF_NATS_CLUSTER_PORT"))
	fs.Var(listValue{&cfg.Routes}, "routes", "comma-separated seed routes, e.g. nats://nats-0.nats:6222,nats://nats-1.nats:6222"+env("routes", "HANDOFF_NATS_ROUTES"))
	fs.DurationVar(&cfg.LameDuck, "lame-duck-duration", 0, "on SIGTERM, stop accepting clients and spread existing disconnects over this duration before shutting down; 0 shuts down at once"+env("lame-duck-duration", "HANDOFF_NATS_LAME_DUCK_DURATION"))
	fs.DurationVar(&cfg.PingEvery, "ping-interval", cfg.PingEvery, "how often the server pings each client; with --max-pings-out it bounds how long a vanished client keeps its subscriptions"+env("ping-interval", "HANDOFF_NATS_PING_INTERVAL"))
	fs.IntVar(&cfg.MaxPingsOut, "max-pings-out", cfg.MaxPingsOut, "unanswered pings before the server closes a client"+env("max-pings-out", "HANDOFF_NATS_MAX_PINGS_OUT"))
	fs.StringVar(&cfg.LogLevel, "log-level", cfg.LogLevel, "error, warn, info, debug or trace (the server's protocol trace)"+env("log-level", "HANDOFF_LOG_LEVEL"))
	fs.StringVar(&cfg.LogFormat, "log-format", cfg.LogFormat, "json or text"+env("log-format", "HANDOFF_LOG_FORMAT"))
	fs.Usage = func() {
		fmt.Fprintln(usage, "Usage: handoff-nats [serve] [flags] | healthcheck [--url URL] [--timeout D] | version")
		fmt.Fprintln(usage, "Flags (a flag wins over its environment twin):")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return config{}, errHelp
		}
		return config{}, fmt.Errorf("%w: %v", errConfig, err)
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("%w: unexpected argument %q (subcommands: healthcheck, version)", errConfig, fs.Arg(0))
	}
	if err := tw.Apply(getenv); err != nil {
		var e *envflag.Error
		if errors.As(err, &e) {
			return config{}, fmt.Errorf("%w: %v (or pass --%s)", errConfig, err, e.Flag)
		}
		return config{}, fmt.Errorf("%w: %v", errConfig, err)
	}
	if cfg.ServerName == "" {
		cfg.ServerName = defaultServerName(getenv)
	}
	// As the workers take it (HANDOFF_LOG_LEVEL is shared): any case,
	// warning for warn.
	cfg.LogLevel = strings.ToLower(cfg.LogLevel)
	if cfg.LogLevel == "warning" {
		cfg.LogLevel = "warn"
	}
	if err := cfg.validate(); err != nil {
		return config{}, err
	}
	return cfg, nil
}

func validPort(p int, allowZero bool) bool {
	return p == -1 || (p >= 1 && p <= 65535) || (allowZero && p == 0)
}

// debug reports whether the server logs its debug lines.
func (c config) debug() bool { return c.LogLevel == "debug" || c.LogLevel == "trace" }

// validate rejects configurations that nats-server would refuse later with a
// less direct message, or that would run but not work for handoff.
func (c config) validate() error {
	var errs []error
	if !validPort(c.Port, false) {
		errs = append(errs, fmt.Errorf("--port %d: want 1..65535 or -1", c.Port))
	}
	if !validPort(c.HTTPPort, true) {
		errs = append(errs, fmt.Errorf("--http-port %d: want 1..65535, 0 (off) or -1", c.HTTPPort))
	}
	if (c.User == "") != (c.Password == "") {
		errs = append(errs, errors.New("--user and --password go together (env NATS_USER, NATS_PASSWORD)"))
	}
	if c.MaxPayload <= 0 || c.MaxPayload > 64<<20 {
		errs = append(errs, fmt.Errorf("--max-payload %d: want 1 byte..64MiB", c.MaxPayload))
	}
	if c.LameDuck < 0 {
		errs = append(errs, fmt.Errorf("--lame-duck-duration %v: negative", c.LameDuck))
	}
	if c.PingEvery < time.Second {
		errs = append(errs, fmt.Errorf("--ping-interval %v: want at least 1s", c.PingEvery))
	}
	if c.MaxPingsOut < 1 {
		errs = append(errs, fmt.Errorf("--max-pings-out %d: want at least 1", c.MaxPingsOut))
	}
	if c.clustered() {
		if !validPort(c.ClusterPort, false) {
			errs = append(errs, fmt.Errorf("--cluster-port %d: want 1..65535 or -1", c.ClusterPort))
		}
		if c.ClusterName == "" {
			errs = append(errs, errors.New("--routes needs --cluster-name (all members use the same name)"))
		}
		for _, r := range c.Routes {
			u, err := url.Parse(r)
			if err != nil || u.Scheme != "nats" || u.Host == "" {
				errs = append(errs, fmt.Errorf("--routes %q: want nats://host:port", r))
			}
		}
	}
	// HANDOFF_LOG_LEVEL is shared with the workers, which take the same
	// names (trace as debug).
	switch c.LogLevel {
	case "error", "warn", "info", "debug", "trace":
	default:
		errs = append(errs, fmt.Errorf("--log-level %q: want error, warn, info, debug or trace", c.LogLevel))
	}
	switch c.LogFormat {
	case "json", "text":
	default:
		errs = append(errs, fmt.Errorf("--log-format %q: want json or text", c.LogFormat))
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", errConfig, errors.Join(errs...))
	}
	return nil
}

func (c config) clustered() bool { return c.ClusterName != "" || len(c.Routes) > 0 }

// serverOptions maps the configuration onto nats-server options. Signals are
// left to this program (NoSigs), so SIGTERM follows the drain path in serve.
func (c config) serverOptions() *server.Options {
	o := &server.Options{
		ServerName:         c.ServerName,
		Host:               c.Host,
		Port:               c.Port,
		HTTPHost:           c.HTTPHost,
		HTTPPort:           c.HTTPPort,
		JetStream:          c.JetStream,
		StoreDir:           c.StoreDir,
		JetStreamMaxMemory: c.JSMaxMemory,
		JetStreamMaxStore:  c.JSMaxStore,
		MaxPayload:         int32(c.MaxPayload),
		Username:           c.User,
		Password:           c.Password,
		NoSigs:             true,
		LameDuckDuration:   c.LameDuck,
		PingInterval:       c.PingEvery,
		MaxPingsOut:        c.MaxPingsOut,
		Debug:              c.debug(),
		Trace:              c.LogLevel == "trace",
	}
	if o.HTTPHost == "" {
		o.HTTPHost = c.Host
	}
	if c.JSMaxMemory == 0 {
		o.JetStreamMaxMemory = -1
	}
	if c.JSMaxStore == 0 {
		o.JetStreamMaxStore = -1
	}
	if c.LameDuck > 0 {
		// The grace period must stay below the duration; nats-server's
		// default (10 s) would reject short durations.
		o.LameDuckGracePeriod = c.LameDuck / 4
	}
	if c.clustered() {
		o.Cluster.Name = c.ClusterName
		o.Cluster.Host = c.ClusterHost
		if o.Cluster.Host == "" {
			o.Cluster.Host = c.Host
		}
		o.Cluster.Port = c.ClusterPort
		if len(c.Routes) > 0 {
			o.Routes = server.RoutesFromStr(strings.Join(c.Routes, ","))
		}
	}
	return o
}
