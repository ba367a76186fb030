package service

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/handoff-io/handoff/internal/natstest"
	"github.com/handoff-io/handoff/worker"
)

// writeTestPKI writes ca.pem and a worker's cert.pem and key.pem into dir.
func writeTestPKI(t *testing.T, dir string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "worker"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	require.NoError(t, err)
	keyDER, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	for name, b := range map[string]*pem.Block{"ca.pem": {Type: "CERTIFICATE", Bytes: caDER},
		"cert.pem": {Type: "CERTIFICATE", Bytes: der}, "key.pem": {Type: "EC PRIVATE KEY", Bytes: keyDER}} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(b), 0o600))
	}
}

// A prefill and a decode worker with --data-tls-* move caches over mutual
// TLS on tcp; a prefill worker without them cannot write to that decode
// worker, and its requests fail instead of hanging.
func TestRemoteOverDataTLS(t *testing.T) {
	ns := natstest.Run(t)
	dir := t.TempDir()
	writeTestPKI(t, dir)
	tlsArgs := []string{"--data-tls-ca", filepath.Join(dir, "ca.pem"), "--data-tls-cert", filepath.Join(dir, "cert.pem"),
		"--data-tls-key", filepath.Join(dir, "key.pem")}
	common := []string{"--nats-url", ns.ClientURL(), "--transport", "tcp", "--namespace", "data-tls"}
	startWorker(t, testConfig(t, worker.RolePrefill, append(common, tlsArgs...)...))
	rep, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(append(common, tlsArgs...), "--prefill", "remote")...))
	lep, _ := startWorker(t, testConfig(t, worker.RoleDecode, "--prefill", "local"))
	for k, p := range prompts[:3] {
		remote, local := complete(t, rep.HTTP, p, 8, 0, k), complete(t, lep.HTTP, p, 8, 0, k)
		require.Equal(t, http.StatusOK, remote.status, remote.text)
		require.Equal(t, local, remote, "request %d over TLS differs from local", k)
	}
	require.Equal(t, 1.0, metricValue(t, rep.Admin, `handoff_transport_info{transport="tcp"}`))

	plainCommon := []string{"--nats-url", ns.ClientURL(), "--transport", "tcp", "--namespace", "data-tls-mixed"}
	startWorker(t, testConfig(t, worker.RolePrefill, plainCommon...))
	mixed, _ := startWorker(t, testConfig(t, worker.RoleDecode, append(append(plainCommon, tlsArgs...), "--prefill", "remote",
		"--request-timeout", "5s")...))
	start := time.Now()
	out := complete(t, mixed.HTTP, prompts[0], 4, 0, 0)
	require.GreaterOrEqual(t, out.status, 500, "a prefill worker without TLS wrote to a TLS decode worker: %s", out.text)
	require.Less(t, time.Since(start), 10*time.Second)
}
