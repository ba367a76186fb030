package transfer

import "sync"

// msgBufs holds the drivers' encode buffers. NATS copies a message into its
// own write buffer before Publish returns, so a buffer is reused at once.
var msgBufs = sync.Pool{New: func() any { return new([]byte) }}

func getMsgBuf() *[]byte { return msgBufs.Get().(*[]byte) }

func putMsgBuf(b *[]byte, used []byte) {
	if cap(used) > 64<<10 { // a rare big prompt: let it go
		return
	}
	*b = used[:0]
	msgBufs.Put(b)
}
