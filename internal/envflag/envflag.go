// Package envflag gives flags environment twins: every handoff binary's flag
// may also be set by an environment variable, named in its --help, and a
// flag given on the command line wins over its twin.
//
//	tw := envflag.New(fs)
//	fs.IntVar(&port, "port", 4222, "client port"+tw.Env("port", "HANDOFF_NATS_PORT"))
//	if err := fs.Parse(args); err != nil { ... }
//	if err := tw.Apply(os.Getenv); err != nil { ... }
package envflag

import (
	"flag"
	"fmt"
)

// Twins links the flags of one flag set to their environment variables.
type Twins struct {
	fs    *flag.FlagSet
	twins []twin
}

type twin struct{ flag, env string }

// New returns an empty set of twins for the flags of fs.
func New(fs *flag.FlagSet) *Twins { return &Twins{fs: fs} }

// Env records env as the twin of the flag named name and returns the note
// that names it in the flag's usage: " (env ENV)".
func (t *Twins) Env(name, env string) string {
	t.twins = append(t.twins, twin{name, env})
	return " (env " + env + ")"
}

// Apply sets every flag that the parsed command line did not give from its
// twin, in the order Env recorded them, when getenv returns a non-empty
// value for it. It stops at the first value the flag refuses and returns it
// as an *Error.
func (t *Twins) Apply(getenv func(string) string) error {
	given := map[string]bool{}
	t.fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, tw := range t.twins {
		if given[tw.flag] {
			continue
		}
		v := getenv(tw.env)
		if v == "" {
			continue
		}
		if err := t.fs.Set(tw.flag, v); err != nil {
			return &Error{Flag: tw.flag, Env: tw.env, Value: v, Err: err}
		}
	}
	return nil
}

// An Error is an environment value its flag refused. Its text names the
// variable and the value: ENV="value": reason.
type Error struct {
	Flag  string // the flag's name, without dashes
	Env   string
	Value string
	Err   error
}

func (e *Error) Error() string { return fmt.Sprintf("%s=%q: %v", e.Env, e.Value, e.Err) }
func (e *Error) Unwrap() error { return e.Err }
