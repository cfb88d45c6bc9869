#include "rdma/rdma_conn.h"

#include <arpa/inet.h>

namespace dsync::rdma {

Status PostRecv(Conn& c) {
  ibv_recv_wr wr{};
  ibv_recv_wr* bad = nullptr;
  wr.num_sge = 0;  // immediate-only: the data went by RDMA WRITE
  if (int err = ibv_post_recv(c.qp, &wr, &bad); err != 0) {
    return Error(StatusCode::kUnavailable, "ibv_post_recv: {}", std::strerror(err));
  }
  return Status::Ok();
}

Status PostWrite(Conn& c, uint64_t wr_id, const void* local, uint32_t lkey, size_t len,
                 uint64_t remote, uint32_t rkey, bool with_imm, uint32_t imm, bool signaled) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uint64_t>(local);
  sge.length = static_cast<uint32_t>(len);
  sge.lkey = lkey;
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  wr.opcode = with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  if (int err = ibv_post_send(c.qp, &wr, &bad); err != 0) {
    return Error(StatusCode::kUnavailable, "ibv_post_send: {}", std::strerror(err));
  }
  return Status::Ok();
}

}  // namespace dsync::rdma
