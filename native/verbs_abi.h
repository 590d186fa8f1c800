/*
 * Our own declarations of the part of libibverbs' ABI that native/verbs.pyx and the test
 * double (tests/transfer/verbs_double.c) use, so the verbs module builds without
 * libibverbs' headers (Debian's libibverbs-dev) and loads libibverbs.so.1 at run time.
 *
 * Written from rdma-core's public libibverbs/verbs.h (linux-rdma/rdma-core 691953d; the
 * same layouts as rdma-core 44, Debian bookworm's), which rdma-core keeps for
 * compatibility (IBVERBS_1.1 symbols). What must match bit for bit: the layouts of the
 * structs passed to or filled by the library (sizes included: it writes whole
 * ibv_device_attr, ibv_wc arrays, a port-attribute prefix), the offsets of the fields read
 * from the objects it allocates, the constants, and the slots of ibv_context_ops that
 * ibv_post_send and ibv_poll_cq call (static inlines in verbs.h, no exported symbol).
 * Parts nobody here reads are reserved space of the same size and alignment.
 * tests/transfer/test_verbs_abi.py compares every layout and constant below with the real
 * header where one is at hand.
 */
#ifndef MOONCAKE_VERBS_ABI_H
#define MOONCAKE_VERBS_ABI_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------- constants */

enum ibv_node_type { IBV_NODE_CA = 1 };
enum ibv_transport_type { IBV_TRANSPORT_IB = 0 };

enum ibv_mtu {
	IBV_MTU_256 = 1, IBV_MTU_512 = 2, IBV_MTU_1024 = 3, IBV_MTU_2048 = 4, IBV_MTU_4096 = 5
};

enum ibv_port_state {
	IBV_PORT_NOP, IBV_PORT_DOWN, IBV_PORT_INIT, IBV_PORT_ARMED, IBV_PORT_ACTIVE,
	IBV_PORT_ACTIVE_DEFER
};

enum { IBV_LINK_LAYER_UNSPECIFIED, IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET };

enum ibv_access_flags {
	IBV_ACCESS_LOCAL_WRITE = 1, IBV_ACCESS_REMOTE_WRITE = 1 << 1, IBV_ACCESS_REMOTE_READ = 1 << 2
};

enum ibv_qp_type { IBV_QPT_RC = 2 };

enum ibv_qp_state {
	IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE,
	IBV_QPS_ERR
};

enum ibv_qp_attr_mask {
	IBV_QP_STATE = 1 << 0,
	IBV_QP_CUR_STATE = 1 << 1,
	IBV_QP_ACCESS_FLAGS = 1 << 3,
	IBV_QP_PKEY_INDEX = 1 << 4,
	IBV_QP_PORT = 1 << 5,
	IBV_QP_AV = 1 << 7,
	IBV_QP_PATH_MTU = 1 << 8,
	IBV_QP_TIMEOUT = 1 << 9,
	IBV_QP_RETRY_CNT = 1 << 10,
	IBV_QP_RNR_RETRY = 1 << 11,
	IBV_QP_RQ_PSN = 1 << 12,
	IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
	IBV_QP_MIN_RNR_TIMER = 1 << 15,
	IBV_QP_SQ_PSN = 1 << 16,
	IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
	IBV_QP_DEST_QPN = 1 << 20
};

enum ibv_wr_opcode { IBV_WR_RDMA_WRITE = 0, IBV_WR_RDMA_READ = 4 };

enum ibv_send_flags { IBV_SEND_SIGNALED = 1 << 1, IBV_SEND_INLINE = 1 << 3 };

enum ibv_wc_status {
	IBV_WC_SUCCESS, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_QP_OP_ERR, IBV_WC_LOC_EEC_OP_ERR,
	IBV_WC_LOC_PROT_ERR, IBV_WC_WR_FLUSH_ERR, IBV_WC_MW_BIND_ERR, IBV_WC_BAD_RESP_ERR,
	IBV_WC_LOC_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_OP_ERR,
	IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_LOC_RDD_VIOL_ERR,
	IBV_WC_REM_INV_RD_REQ_ERR, IBV_WC_REM_ABORT_ERR, IBV_WC_INV_EECN_ERR,
	IBV_WC_INV_EEC_STATE_ERR, IBV_WC_FATAL_ERR, IBV_WC_RESP_TIMEOUT_ERR, IBV_WC_GENERAL_ERR
};

enum ibv_wc_opcode { IBV_WC_RDMA_WRITE = 1, IBV_WC_RDMA_READ = 2 };

/* ------------------------------------------------------------------ structs */

struct ibv_context;
struct ibv_comp_channel;
struct ibv_srq;
struct ibv_recv_wr;

union ibv_gid {
	uint8_t raw[16];
	struct { uint64_t subnet_prefix, interface_id; } global; /* big-endian; 8-byte aligned */
};

struct ibv_device {
	void *_ops[2]; /* obsolete */
	enum ibv_node_type node_type;
	enum ibv_transport_type transport_type;
	char name[64];
	char dev_name[64];
	char dev_path[256];
	char ibdev_path[256];
};

struct ibv_device_attr {
	char fw_ver[64];
	uint64_t node_guid; /* big-endian */
	uint64_t sys_image_guid;
	uint64_t max_mr_size;
	uint64_t page_size_cap;
	uint32_t vendor_id, vendor_part_id, hw_ver;
	int max_qp, max_qp_wr;
	unsigned int device_cap_flags;
	int max_sge, max_sge_rd, max_cq, max_cqe, max_mr, max_pd, max_qp_rd_atom;
	int max_ee_rd_atom, max_res_rd_atom, max_qp_init_rd_atom, max_ee_init_rd_atom;
	int atomic_cap; /* enum ibv_atomic_cap */
	int max_ee, max_rdd, max_mw, max_raw_ipv6_qp, max_raw_ethy_qp, max_mcast_grp;
	int max_mcast_qp_attach, max_total_mcast_qp_attach, max_ah, max_fmr, max_map_per_fmr;
	int max_srq, max_srq_wr, max_srq_sge;
	uint16_t max_pkeys;
	uint8_t local_ca_ack_delay;
	uint8_t phys_port_cnt;
};

/* ibv_query_port (IBVERBS_1.1) fills the part through `flags` (48 bytes); newer rdma-core
 * appends fields after port_cap_flags2, for the extended query only. */
struct ibv_port_attr {
	enum ibv_port_state state;
	enum ibv_mtu max_mtu;
	enum ibv_mtu active_mtu;
	int gid_tbl_len;
	uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
	uint16_t pkey_tbl_len, lid, sm_lid;
	uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width,
		active_speed, phys_state, link_layer, flags;
	uint16_t port_cap_flags2;
};

struct ibv_pd {
	struct ibv_context *context;
	uint32_t handle;
};

struct ibv_mr {
	struct ibv_context *context;
	struct ibv_pd *pd;
	void *addr;
	size_t length;
	uint32_t handle, lkey, rkey;
};

struct ibv_cq {
	struct ibv_context *context;
	struct ibv_comp_channel *channel;
	void *cq_context;
	uint32_t handle;
	int cqe;
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t comp_events_completed, async_events_completed;
};

struct ibv_qp {
	struct ibv_context *context;
	void *qp_context;
	struct ibv_pd *pd;
	struct ibv_cq *send_cq;
	struct ibv_cq *recv_cq;
	struct ibv_srq *srq;
	uint32_t handle, qp_num;
	enum ibv_qp_state state;
	enum ibv_qp_type qp_type;
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t events_completed;
};

struct ibv_qp_cap {
	uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data;
};

struct ibv_qp_init_attr {
	void *qp_context;
	struct ibv_cq *send_cq;
	struct ibv_cq *recv_cq;
	struct ibv_srq *srq;
	struct ibv_qp_cap cap;
	enum ibv_qp_type qp_type;
	int sq_sig_all;
};

struct ibv_global_route {
	union ibv_gid dgid;
	uint32_t flow_label;
	uint8_t sgid_index, hop_limit, traffic_class;
};

struct ibv_ah_attr {
	struct ibv_global_route grh;
	uint16_t dlid;
	uint8_t sl, src_path_bits, static_rate, is_global, port_num;
};

struct ibv_qp_attr {
	enum ibv_qp_state qp_state;
	enum ibv_qp_state cur_qp_state;
	enum ibv_mtu path_mtu;
	int path_mig_state;
	uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
	unsigned int qp_access_flags;
	struct ibv_qp_cap cap;
	struct ibv_ah_attr ah_attr;
	struct ibv_ah_attr alt_ah_attr;
	uint16_t pkey_index, alt_pkey_index;
	uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic,
		min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
	uint32_t rate_limit;
};

struct ibv_sge {
	uint64_t addr;
	uint32_t length, lkey;
};

/* The anonymous unions are named here (their layout is what counts). */
struct ibv_rdma_wr { uint64_t remote_addr; uint32_t rkey; };

union ibv_send_wr_wr {
	struct ibv_rdma_wr rdma;
	uint64_t _atomic_ud[4]; /* the atomic and ud members, the largest of the union */
};

struct ibv_send_wr {
	uint64_t wr_id;
	struct ibv_send_wr *next;
	struct ibv_sge *sg_list;
	int num_sge;
	enum ibv_wr_opcode opcode;
	unsigned int send_flags;
	uint32_t imm_data; /* or invalidate_rkey */
	union ibv_send_wr_wr wr;
	uint32_t remote_srqn; /* qp_type.xrc */
	uint64_t _bind_mw_tso[6]; /* the bind_mw and tso members */
};

struct ibv_wc {
	uint64_t wr_id;
	enum ibv_wc_status status;
	enum ibv_wc_opcode opcode;
	uint32_t vendor_err, byte_len;
	uint32_t imm_data; /* or invalidated_rkey */
	uint32_t qp_num, src_qp;
	unsigned int wc_flags;
	uint16_t pkey_index, slid;
	uint8_t sl, dlid_path_bits;
};

/* The provider's entry points; verbs.h names the other 29 slots _compat_* or leaves them
 * to the extended verbs_context. */
struct ibv_context_ops {
	void *_slots0_10[11];
	int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
	void *_slots12_24[13];
	int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
	int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
	void *_slots27_31[5];
};

struct ibv_context {
	struct ibv_device *device;
	struct ibv_context_ops ops;
	int cmd_fd, async_fd, num_comp_vectors;
	pthread_mutex_t mutex;
	void *abi_compat;
};

/* ---------------------------------- the static inlines of verbs.h we call */

static inline int ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr,
				struct ibv_send_wr **bad_wr)
{
	return qp->context->ops.post_send(qp, wr, bad_wr);
}

static inline int ibv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
	return cq->context->ops.poll_cq(cq, num_entries, wc);
}

/* ------------------------- the exported functions, resolved with dlsym */

typedef struct ibv_device **(*ibv_get_device_list_fn)(int *num_devices);
typedef void (*ibv_free_device_list_fn)(struct ibv_device **list);
typedef const char *(*ibv_get_device_name_fn)(struct ibv_device *device);
typedef struct ibv_context *(*ibv_open_device_fn)(struct ibv_device *device);
typedef int (*ibv_close_device_fn)(struct ibv_context *context);
typedef int (*ibv_query_device_fn)(struct ibv_context *context, struct ibv_device_attr *attr);
/* verbs.h: struct _compat_ibv_port_attr *, the prefix of ibv_port_attr through `flags` */
typedef int (*ibv_query_port_fn)(struct ibv_context *context, uint8_t port_num,
				 struct ibv_port_attr *attr);
typedef int (*ibv_query_gid_fn)(struct ibv_context *context, uint8_t port_num, int index,
				union ibv_gid *gid);
typedef struct ibv_pd *(*ibv_alloc_pd_fn)(struct ibv_context *context);
typedef int (*ibv_dealloc_pd_fn)(struct ibv_pd *pd);
typedef struct ibv_mr *(*ibv_reg_mr_fn)(struct ibv_pd *pd, void *addr, size_t length, int access);
/* IBVERBS_1.12 (rdma-core 34) */
typedef struct ibv_mr *(*ibv_reg_dmabuf_mr_fn)(struct ibv_pd *pd, uint64_t offset, size_t length,
					       uint64_t iova, int fd, int access);
typedef int (*ibv_dereg_mr_fn)(struct ibv_mr *mr);
typedef struct ibv_cq *(*ibv_create_cq_fn)(struct ibv_context *context, int cqe, void *cq_context,
					   struct ibv_comp_channel *channel, int comp_vector);
typedef int (*ibv_destroy_cq_fn)(struct ibv_cq *cq);
typedef struct ibv_qp *(*ibv_create_qp_fn)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
typedef int (*ibv_modify_qp_fn)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
typedef int (*ibv_destroy_qp_fn)(struct ibv_qp *qp);

#endif
