package api

import (
	"encoding/json"
	"testing"
	"unicode/utf8"

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
		`{"model":"tiny-hybrid","prompt":"a","stop":["x","yz"],"top_p":0.5,"logprobs":2,"echo":false,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"tiny-hybrid","prompt":[104,105],"best_of":1,"suffix":"","logit_bias":{},"user":"x"}`,
		`{"model":"tiny-hybrid","prompt":"a"} `, `{"model":"tiny-hybrid","prompt":"a"}}`, `{"MODEL":"tiny-hybrid","prompt":"a"}`,
		`{"model":"tiny-hybrid","prompt":"a","prompt":"b"}`,
		`{"model":"tiny-hybrid","prompt":"a","prompt_cache_key":"conv-1","user":"u"}`,
		`{"model":"tiny-hybrid","prompt":"a","prompt_cache_key":7}`,
		`{`, `null`, `[]`, `""`, `{"model":"tiny-hybrid","prompt":"\ud800"}`,
	} {
		f.Add([]byte(seed))
	}
	s := &server{cfg: Config{Model: model.TinyHybrid, DefaultMaxTokens: 16}, gen: fakeGen{}, base: model.TinyHybrid}
	maxCtx := fakeGen{}.MaxContext()
	f.Fuzz(func(t *testing.T, body []byte) {
		p, status, e := s.parseCompletion(body)
		if e != nil {
			if status < 400 || status >= 500 || e.Message == "" || e.Type == "" {
				t.Fatalf("refusal %d %+v", status, e)
			}
			return
		}
		if status != 0 || len(p.prompt) == 0 || p.maxTokens < 1 || len(p.prompt)+p.maxTokens > maxCtx ||
			!(p.smp.Temperature >= 0 && p.smp.Temperature <= 2) || !(p.smp.TopP >= 0 && p.smp.TopP < 1) ||
			len(p.stop) > maxStops || p.logprobs > maxLogprobs || (p.echo && p.logprobs >= 0) ||
			(p.includeUsage && !p.stream) || utf8.RuneCountInString(p.cacheKey) > maxCacheKeyLen {
			t.Fatalf("accepted a bad request: %+v", p)
		}
		for _, st := range p.stop {
			if st == "" || len(st) > maxStopBytes {
				t.Fatalf("accepted a bad stop sequence %q", st)
			}
		}
		// Strictness: an accepted body is one object whose keys are all
		// served exactly as written.
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(body, &obj); err != nil {
			t.Fatalf("accepted a body that is not one object: %q", body)
		}
		for k := range obj {
			if _, ok := completionFields[k]; !ok {
				t.Fatalf("accepted unknown key %q", k)
			}
		}
	})
}

// FuzzParseChat feeds arbitrary bodies to the chat decoder: it must never
// panic, must answer every refusal with a 4xx and a message, and must only
// accept strict bodies that fit the context.
func FuzzParseChat(f *testing.F) {
	for _, seed := range []string{
		`{"model":"tiny-hybrid","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"tiny-hybrid","messages":[{"role":"system","content":"s"},{"role":"user","name":"a","content":[{"type":"text","text":"x"}]}],"logprobs":true,"top_logprobs":3}`,
		`{"model":"tiny-hybrid","messages":[{"role":"tool","content":"x"}]}`,
		`{"model":"tiny-hybrid","messages":[{"role":"user","content":[{"type":"image_url"}]}]}`,
		`{"model":"tiny-hybrid","messages":[],"tools":[1]}`,
		`{"model":"tiny-hybrid","messages":[{"role":"user","content":"x"}]} {}`,
		`{"model":"tiny-hybrid","messages":[{"ROLE":"user","content":"x"}]}`,
		`{"model":"tiny-hybrid","messages":[{"role":"user","content":"x"}],"max_tokens":2,"max_completion_tokens":3}`,
		`{"model":"tiny-hybrid","messages":[{"role":"user","content":"x"}],"prompt_cache_key":"k","safety_identifier":"s"}`,
		`{`, `null`, `[]`,
	} {
		f.Add([]byte(seed))
	}
	s := &server{cfg: Config{Model: model.TinyHybrid, DefaultMaxTokens: 16}, gen: fakeGen{}, base: model.TinyHybrid}
	maxCtx := fakeGen{}.MaxContext()
	f.Fuzz(func(t *testing.T, body []byte) {
		c, status, e := s.parseChat(body)
		if e != nil {
			if status < 400 || status >= 500 || e.Message == "" || e.Type == "" {
				t.Fatalf("refusal %d %+v", status, e)
			}
			return
		}
		if status != 0 || len(c.prompt) == 0 || c.maxTokens < 1 || len(c.prompt)+c.maxTokens > maxCtx ||
			!(c.smp.Temperature >= 0 && c.smp.Temperature <= 2) || c.logprobs > maxTopLogprobs ||
			(c.smp.Logprobs != (c.logprobs >= 0)) || (c.includeUsage && !c.stream) ||
			utf8.RuneCountInString(c.cacheKey) > maxCacheKeyLen {
			t.Fatalf("accepted a bad request: %+v", c)
		}
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(body, &obj); err != nil {
			t.Fatalf("accepted a body that is not one object: %q", body)
		}
		for k := range obj {
			if _, ok := chatFields[k]; !ok {
				t.Fatalf("accepted unknown key %q", k)
			}
		}
	})
}
