package ucx

import (
	"errors"
	"reflect"
	"testing"
)

func TestSettingsOperatorWins(t *testing.T) {
	env := map[string]string{"UCX_TLS": "rc"}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	modify, setenv := settings(map[string]string{"TLS": "tcp", "ucx_net_devices": "lo", "RNDV_SCHEME": "auto"}, lookup)
	want := [][2]string{
		{"NET_DEVICES", "lo"},   // an option, named either way
		{"RNDV_SCHEME", "auto"}, // an option replaces a default
		{"WARN_UNUSED_ENV_VARS", "n"},
		{"ZCOPY_THRESH", "inf"},
		// TLS: the environment's
	}
	if !reflect.DeepEqual(modify, want) {
		t.Errorf("modify = %v, want %v", modify, want)
	}
	if want := [][2]string{{"UCX_TCP_PUT_ENABLE", "n"}, {"UCX_TCP_RX_SEG_SIZE", "256K"}, {"UCX_TCP_TX_SEG_SIZE", "64K"}}; !reflect.DeepEqual(setenv, want) {
		t.Errorf("env = %v, want %v", setenv, want)
	}
	env["UCX_TCP_PUT_ENABLE"] = "y"
	env["UCX_TCP_TX_SEG_SIZE"] = "8K"
	env["UCX_TCP_RX_SEG_SIZE"] = "64K"
	env["UCX_WARN_UNUSED_ENV_VARS"] = "y"
	modify, setenv = settings(nil, lookup)
	if want := [][2]string{{"RNDV_SCHEME", "get_zcopy"}, {"ZCOPY_THRESH", "inf"}}; !reflect.DeepEqual(modify, want) || len(setenv) != 0 {
		t.Errorf("with the environment set: modify %v, env %v; want %v and nothing", modify, setenv, want)
	}
}

func TestStatusErrors(t *testing.T) {
	var err error = ErrRejected
	if !errors.Is(err, ErrRejected) || err.Error() != "ucx: operation rejected by remote peer" {
		t.Errorf("ErrRejected: %v", err)
	}
	if s := Status(-42).Error(); s != "ucx: link failure (-42)" {
		t.Errorf("Status(-42) = %q", s)
	}
	if !errors.Is(ErrUnavailable, errors.ErrUnsupported) {
		t.Error("ErrUnavailable does not wrap errors.ErrUnsupported")
	}
}

func TestStubUnavailable(t *testing.T) {
	if Available {
		t.Skip("UCX is built in")
	}
	if _, err := New(Config{}); !errors.Is(err, ErrUnavailable) || !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("New without UCX: %v, want ErrUnavailable", err)
	}
}
