package wire

import (
	"fmt"
	"strings"
)

// DefaultPrefix is the first token of every subject of the protocol.
const DefaultPrefix = "handoff"

// PrefillQueue is the queue group prefill workers serve the shared prefill
// endpoint in: NATS hands each request to exactly one member.
const PrefillQueue = "prefill"

// ServiceName is the NATS micro service name prefill workers register under
// (`nats micro ls` lists them): a decoder pings a prefill instance at
// $SRV.PING.<ServiceName>.<Instance.Service>.
const ServiceName = "handoff-prefill"

// ServiceVersion is the micro service version: the wire version as semver.
const ServiceVersion = "1.0.0"

// SubjectKind names one subject of the protocol.
type SubjectKind uint8

const (
	// SubjectPrefill is the shared prefill endpoint (queue group PrefillQueue):
	// <prefix>.<ns>.prefill
	SubjectPrefill SubjectKind = iota
	// SubjectInstancePrefill is one instance's own prefill endpoint, used to
	// retry on a chosen worker: <prefix>.<ns>.inst.<id>.prefill
	SubjectInstancePrefill
	// SubjectInstanceCancel is one instance's cancel subject:
	// <prefix>.<ns>.inst.<id>.cancel
	SubjectInstanceCancel
	// SubjectCancel reaches every prefill instance of the namespace, for a
	// request whose serving instance is not known yet: <prefix>.<ns>.cancel
	SubjectCancel
	// SubjectInstanceReconnected is where a prefill instance says that its
	// NATS connection dropped and came back, so requests or replies in
	// flight may have been lost: <prefix>.<ns>.inst.<id>.reconnected
	SubjectInstanceReconnected
	// SubjectInstanceEvents carries an instance's cache events (package
	// kvevents), every rank's stream: <prefix>.<ns>.inst.<id>.kvevents.
	// A subscriber to every instance's passes "*" as the instance.
	SubjectInstanceEvents
	// SubjectInstanceEventsSync is where a consumer that lost track of
	// one of an instance's event streams asks for a snapshot:
	// <prefix>.<ns>.inst.<id>.kvevents.sync
	SubjectInstanceEventsSync
	// SubjectInstanceStateOffer is where a prefill instance hears that a
	// decode instance holds a conversation's end-of-turn state (StateOffer):
	// <prefix>.<ns>.inst.<id>.state.offer
	SubjectInstanceStateOffer
)

// Subject builds every subject of the protocol; nothing else formats subjects.
// prefix, ns and instance must be valid tokens (see ValidToken); instance is
// ignored for the namespace-wide kinds.
func Subject(prefix, ns string, kind SubjectKind, instance string) string {
	switch kind {
	case SubjectPrefill:
		return prefix + "." + ns + ".prefill"
	case SubjectInstancePrefill:
		return prefix + "." + ns + ".inst." + instance + ".prefill"
	case SubjectInstanceCancel:
		return prefix + "." + ns + ".inst." + instance + ".cancel"
	case SubjectCancel:
		return prefix + "." + ns + ".cancel"
	case SubjectInstanceReconnected:
		return prefix + "." + ns + ".inst." + instance + ".reconnected"
	case SubjectInstanceEvents:
		return prefix + "." + ns + ".inst." + instance + ".kvevents"
	case SubjectInstanceEventsSync:
		return prefix + "." + ns + ".inst." + instance + ".kvevents.sync"
	case SubjectInstanceStateOffer:
		return prefix + "." + ns + ".inst." + instance + ".state.offer"
	default:
		panic(fmt.Sprintf("transfer: unknown subject kind %d", kind))
	}
}

// BucketName is the JetStream KV bucket holding the namespace's instances.
func BucketName(prefix, ns string) string { return prefix + "_" + ns }

// ValidToken reports whether s can be used as one subject token and in a
// bucket name: 1-64 characters of [A-Za-z0-9_-].
func ValidToken(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	return strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-')
	}) < 0
}
