package rdma

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Memory that outlives its engine (an agent's engine over an engine
// worker's memfd) may be used again once the engine closed. A shm writer
// frozen inside a copy into a grant of the old engine stores into it when
// it wakes: Close alone ends the grant's quarantine at once, so the owner
// quiesces first, and Quiesce returns only once that writer left its copy.
func TestQuiesceOutlastsAFrozenWriter(t *testing.T) {
	if !shmSupported {
		t.Skip("no shm")
	}
	const size = 1 << 20
	fd, err := unix.MemfdCreate("quiesce", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, size))
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	defer unix.Munmap(mem)

	rx, err := New(Config{Agent: "quiesce-rx#1", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer rx.Close()
	_, err = rx.RegisterFD("kv", fd, size)
	require.NoError(t, err)
	tx, err := New(Config{Agent: "quiesce-tx", Transports: []Transport{TransportSHM}, Logger: quietLogger()})
	require.NoError(t, err)
	defer tx.Close()
	src, err := tx.Register("src", size)
	require.NoError(t, err)
	fill(src.Bytes(), 0xAB)

	ext := []Extent{{Region: 1, Offset: 4096, Length: 64 << 10}}
	g, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: ext, Deadline: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	inBracket, thaw := make(chan struct{}), make(chan struct{})
	tx.hooks.Store(&hooks{writing: func(*Ticket, uint64) {
		select {
		case <-inBracket:
		default:
			close(inBracket)
			<-thaw // frozen inside its copy bracket
		}
	}})
	wrote := make(chan error, 1)
	go func() {
		_, err := tx.Write(context.Background(), rx.Descriptor(), g.Ticket(), []Extent{{Region: src.ID(), Offset: 0, Length: 64 << 10}})
		wrote <- err
	}()
	<-inBracket

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	err = rx.Quiesce(ctx)
	require.ErrorIs(t, err, ErrQuarantined, "quiesced while a writer is inside a copy")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.True(t, g.Quarantined())

	quiesced := make(chan error, 1)
	go func() { quiesced <- rx.Quiesce(context.Background()) }()
	select {
	case err := <-quiesced:
		t.Fatalf("quiesced (%v) with the writer still frozen", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(thaw)
	select {
	case err := <-quiesced:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Quiesce did not return once the writer left its copy")
	}
	require.NoError(t, rx.Close())

	// The owner uses its memory again: nothing of the old grant lands.
	for i := range mem {
		mem[i] = 0x11
	}
	select {
	case err := <-wrote:
		require.Error(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the writer did not return")
	}
	require.True(t, bytes.Equal(bytes.Repeat([]byte{0x11}, size), mem), "bytes landed after Quiesce returned")
}
