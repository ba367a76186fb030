package service

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/transfer"
	"github.com/handoff-io/handoff/transfer/session"
	"github.com/handoff-io/handoff/worker"
)

// TestClassify: each handoff failure gets the worker's transfer class its
// cause calls for. A remote prefill that did not deliver (its worker died
// or failed mid-way, its executor failed, its bytes disagree with its
// reply, its messages cannot be read) is ErrTransferFailed: with --prefill
// auto the request is prefilled here (worker's fallbackReason), otherwise
// the API answers 503 prefill_failed. A refusal is ErrTransferRefused (a
// local prefill too, or 503 prefill_unavailable), a deadline
// ErrTransferTimeout (504), and a request too long for every pool
// ErrTooLong (400).
func TestClassify(t *testing.T) {
	remote := func(c session.Code) error {
		return fmt.Errorf("transfer: request 3: %w", &transfer.RemoteError{Code: c, Msg: "from the peer", Instance: "p1"})
	}
	local := func(sentinel error) error { return fmt.Errorf("transfer: request 3: %w", sentinel) }
	for _, tc := range []struct {
		name string
		err  error
		want error // nil: left as it is
	}{
		{"too long", fmt.Errorf("transfer: request 3: %w", &transfer.RemoteError{Code: session.CodeCapacityRefused, TooLong: true}), worker.ErrTooLong},
		{"capacity refused", remote(session.CodeCapacityRefused), worker.ErrTransferRefused},
		{"no prefill worker", local(transfer.ErrNoPrefillWorker), worker.ErrTransferRefused},
		{"layout mismatch", remote(session.CodeLayoutMismatch), worker.ErrTransferRefused},
		{"payload too large", local(transfer.ErrPayloadTooLarge), worker.ErrTransferRefused},
		{"dummy request", local(transfer.ErrDummyRequest), worker.ErrTransferRefused},
		{"peer died", local(transfer.ErrPeerFailed), worker.ErrTransferFailed},
		{"peer failed remote", remote(session.CodePeerFailed), worker.ErrTransferFailed},
		{"prefill failed", remote(session.CodePrefillFailed), worker.ErrTransferFailed},
		{"integrity", local(transfer.ErrIntegrity), worker.ErrTransferFailed},
		{"integrity remote", remote(session.CodeIntegrity), worker.ErrTransferFailed},
		{"bad reply", local(transfer.ErrBadMessage), worker.ErrTransferFailed},
		{"bad message remote", remote(session.CodeBadMessage), worker.ErrTransferFailed},
		{"quarantined peer failure", &transfer.QuarantinedError{Err: remote(session.CodePrefillFailed)}, worker.ErrTransferFailed},
		{"timeout", local(transfer.ErrTimeout), worker.ErrTransferTimeout},
		{"closed", local(transfer.ErrClosed), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := classify(context.Background(), tc.err)
			require.ErrorIs(t, got, tc.err, "the cause is kept")
			classes := []error{worker.ErrTooLong, worker.ErrTransferRefused, worker.ErrTransferFailed, worker.ErrTransferTimeout}
			for _, class := range classes {
				require.Equal(t, class == tc.want, errors.Is(got, class), "classify(%v) = %v: matches %v", tc.err, got, class)
			}
		})
	}
	// A handoff ended by the caller's context says so, whatever the cause.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, classify(ctx, local(transfer.ErrCancelled)), context.Canceled)
}
