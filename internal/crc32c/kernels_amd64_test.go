package crc32c

// kernels lists the folding kernels this core can run; use switches to one
// until the returned func restores the choice.
func kernels() []kernel {
	var ks []kernel
	if have512 {
		ks = append(ks, kernel{"avx512", func() func() {
			old := have512
			have512 = true
			return func() { have512 = old }
		}})
	}
	if have256 {
		ks = append(ks, kernel{"avx2", func() func() {
			old := have512
			have512 = false
			return func() { have512 = old }
		}})
	}
	return ks
}
