package rdma

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRemoteErrorRoundTrip(t *testing.T) {
	for c := codeUnknownGrant; c < numCodes; c++ {
		if c == codeInternal {
			continue
		}
		s := codeSentinels[c]
		require.NotNil(t, s, "code %d", c)
		err := fmt.Errorf("context: %w", s)
		require.Equal(t, c, codeOf(err))
		re := remoteErr("peer", err)
		require.ErrorIs(t, re, s)
		var r *RemoteError
		require.ErrorAs(t, re, &r)
		require.Contains(t, r.Error(), "peer")
	}
	require.Equal(t, codeInternal, codeOf(errors.New("other")))
	require.Equal(t, codeOK, codeOf(nil))
	require.NoError(t, (&RemoteError{Code: 999}).Unwrap())
	// A late frame after a revoke is reported as revoked, not merely stale.
	late := fmt.Errorf("%w: epoch 3: %w", ErrStaleEpoch, ErrRevoked)
	require.Equal(t, codeRevoked, codeOf(late))
}
