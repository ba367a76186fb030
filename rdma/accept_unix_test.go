//go:build unix

package rdma

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A receiver that runs out of descriptors for a moment (a writer's dial
// completed by the kernel, accept failing with EMFILE) serves writers
// again once some were let go: its accept loop does not end, which would
// leave a listener that completes dials no one answers.
func TestAcceptOutlivesRunningOutOfDescriptors(t *testing.T) {
	const size = 1 << 20
	rx, err := New(Config{Agent: "emfile-rx", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	defer rx.Close()
	_, err = rx.Register("dst", size)
	require.NoError(t, err)
	tx, err := New(Config{Agent: "emfile-tx", Transports: []Transport{TransportTCP}, Logger: quietLogger()})
	require.NoError(t, err)
	defer tx.Close()
	src, err := tx.Register("src", size)
	require.NoError(t, err)
	fill(src.Bytes(), 5)

	// Every descriptor but one taken: the dial below takes the last, so
	// the receiver's accept of it fails.
	var lim unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &lim))
	low := lim
	low.Cur = 256
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	var hogs []*os.File
	release := func() {
		for _, f := range hogs {
			f.Close()
		}
		hogs = nil
		require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	}
	defer release()
	for {
		f, err := os.Open(os.DevNull)
		if err != nil {
			require.ErrorIs(t, err, unix.EMFILE)
			break
		}
		hogs = append(hogs, f)
	}
	hogs[len(hogs)-1].Close()
	hogs = hogs[:len(hogs)-1]
	c, err := net.Dial("tcp", rx.Descriptor().TCPAddr)
	require.NoError(t, err)
	defer c.Close()
	time.Sleep(200 * time.Millisecond) // the receiver's accept fails meanwhile
	release()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	g, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{1, 0, size}}, Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	_, err = tx.Write(ctx, rx.Descriptor(), g.Ticket(), []Extent{{src.ID(), 0, size}})
	require.NoError(t, err, "the receiver took no writer after its accept failed")
	_, err = g.Wait(ctx)
	require.NoError(t, err)
}
