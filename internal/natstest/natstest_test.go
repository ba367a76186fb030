package natstest

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

func TestRun(t *testing.T) {
	var s *server.Server
	t.Run("server", func(t *testing.T) {
		s = Run(t, func(o *server.Options) { o.Username, o.Password = "u", "p" })
		require.True(t, s.JetStreamEnabled())
		_, err := nats.Connect(s.ClientURL())
		require.Error(t, err, "the mutator's credentials are required")
		nc := Connect(t, s, nats.UserInfo("u", "p"))
		require.NoError(t, nc.Publish("x", nil))
		require.NoError(t, nc.Flush())
	})
	require.False(t, s.Running(), "stopped when the test ended")
}

func TestRestartSamePort(t *testing.T) {
	opts := Options(t.TempDir())
	s, err := Start(opts)
	require.NoError(t, err)
	opts.Port = s.Addr().(*net.TCPAddr).Port
	url := s.ClientURL()
	Stop(s)
	Stop(s) // a second Stop does nothing
	s, err = Start(opts)
	require.NoError(t, err)
	defer Stop(s)
	require.Equal(t, url, s.ClientURL())
}

func TestCheckFor(t *testing.T) {
	n := 0
	CheckFor(t, time.Second, time.Millisecond, func() error {
		if n++; n < 3 {
			return errors.New("not yet")
		}
		return nil
	})
	require.Equal(t, 3, n)
}
