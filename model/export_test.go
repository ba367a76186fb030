package model

// NewSynthetic returns a synthetic executor for an arbitrary cache shape, so
// tests can exercise the synthetic semantics on small states.
func NewSynthetic(name string, spec Spec) (Executor, error) {
	return buildSynthetic(name, spec, Options{})
}

// NewSyntheticTouch is NewSynthetic with Options.DecodeTouch.
func NewSyntheticTouch(name string, spec Spec, touch int) (Executor, error) {
	return buildSynthetic(name, spec, Options{DecodeTouch: touch})
}
