package transfer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/handoff-io/handoff/transfer/wire"
)

// RegistryConfig configures a Registry.
type RegistryConfig struct {
	Prefix    string        // default DefaultPrefix
	Namespace string        // required, a valid token
	TTL       time.Duration // how long an entry lives without a heartbeat; default 6s
	Heartbeat time.Duration // how often announce refreshes the entry; default TTL/3
	// Replicas is the bucket's replication: 0 picks 3 on a clustered server
	// (falling back to 1 where the cluster cannot place 3), else 1. A
	// replicated bucket keeps discovery alive when a node holding it dies.
	Replicas int
	Logger   *slog.Logger
}

func (c *RegistryConfig) validate() error {
	if c.Prefix == "" {
		c.Prefix = wire.DefaultPrefix
	}
	if !wire.ValidToken(c.Prefix) || !wire.ValidToken(c.Namespace) {
		return fmt.Errorf("%w: prefix %q and namespace %q must be tokens of [A-Za-z0-9_-]", ErrInvalidConfig, c.Prefix, c.Namespace)
	}
	if c.TTL == 0 {
		c.TTL = 6 * time.Second
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = c.TTL / 3
	}
	if c.TTL < time.Second || c.Heartbeat <= 0 || c.Heartbeat >= c.TTL {
		return fmt.Errorf("%w: registry ttl %v must be >= 1s and exceed the heartbeat %v", ErrInvalidConfig, c.TTL, c.Heartbeat)
	}
	if c.Replicas < 0 || c.Replicas > 5 {
		return fmt.Errorf("%w: registry replicas %d not in 0..5 (0: auto)", ErrInvalidConfig, c.Replicas)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Registry is the namespace's instance directory: a JetStream KV bucket whose
// entries (one per instance, key "<role>.<id>") expire after TTL unless
// refreshed. The Decoder or Prefiller that opened it keeps its own entry
// alive (announce) and mirrors the entries of the role it talks to into
// memory (watch), dropping them when they are deleted or expire; Instances
// reads that mirror. Its goroutines stop when its driver closes.
type Registry struct {
	cfg  RegistryConfig
	js   jetstream.JetStream
	kcfg jetstream.KeyValueConfig

	mu      sync.Mutex
	kv      jetstream.KeyValue // replaced when the bucket is recreated
	closed  bool
	entries map[string]wire.Instance // by instance id
	// seen is when each entry was last received, on this host's monotonic
	// clock: liveness never compares the announcer's wall clock with ours.
	seen      map[string]time.Time
	revs      map[string]uint64 // bucket revision of each entry as received
	onChanges []func(inst wire.Instance, gone bool)

	stop chan struct{}
	// life bounds the watches' subscriptions: nats.go unsubscribes a KV
	// watcher when the context it was created with ends, so it must not be
	// the caller's. Cancelled by close.
	life     context.Context
	lifeStop context.CancelFunc
	wg       sync.WaitGroup
	self     string // key of the announced entry
	selfRev  uint64 // bucket revision of this process's last put of it
	// putMu orders the puts of the entry (heartbeats, refreshes), so that
	// selfRev is the revision of the last one, which close deletes.
	putMu  sync.Mutex
	selfFn func() wire.Instance // what announce publishes
}

// openRegistry creates or opens the namespace's bucket.
func openRegistry(ctx context.Context, nc *nats.Conn, cfg RegistryConfig) (*Registry, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("transfer: registry: %w", err)
	}
	kcfg := jetstream.KeyValueConfig{
		Bucket:         wire.BucketName(cfg.Prefix, cfg.Namespace),
		Description:    "handoff instances: data-plane descriptor, layout fingerprint, capacity",
		TTL:            cfg.TTL,
		History:        1,
		Storage:        jetstream.MemoryStorage,
		LimitMarkerTTL: cfg.TTL, // watchers hear about expiries
		Replicas:       cfg.Replicas,
	}
	if kcfg.Replicas == 0 {
		kcfg.Replicas = 1
		if nc.ConnectedClusterName() != "" {
			kcfg.Replicas = 3 // openWhenReady falls back to 1 where the cluster cannot
		}
	}
	r := &Registry{cfg: cfg, js: js, kcfg: kcfg, entries: map[string]wire.Instance{}, seen: map[string]time.Time{}, revs: map[string]uint64{}, stop: make(chan struct{})}
	if err := r.openWhenReady(ctx); err != nil {
		return nil, err
	}
	r.life, r.lifeStop = context.WithCancel(context.Background())
	return r, nil
}

// open creates the bucket, or opens it when it exists, and makes it the one
// the registry uses. Called again when the bucket is found missing: its
// storage is memory, so a restarted NATS server has lost it.
func (r *Registry) open(ctx context.Context) error {
	r.mu.Lock()
	kcfg := r.kcfg
	r.mu.Unlock()
	kv, err := r.js.CreateOrUpdateKeyValue(ctx, kcfg)
	if errors.Is(err, jetstream.ErrLimitMarkerTTLNotSupported) {
		kcfg.LimitMarkerTTL = 0 // older server: expiry is then detected from receipt time alone
		kv, err = r.js.CreateOrUpdateKeyValue(ctx, kcfg)
	}
	if err != nil {
		return fmt.Errorf("transfer: registry bucket %s: %w", kcfg.Bucket, err)
	}
	r.mu.Lock()
	r.kv, r.kcfg = kv, kcfg
	r.mu.Unlock()
	return nil
}

// openWhenReady opens the bucket, retrying with a backoff while JetStream
// cannot answer yet (a cluster electing its meta leader, servers still
// starting: workers and NATS usually start together) until ctx ends.
//
// With Replicas 0 (auto) on a cluster, a bucket of 3 replicas that cannot be
// placed is retried for replicaPatience (the cluster may still be forming),
// then the bucket gets 1 replica, with a warning.
func (r *Registry) openWhenReady(ctx context.Context) error {
	wait, start := 100*time.Millisecond, time.Now()
	for {
		octx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := r.open(octx)
		cancel()
		if err == nil || ctx.Err() != nil {
			return err
		}
		r.mu.Lock()
		auto3 := r.cfg.Replicas == 0 && r.kcfg.Replicas > 1
		r.mu.Unlock()
		switch {
		case auto3 && cannotReplicate(err) && time.Since(start) >= replicaPatience:
			r.cfg.Logger.Warn("registry bucket: the cluster cannot hold 3 replicas; using 1 (set --registry-replicas to insist)",
				"bucket", r.kcfg.Bucket, "err", err)
			r.mu.Lock()
			r.kcfg.Replicas = 1
			r.mu.Unlock()
			continue
		case auto3 && cannotReplicate(err):
		case !jetStreamNotReady(err):
			return err
		}
		r.cfg.Logger.Warn("registry bucket: JetStream not ready yet; retrying", "bucket", r.kcfg.Bucket, "in", wait, "err", err)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// replicaPatience is how long an auto-replicated bucket waits for a forming
// cluster to place 3 replicas before it settles for 1.
const replicaPatience = 20 * time.Second

// jetStreamNotReady reports whether err is JetStream not answering yet, as
// opposed to a refusal that retrying will not change.
func jetStreamNotReady(err error) bool {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout),
		errors.Is(err, nats.ErrNoResponders), errors.Is(err, jetstream.ErrNoStreamResponse):
		return true
	case errors.As(err, &apiErr):
		return apiErr.Code == 503 && apiErr.ErrorCode != jetstream.JSErrCodeJetStreamNotEnabled &&
			apiErr.ErrorCode != jetstream.JSErrCodeJetStreamNotEnabledForAccount
	}
	return false
}

// cannotReplicate reports whether err says the server cannot place a
// replicated stream: not clustered, or too few JetStream peers.
func cannotReplicate(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	switch apiErr.ErrorCode {
	case 10023, // insufficient resources
		10005: // no suitable peers for placement
		return true
	}
	return false
}

// bucket returns the bucket in use.
func (r *Registry) bucket() jetstream.KeyValue {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.kv
}

func registryKey(role wire.Role, id string) string { return string(role) + "." + id }

// announce publishes self() now and every Heartbeat until close, which deletes
// the entry. It may be called once.
func (r *Registry) announce(ctx context.Context, self func() wire.Instance) error {
	inst := self()
	if !wire.ValidToken(inst.ID) {
		return fmt.Errorf("%w: instance id %q", ErrInvalidConfig, inst.ID)
	}
	key := registryKey(inst.Role, inst.ID)
	if err := r.put(ctx, key, self); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	if r.self != "" {
		return fmt.Errorf("transfer: registry: already announcing %s", r.self)
	}
	r.self, r.selfFn = key, self
	r.wg.Go(func() {
		t := time.NewTicker(r.cfg.Heartbeat)
		defer t.Stop()
		for {
			select {
			case <-r.stop:
				return
			case <-t.C:
				if err := r.heartbeat(key, self); err != nil {
					r.cfg.Logger.Warn("registry heartbeat", "key", key, "err", err)
				}
			}
		}
	})
	return nil
}

// refresh publishes the announced entry now, ahead of its next heartbeat
// (after a change peers should see at once). It returns ErrClosed when
// nothing is announced.
func (r *Registry) refresh(ctx context.Context) error {
	r.mu.Lock()
	key, self, closed := r.self, r.selfFn, r.closed
	r.mu.Unlock()
	if closed || key == "" {
		return ErrClosed
	}
	return r.put(ctx, key, self)
}

// heartbeat refreshes the entry. When that fails it reopens the bucket (the
// server may have restarted without it) and tries once more.
func (r *Registry) heartbeat(key string, self func() wire.Instance) error {
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.Heartbeat)
	defer cancel()
	err := r.put(ctx, key, self)
	if err == nil {
		return nil
	}
	octx, ocancel := context.WithTimeout(context.Background(), r.cfg.Heartbeat)
	defer ocancel()
	if oerr := r.open(octx); oerr != nil {
		return errors.Join(err, oerr)
	}
	return r.put(octx, key, self)
}

// put publishes what self says now under key and records the revision,
// the last put of this process's own entry, that close may delete. self is
// read in the puts' order: a heartbeat queued behind a refresh that
// announced draining puts draining too, not what it read before.
func (r *Registry) put(ctx context.Context, key string, self func() wire.Instance) error {
	r.putMu.Lock()
	defer r.putMu.Unlock()
	r.mu.Lock()
	closed := r.closed
	r.mu.Unlock()
	if closed {
		return ErrClosed // close deletes the entry: putting it again would outlive us
	}
	inst := self()
	inst.Updated = time.Now().UnixNano()
	b, err := wire.EncodeInstance(inst)
	if err != nil {
		return err
	}
	rev, err := r.bucket().Put(ctx, key, b)
	if err != nil {
		return fmt.Errorf("transfer: registry put %s: %w", key, err)
	}
	r.mu.Lock()
	r.selfRev = rev
	r.mu.Unlock()
	return nil
}

// onChange registers fn, called from the watch goroutine for every entry that
// appears, changes (gone false) or is deleted or expires (gone true). An
// entry taken over by another incarnation (Instance.Service changed: the
// instance restarted under the same id) is reported twice: the old one
// gone, then the new one. fn must not block. Register before watching.
func (r *Registry) onChange(fn func(inst wire.Instance, gone bool)) {
	r.mu.Lock()
	r.onChanges = append(r.onChanges, fn)
	r.mu.Unlock()
}

// watch mirrors the entries of role until close. It returns once the current
// entries are loaded, or with ctx's error when ctx ends first (the watch then
// keeps starting in the background until close); ctx does not bound the watch
// itself.
func (r *Registry) watch(ctx context.Context, role wire.Role) error {
	loaded := make(chan error, 1)
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return ErrClosed
	}
	r.wg.Go(func() { r.watchLoop(role, loaded) })
	r.mu.Unlock()
	select {
	case err := <-loaded:
		return err
	case <-ctx.Done():
		return fmt.Errorf("transfer: registry watch: %w", ctx.Err())
	}
}

// watchLoop runs one watch until close, reporting on loaded (once) when its
// initial entries are applied or it failed to start. Every TTL/2 (one bucket
// info request, whatever the number of entries) it checks that the bucket it
// watches is still the server's: a restarted server has lost it (memory
// storage) and a watch on the old one hears nothing more, so the bucket is
// then recreated if need be and watched again.
func (r *Registry) watchLoop(role wire.Role, loaded chan<- error) {
	w, born, err := r.startWatch(role)
	if err != nil {
		if r.life.Err() != nil {
			err = ErrClosed
		}
		loaded <- err
		return
	}
	updates := w.Updates()
	defer func() {
		if w != nil {
			_ = w.Stop()
		}
	}()
	check := time.NewTicker(r.cfg.Heartbeat)
	defer check.Stop()
	initial := true
	for {
		select {
		case <-r.stop:
			if initial {
				loaded <- ErrClosed
			}
			return
		case <-check.C:
			if initial || (w != nil && !r.watchStalled(role) && !r.bucketReplaced(born)) {
				continue
			}
			if w != nil {
				_ = w.Stop()
			}
			if w, born, err = r.startWatch(role); err != nil {
				w, updates = nil, nil    // retried at the next check
				if r.life.Err() != nil { // closing
					return
				}
				if errors.Is(err, nats.ErrConnectionClosed) {
					r.cfg.Logger.Warn("registry watch stopped: connection closed", "watching", string(role))
					return
				}
				r.cfg.Logger.Warn("registry watch restart", "watching", string(role), "err", err)
				continue
			}
			updates = w.Updates()
			r.cfg.Logger.Info("registry watch restarted on a new bucket", "watching", string(role))
		case e, ok := <-updates:
			if !ok {
				select {
				case <-r.stop: // close ended it
					if initial {
						loaded <- ErrClosed
					}
					return
				default: // the subscription ended under us
				}
				if initial {
					loaded <- fmt.Errorf("transfer: registry watch: %w", ErrClosed)
					return
				}
				r.cfg.Logger.Warn("registry watch ended; restarting it", "watching", string(role))
				w, updates = nil, nil // the next check restarts it
				continue
			}
			if e == nil {
				if initial {
					initial = false
					loaded <- nil
				}
				continue
			}
			r.apply(e)
		}
	}
}

// watchStalled reports whether the watch of role has stopped delivering: an
// entry it holds is overdue (not received for 1.5 heartbeats) while the
// bucket has a newer revision of it. A stream's leader dying can leave a
// watch's consumer silent for good while the bucket, replicated, carries on.
func (r *Registry) watchStalled(role wire.Role) bool {
	now := time.Now()
	r.mu.Lock()
	var overdue []string
	var revs []uint64
	for id, inst := range r.entries {
		if inst.Role == role && now.Sub(r.seen[id]) > r.cfg.Heartbeat*3/2 {
			overdue = append(overdue, id)
			revs = append(revs, r.revs[id])
		}
	}
	r.mu.Unlock()
	if len(overdue) == 0 {
		return false
	}
	ctx, cancel := context.WithTimeout(r.life, r.cfg.Heartbeat)
	defer cancel()
	kv := r.bucket()
	for i, id := range overdue {
		e, err := kv.Get(ctx, registryKey(role, id))
		if err == nil && e.Revision() > revs[i] {
			r.cfg.Logger.Warn("registry watch stalled (the bucket moved on without it); restarting it", "watching", string(role), "entry", id)
			return true
		}
	}
	return false
}

// startWatch watches role's keys in the current bucket, and returns when that
// bucket was created.
func (r *Registry) startWatch(role wire.Role) (jetstream.KeyWatcher, time.Time, error) {
	kv := r.bucket()
	ctx, cancel := context.WithTimeout(r.life, r.cfg.TTL)
	defer cancel()
	var born time.Time
	if st, err := kv.Status(ctx); err == nil {
		if bs, ok := st.(*jetstream.KeyValueBucketStatus); ok {
			born = bs.StreamInfo().Created
		}
	}
	w, err := kv.Watch(r.life, string(role)+".>")
	if err != nil {
		return nil, born, fmt.Errorf("transfer: registry watch: %w", err)
	}
	return w, born, nil
}

// bucketReplaced reports whether the server's bucket is not the one created
// at born (it was recreated, or it is missing and was recreated now).
func (r *Registry) bucketReplaced(born time.Time) bool {
	ctx, cancel := context.WithTimeout(r.life, r.cfg.Heartbeat)
	defer cancel()
	st, err := r.bucket().Status(ctx)
	if errors.Is(err, jetstream.ErrBucketNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) {
		return r.open(ctx) == nil
	}
	if err != nil {
		return false // unreachable now: check again later
	}
	bs, ok := st.(*jetstream.KeyValueBucketStatus)
	return ok && !bs.StreamInfo().Created.Equal(born)
}

func (r *Registry) apply(e jetstream.KeyValueEntry) {
	role, id, _ := strings.Cut(e.Key(), ".")
	var inst wire.Instance
	gone := e.Operation() != jetstream.KeyValuePut
	if !gone {
		var err error
		if inst, err = wire.DecodeInstance(e.Value()); err != nil {
			r.cfg.Logger.Warn("registry entry", "key", e.Key(), "err", err)
			return
		}
		// Entries are mirrored by id and a deletion names only its key:
		// one whose value names another instance than its key (a faulty
		// or foreign writer) could never be removed once mirrored, nor
		// reported gone.
		if inst.ID != id || inst.Role != wire.Role(role) {
			r.cfg.Logger.Warn("registry entry refused: its value names another instance than its key",
				"key", e.Key(), "id", inst.ID, "role", string(inst.Role))
			return
		}
	}
	// An entry that names another micro service than the one it replaces
	// is another process under the same id: a worker restarted before its
	// entry expired (a pod keeps $POD_NAME). The key alone would never say
	// the old one died, so it is reported gone before the new one appears.
	// One process announces one service for its life, so a heartbeat never
	// looks like this.
	var prev wire.Instance
	replaced := false
	r.mu.Lock()
	if gone {
		old, ok := r.entries[id]
		if !ok {
			r.mu.Unlock()
			return
		}
		inst = old
		delete(r.entries, id)
		delete(r.seen, id)
		delete(r.revs, id)
	} else {
		old, ok := r.entries[id]
		replaced = ok && old.Service != inst.Service
		prev = old
		r.entries[id] = inst
		r.seen[id] = time.Now()
		r.revs[id] = e.Revision()
	}
	fns := slices.Clone(r.onChanges)
	r.mu.Unlock()
	if replaced {
		r.cfg.Logger.Info("registry entry taken over by a new incarnation (restarted under the same id): the old one is gone",
			"key", e.Key(), "old_service", prev.Service, "service", inst.Service)
		for _, fn := range fns {
			fn(prev, true)
		}
	}
	for _, fn := range fns {
		fn(inst, gone)
	}
}

// instance returns the entry mirrored under id, live or not.
func (r *Registry) instance(id string) (wire.Instance, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	inst, ok := r.entries[id]
	return inst, ok
}

// Instances returns the watched entries of role that are live at now (a
// reading of this host's clock): present in the bucket and received within
// TTL, so an expiry is honoured even before the server's marker arrives.
// The announcer's own timestamp (Updated) is not compared with now: hosts'
// wall clocks may disagree by more than the TTL. Sorted by id.
func (r *Registry) Instances(role wire.Role, now time.Time) []wire.Instance {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]wire.Instance, 0, len(r.entries))
	for id, inst := range r.entries {
		if inst.Role == role && now.Sub(r.seen[id]) < r.cfg.TTL {
			out = append(out, inst)
		}
	}
	slices.SortFunc(out, func(a, b wire.Instance) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// close stops the goroutines and deletes the announced entry (bounded by ctx).
// Idempotent.
func (r *Registry) close(ctx context.Context) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	r.mu.Unlock()
	close(r.stop)
	r.lifeStop() // aborts a bucket request in flight in the watch goroutines
	r.wg.Wait()
	// A put in flight (a heartbeat, a refresh) ends before this; later
	// ones see closed: the revision read now is the entry's last.
	r.putMu.Lock()
	defer r.putMu.Unlock()
	r.mu.Lock()
	self, rev := r.self, r.selfRev
	r.mu.Unlock()
	if self != "" {
		// Only the entry this process put: an instance restarted under
		// the same id may have announced itself meanwhile, and deleting
		// its entry would make decoders take it for gone.
		var opts []jetstream.KVDeleteOpt
		if rev != 0 {
			opts = append(opts, jetstream.LastRevision(rev))
		}
		if err := r.bucket().Delete(ctx, self, opts...); err != nil && !wrongRevision(err) {
			return fmt.Errorf("transfer: registry delete %s: %w", self, err)
		}
	}
	return nil
}

// wrongRevision reports whether err is a KV write refused because the key
// moved past the revision it named.
func wrongRevision(err error) bool {
	var api *jetstream.APIError
	return errors.As(err, &api) && (api.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		api.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}
