// loom._loom: the C++ side of the Python package. Thin: it checks what only C++ can check
// (agreement between ranks, the shard plan), turns torch tensors into loom views without
// copying, and runs loom's engine with the GIL released. The user-facing argument checks and the
// autograd Functions are in loom/torch.py.
//
// Rows. Every op sees one packed sequence: [B, S, H, D] (bshd) is B documents of S tokens each
// (B * S rows), [T, H, D] with cu_seqlens (thd) is the documents cu_seqlens describes. In a
// context-parallel call the tensors are this rank's shard: for bshd, rank r holds the same rows
// of every batch row (the layout applied to each row of length S on its own); for thd, the
// layout applied to each document (ShardPlan's per-document rule).
//
// Errors: loom::Error and its kinds become the Python classes of loom/errors.py (one line,
// naming the values).
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "loom/attention.h"
#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/error.h"
#include "loom/rng.h"
#include "loom/timer.h"
#include "loom/verify.h"
#include "torch_comm.h"

namespace py = pybind11;
using loom::bf16;
using loom::View3;

namespace {

// ---------------------------------------------------------------------------------------------
// Tensors <-> views. Callers (torch.py) pass contiguous CPU tensors of the right dtype; these
// re-check cheaply so that a direct caller of _loom cannot pass a bad pointer.

void require(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows, int64_t h,
             int64_t d) {
  LOOM_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype,
             InvalidArgument,
             name << ": expected a contiguous CPU tensor of " << c10::toString(dtype));
  LOOM_CHECK(
      t.numel() == rows * h * d, InvalidArgument,
      name << ": expected " << rows << " x " << h << " x " << d << " elements, got " << t.numel());
}

template <class T>
View3<T> view(const at::Tensor& t, int64_t rows, int64_t h, int64_t d) {
  return View3<T>{reinterpret_cast<T*>(t.data_ptr()), rows, h, d, h * d, d};
}

at::ScalarType storage_type(bool is_bf16) {
  return is_bf16 ? at::kBFloat16 : at::kFloat;
}

// One attention call's sizes: n rows, h query heads, hk KV heads, head dim d.
struct Dims {
  int64_t n, h, hk, d;
};

// The inputs every op takes: q [n, h, d], k and v [n, hk, d], of storage type st.
void require_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::ScalarType st,
                 const Dims& s) {
  require(q, "q", st, s.n, s.h, s.d);
  require(k, "k", st, s.n, s.hk, s.d);
  require(v, "v", st, s.n, s.hk, s.d);
}

// What a kernel backward takes besides q, k, v: out and dout [n, h, d] of type st, and the fp32
// lse [h, n] of the forward.
void require_backward_inputs(const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                             at::ScalarType st, const Dims& s) {
  require(out, "out", st, s.n, s.h, s.d);
  require(dout, "dout", st, s.n, s.h, s.d);
  require(lse, "lse", at::kFloat, s.h, s.n, 1);
}

// The flat index of the first NaN or Inf in a contiguous fp32 or bf16 tensor, or -1: an exponent
// of all ones, tested on the bits. One read of the tensor at about 28 GB/s (Zen 5, SSE2 code):
// for q, k, v at S = 512, H = 8, D = 64 0.11 ms beside a 3.5 ms forward, at S = 4096 0.9 ms
// beside 119 ms.
int64_t first_non_finite(const at::Tensor& t) {
  const int64_t n = t.numel();
  const auto scan = [n](const auto* bits, auto exp_mask) -> int64_t {
    constexpr int64_t kBlock = 4096;
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t e = std::min(n, b + kBlock);
      uint32_t count = 0;  // a count, not a bool: GCC vectorises the sum, not the |=
      for (int64_t i = b; i < e; ++i) count += (bits[i] & exp_mask) == exp_mask;
      if (count == 0) continue;
      for (int64_t i = b; i < e; ++i)
        if ((bits[i] & exp_mask) == exp_mask) return i;
    }
    return -1;
  };
  if (t.scalar_type() == at::kBFloat16)
    return scan(static_cast<const uint16_t*>(t.data_ptr()), static_cast<uint16_t>(0x7f80));
  return scan(static_cast<const uint32_t*>(t.data_ptr()), static_cast<uint32_t>(0x7f800000));
}

// Under torch.autograd's anomaly detection loom.torch refuses NaN and Inf inputs, naming where
// the first one is (otherwise it carries them through to NaN outputs, as PyTorch's attention does).
std::string non_finite_message(const char* name, int64_t index, const Dims& s, int64_t heads) {
  const int64_t row = index / (heads * s.d), head = index / s.d % heads, dim = index % s.d;
  std::ostringstream os;
  os << name << " holds a NaN or Inf (row " << row << ", head " << head << ", dim " << dim
     << " of this rank's [" << s.n << ", " << heads << ", " << s.d
     << "]); under torch.autograd.detect_anomaly loom.torch refuses non-finite inputs";
  return os.str();
}

// The first of q, k, v (which 1, 2, 3) or dout (4) that holds a NaN or Inf, as (which, flat
// index), or (0, -1).
std::pair<int64_t, int64_t> find_non_finite(std::initializer_list<const at::Tensor*> ts,
                                            int64_t first_which = 1) {
  int64_t which = first_which;
  for (const at::Tensor* t : ts) {
    const int64_t i = first_non_finite(*t);
    if (i >= 0) return {which, i};
    ++which;
  }
  return {0, -1};
}

constexpr const char* kInputNames[] = {"", "q", "k", "v", "dout"};

// InvalidArgument naming the first non-finite input (prefix: who says it).
void require_finite(std::pair<int64_t, int64_t> found, const Dims& s, const std::string& prefix) {
  if (found.first == 0) return;
  const int64_t heads = found.first == 2 || found.first == 3 ? s.hk : s.h;
  throw loom::InvalidArgument(prefix +
                              non_finite_message(kInputNames[found.first], found.second, s, heads));
}

// The gradients of q, k and v: dq [n, h, d], dk and dv [n, hk, d], of type t; zeroed where the
// callee accumulates into them.
struct Grads {
  at::Tensor dq, dk, dv;
  py::tuple tuple() const { return py::make_tuple(dq, dk, dv); }
};

Grads make_grads(const Dims& s, at::ScalarType t, bool zeroed) {
  const auto make = [&](int64_t heads) {
    return zeroed ? at::zeros({s.n, heads, s.d}, t) : at::empty({s.n, heads, s.d}, t);
  };
  return Grads{make(s.h), make(s.hk), make(s.hk)};
}

// Calls f(std::type_identity<T>{}) with T the storage type: bf16 or float.
template <class F>
void with_storage(bool is_bf16, F&& f) {
  if (is_bf16) {
    f(std::type_identity<bf16>{});
  } else {
    f(std::type_identity<float>{});
  }
}

// ---------------------------------------------------------------------------------------------
// Plans.

// bshd: B rows of length L; rank r holds, of every row, the tokens the layout gives it for one
// sequence of L (so a [B, S_local, H, D] shard is one tensor). thd: ShardPlan's rule over the
// documents. B == 0 means thd.
loom::ShardPlan make_plan(loom::Layout layout, int64_t batch, int64_t len, int ranks,
                          const std::vector<int64_t>& doc_lengths) {
  if (batch == 0) {
    const bool one_doc = doc_lengths.size() <= 1;
    return loom::ShardPlan::make(layout, len, ranks,
                                 one_doc ? std::vector<int64_t>{} : doc_lengths);
  }
  loom::ShardPlan row = loom::ShardPlan::make(layout, len, ranks);
  if (batch == 1) return row;
  loom::ShardPlan p;
  p.layout = layout;
  p.seq = batch * len;
  p.ranks = ranks;
  p.doc_lengths.assign(batch, len);
  p.tokens.assign(ranks, {});
  p.docs.assign(ranks, {});
  p.segments.assign(ranks, {});
  for (int r = 0; r < ranks; ++r) {
    const int64_t n = row.rows(r);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t : row.tokens[r]) p.tokens[r].push_back(b * len + t);
      p.docs[r].insert(p.docs[r].end(), n, static_cast<int32_t>(b));
      for (const loom::Segment& s : row.segments[r])
        p.segments[r].push_back(loom::Segment{b * n + s.begin, s.count});
    }
  }
  return p;
}

// The global indices (within one bshd row, or within the thd sequence) of rank r's rows.
at::Tensor shard_index(const std::string& layout, int ranks, int rank, int64_t batch, int64_t len,
                       const std::vector<int64_t>& doc_lengths) {
  LOOM_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, InvalidArgument,
             "shard: rank " << rank << " is outside a group of " << ranks);
  loom::ShardPlan p =
      make_plan(loom::parse_layout(layout), batch == 0 ? 0 : 1, len, ranks, doc_lengths);
  const auto& t = p.tokens[rank];
  at::Tensor idx = at::empty({static_cast<int64_t>(t.size())}, at::kLong);
  if (!t.empty()) std::memcpy(idx.data_ptr<int64_t>(), t.data(), t.size() * sizeof(int64_t));
  return idx;
}

loom::KernelConfig kernel_config(bool causal, int64_t window, double scale) {
  loom::KernelConfig cfg;
  cfg.mask.causal = causal;
  cfg.mask.window = window;
  cfg.scale = static_cast<float>(scale);
  return cfg;
}

// ---------------------------------------------------------------------------------------------
// Context-parallel ops over a torch group.

struct CpOp {
  std::shared_ptr<loom::Communicator> comm;  // outlives attn
  loom::ShardPlan plan;
  std::unique_ptr<loom::CpAttention> attn;
  int64_t rows = 0, heads = 0, kv_heads = 0, dim = 0;
  bool is_bf16 = false;
  // Seconds inside CpAttention::forward / backward in the last call (for the binding
  // benchmark: the wall time of the Python call minus these is what the binding costs).
  double last_forward_s = 0, last_backward_s = 0;
};

// loom.torch's small all-gathers (a forward's arguments, a backward's check, unshard's
// description) travel on one internal tag, and gloo aborts the process from its I/O thread when a
// message is longer than the buffer posted for it (a shorter one is taken, truncated). So every
// one of them has the same size, kExchangeSlots int64, and starts with what the rank is calling:
// ranks out of step (one in a backward, another in the next forward) get one clear error each,
// never an abort or one exchange read as another. Every cp call, backward included, opens with
// one: without it a rank that skipped a backward met the engine's messages of another call (a
// Timeout, gloo aborting on a longer message, or, for two backwards of one shape, gradients
// mixed from both calls without an error).
enum class Phase : int64_t {
  kForward = 0x6c6f6f6d01,
  kBackward = 0x6c6f6f6d02,
  kUnshard = 0x6c6f6f6d03,
  kWarning = 0x6c6f6f6d04
};
constexpr int kExchangeSlots = 24, kExchangeFields = kExchangeSlots - 1;
// The forward's field that says this rank refused the call (Group::refuse_forward).
constexpr int kRefused = kExchangeFields - 1;

const char* phase_name(int64_t p) {
  switch (static_cast<Phase>(p)) {
    case Phase::kForward:
      return "cp_attention (the forward)";
    case Phase::kBackward:
      return "the backward of cp_attention";
    case Phase::kUnshard:
      return "unshard";
    case Phase::kWarning:
      return "cp_attention (the forward's warning)";
  }
  return "an unknown call";
}

// Every rank's `fields` (at most kExchangeFields; the rest reads 0), rank-major with a stride of
// kExchangeFields, once every rank has called `phase`.
std::vector<int64_t> exchange(loom::Communicator& comm, Phase phase,
                              const std::vector<int64_t>& fields) {
  LOOM_CHECK(fields.size() <= static_cast<size_t>(kExchangeFields), InvalidArgument,
             "exchange of " << fields.size() << " fields");
  const int P = comm.size(), me = comm.rank();
  int64_t mine[kExchangeSlots] = {};
  mine[0] = static_cast<int64_t>(phase);
  std::copy(fields.begin(), fields.end(), mine + 1);
  std::vector<int64_t> all(static_cast<size_t>(kExchangeSlots) * P);
  {
    py::gil_scoped_release nogil;
    comm.all_gather(mine, sizeof mine, all.data());
  }
  std::vector<int64_t> out(static_cast<size_t>(kExchangeFields) * P);
  for (int r = 0; r < P; ++r) {
    const int64_t theirs = all[static_cast<size_t>(r) * kExchangeSlots];
    LOOM_CHECK(theirs == mine[0], InvalidArgument,
               "loom.torch: rank " << me << " is in " << phase_name(mine[0]) << " while rank " << r
                                   << " is in " << phase_name(theirs)
                                   << ": every rank of the group must make the same loom.torch "
                                      "calls in the same order");
    std::copy_n(all.begin() + static_cast<ptrdiff_t>(r) * kExchangeSlots + 1, kExchangeFields,
                out.begin() + static_cast<ptrdiff_t>(r) * kExchangeFields);
  }
  return out;
}

class Group {
 public:
  Group(c10::intrusive_ptr<c10d::ProcessGroup> pg, double timeout_s)
      : comm_(loom::torch_communicator(std::move(pg), timeout_s)) {}

  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  // How many cp_attention forwards this group has agreed on (op() calls past their exchange):
  // the same on every rank, so a backward names its forward by this count.
  int64_t forward_calls() const { return forward_calls_; }
  double timeout_s() const { return comm_->timeout_s(); }
  void set_timeout_s(double t) { comm_->set_timeout_s(t); }
  loom::Communicator& comm() { return *comm_; }
  void barrier() {
    py::gil_scoped_release nogil;
    comm_->barrier();
  }
  // Counts a cp_attention call on this rank where it starts, before anything can raise (op()
  // compares the counts).
  void begin_forward() { ++attempts_; }
  // The forward's exchange for a call this rank cannot make (its arguments raised before it):
  // marked refused, so that every other rank raises at once, naming this rank, instead of
  // waiting for it until the timeout. The caller then raises its own error.
  void refuse_forward() {
    std::vector<int64_t> mine(kRefused + 1, 0);
    mine[kRefused] = 1;
    forward_exchange(mine);
    ++forward_calls_;  // as every other rank does for this call
  }
  // unshard's description of its part (at most kExchangeFields numbers), every rank's, rank-major.
  std::vector<int64_t> unshard_exchange(const std::vector<int64_t>& fields) {
    return exchange(*comm_, Phase::kUnshard, fields);
  }
  // Every rank's bytes (a 1-d uint8 tensor of the same length on every rank): [P, n], under
  // loom's timeout.
  at::Tensor all_gather_bytes(const at::Tensor& t) {
    LOOM_CHECK(
        t.scalar_type() == at::kByte && t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(),
        InvalidArgument, "all_gather_bytes takes a contiguous 1-d uint8 CPU tensor");
    at::Tensor all = at::empty({comm_->size(), t.numel()}, at::kByte);
    py::gil_scoped_release nogil;
    comm_->all_gather(t.data_ptr(), static_cast<size_t>(t.numel()), all.data_ptr());
    return all;
  }

  // The op for these arguments (cached; construction is collective). `rows` is this rank's
  // shard: batch * S_local (bshd) or T_local (thd).
  std::shared_ptr<CpOp> op(const std::string& strategy, const std::string& layout, int ulysses,
                           int inner, bool causal, int64_t window, double scale, int64_t batch,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, bool is_bf16,
                           const std::vector<int64_t>& doc_lengths, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, bool check_finite);

 private:
  // The forward's exchange. A rank met in another kind of call (the ranks raise: out of step)
  // did not begin a forward: this call is then not counted, so that the counts agree again.
  std::vector<int64_t> forward_exchange(const std::vector<int64_t>& mine) {
    try {
      return exchange(*comm_, Phase::kForward, mine);
    } catch (const loom::InvalidArgument&) {
      --attempts_;
      throw;
    }
  }
  std::shared_ptr<loom::Communicator> comm_;
  std::map<std::string, std::shared_ptr<CpOp>> cache_;
  int64_t forward_calls_ = 0;
  int64_t attempts_ = 0;        // begin_forward calls
  bool warned_same_q_ = false;  // the unsharded-input warning, given once per group
};

// A fingerprint of q's first and last rows (FNV-1a over their bytes), or 0 when it cannot tell
// shards apart: no rows, or a first row whose elements are all one value (zeros, ones: test data
// that may legitimately repeat on every rank). Equal non-zero fingerprints on every rank of a
// group of two or more mean, in practice, that every rank passed the same tensor: the whole
// sequence, which cp_attention reads as P parts of a sequence P times as long.
int64_t shard_fingerprint(const at::Tensor& q, int64_t rows) {
  if (rows < 1 || q.numel() == 0) return 0;
  const size_t row = static_cast<size_t>(q.numel() / rows) * q.element_size();
  const auto* bytes = static_cast<const unsigned char*>(q.data_ptr());
  const size_t es = q.element_size();
  bool constant = true;
  for (size_t i = es; i < row && constant; i += es)
    constant = std::memcmp(bytes, bytes + i, es) == 0;
  if (constant) return 0;
  const uint64_t h =
      loom::fnv1a64(bytes + (static_cast<size_t>(rows) - 1) * row, row, loom::fnv1a64(bytes, row));
  return static_cast<int64_t>(h | 1);  // never 0
}

// The strategy's place in the registry (the ranks compare it).
int64_t strategy_index(loom::Strategy s) {
  const auto& all = loom::strategies();
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].id == s) return static_cast<int64_t>(i);
  return -1;
}

std::shared_ptr<CpOp> Group::op(const std::string& strategy, const std::string& layout, int ulysses,
                                int inner, bool causal, int64_t window, double scale, int64_t batch,
                                int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                                bool is_bf16, const std::vector<int64_t>& doc_lengths,
                                const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                bool check_finite) {
  loom::Strategy strat = loom::Strategy::ring;
  loom::Layout lay{};
  try {
    strat = loom::parse_strategy(strategy);
    lay = loom::parse_layout(layout);
  } catch (const loom::Error&) {
    refuse_forward();  // the others raise at once too, naming this rank
    throw;
  }
  const int P = comm_->size(), me = comm_->rank();
  // Every rank states its arguments; all must agree (but the shard length), or the ranks would
  // post messages that never match. One small all-gather per call.
  const int64_t docs_hash =
      static_cast<int64_t>(loom::fnv1a64(doc_lengths.data(), doc_lengths.size() * sizeof(int64_t)));
  int64_t scale_bits = 0;
  std::memcpy(&scale_bits, &scale, sizeof scale);
  // After the arguments every rank compares (1 .. kAgree - 1; 0 is the shard length): under
  // anomaly detection (which the ranks must agree on, as the backward then exchanges too), which
  // of this rank's q, k, v holds a NaN or Inf, and where, so that every rank raises the same error
  // instead of the others waiting for a rank that raised alone. requires_grad: whether autograd
  // records this call (grad mode on and q, k or v requiring grad), so whether this rank will run
  // its backward, which is collective (a rank whose inputs alone required grad waited in the
  // backward until the timeout).
  const char* names[] = {"rows",          "batch",      "heads",    "kv_heads", "head_dim",
                         "causal",        "window",     "strategy", "layout",   "ulysses",
                         "dtype",         "cu_seqlens", "inner",    "scale",    "detect_anomaly",
                         "requires_grad", "call"};
  constexpr int kCausal = 5, kWindow = 6, kStrategy = 7, kLayout = 8, kDtype = 10, kDocs = 11,
                kScale = 13, kAnomaly = 14, kGrad = 15, kCall = 16, kAgree = 17,
                kPrint = kAgree + 2, kN = kAgree + 3;
  const bool records =
      at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  static_assert(kN <= kRefused);
  const auto bad =
      check_finite ? find_non_finite({&q, &k, &v}) : std::pair<int64_t, int64_t>{0, -1};
  const std::vector<int64_t> mine = {rows,
                                     batch,
                                     heads,
                                     kv_heads,
                                     dim,
                                     causal,
                                     window,
                                     strategy_index(strat),
                                     static_cast<int64_t>(lay),
                                     ulysses,
                                     is_bf16,
                                     docs_hash,
                                     inner,
                                     scale_bits,
                                     check_finite,
                                     records,
                                     attempts_,
                                     bad.first,
                                     bad.second,
                                     shard_fingerprint(q, rows)};
  static_assert(kN <= kExchangeFields);
  constexpr int kStride = kExchangeFields;
  const std::vector<int64_t> all = forward_exchange(mine);
  ++forward_calls_;  // on every rank: a rank out of step makes every rank raise in exchange
  for (int r = 0; r < P; ++r)
    LOOM_CHECK(all[r * kStride + kRefused] == 0, InvalidArgument,
               "cp_attention: rank " << r
                                     << " could not take its arguments (its own error says why); "
                                        "every rank of the group raises with it");
  // A call that raised on one rank before its exchange (a TypeError converting its arguments)
  // let that rank's next call pair with the others' pending one: every rank got another call's
  // attention, silently. Every call is counted where it starts (begin_forward), made or not, so
  // the pairing shows here; the counts are then set equal, and the calls after work again.
  int64_t most = 0;
  for (int r = 0; r < P; ++r) most = std::max(most, all[r * kStride + kCall]);
  for (int r = 0; r < P; ++r) {
    if (all[r * kStride + kCall] == attempts_) continue;
    const int64_t mine_was = attempts_;
    attempts_ = most;
    LOOM_CHECK(false, InvalidArgument,
               "cp_attention: ranks out of step: this is rank "
                   << me << "'s cp_attention call " << mine_was << " on this group, rank " << r
                   << "'s call " << all[r * kStride + kCall]
                   << " (a call raised on one rank before the ranks met); every rank of the group "
                      "must make the same loom.torch calls in the same order");
  }
  // A compared value as the caller wrote it (the strategy's and layout's names, the dtype), or
  // "another ..." where the exchange carries a hash or bits.
  auto shown = [&](int i, int64_t value, bool own) -> std::string {
    switch (i) {
      case kStrategy:
        return value >= 0 && value < static_cast<int64_t>(loom::strategies().size())
                   ? "'" + loom::strategies()[static_cast<size_t>(value)].name + "'"
                   : std::to_string(value);
      case kLayout:
        return "'" + loom::to_string(static_cast<loom::Layout>(value)) + "'";
      case kDtype:
        return value ? "bfloat16" : "float32";
      case kDocs:
        return own ? "one" : "another";  // the exchange carries their hash
      case kScale: {  // the bits of a double, shown as Python does (1e-7 read "0.000000")
        double x = 0;
        std::memcpy(&x, &value, sizeof x);
        return loom::exact_text(x);
      }
      case kWindow:
        return value ? std::to_string(value) : "None";
      case kCausal:
      case kGrad:
        return value ? "True" : "False";
      case kAnomaly:
        return value ? "on" : "off";
      default:
        return std::to_string(value);
    }
  };
  for (int r = 0; r < P; ++r) {
    for (int i = 1; i < kAgree; ++i) {
      LOOM_CHECK(all[r * kStride + i] == mine[i], InvalidArgument,
                 "cp_attention: the ranks of the group disagree on "
                     << names[i] << ": rank " << me << " passed " << shown(i, mine[i], true)
                     << ", rank " << r << " passed " << shown(i, all[r * kStride + i], false));
    }
  }
  for (int r = 0; r < P; ++r)
    require_finite({all[r * kStride + kAgree], all[r * kStride + kAgree + 1]},
                   Dims{all[r * kStride], heads, kv_heads, dim},
                   "cp_attention: rank " + std::to_string(r) + "'s ");
  int64_t total = 0;
  for (int r = 0; r < P; ++r) total += all[r * kStride];
  int64_t len = 0;
  if (batch > 0) {
    len = total / batch;
  } else {
    len = 0;
    for (int64_t l : doc_lengths) len += l;
    LOOM_CHECK(len == total, InvalidArgument,
               "cp_attention: cu_seqlens describes " << len << " tokens but the ranks hold "
                                                     << total << " together");
  }
  LOOM_CHECK(len >= 1, InvalidArgument, "cp_attention: the global sequence is empty");
  // Every rank holding the same q is, in practice, the whole sequence passed unsharded: a valid
  // call (P copies of it read as one sequence P times as long), so a warning, once per group,
  // and the same decision on every rank (it depends only on what they all exchanged). The same
  // q means the same row count too: a zigzag shard's first and last rows are the sequence's, so
  // one rank's shard beside another's whole sequence matched, and the false warning used up the
  // group's one. Given only for a call whose row counts the layout accepts (after the check
  // below), so a refused call does not use it up either.
  const auto warn_if_same_q = [&] {
    bool same_q = P > 1 && all[kPrint] != 0;
    for (int r = 1; r < P && same_q; ++r)
      same_q = all[r * kStride + kPrint] == all[kPrint] && all[r * kStride] == all[0];
    if (!same_q || warned_same_q_) return;
    warned_same_q_ = true;
    std::ostringstream msg;
    msg << "cp_attention: every rank of the group passed the same q (" << rows
        << " rows each, bit-identical first and last rows). cp_attention takes each rank's shard "
           "of one sequence, so this is read as "
        << P << " parts of one sequence " << P
        << " times as long; if every rank holds the whole sequence, shard q, k and v first "
           "(loom.torch.shard with the same layout). Warned once per group.";
    // A warnings filter can turn the warning into an exception on some ranks only (filters are
    // per process): that rank raised here while the others went on into the engine, which met it
    // in its next call instead ("rank 1 is in an unknown call", or a Timeout), and the group was
    // dead. So the ranks tell one another whether it raised (one more exchange, once per group)
    // and raise together; the counts stay equal, and the next call works.
    py::object type, value, trace;
    const bool raised = PyErr_WarnEx(PyExc_UserWarning, msg.str().c_str(), 2) != 0;
    if (raised) {
      PyObject *t = nullptr, *v = nullptr, *tb = nullptr;
      PyErr_Fetch(&t, &v, &tb);  // held (and released on any error) while the ranks exchange
      type = py::reinterpret_steal<py::object>(t);
      value = py::reinterpret_steal<py::object>(v);
      trace = py::reinterpret_steal<py::object>(tb);
    }
    const std::vector<int64_t> verdict = exchange(*comm_, Phase::kWarning, {raised ? 1 : 0});
    if (raised) {
      PyErr_Restore(type.release().ptr(), value.release().ptr(), trace.release().ptr());
      throw py::error_already_set();
    }
    for (int r = 0; r < P; ++r)
      LOOM_CHECK(verdict[static_cast<size_t>(r) * kStride] == 0, InvalidArgument,
                 "cp_attention: rank "
                     << r
                     << " raised on the warning that every rank passed the same q (a warnings "
                        "filter made it an error there); every rank of the group raises with it");
  };

  std::ostringstream key;
  for (int r = 0; r < P; ++r) key << all[r * kStride] << ',';
  for (int i = 1; i < kAnomaly; ++i) key << mine[i] << ',';  // either way, the same op
  auto it = cache_.find(key.str());
  if (it != cache_.end()) {
    warn_if_same_q();
    return it->second;
  }

  auto op = std::make_shared<CpOp>();
  op->comm = comm_;
  op->plan = make_plan(lay, batch, len, P, doc_lengths);
  for (int r = 0; r < P; ++r) {
    const int64_t expect = op->plan.rows(r);
    LOOM_CHECK(all[r * kStride] == expect, InvalidArgument,
               "cp_attention: rank " << r << " holds " << all[r * kStride] << " rows but layout '"
                                     << layout << "' of " << (batch > 0 ? "S = " : "T = ") << len
                                     << " tokens over " << P << " ranks puts " << expect
                                     << " there (shard the input with loom.torch.shard)");
  }
  warn_if_same_q();
  loom::CpConfig cfg;
  cfg.strategy = strat;
  cfg.ulysses = ulysses;
  cfg.inner = inner;
  cfg.kernel = kernel_config(causal, window, scale);
  cfg.option_spelling = loom::OptionSpelling::keyword;  // "hybrid: ulysses=8 must divide ..."
  {
    py::gil_scoped_release nogil;
    op->attn = std::make_unique<loom::CpAttention>(*comm_, op->plan, cfg, heads, kv_heads, dim);
  }
  op->attn->metrics().record_spans = false;
  op->rows = rows;
  op->heads = heads;
  op->kv_heads = kv_heads;
  op->dim = dim;
  op->is_bf16 = is_bf16;
  if (cache_.size() >= 16) cache_.clear();
  cache_[key.str()] = op;
  return op;
}

// Self-attention rows whose lse is -inf: every row sees at least its own key, so such a row's
// visible scores were all -inf (an infinite q or k against keys of one sign), where the formula's
// softmax is 0 / 0 = NaN, as in PyTorch's attention. The kernels cannot tell that from a row that
// sees no key (out 0, lse -inf: the convention of a masked-out row, kept for cross-attention), so
// it is made NaN here: out's row and lse. out [n, h, d] (any floating dtype), lse [h, n].
void nan_rows_without_mass(at::Tensor& out, at::Tensor& lse, int64_t n, int64_t h, int64_t d) {
  const at::Tensor dead = lse.isneginf();
  if (!dead.any().item<bool>()) return;
  lse.masked_fill_(dead, std::numeric_limits<double>::quiet_NaN());
  out.view({n, h, d}).masked_fill_(dead.t().unsqueeze(-1),
                                   std::numeric_limits<double>::quiet_NaN());
}

py::tuple cp_forward(CpOp& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const Dims s{op.rows, op.heads, op.kv_heads, op.dim};
  require_qkv(q, k, v, storage_type(op.is_bf16), s);
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({s.h, s.n}, at::kFloat);
  {
    py::gil_scoped_release nogil;
    const int64_t n = s.n, h = s.h, hk = s.hk, d = s.d;
    loom::ScopedTimer timer(op.last_forward_s = 0);
    with_storage(op.is_bf16, [&](auto tag) {
      using T = typename decltype(tag)::type;
      op.attn->forward(view<const T>(q, n, h, d), view<const T>(k, n, hk, d),
                       view<const T>(v, n, hk, d), view<T>(out, n, h, d), lse.data_ptr<float>());
    });
  }
  nan_rows_without_mass(out, lse, s.n, s.h, s.d);
  return py::make_tuple(out, lse);
}

// The backward of the group's forward number `call` (Group::forward_calls after that forward).
py::tuple cp_backward(CpOp& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                      bool check_finite, int64_t call) {
  const auto st = storage_type(op.is_bf16);
  const Dims s{op.rows, op.heads, op.kv_heads, op.dim};
  const int64_t n = s.n, h = s.h, hk = s.hk, d = s.d;
  require_qkv(q, k, v, st, s);
  require_backward_inputs(out, dout, lse, st, s);
  // Before the engine's first message, one small all-gather: every rank states that it is in a
  // backward, of which forward, and (under anomaly detection, agreed in the forward) whether its
  // dout holds a NaN or Inf. A rank out of step (in a forward, in unshard, in the backward of
  // another call) gives every rank one clear error at once, and a non-finite dout makes all raise
  // together rather than wait for the one that raised.
  const auto bad = check_finite ? find_non_finite({&dout}, 4) : std::pair<int64_t, int64_t>{0, -1};
  const std::vector<int64_t> all =
      exchange(*op.comm, Phase::kBackward, {call, op.rows, bad.first, bad.second});
  const int me = op.comm->rank();
  for (int r = 0; r < op.comm->size(); ++r) {
    const int64_t theirs = all[static_cast<size_t>(r) * kExchangeFields];
    LOOM_CHECK(theirs == call, InvalidArgument,
               "loom.torch: rank " << me << " is in the backward of cp_attention call " << call
                                   << " of this group while rank " << r
                                   << " is in the backward of call " << theirs
                                   << ": every rank of the group must make the same loom.torch "
                                      "calls in the same order");
  }
  for (int r = 0; r < op.comm->size(); ++r) {
    const int64_t* f = all.data() + static_cast<ptrdiff_t>(r) * kExchangeFields;
    require_finite({f[2], f[3]}, Dims{f[1], s.h, s.hk, s.d},
                   "cp_attention backward: rank " + std::to_string(r) + "'s ");
  }
  const Grads g = make_grads(s, at::kFloat, false);
  {
    py::gil_scoped_release nogil;
    loom::ScopedTimer timer(op.last_backward_s = 0);
    with_storage(op.is_bf16, [&](auto tag) {
      using T = typename decltype(tag)::type;
      op.attn->backward(
          view<const T>(q, n, h, d), view<const T>(k, n, hk, d), view<const T>(v, n, hk, d),
          view<const T>(out, n, h, d), view<const T>(dout, n, h, d), lse.data_ptr<float>(),
          view<float>(g.dq, n, h, d), view<float>(g.dk, n, hk, d), view<float>(g.dv, n, hk, d));
    });
  }
  return g.tuple();
}

// ---------------------------------------------------------------------------------------------
// One rank: the blockwise kernels over the whole packed sequence.

struct OneRank {
  loom::ShardPlan plan;
  loom::Tokens tokens;
  int64_t rows;
};

OneRank one_rank(int64_t batch, int64_t len, const std::vector<int64_t>& doc_lengths) {
  OneRank o;
  o.plan = make_plan(loom::Layout::contiguous, batch, len, 1, doc_lengths);
  o.tokens = o.plan.token_info(0);
  o.rows = o.plan.rows(0);
  return o;
}

py::tuple attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t batch, int64_t len, const std::vector<int64_t>& doc_lengths,
                            int64_t heads, int64_t kv_heads, int64_t dim, bool causal,
                            int64_t window, double scale, bool is_bf16, bool check_finite) {
  OneRank o = one_rank(batch, len, doc_lengths);
  const Dims s{o.rows, heads, kv_heads, dim};
  const int64_t n = s.n, h = s.h, hk = s.hk, d = s.d;
  require_qkv(q, k, v, storage_type(is_bf16), s);
  if (check_finite) require_finite(find_non_finite({&q, &k, &v}), s, "");
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({h, n}, at::kFloat);
  const loom::KernelConfig cfg = kernel_config(causal, window, scale);
  {
    py::gil_scoped_release nogil;
    loom::SoftmaxState state(n, h, d);
    with_storage(is_bf16, [&](auto tag) {
      using T = typename decltype(tag)::type;
      loom::attend(state.view(), view<const T>(q, n, h, d), view<const T>(k, n, hk, d),
                   view<const T>(v, n, hk, d), o.tokens, o.tokens, cfg);
      loom::finish(state.view(), view<T>(out, n, h, d), lse.data_ptr<float>(), n);
    });
  }
  nan_rows_without_mass(out, lse, n, h, d);
  return py::make_tuple(out, lse);
}

py::tuple attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                             int64_t batch, int64_t len, const std::vector<int64_t>& doc_lengths,
                             int64_t heads, int64_t kv_heads, int64_t dim, bool causal,
                             int64_t window, double scale, bool is_bf16, bool check_finite) {
  OneRank o = one_rank(batch, len, doc_lengths);
  const auto st = storage_type(is_bf16);
  const Dims s{o.rows, heads, kv_heads, dim};
  const int64_t n = s.n, h = s.h, hk = s.hk, d = s.d;
  require_qkv(q, k, v, st, s);
  require_backward_inputs(out, dout, lse, st, s);
  if (check_finite) require_finite(find_non_finite({&dout}, 4), s, "");
  const Grads g = make_grads(s, at::kFloat, true);
  const loom::KernelConfig cfg = kernel_config(causal, window, scale);
  {
    py::gil_scoped_release nogil;
    std::vector<float> delta(static_cast<size_t>(h * n));
    with_storage(is_bf16, [&](auto tag) {
      using T = typename decltype(tag)::type;
      loom::compute_delta(view<const T>(out, n, h, d), view<const T>(dout, n, h, d), delta.data(),
                          n);
      loom::attend_backward(view<const T>(q, n, h, d), view<const T>(k, n, hk, d),
                            view<const T>(v, n, hk, d), view<const T>(dout, n, h, d),
                            lse.data_ptr<float>(), delta.data(), n, o.tokens, o.tokens, cfg,
                            view<float>(g.dq, n, h, d), view<float>(g.dk, n, hk, d),
                            view<float>(g.dv, n, hk, d));
    });
  }
  return g.tuple();
}

// loom's fp64 reference (plain loops) over the packed sequence.
py::tuple reference_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t batch, int64_t len, const std::vector<int64_t>& doc_lengths,
                            int64_t heads, int64_t kv_heads, int64_t dim, bool causal,
                            int64_t window, double scale) {
  OneRank o = one_rank(batch, len, doc_lengths);
  const int64_t n = o.rows, h = heads, hk = kv_heads, d = dim;
  require_qkv(q, k, v, at::kDouble, Dims{n, h, hk, d});
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({h, n}, at::kDouble);
  loom::Mask mask{causal, window};
  {
    py::gil_scoped_release nogil;
    loom::reference_forward(view<const double>(q, n, h, d), view<const double>(k, n, hk, d),
                            view<const double>(v, n, hk, d), o.tokens, o.tokens, mask, scale,
                            view<double>(out, n, h, d), lse.data_ptr<double>());
  }
  nan_rows_without_mass(out, lse, n, h, d);
  return py::make_tuple(out, lse);
}

py::tuple reference_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& dout, int64_t batch, int64_t len,
                             const std::vector<int64_t>& doc_lengths, int64_t heads,
                             int64_t kv_heads, int64_t dim, bool causal, int64_t window,
                             double scale) {
  OneRank o = one_rank(batch, len, doc_lengths);
  const int64_t n = o.rows, h = heads, hk = kv_heads, d = dim;
  require_qkv(q, k, v, at::kDouble, Dims{n, h, hk, d});
  require(dout, "dout", at::kDouble, n, h, d);
  const Grads g = make_grads(Dims{n, h, hk, d}, at::kDouble, false);
  loom::Mask mask{causal, window};
  {
    py::gil_scoped_release nogil;
    loom::reference_backward(view<const double>(q, n, h, d), view<const double>(k, n, hk, d),
                             view<const double>(v, n, hk, d), view<const double>(dout, n, h, d),
                             o.tokens, o.tokens, mask, scale, view<double>(g.dq, n, h, d),
                             view<double>(g.dk, n, hk, d), view<double>(g.dv, n, hk, d));
  }
  return g.tuple();
}

// loom verify on global fp64 tensors (loom.torch.verify): the report as JSON text.
loom::Tensor<double> to_loom(const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  loom::Tensor<double> t(shape);
  const at::Tensor c = x.to(at::kDouble).contiguous();
  std::copy_n(c.data_ptr<double>(), t.numel(), t.data());
  return t;
}

std::string verify_json(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& dout, bool causal, int64_t window,
                        double scale, const std::vector<int64_t>& doc_lengths,
                        const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& lse,
                        const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                        const std::optional<at::Tensor>& dv, const std::string& convention,
                        int ranks, const std::string& dtype, int64_t full_check_max) {
  loom::verify::Problem problem;
  problem.q = to_loom(q);
  problem.k = to_loom(k);
  problem.v = to_loom(v);
  if (dout) problem.dout = to_loom(*dout);
  problem.mask = loom::Mask{causal, window};
  problem.scale = scale;
  problem.doc_lengths = doc_lengths;
  loom::verify::Candidate cand;
  const std::pair<const std::optional<at::Tensor>*, std::optional<loom::Tensor<double>>*> parts[] =
      {{&out, &cand.out}, {&lse, &cand.lse}, {&dq, &cand.dq}, {&dk, &cand.dk}, {&dv, &cand.dv}};
  for (const auto& [from, to] : parts)
    if (*from) *to = to_loom(**from);
  loom::verify::Options opt;
  opt.convention = convention;
  opt.ranks = ranks;
  opt.dtype = dtype;
  opt.full_check_max = full_check_max;
  opt.option_spelling = loom::OptionSpelling::keyword;  // "(full_check_max=4096)"
  py::gil_scoped_release nogil;
  return loom::verify::verify(problem, cand, opt).to_json();
}

// loom::Error kinds -> the classes of loom/errors.py (imported when the first error happens): a
// loom error's class is that of its most derived kind (Timeout before its base CommError), else
// Error.
template <class E>
bool is_kind(const loom::Error& e) {
  return dynamic_cast<const E*>(&e) != nullptr;
}

const char* error_class(const loom::Error& e) {
  static constexpr std::pair<bool (*)(const loom::Error&), const char*> kinds[] = {
      {is_kind<loom::Timeout>, "Timeout"},
      {is_kind<loom::CommError>, "CommError"},
      {is_kind<loom::InvalidArgument>, "InvalidArgument"},
      {is_kind<loom::NotSupported>, "NotSupported"},
      {is_kind<loom::IoError>, "IoError"}};
  for (const auto& [is, name] : kinds)
    if (is(e)) return name;
  return "Error";
}

void translate(const loom::Error& e, const char* kind) {
  py::gil_scoped_acquire gil;
  py::object cls = py::module_::import("loom.errors").attr(kind);
  PyErr_SetString(cls.ptr(), e.what());
}

}  // namespace

PYBIND11_MODULE(_loom, m) {
  m.doc() = "loom's C++ engine for loom.torch (internal; use loom.torch)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const loom::Error& e) {
      translate(e, error_class(e));
    }
  });

  py::class_<CpOp, std::shared_ptr<CpOp>>(m, "CpOp")
      .def_readonly("rows", &CpOp::rows)
      .def_readonly("last_forward_s", &CpOp::last_forward_s)
      .def_readonly("last_backward_s", &CpOp::last_backward_s)
      .def("metrics", [](CpOp& op) {
        const loom::CpMetrics& mt = op.attn->metrics();
        py::dict d;
        d["compute_s"] = mt.compute_s;
        d["comm_s"] = mt.comm_s;
        d["wait_s"] = mt.wait_s;
        d["bytes_sent"] = mt.bytes_sent;
        d["bytes_recv"] = mt.bytes_recv;
        d["tiles"] = mt.tiles;
        return d;
      });

  py::class_<Group>(m, "Group")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, double>(), py::arg("pg"),
           py::arg("timeout_s") = -1.0)
      .def_property_readonly("rank", &Group::rank)
      .def_property_readonly("size", &Group::size)
      .def_property_readonly("forward_calls", &Group::forward_calls)
      .def("begin_forward", &Group::begin_forward)
      .def_property("timeout_s", &Group::timeout_s, &Group::set_timeout_s)
      .def("barrier", &Group::barrier)
      .def("unshard_exchange", &Group::unshard_exchange)
      .def("refuse_forward", &Group::refuse_forward)
      .def("all_gather_bytes", &Group::all_gather_bytes)
      .def("op", &Group::op);

  // The communicators' timeout rule (0.001 to 1e9 s), for loom.torch.set_timeout to apply before
  // it looks for the group.
  m.def("checked_timeout_s", &loom::Communicator::checked_timeout_s);
  m.def("cp_forward", &cp_forward);
  m.def("cp_backward", &cp_backward);
  m.def("attention_forward", &attention_forward);
  m.def("attention_backward", &attention_backward);
  m.def("reference_forward", &reference_forward);
  m.def("reference_backward", &reference_backward);
  m.def("verify_json", &verify_json);
  // loom verify's sharding conventions, which loom.torch.verify checks `layout` against (the
  // engine's message names --convention, an option the Python caller never passed).
  m.def("verify_conventions", [] { return loom::verify::convention_names(); });
  m.def("shard_index", &shard_index);
  m.def("launcher_backend", [] { return loom::launcher_backend(); });
  m.def("kernel_path", [] { return std::string(loom::kernel_path()); });
  m.def("strategies", [] {
    // Every registered strategy's name, from the registry.
    std::vector<std::string> names;
    for (const loom::StrategyInfo& s : loom::strategies()) names.push_back(s.name);
    return names;
  });
  m.def("strategy_options", [] {
    // name -> (degree option without "--", what N is), for the strategies that take one.
    std::map<std::string, std::pair<std::string, std::string>> options;
    for (const loom::StrategyInfo& s : loom::strategies())
      if (!s.option.empty()) options[s.name] = {s.option.substr(2), s.option_help};
    return options;
  });
}
