package wire

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Draft tokens ride in the request (how many) and the reply (which),
// omitted when there are none, so that a message without them encodes as
// before speculative decoding.
func TestDraftsRoundTrip(t *testing.T) {
	req := sampleRequest(4, 2)
	plain, err := EncodePrefillRequest(req, 0)
	require.NoError(t, err)
	req.Drafts = 4
	b, err := EncodePrefillRequest(req, 0)
	require.NoError(t, err)
	require.Greater(t, len(b), len(plain))
	got, err := DecodePrefillRequest(b)
	require.NoError(t, err)
	require.Equal(t, uint8(4), got.Drafts)
	got, err = DecodePrefillRequest(plain)
	require.NoError(t, err)
	require.Zero(t, got.Drafts, "omitted: none")

	rep := sampleReply()
	plain, err = EncodePrefillReply(rep, 0)
	require.NoError(t, err)
	rep.Drafts = Tokens{101, 32, 0, 257}
	b, err = EncodePrefillReply(rep, 0)
	require.NoError(t, err)
	r, err := DecodePrefillReply(b)
	require.NoError(t, err)
	require.Equal(t, rep.Drafts, r.Drafts)
	r, err = DecodePrefillReply(plain)
	require.NoError(t, err)
	require.Nil(t, r.Drafts)
}

func TestDraftsRefused(t *testing.T) {
	for _, tc := range []struct {
		name   string
		drafts Tokens
		want   string
	}{
		{"negative", Tokens{5, -3}, "draft token 1 is -3"},
		{"too many", make(Tokens, MaxDrafts+1), "17 draft tokens, want at most 16"},
	} {
		rep := sampleReply()
		rep.Drafts = tc.drafts
		b, err := EncodePrefillReply(rep, 0)
		require.NoError(t, err)
		_, err = DecodePrefillReply(b)
		require.ErrorIs(t, err, ErrBadMessage, tc.name)
		require.ErrorContains(t, err, tc.want, tc.name)
	}
	req := sampleRequest(4, 2)
	req.Drafts = MaxDrafts + 1
	b, err := EncodePrefillRequest(req, 0)
	require.NoError(t, err)
	_, err = DecodePrefillRequest(b)
	require.ErrorIs(t, err, ErrBadMessage, "a request asking for more than MaxDrafts")
}
