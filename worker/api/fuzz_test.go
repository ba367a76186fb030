package api

import (
	"testing"

	"github.com/handoff-io/handoff/model"
)

// FuzzParse feeds arbitrary bodies to the request decoder: it must never
// panic, must answer every refusal with a 4xx and a message, and must only
// accept requests that fit the context.
func FuzzParse(f *testing.F) {
	for _, seed := range []string{
		`{"model":"tiny-hybrid","prompt":"hi","max_tokens":5,"temperature":0,"seed":3,"stream":true}`,
		`{"model":"tiny-hybrid","prompt":["one"],"max_tokens":1}`,
		`{"model":"tiny-hybrid","prompt":"","max_tokens":0}`,
		`{"model":"x","prompt":7}`,
		`{"model":"tiny-hybrid","prompt":"a","max_tokens":99999999999999999999}`,
		`{"model":"tiny-hybrid","prompt":"a","temperature":"NaN"}`,
		`{"model":"tiny-hybrid","prompt":"a","n":3}`,
		`{`, `null`, `[]`, `""`, `{"model":"tiny-hybrid","prompt":"\ud800"}`,
	} {
		f.Add([]byte(seed))
	}
	s := &server{cfg: Config{Model: model.TinyHybrid, DefaultMaxTokens: 16}, gen: fakeGen{}, base: model.TinyHybrid}
	maxCtx := fakeGen{}.MaxContext()
	f.Fuzz(func(t *testing.T, body []byte) {
		p, status, e := s.parse(body)
		if e != nil {
			if status < 400 || status >= 500 || e.Message == "" || e.Type == "" {
				t.Fatalf("refusal %d %+v", status, e)
			}
			return
		}
		if status != 0 || len(p.prompt) == 0 || p.maxTokens < 1 || len(p.prompt)+p.maxTokens > maxCtx ||
			!(p.temp >= 0 && p.temp <= 2) {
			t.Fatalf("accepted a bad request: %+v", p)
		}
	})
}
