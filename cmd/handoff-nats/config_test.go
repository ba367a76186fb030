package main

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/worker"
	workerconfig "github.com/handoff-io/handoff/worker/config"
)

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestParseServe(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		check   func(t *testing.T, c config)
		wantErr string
	}{
		{
			name: "defaults",
			env:  map[string]string{"POD_NAME": "nats-0"},
			check: func(t *testing.T, c config) {
				require.Equal(t, "0.0.0.0", c.Host)
				require.Equal(t, 4222, c.Port)
				require.Equal(t, 8222, c.HTTPPort)
				require.True(t, c.JetStream)
				require.Equal(t, int64(8<<20), c.MaxPayload)
				require.Equal(t, "nats-0", c.ServerName)
				require.False(t, c.clustered())
				require.Equal(t, "json", c.LogFormat)
				o := c.serverOptions()
				require.Equal(t, 10*time.Second, o.PingInterval)
				require.Equal(t, 3, o.MaxPingsOut)
			},
		},
		{
			name: "env fills what flags leave out",
			env: map[string]string{
				"HANDOFF_NATS_PORT": "5222", "HANDOFF_NATS_HTTP_PORT": "0", "HANDOFF_NATS_STORE_DIR": "/data",
				"NATS_USER": "u", "NATS_PASSWORD": "p", "HANDOFF_NATS_MAX_PAYLOAD": "2MiB",
				"HANDOFF_NATS_JETSTREAM": "false", "HANDOFF_NATS_JS_MAX_STORE": "10GiB",
			},
			check: func(t *testing.T, c config) {
				require.Equal(t, 5222, c.Port)
				require.Equal(t, 0, c.HTTPPort)
				require.Equal(t, "/data", c.StoreDir)
				require.Equal(t, "u", c.User)
				require.Equal(t, "p", c.Password)
				require.Equal(t, int64(2<<20), c.MaxPayload)
				require.False(t, c.JetStream)
				require.Equal(t, int64(10<<30), c.JSMaxStore)
			},
		},
		{
			name: "flag wins over env",
			args: []string{"--port", "6000", "--store-dir=/flag"},
			env:  map[string]string{"HANDOFF_NATS_PORT": "5222", "HANDOFF_NATS_STORE_DIR": "/env"},
			check: func(t *testing.T, c config) {
				require.Equal(t, 6000, c.Port)
				require.Equal(t, "/flag", c.StoreDir)
			},
		},
		{
			name: "cluster from env",
			env: map[string]string{
				"HANDOFF_NATS_CLUSTER_NAME": "handoff",
				"HANDOFF_NATS_ROUTES":       "nats://nats-0.nats:6222, nats://nats-1.nats:6222,,",
				"HANDOFF_NATS_SERVER_NAME":  "nats-2",
			},
			check: func(t *testing.T, c config) {
				require.True(t, c.clustered())
				require.Equal(t, []string{"nats://nats-0.nats:6222", "nats://nats-1.nats:6222"}, c.Routes)
				o := c.serverOptions()
				require.Equal(t, "handoff", o.Cluster.Name)
				require.Equal(t, 6222, o.Cluster.Port)
				require.Len(t, o.Routes, 2)
				require.Equal(t, "nats-2", o.ServerName)
			},
		},
		{
			name: "lame duck keeps grace below duration",
			args: []string{"--lame-duck-duration", "8s"},
			check: func(t *testing.T, c config) {
				o := c.serverOptions()
				require.Equal(t, 8*time.Second, o.LameDuckDuration)
				require.Less(t, o.LameDuckGracePeriod, o.LameDuckDuration)
				require.True(t, o.NoSigs)
			},
		},
		{name: "bad env names the variable", env: map[string]string{"HANDOFF_NATS_PORT": "abc"}, wantErr: "HANDOFF_NATS_PORT"},
		{name: "bad size", args: []string{"--max-payload", "lots"}, wantErr: "max-payload"},
		{name: "payload too large", args: []string{"--max-payload", "65MiB"}, wantErr: "64MiB"},
		{name: "user without password", args: []string{"--user", "u"}, wantErr: "--user and --password"},
		{name: "password without user", env: map[string]string{"NATS_PASSWORD": "p"}, wantErr: "--user and --password"},
		{name: "routes need a cluster name", args: []string{"--routes", "nats://a:6222"}, wantErr: "--cluster-name"},
		{name: "bad route", args: []string{"--cluster-name", "c", "--routes", "http://a:6222"}, wantErr: "nats://host:port"},
		{name: "port out of range", args: []string{"--port", "70000"}, wantErr: "--port 70000"},
		{name: "port zero", args: []string{"--port", "0"}, wantErr: "--port 0"},
		{name: "bad log level", args: []string{"--log-level", "loud"}, wantErr: "--log-level"},
		{name: "bad log format", args: []string{"--log-format", "xml"}, wantErr: "--log-format"},
		{name: "negative lame duck", args: []string{"--lame-duck-duration", "-1s"}, wantErr: "negative"},
		{name: "ping interval too short", args: []string{"--ping-interval", "10ms"}, wantErr: "--ping-interval"},
		{name: "no pings out", env: map[string]string{"HANDOFF_NATS_MAX_PINGS_OUT": "0"}, wantErr: "--max-pings-out"},
		{name: "stray argument", args: []string{"serve2"}, wantErr: "unexpected argument"},
		{name: "unknown flag", args: []string{"--nope"}, wantErr: "not defined"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseServe(tt.args, envOf(tt.env), io.Discard)
			if tt.wantErr != "" {
				require.ErrorIs(t, err, errConfig)
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			tt.check(t, c)
		})
	}
}

func TestParseServeHelp(t *testing.T) {
	_, err := parseServe([]string{"--help"}, envOf(nil), io.Discard)
	require.ErrorIs(t, err, errHelp)
}

// HANDOFF_LOG_LEVEL is shared with the workers: each level one takes, the
// other takes too (the workers read trace as debug), so exporting it once
// for a whole pair does not stop one of them.
func TestLogLevelSharedWithTheWorkers(t *testing.T) {
	for _, lvl := range []string{"error", "warn", "info", "debug", "trace", "WARN", "Debug", "warning"} {
		c, err := parseServe(nil, envOf(map[string]string{"HANDOFF_LOG_LEVEL": lvl}), io.Discard)
		require.NoError(t, err, lvl)
		_, err = workerconfig.Parse(worker.RolePrefill, nil, envOf(map[string]string{"HANDOFF_LOG_LEVEL": lvl}), io.Discard)
		require.NoError(t, err, lvl)
		l := strings.ToLower(lvl)
		require.Equal(t, l == "debug" || l == "trace", c.serverOptions().Debug, lvl)
	}
}
