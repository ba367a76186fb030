//go:build race

package agent

// raceEnabled: the race detector slows the largest tests past their use.
const raceEnabled = true
