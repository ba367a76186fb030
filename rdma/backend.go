package rdma

import "context"

// link is the writer side of one transport to one peer. Implementations:
// inprocLink, tcpLink (tcp, and cuda-ipc with pull frames), shmLink. A
// GPUDirect RDMA (verbs) link would be another, in a build-tagged file.
type link interface {
	transport() Transport
	// write lands op's pieces in the peer's grant, then commits with
	// op.manifest (filling its CRCs through op.sum) and returns the
	// receiver's verdict. It must not touch source memory after returning.
	write(ctx context.Context, op *writeOp) error
	// close releases the link; in-flight writes fail.
	close()
}

// remoteErr turns a receiver-side error into the writer's *RemoteError.
func remoteErr(agent AgentID, err error) error {
	if err == nil {
		return nil
	}
	return &RemoteError{Agent: agent, Code: codeOf(err), Msg: err.Error()}
}
