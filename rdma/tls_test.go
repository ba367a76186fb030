package rdma

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// testCA is a certificate authority for tests, in memory.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pool *x509.CertPool
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "handoff test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &testCA{cert: cert, key: key, pool: pool}
}

// config returns a worker's TLS config: a certificate this CA signed (for
// both client and server use, no host names) and the CA as the only root.
func (ca *testCA) config(t *testing.T, name string) *tls.Config {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	require.NoError(t, err)
	return &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}},
		RootCAs:      ca.pool, ClientCAs: ca.pool,
	}
}

func tlsEngine(t *testing.T, agent string, c *tls.Config) *Engine {
	t.Helper()
	e, err := New(Config{Agent: AgentID(agent), Transports: []Transport{TransportTCP}, Logger: quietLogger(), TLS: c})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, e.Close()) })
	return e
}

// A write over mutual TLS lands every byte and commits, revokes still
// fence it, and the striped path works through TLS too.
func TestTLSWriteReadBack(t *testing.T) {
	ca := newTestCA(t)
	rx, tx := tlsEngine(t, "tls-rx", ca.config(t, "rx")), tlsEngine(t, "tls-tx", ca.config(t, "tx"))
	const size = 8 << 20 // striped over the lanes
	dst, err := rx.Register("dst", size+4096)
	require.NoError(t, err)
	src, err := tx.Register("src", size)
	require.NoError(t, err)
	fill(dst.Bytes(), canary)
	for i := range src.Bytes() {
		src.Bytes()[i] = byte(i*7 + i>>9)
	}
	desc := rx.Descriptor()
	tr, err := tx.Connect(context.Background(), desc)
	require.NoError(t, err)
	require.Equal(t, TransportTCP, tr)
	g, err := rx.OpenGrant(GrantSpec{RequestID: 1, Extents: []Extent{{Region: dst.ID(), Offset: 4096, Length: size}}})
	require.NoError(t, err)
	_, err = tx.Write(context.Background(), desc, g.Ticket(), []Extent{{Region: src.ID(), Length: size}})
	require.NoError(t, err)
	_, err = g.Wait(context.Background())
	require.NoError(t, err)
	require.True(t, bytes.Equal(src.Bytes(), dst.Bytes()[4096:]))
	for _, b := range dst.Bytes()[:4096] {
		require.Equal(t, byte(canary), b)
	}

	g2, err := rx.OpenGrant(GrantSpec{RequestID: 2, Extents: []Extent{{Region: dst.ID(), Offset: 4096, Length: size}}})
	require.NoError(t, err)
	tk := g2.Ticket()
	g2.Revoke()
	_, err = tx.Write(context.Background(), desc, tk, []Extent{{Region: src.ID(), Length: size}})
	require.ErrorIs(t, err, ErrRevoked)
}

// Whoever is not a worker of the CA is refused before any frame: a writer
// with another CA's certificate, a writer without TLS, and a receiver whose
// certificate the writer cannot verify.
func TestTLSRefusesStrangers(t *testing.T) {
	ca, other := newTestCA(t), newTestCA(t)
	rx := tlsEngine(t, "tls-rx", ca.config(t, "rx"))
	_, err := rx.Register("dst", 1<<20)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// It trusts the receiver, but the receiver does not trust it.
	strangerCfg := other.config(t, "stranger")
	strangerCfg.RootCAs = ca.pool
	stranger := tlsEngine(t, "tls-stranger", strangerCfg)
	_, err = stranger.Connect(ctx, rx.Descriptor())
	require.Error(t, err, "a writer the CA did not sign connected")

	plain := tlsEngine(t, "tls-plain", nil)
	_, err = plain.Connect(ctx, rx.Descriptor())
	require.Error(t, err, "a writer without TLS connected to a TLS receiver")

	imposter := tlsEngine(t, "tls-imposter", other.config(t, "imposter"))
	_, err = imposter.Register("dst", 1<<20)
	require.NoError(t, err)
	writer := tlsEngine(t, "tls-writer", ca.config(t, "writer"))
	_, err = writer.Connect(ctx, imposter.Descriptor())
	require.ErrorContains(t, err, "certificate")
}
