//go:build !(linux && cgo && ucx)

package ucx

import "context"

// Available reports whether this build has UCX.
const Available = false

// Version returns the UCX library's version string; empty without UCX.
func Version() string { return "" }

// Worker is a UCP worker; without UCX New returns ErrUnavailable and no
// Worker exists.
type Worker struct{ _ struct{} }

// Op is a message in flight from Post.
type Op struct{ _ struct{} }

// New returns ErrUnavailable: this build has no UCX.
func New(Config) (*Worker, error) { return nil, ErrUnavailable }

func (*Worker) Address() []byte { return nil }
func (*Worker) MaxHeader() int  { return 0 }
func (*Worker) Stats() Stats    { return Stats{} }
func (*Worker) Close() error    { return nil }

func (*Worker) Connect(context.Context, []byte) (EndpointID, error) { return 0, ErrUnavailable }

func (*Worker) EndpointInfo(context.Context, EndpointID) (string, error) { return "", ErrUnavailable }

func (*Worker) CloseEndpoint(context.Context, EndpointID, CloseMode) error { return ErrUnavailable }

func (*Worker) Post(EndpointID, []byte, []byte) (*Op, error) { return nil, ErrUnavailable }

func (*Worker) Send(context.Context, EndpointID, []byte, []byte) error { return ErrUnavailable }

func (*Worker) Fence(context.Context, Token) error { return nil }

func (*Worker) Abort(context.Context, Token) error { return ErrUnavailable }

func (*Op) Done() <-chan struct{}      { return nil }
func (*Op) Err() error                 { return ErrUnavailable }
func (*Op) Wait(context.Context) error { return ErrUnavailable }
