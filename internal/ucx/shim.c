//go:build linux && cgo && ucx

#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "shim.h"
#include "_cgo_export.h"

ucs_status_t hx_init(ucp_config_t *config, const char *name, ucp_context_h *ctx)
{
    ucp_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME |
                   UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    p.features          = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    p.mt_workers_shared = 0;
    p.name              = name;
    return ucp_init(&p, config, ctx);
}

ucs_status_t hx_worker_create(ucp_context_h ctx, const char *name, ucp_worker_h *w)
{
    ucp_worker_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask  = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_NAME;
    p.thread_mode = UCS_THREAD_MODE_SINGLE;
    p.name        = name;
    return ucp_worker_create(ctx, &p, w);
}

static ucs_status_t hx_am_cb(void *arg, const void *hdr, size_t hdr_len,
                             void *data, size_t len, const ucp_am_recv_param_t *p)
{
    ucp_ep_h reply = (p->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? p->reply_ep : NULL;
    return (ucs_status_t)hxAMRecv((uintptr_t)arg, (void*)hdr, hdr_len, data, len,
                                  p->recv_attr, reply);
}

ucs_status_t hx_set_am_handler(ucp_worker_h w, unsigned id, uintptr_t arg)
{
    ucp_am_handler_param_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id    = id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb    = hx_am_cb;
    p.arg   = (void*)arg;
    return ucp_worker_set_am_recv_handler(w, &p);
}

ucs_status_t hx_max_am_header(ucp_worker_h w, size_t *n)
{
    ucp_worker_attr_t a;
    ucs_status_t st;
    memset(&a, 0, sizeof(a));
    a.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    st = ucp_worker_query(w, &a);
    *n = a.max_am_header;
    return st;
}

static void hx_ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    hxEpError((uintptr_t)arg, status);
}

ucs_status_t hx_ep_create(ucp_worker_h w, const void *addr, uintptr_t arg, ucp_ep_h *ep)
{
    ucp_ep_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address        = (const ucp_address_t*)addr;
    p.err_mode       = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = hx_ep_err_cb;
    p.err_handler.arg = (void*)arg;
    return ucp_ep_create(w, &p, ep);
}

static void hx_close_cb(void *req, ucs_status_t status, void *ud)
{
    hxCloseDone((uintptr_t)ud, status);
    ucp_request_free(req);
}

void *hx_ep_close(ucp_ep_h ep, int force, uintptr_t ud)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                     UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags     = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    p.cb.send   = hx_close_cb;
    p.user_data = (void*)ud;
    return ucp_ep_close_nbx(ep, &p);
}

static void hx_send_cb(void *req, ucs_status_t status, void *ud)
{
    hxSendDone((uintptr_t)ud, status);
    ucp_request_free(req);
}

void *hx_am_send(ucp_ep_h ep, unsigned id, const void *hdr, size_t hdr_len,
                 const void *buf, size_t len, int rndv, uintptr_t ud)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                     UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    /* REPLY: the receiver learns which of its endpoints the message came
     * by, so it can force-close that one to end receives that stall. */
    p.flags     = UCP_AM_SEND_FLAG_REPLY | (rndv ? UCP_AM_SEND_FLAG_RNDV : 0);
    p.cb.send   = hx_send_cb;
    p.user_data = (void*)ud;
    p.datatype  = ucp_dt_make_contig(1);
    return ucp_am_send_nbx(ep, id, hdr, hdr_len, buf, len, &p);
}

static void hx_recv_cb(void *req, ucs_status_t status, size_t length, void *ud)
{
    hxRecvDone((uintptr_t)ud, status, length);
    ucp_request_free(req);
}

void *hx_am_recv_data(ucp_worker_h w, void *desc, void *buf, size_t len, uintptr_t ud)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_DATATYPE;
    p.cb.recv_am = hx_recv_cb;
    p.user_data  = (void*)ud;
    p.datatype   = ucp_dt_make_contig(1);
    return ucp_am_recv_data_nbx(w, desc, buf, len, &p);
}

char *hx_ep_info(ucp_ep_h ep, size_t *len)
{
    char *buf = NULL;
    FILE *f = open_memstream(&buf, len);
    if (f == NULL) {
        return NULL;
    }
    ucp_ep_print_info(ep, f);
    fclose(f);
    return buf;
}

int hx_ptr_is_err(void *p) { return UCS_PTR_IS_ERR(p); }
int hx_ptr_status(void *p) { return UCS_PTR_STATUS(p); }
