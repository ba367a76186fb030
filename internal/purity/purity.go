// Package purity holds the tests that keep a pure core pure: a package whose
// only dependencies are an allowlist of standard-library (or named sibling)
// packages, and which starts no goroutines. The pools call it from their
// tests; it is imported by tests only.
package purity

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Forbidden may not appear among a pure package's dependencies, even
// transitively: network, processes, plugins, cgo, logging, contexts, crypto.
var Forbidden = []string{"net", "os/exec", "os/signal", "plugin", "runtime/cgo", "log", "context", "crypto"}

// CheckDeps fails t when the package in the current directory imports
// anything not in allowed, depends (transitively) on a non-standard package
// that is not in allowed, or depends on anything in Forbidden.
func CheckDeps(t testing.TB, allowed map[string]bool) {
	t.Helper()
	checkImports(t, allowed)
	for _, d := range deps(t) {
		require.True(t, d.std || d.self || allowed[d.path], "non-standard dependency %q", d.path)
		for _, bad := range Forbidden {
			require.False(t, under(d.path, bad), "forbidden dependency %q", d.path)
		}
	}
}

// CheckImports fails t when the package in the current directory imports
// anything not in allowed, or depends, even transitively, on a package at
// or below one of forbidden. Unlike CheckDeps it lets the allowed imports
// bring what they depend on: for a package that is not pure but must stay
// out of some layers (transfer/wire names rdma's types, knows no NATS).
func CheckImports(t testing.TB, allowed map[string]bool, forbidden ...string) {
	t.Helper()
	checkImports(t, allowed)
	for _, d := range deps(t) {
		for _, bad := range forbidden {
			require.False(t, under(d.path, bad), "forbidden dependency %q", d.path)
		}
	}
}

func checkImports(t testing.TB, allowed map[string]bool) {
	t.Helper()
	for _, imp := range strings.Fields(goList(t, "-f", `{{join .Imports "\n"}}`, ".")) {
		require.True(t, allowed[imp], "forbidden direct import %q", imp)
	}
}

type dep struct {
	path      string
	std, self bool
}

// deps lists the package in the current directory and everything it
// depends on.
func deps(t testing.TB) []dep {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(goList(t, "-deps", "-f", `{{.ImportPath}} {{.Standard}}`, ".")), "\n")
	out := make([]dep, len(lines))
	for i, line := range lines {
		f := strings.Fields(line)
		require.Len(t, f, 2, "go list line %q", line)
		out[i] = dep{path: f[0], std: f[1] == "true", self: i == len(lines)-1} // -deps lists the package itself last
	}
	return out
}

// under reports whether path is pkg or below it.
func under(path, pkg string) bool { return path == pkg || strings.HasPrefix(path, pkg+"/") }

func goList(t testing.TB, args ...string) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go tool not on PATH: cannot list dependencies")
	}
	out, err := exec.Command(goTool, append([]string{"list"}, args...)...).Output()
	require.NoError(t, err)
	return string(out)
}

// CheckNoGoroutines fails t when a non-test file of the package in the
// current directory has a go statement: a pure core leaves concurrency to
// its caller.
func CheckNoGoroutines(t testing.TB) {
	t.Helper()
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	checked := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		require.NoError(t, err)
		ast.Inspect(f, func(n ast.Node) bool {
			if g, ok := n.(*ast.GoStmt); ok {
				t.Errorf("%s: go statement in a pure package", fset.Position(g.Pos()))
			}
			return true
		})
		checked++
	}
	require.Positive(t, checked)
}
