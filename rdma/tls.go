package rdma

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
)

// serverTLS is the receiver's side of Config.TLS: TLS 1.3, and a client
// certificate that verifies against ClientCAs is required.
func serverTLS(base *tls.Config) *tls.Config {
	c := base.Clone()
	c.MinVersion = tls.VersionTLS13
	c.ClientAuth = tls.RequireAndVerifyClientCert
	return c
}

// clientTLS is the writer's side of Config.TLS: TLS 1.3, the receiver's
// certificate chain verified against RootCAs, its host name not (see
// Config.TLS).
func clientTLS(base *tls.Config) *tls.Config {
	c := base.Clone()
	c.MinVersion = tls.VersionTLS13
	roots := c.RootCAs
	c.InsecureSkipVerify = true // the chain is verified below, the name is not
	c.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("rdma: tls: the receiver sent no certificate")
		}
		opts := x509.VerifyOptions{Roots: roots, Intermediates: x509.NewCertPool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
		for _, ic := range cs.PeerCertificates[1:] {
			opts.Intermediates.AddCert(ic)
		}
		if _, err := cs.PeerCertificates[0].Verify(opts); err != nil {
			return fmt.Errorf("rdma: tls: the receiver's certificate: %w", err)
		}
		return nil
	}
	return c
}
