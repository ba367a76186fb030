//go:build !(linux && cgo && ucx)

package rdma

func ucxTestTransports() []Transport { return nil }

func cutUCXWriters(*Engine) int { return 0 }

func ucxStopAt(Transport) uint64 { return 0 }

func ucxConns(*Engine) int { return 0 }

func ucxPeerErrors(*Engine) uint64 { return 0 }

func ucxEndpoints(*Engine) int64 { return 0 }
