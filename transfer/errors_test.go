package transfer

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRemoteErrorMatchesSentinel(t *testing.T) {
	for c := Code(1); c < codeCount; c++ {
		err := fmt.Errorf("wrapped: %w", &RemoteError{Code: c, Msg: "m", Instance: "p1"})
		require.ErrorIs(t, err, CodeErr(c), c.String())
		require.Equal(t, c, CodeOf(err))
		require.Equal(t, c, CodeOf(fmt.Errorf("x: %w", CodeErr(c))))
		for o := Code(1); o < codeCount; o++ {
			if o != c {
				require.NotErrorIs(t, err, CodeErr(o))
			}
		}
	}
	require.Equal(t, CodeOK, CodeOf(nil))
	require.Equal(t, CodePeerFailed, CodeOf(errors.New("other")))
	require.Nil(t, CodeErr(CodeOK))
	require.ErrorIs(t, CodeErr(Code(999)), ErrBadMessage)
	require.Equal(t, "code(999)", Code(999).String())
}
