package session

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// A script file in testdata (the layout of etcd raft's datadriven tests)
// holds one scenario: '#' comment lines, a directive that builds the
// session ("recv id=7 draft=2 deadline=100ms attempts=3 quiet=300ms holder=d2" or
// "write id=7 draft=2 deadline=100ms fp=fp local=fp kv=4096 mamba=512"), one
// event per line ("+5ms committed manifest=4096,512/43690,48059"; the
// offset is from the session's epoch), a "----" line, then the transcript
// the session must produce (rewritten under -update).
type script struct {
	comments  []string
	directive string
	events    []at
	want      string
}

const scriptSep = "----"

func readScript(path string) (script, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return script{}, err
	}
	in, want, ok := strings.Cut(string(b), scriptSep+"\n")
	if !ok {
		return script{}, fmt.Errorf("%s: no %q line", path, scriptSep)
	}
	sc := script{want: want}
	for n, line := range strings.Split(strings.TrimRight(in, "\n"), "\n") {
		switch {
		case strings.HasPrefix(line, "#"):
			sc.comments = append(sc.comments, line)
		case sc.directive == "":
			sc.directive = line
		default:
			ev, err := parseAt(line)
			if err != nil {
				return script{}, fmt.Errorf("%s:%d: %w", path, n+1, err)
			}
			sc.events = append(sc.events, ev)
		}
	}
	if sc.directive == "" {
		return script{}, fmt.Errorf("%s: no directive", path)
	}
	return sc, nil
}

// input renders sc's part above the separator.
func (sc script) input() string {
	var b strings.Builder
	for _, c := range sc.comments {
		b.WriteString(c + "\n")
	}
	b.WriteString(sc.directive + "\n")
	for _, st := range sc.events {
		fmt.Fprintf(&b, "+%s %s\n", st.dt, formatEvent(st.ev))
	}
	return b.String() + scriptSep + "\n"
}

// args parses "key=value" fields.
func args(fields []string) (map[string]string, error) {
	m := map[string]string{}
	for _, f := range fields {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			return nil, fmt.Errorf("argument %q is not key=value", f)
		}
		m[k] = v
	}
	return m, nil
}

// newStepper builds the session a directive names.
func newStepper(directive string) (stepper, error) {
	f := strings.Fields(directive)
	if len(f) == 0 {
		return nil, fmt.Errorf("empty directive")
	}
	a, err := args(f[1:])
	if err != nil {
		return nil, err
	}
	var errs []error
	num := func(k string) uint64 {
		if a[k] == "" {
			return 0
		}
		n, err := strconv.ParseUint(a[k], 10, 64)
		errs = append(errs, err)
		return n
	}
	dur := func(k string) time.Duration {
		if a[k] == "" {
			return 0
		}
		d, err := time.ParseDuration(a[k])
		errs = append(errs, err)
		return d
	}
	var s stepper
	switch f[0] {
	case "recv":
		s = NewRecvSession(RecvParams{RequestID: num("id"), MaxDraftTokens: int(num("draft")),
			Deadline: epoch.Add(dur("deadline")), MaxAttempts: int(num("attempts")), QuietWait: dur("quiet"),
			Holder: a["holder"]})
	case "write":
		s = NewWriteSession(WriteParams{RequestID: num("id"), MaxDraftTokens: int(num("draft")),
			Deadline: epoch.Add(dur("deadline")), Fingerprint: a["fp"], Local: a["local"],
			KVBytes: num("kv"), MambaBytes: num("mamba")})
	default:
		return nil, fmt.Errorf("unknown session %q", f[0])
	}
	for _, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("directive %q: %w", directive, err)
		}
	}
	return s, nil
}

// formatEvent renders ev as a script line's event: its kind, then every
// field that is set.
func formatEvent(ev Event) string {
	var b strings.Builder
	b.WriteString(ev.Kind.String())
	if ev.Code != CodeOK {
		fmt.Fprintf(&b, " code=%s", ev.Code)
	}
	if ev.Instance != "" {
		fmt.Fprintf(&b, " inst=%s", ev.Instance)
	}
	if ev.Manifest.Bytes != nil || ev.Manifest.CRC != nil {
		fmt.Fprintf(&b, " manifest=%s/%s", joinNums(ev.Manifest.Bytes), joinNums(ev.Manifest.CRC))
	}
	if ev.Expected != nil {
		fmt.Fprintf(&b, " expected=%s", joinNums(ev.Expected))
	}
	if ev.KVBytes != 0 || ev.MambaBytes != 0 {
		fmt.Fprintf(&b, " kv=%d mamba=%d", ev.KVBytes, ev.MambaBytes)
	}
	if ev.Attempt != 0 {
		fmt.Fprintf(&b, " attempt=%d", ev.Attempt)
	}
	return b.String()
}

func joinNums[T uint32 | uint64](xs []T) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.FormatUint(uint64(x), 10)
	}
	return strings.Join(s, ",")
}

func parseNums[T uint32 | uint64](s string, bits int) ([]T, error) {
	out := []T{}
	if s == "" {
		return out, nil
	}
	for p := range strings.SplitSeq(s, ",") {
		n, err := strconv.ParseUint(p, 10, bits)
		if err != nil {
			return nil, err
		}
		out = append(out, T(n))
	}
	return out, nil
}

// parseAt parses a script line: "+<offset> <event>".
func parseAt(line string) (at, error) {
	f := strings.Fields(line)
	if len(f) < 2 || !strings.HasPrefix(f[0], "+") {
		return at{}, fmt.Errorf("event line %q: want +<offset> <kind> [key=value...]", line)
	}
	dt, err := time.ParseDuration(f[0][1:])
	if err != nil {
		return at{}, fmt.Errorf("event line %q: %w", line, err)
	}
	ev := Event{Kind: eventKind(f[1])}
	if ev.Kind == 0 {
		return at{}, fmt.Errorf("event line %q: unknown event %q", line, f[1])
	}
	a, err := args(f[2:])
	if err != nil {
		return at{}, fmt.Errorf("event line %q: %w", line, err)
	}
	for k, v := range a {
		switch k {
		case "code":
			ev.Code = codeNamed(v)
			if ev.Code == NumCodes {
				err = fmt.Errorf("unknown code %q", v)
			}
		case "inst":
			ev.Instance = v
		case "manifest":
			bs, crcs, _ := strings.Cut(v, "/")
			if ev.Manifest.Bytes, err = parseNums[uint64](bs, 64); err == nil {
				ev.Manifest.CRC, err = parseNums[uint32](crcs, 32)
			}
		case "expected":
			ev.Expected, err = parseNums[uint64](v, 64)
		case "kv", "mamba", "attempt":
			var n uint64
			n, err = strconv.ParseUint(v, 10, 64)
			switch k {
			case "kv":
				ev.KVBytes = n
			case "mamba":
				ev.MambaBytes = n
			default:
				ev.Attempt = int(n)
			}
		default:
			err = fmt.Errorf("unknown field %q", k)
		}
		if err != nil {
			return at{}, fmt.Errorf("event line %q: %s: %w", line, k, err)
		}
	}
	return at{dt: dt, ev: ev}, nil
}

func eventKind(name string) EventKind {
	for k, n := range eventNames {
		if n == name {
			return k
		}
	}
	return 0
}

func codeNamed(name string) Code {
	if i := slices.Index(codeNames[:], name); i >= 0 {
		return Code(i)
	}
	return NumCodes
}
