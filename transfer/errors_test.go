package transfer

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/transfer/session"
)

func TestRemoteErrorMatchesSentinel(t *testing.T) {
	for c := session.Code(1); c < session.NumCodes; c++ {
		err := fmt.Errorf("wrapped: %w", &RemoteError{Code: c, Msg: "m", Instance: "p1"})
		require.ErrorIs(t, err, codeErr(c), c.String())
		require.Equal(t, c, codeOf(err))
		require.Equal(t, c, codeOf(fmt.Errorf("x: %w", codeErr(c))))
		for o := session.Code(1); o < session.NumCodes; o++ {
			if o != c {
				require.NotErrorIs(t, err, codeErr(o))
			}
		}
	}
	require.Equal(t, session.CodeOK, codeOf(nil))
	require.Equal(t, session.CodePeerFailed, codeOf(errors.New("other")))
	require.Nil(t, codeErr(session.CodeOK))
	require.ErrorIs(t, codeErr(session.Code(999)), ErrBadMessage)
	require.Equal(t, "code(999)", session.Code(999).String())
}
