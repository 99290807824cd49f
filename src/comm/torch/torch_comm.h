// The torch backend: a loom Communicator over a torch.distributed ProcessGroup (c10d), so loom's
// engine posts its messages through whatever transport the user's group has (gloo on CPU today,
// NCCL later) while algorithms keep seeing only loom/comm.h.
//
// Only the Python package includes this header (it names c10d types); builds without torch have
// no loom_comm_torch library at all (torch_available() says which).
//
// Messages. isend/irecv become ProcessGroup::send/recv of a uint8 tensor that wraps the caller's
// buffer (no copy). Collectives run loom's own algorithms (src/comm/collectives.h) over those
// point-to-point messages, so every collective, uneven all_to_all and reduce_scatter included,
// works on every ProcessGroup that has send/recv, and every wait is bounded by loom's timeout.
//
// Groups. split() makes a sub-communicator over the same ProcessGroup: its ranks map to ranks of
// the ProcessGroup and its messages carry a wire tag that no other communicator of the tree uses
// between the same ranks (a group id in the high bits; user tags below 2^21 - 8). No new
// ProcessGroup is created, so split needs no store and no rendezvous.
//
// Failure. A peer process that dies closes its connections: the pending waits of the others fail
// at once with CommError naming the peer. A peer that stops without dying is caught by the
// timeout (loom::Timeout naming both ranks). After a failed wait the group must not be used
// again (the transport may still hold the buffer's receive; the process should end): every later
// operation on the communicator or its splits throws CommError at once.
//
// Thread-safety: as loom/comm.h says (one thread per communicator at a time).
#pragma once

#include <memory>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "loom/comm.h"

namespace loom {

// A communicator over all ranks of `pg` (loom rank = pg->getRank()). timeout_s < 0: the default
// (LOOM_TIMEOUT_S or 60 s). The ProcessGroup is shared, not copied; it stays alive as long as
// the communicator or any split of it.
std::unique_ptr<Communicator> torch_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                 double timeout_s = -1);

}  // namespace loom
