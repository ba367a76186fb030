package hybrid

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

const module = "github.com/handoff-io/handoff/"

// allowedImports is everything the package may import directly: the two
// pure pools and the standard library's pure parts, nothing that does IO,
// reads the clock or escapes the type system.
var allowedImports = map[string]bool{
	"errors": true, "fmt": true, "sync": true,
	module + "kvcache": true, module + "mambacache": true,
}

// forbiddenDeps may not appear even transitively.
var forbiddenDeps = []string{"net", "os/exec", "os/signal", "plugin", "runtime/cgo", "log", "context", "crypto"}

// TestDeps fails when the package imports something outside the standard
// library and the two pools, or outside its allowlist.
func TestDeps(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go tool not on PATH: cannot list dependencies")
	}
	out, err := exec.Command(goTool, "list", "-f", `{{join .Imports "\n"}}`, ".").Output()
	require.NoError(t, err)
	for _, imp := range strings.Fields(string(out)) {
		require.True(t, allowedImports[imp], "forbidden direct import %q", imp)
	}
	out, err = exec.Command(goTool, "list", "-deps", "-f", `{{.ImportPath}} {{.Standard}}`, ".").Output()
	require.NoError(t, err)
	self := ""
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if n := len(lines); n > 0 {
		self = strings.Fields(lines[n-1])[0] // -deps lists the package itself last
	}
	for _, line := range lines {
		f := strings.Fields(line)
		require.Len(t, f, 2, "go list line %q", line)
		path, std := f[0], f[1] == "true"
		require.True(t, std || path == self || allowedImports[path], "non-standard dependency %q", path)
		for _, bad := range forbiddenDeps {
			require.False(t, path == bad || strings.HasPrefix(path, bad+"/"), "forbidden dependency %q", path)
		}
	}
}

// TestNoGoroutines fails when a non-test file of the package starts a
// goroutine: the pool is a data structure, the caller owns concurrency.
func TestNoGoroutines(t *testing.T) {
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
