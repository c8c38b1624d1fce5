/* Flat C entry points over libibverbs for gradsync's rdma backend.
 *
 * Several verbs (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq,
 * ibv_query_port, ibv_query_gid_ex) are inline functions or macros in
 * <infiniband/verbs.h>, and the structures they take have unions and
 * version-dependent layouts. This file keeps all of that on the C side: Rust
 * sees opaque pointers, integers and the two small structures below, whose
 * layout is fixed here. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <infiniband/verbs.h>

struct gs_port {
	char dev[64];
	uint64_t node_guid;
	char fw_ver[64];
	uint32_t port;
	uint32_t state;        /* enum ibv_port_state */
	uint32_t max_mtu;      /* enum ibv_mtu */
	uint32_t active_mtu;   /* enum ibv_mtu */
	uint32_t link_layer;   /* IBV_LINK_LAYER_* */
	uint32_t lid;
	uint32_t gid_tbl_len;
	uint32_t active_speed;
	uint32_t active_width;
	uint32_t max_qp_wr;
	uint32_t max_sge;
	uint32_t max_cqe;
};

struct gs_wc {
	uint64_t wr_id;
	uint32_t status;
	uint32_t opcode;
	uint32_t byte_len;
	uint32_t imm;          /* host order */
	uint32_t qp_num;
	uint32_t vendor_err;
	uint32_t with_imm;
	uint32_t pad;
};

struct gs_dev {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_comp_channel *ch;
	struct ibv_cq *cq;
	uint32_t port;
};

static void fill_port(struct ibv_context *ctx, uint32_t port, const struct ibv_port_attr *pa,
		      const struct ibv_device_attr *da, struct gs_port *out)
{
	memset(out, 0, sizeof(*out));
	strncpy(out->dev, ibv_get_device_name(ctx->device), sizeof(out->dev) - 1);
	out->node_guid = be64toh(ibv_get_device_guid(ctx->device));
	strncpy(out->fw_ver, da->fw_ver, sizeof(out->fw_ver) - 1);
	out->port = port;
	out->state = pa->state;
	out->max_mtu = pa->max_mtu;
	out->active_mtu = pa->active_mtu;
	out->link_layer = pa->link_layer;
	out->lid = pa->lid;
	out->gid_tbl_len = pa->gid_tbl_len;
	out->active_speed = pa->active_speed;
	out->active_width = pa->active_width;
	out->max_qp_wr = da->max_qp_wr;
	out->max_sge = da->max_sge;
	out->max_cqe = da->max_cqe;
}

/* Every port of every device, up to max; returns the number written or -errno. */
int gs_list_ports(struct gs_port *out, int max)
{
	int n = 0, num = 0;
	struct ibv_device **list = ibv_get_device_list(&num);
	if (!list)
		return -errno;
	for (int i = 0; i < num && n < max; i++) {
		struct ibv_context *ctx = ibv_open_device(list[i]);
		if (!ctx)
			continue;
		struct ibv_device_attr da;
		if (ibv_query_device(ctx, &da) == 0) {
			for (uint32_t p = 1; p <= da.phys_port_cnt && n < max; p++) {
				struct ibv_port_attr pa;
				if (ibv_query_port(ctx, p, &pa) == 0)
					fill_port(ctx, p, &pa, &da, &out[n++]);
			}
		}
		ibv_close_device(ctx);
	}
	ibv_free_device_list(list);
	return n;
}

/* Opens device `name` (port `port`), with a protection domain, a completion channel and a
 * completion queue of `cqe` entries. */
struct gs_dev *gs_open(const char *name, uint32_t port, int cqe, int *err)
{
	int num = 0;
	struct ibv_device **list = ibv_get_device_list(&num);
	struct gs_dev *d = NULL;
	*err = 0;
	if (!list) {
		*err = errno ? errno : ENODEV;
		return NULL;
	}
	for (int i = 0; i < num; i++) {
		if (strcmp(ibv_get_device_name(list[i]), name) != 0)
			continue;
		d = calloc(1, sizeof(*d));
		if (!d) {
			*err = ENOMEM;
			break;
		}
		d->port = port;
		d->ctx = ibv_open_device(list[i]);
		if (!d->ctx) {
			*err = errno ? errno : EIO;
			break;
		}
		d->pd = ibv_alloc_pd(d->ctx);
		if (!d->pd) {
			*err = errno ? errno : EIO;
			break;
		}
		d->ch = ibv_create_comp_channel(d->ctx);
		if (!d->ch) {
			*err = errno ? errno : EIO;
			break;
		}
		int fl = fcntl(d->ch->fd, F_GETFL);
		fcntl(d->ch->fd, F_SETFL, fl | O_NONBLOCK);
		d->cq = ibv_create_cq(d->ctx, cqe, NULL, d->ch, 0);
		if (!d->cq) {
			*err = errno ? errno : EIO;
			break;
		}
		ibv_free_device_list(list);
		return d;
	}
	if (!d && *err == 0)
		*err = ENODEV;
	ibv_free_device_list(list);
	if (d) {
		if (d->cq)
			ibv_destroy_cq(d->cq);
		if (d->ch)
			ibv_destroy_comp_channel(d->ch);
		if (d->pd)
			ibv_dealloc_pd(d->pd);
		if (d->ctx)
			ibv_close_device(d->ctx);
		free(d);
	}
	return NULL;
}

/* Resizes the completion queue to at least `cqe` entries (completions in it are kept); returns 0
 * or an errno. */
int gs_resize_cq(struct gs_dev *d, int cqe)
{
	return ibv_resize_cq(d->cq, cqe);
}

/* Entries the completion queue holds. */
int gs_cq_size(struct gs_dev *d)
{
	return d->cq->cqe;
}

int gs_port_info(struct gs_dev *d, struct gs_port *out)
{
	struct ibv_device_attr da;
	struct ibv_port_attr pa;
	if (ibv_query_device(d->ctx, &da))
		return errno ? errno : EIO;
	if (ibv_query_port(d->ctx, d->port, &pa))
		return errno ? errno : EIO;
	fill_port(d->ctx, d->port, &pa, &da, out);
	return 0;
}

/* GID `idx` of (device, port) of an open device: 0 and *type = 0 IB/RoCE v1, 1 RoCE v2. */
int gs_gid(struct gs_dev *d, uint32_t idx, uint8_t gid[16], uint32_t *type)
{
	struct ibv_gid_entry e;
	if (ibv_query_gid_ex(d->ctx, d->port, idx, &e, 0))
		return errno ? errno : EIO;
	memcpy(gid, e.gid.raw, 16);
	*type = e.gid_type == IBV_GID_TYPE_ROCE_V2 ? 1 : 0;
	return 0;
}

/* Every valid GID of every port of every device (one table query per device), up to max;
 * returns the number written or -errno. type: 0 IB/RoCE v1, 1 RoCE v2. */
struct gs_gid {
	char dev[64];
	uint8_t gid[16];
	uint32_t index;
	uint32_t port;
	uint32_t type;
	uint32_t pad;
};

int gs_list_gids(struct gs_gid *out, int max)
{
	int n = 0, num = 0;
	struct ibv_gid_entry e[256];
	struct ibv_device **list = ibv_get_device_list(&num);
	if (!list)
		return -errno;
	for (int i = 0; i < num && n < max; i++) {
		struct ibv_context *ctx = ibv_open_device(list[i]);
		if (!ctx)
			continue;
		ssize_t got = ibv_query_gid_table(ctx, e, 256, 0);
		for (ssize_t k = 0; k < got && n < max; k++) {
			memset(&out[n], 0, sizeof(out[n]));
			strncpy(out[n].dev, ibv_get_device_name(list[i]), sizeof(out[n].dev) - 1);
			memcpy(out[n].gid, e[k].gid.raw, 16);
			out[n].index = e[k].gid_index;
			out[n].port = e[k].port_num;
			out[n].type = e[k].gid_type == IBV_GID_TYPE_ROCE_V2 ? 1 : 0;
			n++;
		}
		ibv_close_device(ctx);
	}
	ibv_free_device_list(list);
	return n;
}

void gs_close(struct gs_dev *d)
{
	if (!d)
		return;
	if (d->cq)
		ibv_destroy_cq(d->cq);
	if (d->ch)
		ibv_destroy_comp_channel(d->ch);
	if (d->pd)
		ibv_dealloc_pd(d->pd);
	if (d->ctx)
		ibv_close_device(d->ctx);
	free(d);
}

/* access bits: 1 local write, 2 remote write, 4 remote read */
struct ibv_mr *gs_reg(struct gs_dev *d, void *addr, size_t len, int access, uint32_t *lkey,
		      uint32_t *rkey, int *err)
{
	int fl = 0;
	if (access & 1)
		fl |= IBV_ACCESS_LOCAL_WRITE;
	if (access & 2)
		fl |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
	if (access & 4)
		fl |= IBV_ACCESS_REMOTE_READ;
	struct ibv_mr *mr = ibv_reg_mr(d->pd, addr, len, fl);
	if (!mr) {
		*err = errno ? errno : EIO;
		return NULL;
	}
	*lkey = mr->lkey;
	*rkey = mr->rkey;
	return mr;
}

int gs_dereg(struct ibv_mr *mr)
{
	return ibv_dereg_mr(mr);
}

struct ibv_qp *gs_qp_create(struct gs_dev *d, uint32_t max_send, uint32_t max_recv, uint32_t max_sge,
			    uint32_t max_inline, uint32_t *qpn, int *err)
{
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = d->cq;
	a.recv_cq = d->cq;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 1;
	a.cap.max_send_wr = max_send;
	a.cap.max_recv_wr = max_recv;
	a.cap.max_send_sge = max_sge;
	a.cap.max_recv_sge = 1;
	a.cap.max_inline_data = max_inline;
	struct ibv_qp *qp = ibv_create_qp(d->pd, &a);
	if (!qp) {
		*err = errno ? errno : EIO;
		return NULL;
	}
	*qpn = qp->qp_num;
	return qp;
}

int gs_qp_destroy(struct ibv_qp *qp)
{
	return ibv_destroy_qp(qp);
}

int gs_qp_init(struct ibv_qp *qp, uint32_t port)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = port;
	a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		return errno ? errno : EINVAL;
	return 0;
}

int gs_qp_rtr(struct ibv_qp *qp, uint32_t port, uint32_t mtu, uint32_t dqpn, uint32_t rq_psn,
	      uint32_t is_global, const uint8_t dgid[16], uint32_t sgid_index, uint32_t dlid)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = mtu;
	a.dest_qp_num = dqpn;
	a.rq_psn = rq_psn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = dlid;
	a.ah_attr.sl = 0;
	a.ah_attr.src_path_bits = 0;
	a.ah_attr.port_num = port;
	if (is_global) {
		a.ah_attr.is_global = 1;
		memcpy(a.ah_attr.grh.dgid.raw, dgid, 16);
		a.ah_attr.grh.sgid_index = sgid_index;
		a.ah_attr.grh.hop_limit = 64;
		a.ah_attr.grh.traffic_class = 0;
		a.ah_attr.grh.flow_label = 0;
	}
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		return errno ? errno : EINVAL;
	return 0;
}

int gs_qp_rts(struct ibv_qp *qp, uint32_t sq_psn, uint32_t timeout, uint32_t retry_cnt,
	      uint32_t rnr_retry)
{
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = sq_psn;
	a.timeout = timeout;
	a.retry_cnt = retry_cnt;
	a.rnr_retry = rnr_retry;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				  IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC))
		return errno ? errno : EINVAL;
	return 0;
}

/* RDMA WRITE (with_imm: WRITE WITH IMM) of the gather list to raddr/rkey. */
int gs_post_write(struct ibv_qp *qp, uint64_t wr_id, const uint64_t *addr, const uint32_t *len,
		  const uint32_t *lkey, uint32_t nsge, uint64_t raddr, uint32_t rkey, uint32_t with_imm,
		  uint32_t imm)
{
	struct ibv_sge sg[16];
	struct ibv_send_wr wr, *bad = NULL;
	if (nsge > 16)
		return EINVAL;
	for (uint32_t i = 0; i < nsge; i++) {
		sg[i].addr = addr[i];
		sg[i].length = len[i];
		sg[i].lkey = lkey[i];
	}
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = sg;
	wr.num_sge = (int)nsge;
	wr.opcode = with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.imm_data = htonl(imm);
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

/* SEND (with_imm: SEND WITH IMM) of one span. */
int gs_post_send(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey,
		 uint32_t with_imm, uint32_t imm)
{
	struct ibv_sge sg = { .addr = addr, .length = len, .lkey = lkey };
	struct ibv_send_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sg;
	wr.num_sge = len ? 1 : 0;
	wr.opcode = with_imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.imm_data = htonl(imm);
	return ibv_post_send(qp, &wr, &bad);
}

int gs_post_recv(struct ibv_qp *qp, uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey)
{
	struct ibv_sge sg = { .addr = addr, .length = len, .lkey = lkey };
	struct ibv_recv_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sg;
	wr.num_sge = 1;
	return ibv_post_recv(qp, &wr, &bad);
}

/* Up to n completions; returns how many, or -1. */
int gs_poll(struct gs_dev *d, struct gs_wc *out, int n)
{
	struct ibv_wc wc[32];
	if (n > 32)
		n = 32;
	int got = ibv_poll_cq(d->cq, n, wc);
	for (int i = 0; i < got; i++) {
		out[i].wr_id = wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].opcode = wc[i].opcode;
		out[i].byte_len = wc[i].byte_len;
		out[i].with_imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? 1 : 0;
		out[i].imm = out[i].with_imm ? ntohl(wc[i].imm_data) : 0;
		out[i].qp_num = wc[i].qp_num;
		out[i].vendor_err = wc[i].vendor_err;
		out[i].pad = 0;
	}
	return got;
}

int gs_req_notify(struct gs_dev *d)
{
	return ibv_req_notify_cq(d->cq, 0);
}

int gs_channel_fd(struct gs_dev *d)
{
	return d->ch->fd;
}

/* Consumes a pending completion event (non-blocking); 1 if there was one. */
int gs_take_event(struct gs_dev *d)
{
	struct ibv_cq *cq;
	void *ctx;
	if (ibv_get_cq_event(d->ch, &cq, &ctx))
		return 0;
	ibv_ack_cq_events(cq, 1);
	return 1;
}

const char *gs_wc_status_str(uint32_t s)
{
	return ibv_wc_status_str((enum ibv_wc_status)s);
}

uint32_t gs_wc_opcode(int which)
{
	switch (which) {
	case 0: return IBV_WC_SEND;
	case 1: return IBV_WC_RDMA_WRITE;
	case 2: return IBV_WC_RECV;
	case 3: return IBV_WC_RECV_RDMA_WITH_IMM;
	default: return 0xffffffff;
	}
}
