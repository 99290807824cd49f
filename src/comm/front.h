// Internal to src/comm: the one checking front every backend calls at the top of its public
// operations, so that argument checks and their messages are written once (local, mpi, torch and
// any later backend say the same thing about the same mistake). A backend implements transport
// only; it calls these first and then posts.
//
// `who` is the backend's description of this rank ("rank 3", "rank 3 (world rank 7)"); `group`
// the group it belongs to ("the group of 4 ranks").
#pragma once

#include <cstddef>
#include <string>

#include "loom/comm.h"

namespace loom::detail {

// isend / irecv: peer in [0, size), tag in [0, max_tag] (user tags; negative ones are reserved
// for collectives), a buffer for any non-zero byte count. Throws InvalidArgument.
void check_p2p(const char* op, const std::string& who, int size, const void* buf, size_t bytes,
               int peer, int tag, int max_tag);

// all_to_all: the four size/offset arrays present, and what this rank sends to itself equal to
// what it receives from itself.
void check_all_to_all(int rank, const size_t* send_bytes, const size_t* send_offsets,
                      const size_t* recv_bytes, const size_t* recv_offsets);

// all_gather (bytes), reduce_scatter and all_reduce (elements): buffers present when count > 0.
void check_buffers(const char* op, const void* send, const void* recv, size_t count,
                   const char* unit);

// reduce_scatter and all_reduce: a DType and a ReduceOp that exist (a cast integer was taken, and
// any op but sum acted as max).
void check_reduction(const char* op, DType dtype, ReduceOp reduce);

}  // namespace loom::detail
