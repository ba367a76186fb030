package config

import (
	"bytes"
	"errors"
	"flag"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/transfer/wire"
	"github.com/handoff-io/handoff/worker"
)

func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestDefaults(t *testing.T) {
	c, err := Parse(worker.RoleDecode, nil, envOf(map[string]string{"POD_NAME": "decode-0"}), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, DefaultNATSURL, c.NATS.URL)
	require.Equal(t, "default", c.Namespace)
	require.Equal(t, "decode-0", c.InstanceID)
	require.Equal(t, "tiny-hybrid", c.Model)
	require.Equal(t, 1, c.DPSize)
	require.False(t, c.AttentionDP)
	require.Equal(t, 8, c.MaxBatchSize)
	require.Equal(t, 16, c.TokensPerBlock)
	require.Equal(t, ":8000", c.HTTPAddr)
	require.Equal(t, ":9091", c.AdminAddr)
	require.Equal(t, ":7400", c.DataAddr)
	require.Equal(t, "remote", c.Prefill)
	require.Equal(t, 30*time.Second, c.DrainTimeout)
	require.Equal(t, slog.LevelInfo, c.LogLevel)
	require.Equal(t, "json", c.LogFormat)
	require.False(t, c.Standalone)
	require.Equal(t, 4, c.TCPLanes)
	require.Equal(t, 30*time.Second, c.WriteTimeout)
	require.Equal(t, 30*time.Second, c.PrefillGrace)
	require.Equal(t, worker.DefaultAutoMinRemoteTokens, c.AutoMinTokens)
	require.Equal(t, worker.DefaultAutoMaxPrefillQueue, c.AutoMaxQueue)

	p, err := Parse(worker.RolePrefill, nil, envOf(nil), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, ":9090", p.AdminAddr)
	require.NotEmpty(t, p.InstanceID)
	require.True(t, validToken(p.InstanceID))
}

func TestPrecedence(t *testing.T) {
	env := envOf(map[string]string{
		"HANDOFF_DP_SIZE": "4", "NATS_URL": "nats://env:4222", "HANDOFF_LOG_LEVEL": "debug",
		"HANDOFF_DRAIN_TIMEOUT": "5s", "POD_IP": "10.1.2.3", "HANDOFF_PREFILL": "local", "HANDOFF_TCP_LANES": "2",
	})
	c, err := Parse(worker.RoleDecode, []string{"--dp-size", "2", "--data-addr", ":7500"}, env, &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, 2, c.DPSize, "flag wins over env")
	require.True(t, c.AttentionDP, "defaults to true with dp-size > 1")
	require.Equal(t, "nats://env:4222", c.NATS.URL, "env wins over default")
	require.Equal(t, slog.LevelDebug, c.LogLevel)
	require.Equal(t, 5*time.Second, c.DrainTimeout)
	require.Equal(t, "10.1.2.3:7500", c.DataAdvertise)
	require.Equal(t, "local", c.Prefill)
	require.Equal(t, 2, c.TCPLanes)

	c, err = Parse(worker.RoleDecode, []string{"--dp-size=2", "--attention-dp=false", "--standalone"}, envOf(nil), &bytes.Buffer{})
	require.NoError(t, err)
	require.False(t, c.AttentionDP)
	require.True(t, c.Standalone)
}

func TestPrefillAuto(t *testing.T) {
	c, err := Parse(worker.RoleDecode, []string{"--prefill", "auto", "--prefill-auto-min-tokens", "1024"},
		envOf(map[string]string{"HANDOFF_PREFILL_AUTO_MAX_QUEUE": "2"}), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, "auto", c.Prefill)
	require.Equal(t, 1024, c.AutoMinTokens)
	require.Equal(t, 2, c.AutoMaxQueue)

	c, err = Parse(worker.RoleDecode, []string{"--standalone", "--prefill", "auto"}, envOf(nil), &bytes.Buffer{})
	require.NoError(t, err, "standalone runs a prefill worker, which auto may use")
	require.Equal(t, "auto", c.Prefill)
}

func TestInvalid(t *testing.T) {
	tests := []struct {
		name string
		role worker.Role
		args []string
		env  map[string]string
	}{
		{"dp size zero", worker.RoleDecode, []string{"--dp-size", "0"}, nil},
		{"batch zero", worker.RolePrefill, []string{"--max-batch-size", "0"}, nil},
		{"tokens per block not pow2", worker.RoleDecode, []string{"--tokens-per-block", "12"}, nil},
		{"bad transport", worker.RoleDecode, []string{"--transport", "carrier-pigeon"}, nil},
		{"bad prefill", worker.RoleDecode, []string{"--prefill", "elsewhere"}, nil},
		{"bad log format", worker.RoleDecode, []string{"--log-format", "xml"}, nil},
		{"bad log level", worker.RoleDecode, []string{"--log-level", "loud"}, nil},
		{"bad env int", worker.RoleDecode, nil, map[string]string{"HANDOFF_DP_SIZE": "two"}},
		{"bad env duration", worker.RolePrefill, nil, map[string]string{"HANDOFF_DRAIN_TIMEOUT": "soon"}},
		{"bad namespace", worker.RoleDecode, []string{"--namespace", "a.b"}, nil},
		{"cert without key", worker.RoleDecode, []string{"--nats-cert", "c.pem"}, nil},
		{"standalone with local", worker.RoleDecode, []string{"--standalone", "--prefill", "local"}, nil},
		{"decode flag on prefill", worker.RolePrefill, []string{"--http-addr", ":1"}, nil},
		{"stray argument", worker.RoleDecode, []string{"extra"}, nil},
		{"bad attention dp", worker.RoleDecode, []string{"--attention-dp", "maybe"}, nil},
		{"bad standalone", worker.RoleDecode, []string{"--standalone=maybe"}, nil},
		{"zero write timeout", worker.RoleDecode, []string{"--write-timeout", "0s"}, nil},
		{"negative prefill grace", worker.RoleDecode, nil, map[string]string{"HANDOFF_PREFILL_GRACE": "-1s"}},
		{"prefill grace on prefill", worker.RolePrefill, []string{"--prefill-grace", "1s"}, nil},
		{"bad env standalone", worker.RoleDecode, nil, map[string]string{"HANDOFF_STANDALONE": "maybe"}},
		{"no tcp lanes", worker.RolePrefill, []string{"--tcp-lanes", "0"}, nil},
		{"data TLS with ucx", worker.RoleDecode, []string{"--transport", "ucx", "--data-tls-ca", "ca.pem", "--data-tls-cert", "c.pem", "--data-tls-key", "k.pem"}, nil},
		{"http port out of range", worker.RoleDecode, []string{"--http-addr", "127.0.0.1:99999"}, nil},
		{"http address without a port", worker.RoleDecode, []string{"--http-addr", "127.0.0.1"}, nil},
		{"admin port out of range", worker.RolePrefill, []string{"--admin-addr", ":70000"}, nil},
		{"data port not a port", worker.RolePrefill, []string{"--data-addr", ":seventy"}, nil},
		{"advertise without a port", worker.RoleDecode, []string{"--data-advertise", "10.0.0.5"}, nil},
		{"advertise port out of range", worker.RolePrefill, nil, map[string]string{"HANDOFF_DATA_ADVERTISE": "10.0.0.5:99999"}},
		{"advertise without a host", worker.RoleDecode, []string{"--data-advertise", ":7400"}, nil},
		{"advertise a wildcard", worker.RoleDecode, []string{"--data-advertise", "0.0.0.0:7400"}, nil},
		{"negative auto min tokens", worker.RoleDecode, []string{"--prefill-auto-min-tokens", "-1"}, nil},
		{"zero auto max queue", worker.RoleDecode, nil, map[string]string{"HANDOFF_PREFILL_AUTO_MAX_QUEUE": "0"}},
		{"auto threshold on prefill", worker.RolePrefill, []string{"--prefill-auto-min-tokens", "1"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse(tt.role, tt.args, envOf(tt.env), &bytes.Buffer{})
			require.Error(t, err)
		})
	}
}

// TestTokenLength checks that config refuses, by flag name, the namespaces and
// instance ids transfer would refuse at start-up for their length, and that a
// long pod name still makes a valid default instance id.
func TestTokenLength(t *testing.T) {
	at, over := strings.Repeat("p", maxTokenLen), strings.Repeat("p", maxTokenLen+1)
	require.True(t, wire.ValidToken(at))
	require.False(t, wire.ValidToken(over))

	c, err := Parse(worker.RolePrefill, []string{"--instance-id", at, "--namespace", at}, envOf(nil), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, at, c.InstanceID)

	for _, flag := range []string{"--instance-id", "--namespace"} {
		_, err = Parse(worker.RolePrefill, []string{flag, over}, envOf(nil), &bytes.Buffer{})
		require.ErrorIs(t, err, ErrInvalid)
		require.ErrorContains(t, err, flag+" \""+over+"\": want 1-64 letters")
	}
	_, err = Parse(worker.RoleDecode, nil, envOf(map[string]string{"HANDOFF_INSTANCE_ID": over}), &bytes.Buffer{})
	require.ErrorContains(t, err, "--instance-id")

	// Pod names up to 253 characters; two that differ only in their tail
	// must not collide once cut.
	long := strings.Repeat("decode-statefulset-", 10)
	a, err := Parse(worker.RoleDecode, nil, envOf(map[string]string{"POD_NAME": long + "x7k2q"}), &bytes.Buffer{})
	require.NoError(t, err)
	b, err := Parse(worker.RoleDecode, nil, envOf(map[string]string{"POD_NAME": long + "m4v9z"}), &bytes.Buffer{})
	require.NoError(t, err)
	require.Len(t, a.InstanceID, maxTokenLen)
	require.True(t, wire.ValidToken(a.InstanceID))
	require.True(t, strings.HasPrefix(a.InstanceID, "decode-statefulset-"))
	require.NotEqual(t, a.InstanceID, b.InstanceID)

	// A name that fits is kept as it is, only sanitized.
	c, err = Parse(worker.RoleDecode, nil, envOf(map[string]string{"POD_NAME": "decode.0"}), &bytes.Buffer{})
	require.NoError(t, err)
	require.Equal(t, "decode-0", c.InstanceID)
}

// TestValidTokenMatchesTransfer checks config's copy of the token grammar
// against transfer's, which the subjects and the registry bucket use.
func TestValidTokenMatchesTransfer(t *testing.T) {
	for _, s := range []string{
		"", "a", "decode-0", "prefill_1", "A-Z_09", "a.b", "a b", "a*", "a>", "é", "a/b",
		strings.Repeat("x", maxTokenLen-1), strings.Repeat("x", maxTokenLen),
		strings.Repeat("x", maxTokenLen+1), strings.Repeat("x", 253),
	} {
		require.Equal(t, wire.ValidToken(s), validToken(s), "%q", s)
	}
}

func TestHelpNamesEnv(t *testing.T) {
	var out bytes.Buffer
	_, err := Parse(worker.RoleDecode, []string{"--help"}, envOf(nil), &out)
	require.True(t, errors.Is(err, flag.ErrHelp))
	for _, env := range []string{"NATS_URL", "NATS_CREDS", "NATS_NKEY", "NATS_USER", "NATS_PASSWORD", "NATS_CA",
		"NATS_CERT", "NATS_KEY", "HANDOFF_NAMESPACE", "HANDOFF_INSTANCE_ID", "HANDOFF_MODEL", "HANDOFF_DP_SIZE",
		"HANDOFF_ATTENTION_DP", "HANDOFF_MAX_BATCH_SIZE", "HANDOFF_TOKENS_PER_BLOCK", "HANDOFF_KV_BLOCKS",
		"HANDOFF_DATA_ADDR", "HANDOFF_DATA_ADVERTISE", "HANDOFF_TRANSPORT", "HANDOFF_ADMIN_ADDR",
		"HANDOFF_LOG_LEVEL", "HANDOFF_LOG_FORMAT", "HANDOFF_DRAIN_TIMEOUT", "HANDOFF_HTTP_ADDR", "HANDOFF_PREFILL"} {
		require.Contains(t, out.String(), "(env "+env+")")
	}
}

func TestAdminDial(t *testing.T) {
	require.Equal(t, "127.0.0.1:9091", AdminDial(worker.RoleDecode, envOf(nil)))
	require.Equal(t, "127.0.0.1:9090", AdminDial(worker.RolePrefill, envOf(nil)))
	for addr, want := range map[string]string{
		"0.0.0.0:9999": "127.0.0.1:9999", ":9999": "127.0.0.1:9999", "[::]:9999": "127.0.0.1:9999",
		"10.0.0.5:9091": "10.0.0.5:9091", "[fd00::5]:9091": "[fd00::5]:9091", "localhost:9191": "localhost:9191",
	} {
		require.Equal(t, want, AdminDial(worker.RolePrefill, envOf(map[string]string{"HANDOFF_ADMIN_ADDR": addr})), addr)
	}
}
