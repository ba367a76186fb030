package service

import (
	"bufio"
	"bytes"
	"encoding/json"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
)

// Each listener logs the address it got (":0" becomes the kernel's port)
// in one "listening" line, named after its flag; the data line also names
// the advertised address. The integration harness relies on these lines.
func TestListenersLogTheirAddress(t *testing.T) {
	ns := natstest.Run(t)
	for _, role := range []worker.Role{worker.RolePrefill, worker.RoleDecode} {
		t.Run(string(role), func(t *testing.T) {
			var mu sync.Mutex
			var logs bytes.Buffer
			cfg := testConfig(t, role, "--nats-url", ns.ClientURL(), "--namespace", "listening-"+string(role),
				"--log-level", "info", "--log-format", "json", "--data-advertise", "proxy.example:7400")
			ep, _ := startWorker(t, cfg, func(o *Options) { o.Stderr = lockedWriter{&mu, &logs} })

			type line struct {
				Msg, Listener, Addr, Advertise, Role string
			}
			got := map[string]line{}
			mu.Lock()
			raw := bytes.Clone(logs.Bytes()) // the lines logged before the worker served
			mu.Unlock()
			sc := bufio.NewScanner(bytes.NewReader(raw))
			for sc.Scan() {
				var l line
				require.NoError(t, json.Unmarshal(sc.Bytes(), &l), sc.Text())
				if l.Msg == "listening" {
					require.NotContains(t, got, l.Listener, "one line per listener")
					got[l.Listener] = l
				}
			}
			want := map[string]line{
				"admin": {Msg: "listening", Listener: "admin", Addr: ep.Admin, Role: string(role)},
				"data":  {Msg: "listening", Listener: "data", Addr: got["data"].Addr, Advertise: "proxy.example:7400", Role: string(role)},
			}
			if role == worker.RoleDecode {
				want["http"] = line{Msg: "listening", Listener: "http", Addr: ep.HTTP, Role: string(role)}
			}
			require.Equal(t, want, got)
			require.Equal(t, "proxy.example:7400", ep.Data, "peers dial the advertised address")
			require.Regexp(t, `^127\.0\.0\.1:[1-9][0-9]*$`, got["data"].Addr, "the data listener's own address")
		})
	}
}
