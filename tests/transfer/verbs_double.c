/*
 * TEST DOUBLE of libibverbs: a stand-in for an RDMA device, for CI machines without one.
 *
 * Built as libibverbs.so.1 by tests/transfer/verbs_double.py and loaded through
 * MOONCAKE_LIBIBVERBS. It exports the part of the libibverbs ABI the RDMA transport uses,
 * with the layouts of native/verbs_abi.h (our declarations of rdma-core's ABI, which
 * test_verbs_abi.py compares with <infiniband/verbs.h>), and models RoCE RC queue pairs
 * between processes of one host:
 *   - devices (VERBS_DOUBLE_DEVICES, default "double0"), one active Ethernet port, 2 GIDs;
 *   - MRs and QPs are published as files in a state directory (VERBS_DOUBLE_DIR, default
 *     /dev/shm/verbs-double-<uid>) so other processes can resolve rkeys and QP numbers:
 *       mr-<rkey, 8 hex>: "verbs-double mr pid=<dec> addr=0x<hex> length=<dec> access=0x<hex>\n"
 *       qp-<qpn, 6 hex>:  "verbs-double qp pid=<dec> dev=<dec> state=<dec enum ibv_qp_state>
 *                          dest_qpn=0x<6 hex> access=0x<hex>\n"   (one line)
 *     A qp- file is replaced atomically (rename) on every state change; deregistering an MR
 *     or destroying a QP removes its file, which revokes it for every process;
 *   - the RC state machine with its attribute masks; lkey, rkey and access checks;
 *   - RDMA WRITE and READ, executed synchronously inside post_send with process_vm_writev /
 *     process_vm_readv (memmove within one process), completions in a ring per CQ;
 *   - an error completion moves the QP to ERR; everything posted after it is flushed.
 * Not modelled: the wire (packets, latency, PSNs, retries, timeouts), SEND/RECV, atomics,
 * inline data, SRQs, completion channels and events, async events, memory pinning (an
 * unmapped registered range makes the copy fail with REM_ACCESS_ERR).
 * A CQ whose ring overflows loses the completion and poll_cq returns -1 from then on.
 * VERBS_DOUBLE_FAIL_AFTER=<n> fails the (n+1)-th work request executed in this process with
 * RETRY_EXC_ERR. verbs_double_live() counts live objects so tests can check nothing leaks.
 * Configuration is read from the environment once, at the first call that needs it.
 */
#define _GNU_SOURCE
#include "verbs_abi.h"
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))
#define MAX_DEVICES 32
#define MAX_SGE 16
#define MAX_WR 4096
#define MAX_CQE 65536
#define MAX_MSG 0x80000000u
#define LOCK() pthread_mutex_lock(&g_lock)
#define UNLOCK() pthread_mutex_unlock(&g_lock)

/* ------------------------------------------------------------------ objects */

/* Each wraps the public struct (first member, so the pointers convert both ways). */
struct dev { struct ibv_device dev; int index; };
struct ctx { struct ibv_context ctx; int index, pds, cqs; };
struct pd { struct ibv_pd pd; int mrs, qps; };
struct mr { struct ibv_mr mr; int access; struct mr *next; };
struct cq {
	struct ibv_cq cq;
	pthread_mutex_t lock;     /* guards the ring */
	struct ibv_wc *ring;
	int head, count, overrun; /* overrun: a completion was lost; poll_cq fails from then on */
	int qps;                  /* QPs using this CQ */
};
struct qp {
	struct ibv_qp qp;
	pthread_mutex_t lock;     /* serialises post_send and modify_qp: requests run in order */
	int index, max_send_wr, access;
	uint32_t dest_qpn;
	enum ibv_mtu mtu;
	int outstanding;          /* completions pushed and not yet polled (atomic) */
	struct qp *next;
};
/* A record read from the state directory. */
struct rec { int pid, dev, state, access; uint64_t addr, length; uint32_t dest_qpn; };

/* Lock order: qp->lock, then g_lock or cq->lock; g_lock and cq->lock are never nested. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* guards lists and counters */
static struct mr *g_mrs;
static struct qp *g_qps;
static int g_live;
static long g_executed; /* work requests executed in this process (atomic) */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct dev g_devs[MAX_DEVICES];
static int g_ndevs;
static char g_dir[1024];
static long g_fail_after = -1;

static void configure(void)
{
	const char *names = getenv("VERBS_DOUBLE_DEVICES"), *dir = getenv("VERBS_DOUBLE_DIR");
	const char *fail = getenv("VERBS_DOUBLE_FAIL_AFTER");
	char buf[4096], *save = NULL;

	snprintf(buf, sizeof buf, "%s", names ? names : "double0");
	for (char *n = strtok_r(buf, ",", &save); n && g_ndevs < MAX_DEVICES;
	     n = strtok_r(NULL, ",", &save)) {
		int i = g_ndevs++;
		struct ibv_device *d = &g_devs[i].dev;
		g_devs[i].index = i;
		d->node_type = IBV_NODE_CA, d->transport_type = IBV_TRANSPORT_IB;
		snprintf(d->name, sizeof d->name, "%s", n);
		snprintf(d->dev_name, sizeof d->dev_name, "uverbs%d", i);
		snprintf(d->dev_path, sizeof d->dev_path, "/sys/class/infiniband_verbs/uverbs%d", i);
		snprintf(d->ibdev_path, sizeof d->ibdev_path, "/sys/class/infiniband/%.60s", n);
	}
	if (dir && *dir)
		snprintf(g_dir, sizeof g_dir, "%s", dir);
	else
		snprintf(g_dir, sizeof g_dir, "/dev/shm/verbs-double-%u", (unsigned)getuid());
	mkdir(g_dir, 0700); /* a failure shows later, as the errno of reg_mr / create_qp */
	if (fail && *fail)
		g_fail_after = strtol(fail, NULL, 10);
}

static void *fail_null(int err) { errno = err; return NULL; }
static int fail_int(int err) { errno = err; return err; }

/* Counts a new object (and it in its parent's counter, if any). */
static void born(int *parent)
{
	LOCK();
	if (parent)
		(*parent)++;
	g_live++;
	UNLOCK();
}

/* Uncounts an object, unless it still has children (*a or *b nonzero): then EBUSY. */
static int release(const int *a, const int *b, int *parent)
{
	LOCK();
	int busy = *a || (b && *b);
	if (!busy && parent)
		(*parent)--;
	g_live -= !busy;
	UNLOCK();
	return busy ? fail_int(EBUSY) : 0;
}

API int verbs_double_live(void)
{
	LOCK();
	int n = g_live;
	UNLOCK();
	return n;
}

/* ---------------------------------------------------------- state directory */

static void path_of(char *out, size_t n, char kind, uint32_t id)
{
	snprintf(out, n, kind == 'm' ? "%s/mr-%08" PRIx32 : "%s/qp-%06" PRIx32, g_dir, id);
}

/* Writes text to a new file at path; 0 or an errno (the file is removed on failure). */
static int write_file(const char *path, const char *text, int flags)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | flags, 0600), err = 0;
	if (fd < 0) return errno;
	for (size_t len = strlen(text), done = 0; done < len && !err;) {
		ssize_t w = write(fd, text + done, len - done);
		if (w > 0)
			done += (size_t)w;
		else if (!(w < 0 && errno == EINTR))
			err = w < 0 ? errno : EIO;
	}
	close(fd);
	if (err)
		unlink(path);
	return err;
}

/* Creates <kind>-<random nonzero id & mask> exclusively, holding text; the id, or 0 + errno. */
static uint32_t publish_new(char kind, uint32_t mask, const char *text)
{
	char path[1200];
	for (int tries = 0; tries < 1000; tries++) {
		uint32_t id = 0;
		if (getrandom(&id, sizeof id, 0) != sizeof id) return errno = EIO, 0;
		if (!(id &= mask)) continue;
		path_of(path, sizeof path, kind, id);
		int err = write_file(path, text, O_EXCL);
		if (err != EEXIST) return err ? (errno = err, 0) : id;
	}
	return errno = EAGAIN, 0;
}

static void unpublish(char kind, uint32_t id)
{
	char path[1200];
	path_of(path, sizeof path, kind, id);
	unlink(path);
}

static void fmt_qp(char *out, size_t n, struct qp *q)
{
	snprintf(out, n, "verbs-double qp pid=%d dev=%d state=%d dest_qpn=0x%06" PRIx32 " access=0x%x\n",
		 (int)getpid(), q->index, (int)q->qp.state, q->dest_qpn, q->access);
}

/* Replaces this QP's file atomically (temporary file + rename); caller holds q->lock. */
static void republish_qp(struct qp *q)
{
	char path[1200], tmp[1300], text[256];
	path_of(path, sizeof path, 'q', q->qp.qp_num);
	snprintf(tmp, sizeof tmp, "%s.tmp", path);
	fmt_qp(text, sizeof text, q);
	if (write_file(tmp, text, O_TRUNC) == 0 && rename(tmp, path) != 0)
		unlink(tmp);
}

/* Reads mr-/qp-<id>; 0 when it exists and parses. */
static int read_rec(char kind, uint32_t id, struct rec *r)
{
	char path[1200], text[256];
	path_of(path, sizeof path, kind, id);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) return -1;
	ssize_t n = read(fd, text, sizeof text - 1);
	close(fd);
	if (n <= 0) return -1;
	text[n] = 0;
	memset(r, 0, sizeof *r);
	if (kind == 'm')
		return sscanf(text, "verbs-double mr pid=%d addr=0x%" SCNx64 " length=%" SCNu64 " access=0x%x",
			      &r->pid, &r->addr, &r->length, &r->access) == 4 ? 0 : -1;
	return sscanf(text, "verbs-double qp pid=%d dev=%d state=%d dest_qpn=0x%" SCNx32 " access=0x%x",
		      &r->pid, &r->dev, &r->state, &r->dest_qpn, &r->access) == 5 ? 0 : -1;
}

static int alive(int pid) { return pid > 0 && !(kill(pid, 0) != 0 && errno == ESRCH); }

/* -------------------------------------------------------- devices and ports */

API struct ibv_device **ibv_get_device_list(int *num_devices)
{
	pthread_once(&g_once, configure);
	struct ibv_device **list = calloc((size_t)g_ndevs + 1, sizeof *list); /* NULL-terminated */
	if (!list) return fail_null(ENOMEM);
	for (int i = 0; i < g_ndevs; i++)
		list[i] = &g_devs[i].dev;
	if (num_devices)
		*num_devices = g_ndevs;
	return list;
}

API void ibv_free_device_list(struct ibv_device **list) { free(list); }

API const char *ibv_get_device_name(struct ibv_device *device) { return device->name; }

static int post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
static int poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
static int post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
	return (void)qp, *bad_wr = wr, ENOSYS; /* no receive queue is modelled */
}

API struct ibv_context *ibv_open_device(struct ibv_device *device)
{
	struct ctx *c = calloc(1, sizeof *c);
	if (!c) return fail_null(ENOMEM);
	c->index = ((struct dev *)device)->index;
	c->ctx.device = device;
	/* ibv_post_send and ibv_poll_cq are header inlines calling these: */
	c->ctx.ops.post_send = post_send;
	c->ctx.ops.poll_cq = poll_cq;
	c->ctx.ops.post_recv = post_recv;
	c->ctx.cmd_fd = c->ctx.async_fd = -1;
	c->ctx.num_comp_vectors = 1;
	c->ctx.abi_compat = NULL; /* not a verbs_context: the header's extended inlines see no ops */
	pthread_mutex_init(&c->ctx.mutex, NULL);
	born(NULL);
	return &c->ctx;
}

API int ibv_close_device(struct ibv_context *context)
{
	struct ctx *c = (struct ctx *)context;
	if (release(&c->pds, &c->cqs, NULL)) return EBUSY;
	pthread_mutex_destroy(&c->ctx.mutex);
	free(c);
	return 0;
}

API int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *a)
{
	uint64_t guid = htobe64(0x02000000d0b1e000ULL + (uint64_t)((struct ctx *)context)->index);
	*a = (struct ibv_device_attr){
		.fw_ver = "verbs-double", .node_guid = guid, .sys_image_guid = guid,
		.max_mr_size = 1ULL << 48, .page_size_cap = 4096, .max_qp = 1 << 16,
		.max_qp_wr = MAX_WR, .max_sge = MAX_SGE, .max_sge_rd = MAX_SGE, .max_cq = 1 << 16,
		.max_cqe = MAX_CQE, .max_mr = 1 << 20, .max_pd = 1 << 16, .max_qp_rd_atom = 16,
		.max_qp_init_rd_atom = 16, .max_res_rd_atom = 16 << 16, .max_pkeys = 1,
		.phys_port_cnt = 1 };
	return 0;
}

/* Writes only the compat prefix (through `flags`, left 0), as the real symbol does. */
API int ibv_query_port(struct ibv_context *context, uint8_t port_num, struct ibv_port_attr *p)
{
	(void)context;
	if (port_num != 1) return fail_int(EINVAL);
	memset(p, 0, offsetof(struct ibv_port_attr, flags) + 1); /* lid, sm_lid, counters: 0 */
	p->state = IBV_PORT_ACTIVE;
	p->max_mtu = p->active_mtu = IBV_MTU_4096;
	p->gid_tbl_len = 2, p->max_msg_sz = MAX_MSG, p->pkey_tbl_len = 1, p->max_vl_num = 1;
	p->active_width = 2, p->active_speed = 32, p->phys_state = 5; /* 4x, EDR, LinkUp */
	p->link_layer = IBV_LINK_LAYER_ETHERNET;
	return 0;
}

/* GID 0: fe80::<dev>; GID 1: ::ffff:127.0.0.<dev+1> (RoCEv2, IPv4-mapped). 0 or EINVAL. */
static int gid_of(int dev, int index, union ibv_gid *gid)
{
	if (index < 0 || index > 1) return EINVAL;
	memset(gid, 0, sizeof *gid);
	if (index == 0) {
		gid->raw[0] = 0xfe, gid->raw[1] = 0x80, gid->raw[15] = (uint8_t)dev;
	} else {
		gid->raw[10] = gid->raw[11] = 0xff;
		gid->raw[12] = 127, gid->raw[15] = (uint8_t)(dev + 1);
	}
	return 0;
}

API int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid)
{
	if (port_num != 1 || gid_of(((struct ctx *)context)->index, index, gid))
		return fail_int(EINVAL);
	return 0;
}

/* ------------------------------------------------------------------- PD, MR */

API struct ibv_pd *ibv_alloc_pd(struct ibv_context *context)
{
	struct pd *p = calloc(1, sizeof *p);
	if (!p) return fail_null(ENOMEM);
	p->pd.context = context;
	born(&((struct ctx *)context)->pds);
	return &p->pd;
}

API int ibv_dealloc_pd(struct ibv_pd *pd)
{
	struct pd *p = (struct pd *)pd;
	if (release(&p->mrs, &p->qps, &((struct ctx *)pd->context)->pds)) return EBUSY;
	free(p);
	return 0;
}

API struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access)
{
	char text[256];
	pthread_once(&g_once, configure);
	/* As on hardware, remote write needs local write too. */
	if (!pd || !addr || !length ||
	    ((access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE)))
		return fail_null(EINVAL);
	struct mr *m = calloc(1, sizeof *m);
	if (!m) return fail_null(ENOMEM);
	snprintf(text, sizeof text, "verbs-double mr pid=%d addr=0x%" PRIxPTR " length=%zu access=0x%x\n",
		 (int)getpid(), (uintptr_t)addr, length, access);
	uint32_t key = publish_new('m', 0xffffffffu, text);
	if (!key) {
		int err = errno;
		return free(m), fail_null(err);
	}
	m->mr = (struct ibv_mr){ .context = pd->context, .pd = pd, .addr = addr, .length = length,
				 .handle = key, .lkey = key, .rkey = key };
	m->access = access;
	LOCK();
	m->next = g_mrs, g_mrs = m;
	((struct pd *)pd)->mrs++, g_live++;
	UNLOCK();
	return &m->mr;
}

API struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
				     uint64_t iova, int fd, int access)
{
	(void)pd, (void)offset, (void)length, (void)iova, (void)fd, (void)access;
	return fail_null(EOPNOTSUPP); /* no device memory behind this double */
}

API int ibv_dereg_mr(struct ibv_mr *mr)
{
	struct mr *m = (struct mr *)mr, **pp;
	LOCK();
	for (pp = &g_mrs; *pp && *pp != m; pp = &(*pp)->next)
		;
	if (*pp)
		*pp = m->next;
	((struct pd *)mr->pd)->mrs--, g_live--;
	UNLOCK();
	unpublish('m', mr->rkey); /* revokes the rkey for every process */
	free(m);
	return 0;
}

/* ----------------------------------------------------------------------- CQ */

API struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
				 struct ibv_comp_channel *channel, int comp_vector)
{
	(void)comp_vector;
	if (cqe <= 0 || cqe > MAX_CQE) return fail_null(EINVAL);
	struct cq *c = calloc(1, sizeof *c);
	if (!c || !(c->ring = calloc((size_t)cqe, sizeof *c->ring))) {
		free(c);
		return fail_null(ENOMEM);
	}
	c->cq = (struct ibv_cq){ .context = context, .channel = channel, .cq_context = cq_context,
				 .cqe = cqe };
	pthread_mutex_init(&c->lock, NULL);
	born(&((struct ctx *)context)->cqs);
	return &c->cq;
}

API int ibv_destroy_cq(struct ibv_cq *cq)
{
	struct cq *c = (struct cq *)cq;
	if (release(&c->qps, NULL, &((struct ctx *)cq->context)->cqs)) return EBUSY;
	pthread_mutex_destroy(&c->lock);
	free(c->ring);
	free(c);
	return 0;
}

/* Appends a completion; 0, or -1 when the ring is full (the CQ is then overrun). */
static int push_wc(struct cq *c, const struct ibv_wc *wc)
{
	pthread_mutex_lock(&c->lock);
	int ok = c->count < c->cq.cqe;
	if (ok)
		c->ring[(c->head + c->count++) % c->cq.cqe] = *wc;
	else
		c->overrun = 1;
	pthread_mutex_unlock(&c->lock);
	return ok ? 0 : -1;
}

static int poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
	struct cq *c = (struct cq *)cq;
	int n = 0;
	pthread_mutex_lock(&c->lock);
	int overrun = c->overrun;
	for (; !overrun && n < num_entries && c->count; n++, c->count--) {
		wc[n] = c->ring[c->head];
		c->head = (c->head + 1) % c->cq.cqe;
	}
	pthread_mutex_unlock(&c->lock);
	if (overrun) return -1;
	LOCK(); /* polled completions free their QP's send queue slots */
	for (int i = 0; i < n; i++)
		for (struct qp *q = g_qps; q; q = q->next)
			if (q->qp.qp_num == wc[i].qp_num) {
				__atomic_sub_fetch(&q->outstanding, 1, __ATOMIC_SEQ_CST);
				break;
			}
	UNLOCK();
	return n;
}

/* ----------------------------------------------------------------------- QP */

API struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init)
{
	char text[256];
	pthread_once(&g_once, configure);
	if (!pd || !init) return fail_null(EINVAL);
	if (init->qp_type != IBV_QPT_RC) return fail_null(EOPNOTSUPP);
	if (!init->send_cq || init->srq || init->cap.max_send_wr < 1 ||
	    init->cap.max_send_wr > MAX_WR || init->cap.max_send_sge > MAX_SGE)
		return fail_null(EINVAL);
	struct qp *q = calloc(1, sizeof *q);
	if (!q) return fail_null(ENOMEM);
	q->qp = (struct ibv_qp){ .context = pd->context, .qp_context = init->qp_context, .pd = pd,
				 .send_cq = init->send_cq, .recv_cq = init->recv_cq,
				 .state = IBV_QPS_RESET, .qp_type = IBV_QPT_RC };
	q->index = ((struct ctx *)pd->context)->index;
	q->max_send_wr = (int)init->cap.max_send_wr;
	fmt_qp(text, sizeof text, q);
	if (!(q->qp.qp_num = q->qp.handle = publish_new('q', 0xffffffu, text))) {
		int err = errno;
		return free(q), fail_null(err);
	}
	pthread_mutex_init(&q->lock, NULL);
	init->cap.max_inline_data = 0;
	LOCK();
	q->next = g_qps, g_qps = q;
	((struct pd *)pd)->qps++, g_live++;
	((struct cq *)init->send_cq)->qps++;
	if (init->recv_cq && init->recv_cq != init->send_cq)
		((struct cq *)init->recv_cq)->qps++;
	UNLOCK();
	return &q->qp;
}

API int ibv_destroy_qp(struct ibv_qp *qp)
{
	struct qp *q = (struct qp *)qp, **pp;
	LOCK();
	for (pp = &g_qps; *pp && *pp != q; pp = &(*pp)->next)
		;
	if (*pp)
		*pp = q->next;
	((struct pd *)qp->pd)->qps--, g_live--;
	((struct cq *)qp->send_cq)->qps--;
	if (qp->recv_cq && qp->recv_cq != qp->send_cq)
		((struct cq *)qp->recv_cq)->qps--;
	UNLOCK();
	unpublish('q', qp->qp_num);
	pthread_mutex_destroy(&q->lock);
	free(q);
	return 0;
}

/* Validates and applies one transition (IB spec, RC); caller holds q->lock. 0 or an errno. */
static int transition(struct qp *q, struct ibv_qp_attr *a, int mask)
{
	enum ibv_qp_state from = q->qp.state, to = a->qp_state;
	int required, optional = 0;

	if (!(mask & IBV_QP_STATE) || ((mask & IBV_QP_CUR_STATE) && a->cur_qp_state != from))
		return EINVAL;
	if (to == IBV_QPS_ERR || to == IBV_QPS_RESET) {
		required = IBV_QP_STATE;
	} else if (from == IBV_QPS_RESET && to == IBV_QPS_INIT) {
		required = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
	} else if (from == IBV_QPS_INIT && to == IBV_QPS_RTR) {
		required = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
		optional = IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
	} else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS) {
		required = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
			   IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
		optional = IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER;
	} else {
		return EINVAL;
	}
	if ((mask & required) != required || (mask & ~(required | optional))) return EINVAL;
	/* Value ranges: one port, one pkey, 3-bit retry counts, 5-bit timeout. */
	if (((mask & IBV_QP_PORT) && a->port_num != 1) ||
	    ((mask & IBV_QP_PKEY_INDEX) && a->pkey_index != 0) ||
	    ((mask & IBV_QP_RETRY_CNT) && a->retry_cnt > 7) ||
	    ((mask & IBV_QP_RNR_RETRY) && a->rnr_retry > 7) ||
	    ((mask & IBV_QP_TIMEOUT) && a->timeout > 31))
		return EINVAL;
	if (to == IBV_QPS_RTR) {
		struct rec peer;
		union ibv_gid want;
		if (a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096 || a->dest_qp_num > 0xffffff)
			return EINVAL;
		/* RoCE addresses by GID: the AV needs a GRH whose dgid is the peer device's GID. */
		if (!a->ah_attr.is_global || a->ah_attr.grh.sgid_index > 1 ||
		    read_rec('q', a->dest_qp_num, &peer) != 0 ||
		    gid_of(peer.dev, a->ah_attr.grh.sgid_index, &want) ||
		    memcmp(&want, &a->ah_attr.grh.dgid, sizeof want) != 0)
			return EINVAL;
		q->dest_qpn = a->dest_qp_num;
		q->mtu = a->path_mtu;
	}
	if (mask & IBV_QP_ACCESS_FLAGS)
		q->access = (int)a->qp_access_flags;
	if (to == IBV_QPS_RESET)
		q->dest_qpn = 0;
	q->qp.state = to;
	republish_qp(q);
	return 0;
}

API int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
{
	struct qp *q = (struct qp *)qp;
	pthread_mutex_lock(&q->lock);
	int err = transition(q, attr, attr_mask);
	pthread_mutex_unlock(&q->lock);
	return err ? fail_int(err) : 0;
}

API int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
		     struct ibv_qp_init_attr *init)
{
	struct qp *q = (struct qp *)qp;
	(void)attr_mask; /* everything known is filled */
	pthread_mutex_lock(&q->lock);
	*attr = (struct ibv_qp_attr){ .qp_state = qp->state, .cur_qp_state = qp->state,
				      .path_mtu = q->mtu, .dest_qp_num = q->dest_qpn,
				      .qp_access_flags = (unsigned)q->access, .port_num = 1,
				      .cap = { .max_send_wr = (uint32_t)q->max_send_wr,
					       .max_send_sge = MAX_SGE } };
	if (init)
		*init = (struct ibv_qp_init_attr){ .qp_context = qp->qp_context,
						   .send_cq = qp->send_cq, .recv_cq = qp->recv_cq,
						   .cap = attr->cap, .qp_type = IBV_QPT_RC };
	pthread_mutex_unlock(&q->lock);
	return 0;
}

/* ---------------------------------------------------------------- post_send */

/* Is [addr, addr+len) inside [base, base+size)? (overflow-safe) */
static int inside(uint64_t addr, uint64_t len, uint64_t base, uint64_t size)
{
	return addr >= base && addr - base <= size && len <= size - (addr - base);
}

/* Executes one RDMA WRITE/READ; returns its completion status. */
static enum ibv_wc_status execute(struct qp *q, struct ibv_send_wr *wr, uint64_t total,
				  uint32_t *vendor_err)
{
	int write = wr->opcode == IBV_WR_RDMA_WRITE;
	int need = write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ;
	struct iovec local[MAX_SGE], remote;
	struct rec peer, rmr;

	if (__atomic_fetch_add(&g_executed, 1, __ATOMIC_SEQ_CST) == g_fail_after)
		return IBV_WC_RETRY_EXC_ERR; /* injected: the link went down */
	if (total > MAX_MSG) return IBV_WC_LOC_LEN_ERR;

	/* 1. Each sge inside a registered MR of this PD with its lkey (a READ needs LOCAL_WRITE). */
	LOCK();
	for (int i = 0; i < wr->num_sge; i++) {
		struct ibv_sge *s = &wr->sg_list[i];
		struct mr *m = g_mrs;
		while (m && !(m->mr.lkey == s->lkey && m->mr.pd == q->qp.pd &&
			      inside(s->addr, s->length, (uintptr_t)m->mr.addr, m->mr.length) &&
			      (write || (m->access & IBV_ACCESS_LOCAL_WRITE))))
			m = m->next;
		if (!m) {
			UNLOCK();
			return IBV_WC_LOC_PROT_ERR;
		}
		local[i] = (struct iovec){ (void *)(uintptr_t)s->addr, s->length };
	}
	UNLOCK();

	/* 2. The responder QP exists, its process lives, it is RTR/RTS and connected back to us. */
	if (read_rec('q', q->dest_qpn, &peer) != 0 || !alive(peer.pid) ||
	    (peer.state != IBV_QPS_RTR && peer.state != IBV_QPS_RTS) || peer.dest_qpn != q->qp.qp_num)
		return IBV_WC_RETRY_EXC_ERR;

	/* 3. The rkey: not revoked, in the responder's process, covering the range, allowing the
	 *    op; the responder QP's access flags must allow it too. */
	if (read_rec('m', wr->wr.rdma.rkey, &rmr) != 0 || rmr.pid != peer.pid ||
	    !inside(wr->wr.rdma.remote_addr, total, rmr.addr, rmr.length) ||
	    !(rmr.access & need) || !(peer.access & need))
		return IBV_WC_REM_ACCESS_ERR;

	/* 4. The copy. */
	if (!total) return IBV_WC_SUCCESS;
	if (peer.pid == getpid()) {
		char *r = (char *)(uintptr_t)wr->wr.rdma.remote_addr;
		for (int i = 0; i < wr->num_sge; r += local[i].iov_len, i++)
			memmove(write ? r : local[i].iov_base, write ? local[i].iov_base : r,
				local[i].iov_len);
		return IBV_WC_SUCCESS;
	}
	remote = (struct iovec){ (void *)(uintptr_t)wr->wr.rdma.remote_addr, total };
	unsigned long nsge = (unsigned long)wr->num_sge;
	ssize_t done;
	do
		done = write ? process_vm_writev(peer.pid, local, nsge, &remote, 1, 0)
			     : process_vm_readv(peer.pid, local, nsge, &remote, 1, 0);
	while (done < 0 && errno == EINTR);
	if (done == (ssize_t)total) return IBV_WC_SUCCESS;
	*vendor_err = done < 0 ? (uint32_t)errno : EFAULT;
	if (done >= 0 || errno == EFAULT)
		return IBV_WC_REM_ACCESS_ERR; /* a short copy: part of the range is not mapped */
	if (errno == ESRCH) return IBV_WC_RETRY_EXC_ERR;
	return IBV_WC_GENERAL_ERR; /* e.g. EPERM (ptrace not permitted); vendor_err has the errno */
}

static int post_send(struct ibv_qp *ibqp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)
{
	struct qp *q = (struct qp *)ibqp;
	int err = 0;

	pthread_mutex_lock(&q->lock);
	for (; wr; wr = wr->next) {
		enum ibv_qp_state state = q->qp.state;
		int signaled = (wr->send_flags & IBV_SEND_SIGNALED) != 0;
		if ((wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_READ) ||
		    wr->num_sge < 1 || wr->num_sge > MAX_SGE || !wr->sg_list ||
		    (wr->send_flags & IBV_SEND_INLINE) ||
		    (state != IBV_QPS_RTS && state != IBV_QPS_ERR)) {
			err = EINVAL;
			break;
		}
		/* The send queue is full of signaled (or flushed) requests whose completion is unpolled. */
		if ((signaled || state == IBV_QPS_ERR) &&
		    __atomic_load_n(&q->outstanding, __ATOMIC_SEQ_CST) >= q->max_send_wr) {
			err = ENOMEM;
			break;
		}
		uint64_t total = 0;
		uint32_t vendor_err = 0;
		for (int i = 0; i < wr->num_sge; i++)
			total += wr->sg_list[i].length;
		enum ibv_wc_status status = state == IBV_QPS_ERR ? IBV_WC_WR_FLUSH_ERR
							  : execute(q, wr, total, &vendor_err);
		if (status != IBV_WC_SUCCESS && state != IBV_QPS_ERR) {
			q->qp.state = IBV_QPS_ERR;
			republish_qp(q);
		}
		if (status == IBV_WC_SUCCESS && !signaled) continue;
		struct ibv_wc wc = {
			.wr_id = wr->wr_id, .status = status, .vendor_err = vendor_err,
			.opcode = wr->opcode == IBV_WR_RDMA_WRITE ? IBV_WC_RDMA_WRITE : IBV_WC_RDMA_READ,
			.byte_len = (uint32_t)total, .qp_num = ibqp->qp_num };
		if (push_wc((struct cq *)ibqp->send_cq, &wc) == 0)
			__atomic_add_fetch(&q->outstanding, 1, __ATOMIC_SEQ_CST);
	}
	pthread_mutex_unlock(&q->lock);
	if (err)
		*bad_wr = wr, errno = err;
	return err;
}

/* The exports have the signatures the verbs module calls them with (verbs_abi.h). */
#define SIGNATURE(f) _Static_assert(__builtin_types_compatible_p(__typeof__(&f), f##_fn), \
				    #f " differs from its type in verbs_abi.h")
SIGNATURE(ibv_get_device_list);
SIGNATURE(ibv_free_device_list);
SIGNATURE(ibv_get_device_name);
SIGNATURE(ibv_open_device);
SIGNATURE(ibv_close_device);
SIGNATURE(ibv_query_device);
SIGNATURE(ibv_query_port);
SIGNATURE(ibv_query_gid);
SIGNATURE(ibv_alloc_pd);
SIGNATURE(ibv_dealloc_pd);
SIGNATURE(ibv_reg_mr);
SIGNATURE(ibv_reg_dmabuf_mr);
SIGNATURE(ibv_dereg_mr);
SIGNATURE(ibv_create_cq);
SIGNATURE(ibv_destroy_cq);
SIGNATURE(ibv_create_qp);
SIGNATURE(ibv_modify_qp);
SIGNATURE(ibv_destroy_qp);
