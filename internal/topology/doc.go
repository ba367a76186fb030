// Package topology discovers what a host offers the data path: its GPUs
// (through NVML, injected for tests, absent in CGO_ENABLED=0 builds and on
// hosts without the library: a null topology, not an error) and its network
// interfaces (from sysfs: PCI location, NUMA node, link speed, RDMA devices),
// with the PCI distance between each GPU and each NIC.
//
// It is plain data produced once by Discover; every decision over it is a
// pure function (Host.NICsFor, Host.BestNIC, Host.GPUByUUID). Workers call
// DiscoverAndLog at start-up: the host is logged in one line and exported as
// handoff_host_gpus and handoff_host_nics{rdma}. The data path's transport
// choice does not read it yet: inproc, shm and tcp are chosen by process and
// host identity alone; a GPU transport (CUDA IPC, GPUDirect RDMA) will pick its
// NIC and peer GPUs from it. `handoff-bench topology` prints it.
package topology
