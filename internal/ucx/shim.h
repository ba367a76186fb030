//go:build linux && cgo && ucx

// The C side of internal/ucx: the UCP calls whose parameter structs and
// callbacks are easier to fill in C, and the callbacks UCP calls, which
// hand over to the exported Go functions (hx*). Every callback runs on the
// worker's owner thread, inside ucp_worker_progress (or the call that
// started the operation).
#ifndef HANDOFF_UCX_SHIM_H
#define HANDOFF_UCX_SHIM_H

#include <stdint.h>
#include <stddef.h>
#include <ucp/api/ucp.h>

ucs_status_t hx_init(ucp_config_t *config, const char *name, ucp_context_h *ctx);
ucs_status_t hx_worker_create(ucp_context_h ctx, const char *name, ucp_worker_h *w);
ucs_status_t hx_set_am_handler(ucp_worker_h w, unsigned id, uintptr_t arg);
ucs_status_t hx_max_am_header(ucp_worker_h w, size_t *n);
ucs_status_t hx_ep_create(ucp_worker_h w, const void *addr, uintptr_t arg, ucp_ep_h *ep);
void *hx_ep_close(ucp_ep_h ep, int force, uintptr_t ud);
void *hx_am_send(ucp_ep_h ep, unsigned id, const void *hdr, size_t hdr_len,
                 const void *buf, size_t len, int rndv, uintptr_t ud);
void *hx_am_recv_data(ucp_worker_h w, void *desc, void *buf, size_t len, uintptr_t ud);
char *hx_ep_info(ucp_ep_h ep, size_t *len);

// UCS_PTR_* as functions: 1 when p is an error, and its status.
int hx_ptr_is_err(void *p);
int hx_ptr_status(void *p);

#endif
