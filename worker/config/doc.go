// Package config parses the flags and environment of the prefill and decode
// binaries in one place. Every flag has an environment twin, named in
// --help; a flag given on the command line wins over its variable, which
// wins over the default.
package config
