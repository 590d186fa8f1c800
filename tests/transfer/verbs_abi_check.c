/*
 * Prints the layout facts of native/verbs_abi.h, one "name value" line each: sizes and
 * alignments of the structs, offsets of the fields the verbs module and the test double
 * use, the constants. test_verbs_abi.py compiles it twice, against our header
 * (-DVERBS_HEADER='"verbs_abi.h"') and against rdma-core's (<infiniband/verbs.h>), and
 * compares the two outputs.
 */
#include <stddef.h>
#include <stdio.h>
#include VERBS_HEADER

#define SIZE(T) printf("sizeof(" #T ") %zu\nalignof(" #T ") %zu\n", sizeof(T), _Alignof(T));
#define OFF(T, f) printf("offsetof(" #T ", " #f ") %zu\n", offsetof(T, f));
#define CONST(c) printf(#c " %lld\n", (long long)(c));

int main(void)
{
	SIZE(union ibv_gid)
	OFF(union ibv_gid, raw)

	SIZE(struct ibv_device)
	OFF(struct ibv_device, node_type) OFF(struct ibv_device, transport_type)
	OFF(struct ibv_device, name) OFF(struct ibv_device, dev_name)
	OFF(struct ibv_device, dev_path) OFF(struct ibv_device, ibdev_path)

	SIZE(struct ibv_device_attr)
	OFF(struct ibv_device_attr, fw_ver) OFF(struct ibv_device_attr, node_guid)
	OFF(struct ibv_device_attr, sys_image_guid) OFF(struct ibv_device_attr, max_mr_size)
	OFF(struct ibv_device_attr, page_size_cap) OFF(struct ibv_device_attr, max_qp)
	OFF(struct ibv_device_attr, max_qp_wr) OFF(struct ibv_device_attr, max_sge)
	OFF(struct ibv_device_attr, max_sge_rd) OFF(struct ibv_device_attr, max_cq)
	OFF(struct ibv_device_attr, max_cqe) OFF(struct ibv_device_attr, max_mr)
	OFF(struct ibv_device_attr, max_pd) OFF(struct ibv_device_attr, max_qp_rd_atom)
	OFF(struct ibv_device_attr, max_res_rd_atom)
	OFF(struct ibv_device_attr, max_qp_init_rd_atom)
	OFF(struct ibv_device_attr, atomic_cap) OFF(struct ibv_device_attr, max_srq_sge)
	OFF(struct ibv_device_attr, max_pkeys) OFF(struct ibv_device_attr, phys_port_cnt)

	/* no size: it grows across rdma-core versions (the library fills the part through flags) */
	OFF(struct ibv_port_attr, state) OFF(struct ibv_port_attr, max_mtu)
	OFF(struct ibv_port_attr, active_mtu) OFF(struct ibv_port_attr, gid_tbl_len)
	OFF(struct ibv_port_attr, max_msg_sz) OFF(struct ibv_port_attr, pkey_tbl_len)
	OFF(struct ibv_port_attr, lid) OFF(struct ibv_port_attr, max_vl_num)
	OFF(struct ibv_port_attr, active_width) OFF(struct ibv_port_attr, active_speed)
	OFF(struct ibv_port_attr, phys_state) OFF(struct ibv_port_attr, link_layer)
	OFF(struct ibv_port_attr, flags) OFF(struct ibv_port_attr, port_cap_flags2)

	SIZE(struct ibv_pd)
	OFF(struct ibv_pd, context) OFF(struct ibv_pd, handle)

	SIZE(struct ibv_mr)
	OFF(struct ibv_mr, context) OFF(struct ibv_mr, pd) OFF(struct ibv_mr, addr)
	OFF(struct ibv_mr, length) OFF(struct ibv_mr, handle) OFF(struct ibv_mr, lkey)
	OFF(struct ibv_mr, rkey)

	SIZE(struct ibv_cq)
	OFF(struct ibv_cq, context) OFF(struct ibv_cq, channel) OFF(struct ibv_cq, cq_context)
	OFF(struct ibv_cq, cqe) OFF(struct ibv_cq, mutex)

	SIZE(struct ibv_qp)
	OFF(struct ibv_qp, context) OFF(struct ibv_qp, qp_context) OFF(struct ibv_qp, pd)
	OFF(struct ibv_qp, send_cq) OFF(struct ibv_qp, recv_cq) OFF(struct ibv_qp, srq)
	OFF(struct ibv_qp, handle) OFF(struct ibv_qp, qp_num) OFF(struct ibv_qp, state)
	OFF(struct ibv_qp, qp_type) OFF(struct ibv_qp, mutex)

	SIZE(struct ibv_qp_cap)
	OFF(struct ibv_qp_cap, max_send_wr) OFF(struct ibv_qp_cap, max_recv_wr)
	OFF(struct ibv_qp_cap, max_send_sge) OFF(struct ibv_qp_cap, max_recv_sge)
	OFF(struct ibv_qp_cap, max_inline_data)

	SIZE(struct ibv_qp_init_attr)
	OFF(struct ibv_qp_init_attr, qp_context) OFF(struct ibv_qp_init_attr, send_cq)
	OFF(struct ibv_qp_init_attr, recv_cq) OFF(struct ibv_qp_init_attr, srq)
	OFF(struct ibv_qp_init_attr, cap) OFF(struct ibv_qp_init_attr, qp_type)
	OFF(struct ibv_qp_init_attr, sq_sig_all)

	SIZE(struct ibv_global_route)
	OFF(struct ibv_global_route, dgid) OFF(struct ibv_global_route, flow_label)
	OFF(struct ibv_global_route, sgid_index) OFF(struct ibv_global_route, hop_limit)
	OFF(struct ibv_global_route, traffic_class)

	SIZE(struct ibv_ah_attr)
	OFF(struct ibv_ah_attr, grh) OFF(struct ibv_ah_attr, dlid) OFF(struct ibv_ah_attr, sl)
	OFF(struct ibv_ah_attr, is_global) OFF(struct ibv_ah_attr, port_num)

	SIZE(struct ibv_qp_attr)
	OFF(struct ibv_qp_attr, qp_state) OFF(struct ibv_qp_attr, cur_qp_state)
	OFF(struct ibv_qp_attr, path_mtu) OFF(struct ibv_qp_attr, rq_psn)
	OFF(struct ibv_qp_attr, sq_psn) OFF(struct ibv_qp_attr, dest_qp_num)
	OFF(struct ibv_qp_attr, qp_access_flags) OFF(struct ibv_qp_attr, cap)
	OFF(struct ibv_qp_attr, ah_attr) OFF(struct ibv_qp_attr, alt_ah_attr)
	OFF(struct ibv_qp_attr, pkey_index) OFF(struct ibv_qp_attr, max_rd_atomic)
	OFF(struct ibv_qp_attr, max_dest_rd_atomic) OFF(struct ibv_qp_attr, min_rnr_timer)
	OFF(struct ibv_qp_attr, port_num) OFF(struct ibv_qp_attr, timeout)
	OFF(struct ibv_qp_attr, retry_cnt) OFF(struct ibv_qp_attr, rnr_retry)
	OFF(struct ibv_qp_attr, rate_limit)

	SIZE(struct ibv_sge)
	OFF(struct ibv_sge, addr) OFF(struct ibv_sge, length) OFF(struct ibv_sge, lkey)

	SIZE(struct ibv_send_wr)
	OFF(struct ibv_send_wr, wr_id) OFF(struct ibv_send_wr, next)
	OFF(struct ibv_send_wr, sg_list) OFF(struct ibv_send_wr, num_sge)
	OFF(struct ibv_send_wr, opcode) OFF(struct ibv_send_wr, send_flags)
	OFF(struct ibv_send_wr, imm_data) OFF(struct ibv_send_wr, wr)
	OFF(struct ibv_send_wr, wr.rdma.remote_addr) OFF(struct ibv_send_wr, wr.rdma.rkey)

	SIZE(struct ibv_wc)
	OFF(struct ibv_wc, wr_id) OFF(struct ibv_wc, status) OFF(struct ibv_wc, opcode)
	OFF(struct ibv_wc, vendor_err) OFF(struct ibv_wc, byte_len) OFF(struct ibv_wc, imm_data)
	OFF(struct ibv_wc, qp_num) OFF(struct ibv_wc, src_qp) OFF(struct ibv_wc, wc_flags)
	OFF(struct ibv_wc, pkey_index) OFF(struct ibv_wc, slid) OFF(struct ibv_wc, sl)
	OFF(struct ibv_wc, dlid_path_bits)

	SIZE(struct ibv_context_ops)
	OFF(struct ibv_context_ops, poll_cq) OFF(struct ibv_context_ops, post_send)
	OFF(struct ibv_context_ops, post_recv)

	SIZE(struct ibv_context)
	OFF(struct ibv_context, device) OFF(struct ibv_context, ops)
	OFF(struct ibv_context, ops.poll_cq) OFF(struct ibv_context, ops.post_send)
	OFF(struct ibv_context, cmd_fd) OFF(struct ibv_context, async_fd)
	OFF(struct ibv_context, num_comp_vectors) OFF(struct ibv_context, mutex)
	OFF(struct ibv_context, abi_compat)

	CONST(IBV_NODE_CA) CONST(IBV_TRANSPORT_IB)
	CONST(IBV_MTU_256) CONST(IBV_MTU_512) CONST(IBV_MTU_1024) CONST(IBV_MTU_2048)
	CONST(IBV_MTU_4096)
	CONST(IBV_PORT_NOP) CONST(IBV_PORT_DOWN) CONST(IBV_PORT_INIT) CONST(IBV_PORT_ARMED)
	CONST(IBV_PORT_ACTIVE) CONST(IBV_PORT_ACTIVE_DEFER)
	CONST(IBV_LINK_LAYER_UNSPECIFIED) CONST(IBV_LINK_LAYER_INFINIBAND)
	CONST(IBV_LINK_LAYER_ETHERNET)
	CONST(IBV_ACCESS_LOCAL_WRITE) CONST(IBV_ACCESS_REMOTE_WRITE) CONST(IBV_ACCESS_REMOTE_READ)
	CONST(IBV_QPT_RC)
	CONST(IBV_QPS_RESET) CONST(IBV_QPS_INIT) CONST(IBV_QPS_RTR) CONST(IBV_QPS_RTS)
	CONST(IBV_QPS_SQD) CONST(IBV_QPS_SQE) CONST(IBV_QPS_ERR)
	CONST(IBV_QP_STATE) CONST(IBV_QP_CUR_STATE) CONST(IBV_QP_ACCESS_FLAGS)
	CONST(IBV_QP_PKEY_INDEX) CONST(IBV_QP_PORT) CONST(IBV_QP_AV) CONST(IBV_QP_PATH_MTU)
	CONST(IBV_QP_TIMEOUT) CONST(IBV_QP_RETRY_CNT) CONST(IBV_QP_RNR_RETRY) CONST(IBV_QP_RQ_PSN)
	CONST(IBV_QP_MAX_QP_RD_ATOMIC) CONST(IBV_QP_MIN_RNR_TIMER) CONST(IBV_QP_SQ_PSN)
	CONST(IBV_QP_MAX_DEST_RD_ATOMIC) CONST(IBV_QP_DEST_QPN)
	CONST(IBV_WR_RDMA_WRITE) CONST(IBV_WR_RDMA_READ)
	CONST(IBV_SEND_SIGNALED) CONST(IBV_SEND_INLINE)
	CONST(IBV_WC_SUCCESS) CONST(IBV_WC_LOC_LEN_ERR) CONST(IBV_WC_LOC_QP_OP_ERR)
	CONST(IBV_WC_LOC_EEC_OP_ERR) CONST(IBV_WC_LOC_PROT_ERR) CONST(IBV_WC_WR_FLUSH_ERR)
	CONST(IBV_WC_MW_BIND_ERR) CONST(IBV_WC_BAD_RESP_ERR) CONST(IBV_WC_LOC_ACCESS_ERR)
	CONST(IBV_WC_REM_INV_REQ_ERR) CONST(IBV_WC_REM_ACCESS_ERR) CONST(IBV_WC_REM_OP_ERR)
	CONST(IBV_WC_RETRY_EXC_ERR) CONST(IBV_WC_RNR_RETRY_EXC_ERR) CONST(IBV_WC_LOC_RDD_VIOL_ERR)
	CONST(IBV_WC_REM_INV_RD_REQ_ERR) CONST(IBV_WC_REM_ABORT_ERR) CONST(IBV_WC_INV_EECN_ERR)
	CONST(IBV_WC_INV_EEC_STATE_ERR) CONST(IBV_WC_FATAL_ERR) CONST(IBV_WC_RESP_TIMEOUT_ERR)
	CONST(IBV_WC_GENERAL_ERR)
	CONST(IBV_WC_RDMA_WRITE) CONST(IBV_WC_RDMA_READ)
	return 0;
}
