// CpAttention: the public entry. It checks the arguments once, checks that every rank of the cp
// group built the same attention (one small all-gather), takes the groups of the strategy's shape
// from the mesh, builds the engine and the registered strategy, and brackets every call with the
// recorder (bytes, communication window).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine.h"
#include "loom/rng.h"
#include "strategies/strategy.h"

namespace loom {

namespace detail {
// build_mesh without its agreement exchange (src/comm/mesh.cc): the constructor splits its mesh
// from a shape every rank has agreed on already, so the exchange would only add a collective.
Mesh build_agreed_mesh(Communicator& world, const MeshShape& shape);
}  // namespace detail

struct CpAttention::Impl {
  ShardPlan plan;
  CpMetrics metrics;
  Communicator* cp = nullptr;
  Mesh mesh;  // the inner and outer groups, when they had to be split from cp
  std::unique_ptr<cp_detail::Engine> engine;
  std::unique_ptr<cp_detail::CpStrategy> strategy;
  std::vector<int64_t> calls;  // every rank's call word (check_same_call), reused
};

namespace {

// The sizes, and strides that leave room for the rows and heads (the kernels' own rule,
// src/kernels/checks.h): every strategy reads and writes views through their strides, and some
// (ulysses, hybrid) never hand the caller's view to a kernel.
template <class T>
void check_view(const char* name, View3<const T> x, int64_t rows, int64_t heads, int64_t dim) {
  LOOM_CHECK(x.s == rows && x.h == heads && x.d == dim, InvalidArgument,
             name << " must be [" << rows << ", " << heads << ", " << dim << "] on this rank, got ["
                  << x.s << ", " << x.h << ", " << x.d << "]");
  // Said apart: the sizes alone read "must be [6, 4, 8] on this rank, got [6, 4, 8]".
  LOOM_CHECK(x.data != nullptr || rows == 0, InvalidArgument,
             name << " has null data for its [" << rows << ", " << heads << ", " << dim
                  << "] on this rank");
  LOOM_CHECK(x.h <= 1 || x.hs >= x.d, InvalidArgument,
             name << ": head stride " << x.hs << " is smaller than the head dim " << x.d);
  // As h <= ss / d: h * d can overflow int64.
  LOOM_CHECK(x.s <= 1 || x.d == 0 || (x.ss >= 0 && x.h <= x.ss / x.d), InvalidArgument,
             name << ": row stride " << x.ss << " is smaller than heads x head dim " << x.h << " x "
                  << x.d);
}

// An output's rows and heads must not share memory: with head stride 2D and row stride H x D,
// row i's head 1 was row i + 1's head 0, and the results overwrote each other silently.
template <class T>
void check_output_view(const char* name, View3<T> x) {
  LOOM_CHECK(x.s <= 1 || x.h <= 1 || x.ss >= (x.h - 1) * x.hs + x.d, InvalidArgument,
             name << ": row stride " << x.ss << " is smaller than (heads - 1) x head stride + head "
                  << "dim = " << (x.h - 1) * x.hs + x.d << ": its rows would overlap");
}

// Where a view's bytes lie: rows of `h` runs of `d` bytes, `hs` apart, the rows `ss` apart.
struct Footprint {
  uintptr_t begin = 0, end = 0;  // the bytes spanned, [begin, end); begin == end: empty
  int64_t h = 0, d = 0, hs = 0, ss = 0;
  const char* name = "";
  int64_t row_extent() const { return (h - 1) * hs + d; }
};
template <class T>
Footprint footprint(const char* name, View3<T> x) {
  if (x.s == 0 || x.h == 0 || x.d == 0) return Footprint{0, 0, 0, 0, 0, 0, name};
  const int64_t e = int64_t(sizeof(T));
  const uintptr_t b = reinterpret_cast<uintptr_t>(x.data);
  return Footprint{b,        b + uintptr_t(((x.s - 1) * x.ss + (x.h - 1) * x.hs + x.d) * e),
                   x.h,      x.d * e,
                   x.hs * e, x.ss * e,
                   name};
}
Footprint footprint(const char* name, const float* p, int64_t count) {
  if (count <= 0 || !p) return Footprint{0, 0, 0, 0, 0, 0, name};
  const uintptr_t b = reinterpret_cast<uintptr_t>(p);
  const int64_t bytes = count * int64_t(sizeof(float));
  return Footprint{b, b + uintptr_t(bytes), 1, bytes, bytes, bytes, name};
}

// Whether two views may share a byte. Disjoint spans do not. Views with the same row stride whose
// rows each fit in it (the heads of a packed [n, 3, H, D] buffer: dq, dk and dv side by side in
// every row, flash-attn's qkvpacked layout) share a byte only where their runs meet modulo the
// row stride; any other pair whose spans meet is taken to share one.
bool may_share(const Footprint& a, const Footprint& b) {
  if (a.begin == a.end || b.begin == b.end || a.end <= b.begin || b.end <= a.begin) return false;
  const int64_t ss = a.ss;
  if (b.ss != ss || ss <= 0 || a.row_extent() > ss || b.row_extent() > ss) return true;
  // The runs of one row, as intervals of [0, ss) (a run that wraps is cut in two).
  const auto runs = [ss](const Footprint& f) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t i = 0; i < f.h; ++i) {
      const int64_t at = int64_t((f.begin + uintptr_t(i * f.hs)) % uintptr_t(ss));
      if (at + f.d <= ss) {
        out.emplace_back(at, at + f.d);
      } else {
        out.emplace_back(at, ss);
        out.emplace_back(0, at + f.d - ss);
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  const auto ra = runs(a), rb = runs(b);
  for (size_t i = 0, j = 0; i < ra.size() && j < rb.size();) {
    if (ra[i].first < rb[j].second && rb[j].first < ra[i].second) return true;
    if (ra[i].second <= rb[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return false;
}

// No output may share memory with an input or another output: dq sharing dout's buffer gave
// wrong gradients in ring, allgather and ring2d (dq is zeroed before dout is read).
void check_no_overlap(const std::vector<Footprint>& outputs, const std::vector<Footprint>& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (const Footprint& in : inputs)
      LOOM_CHECK(!may_share(outputs[i], in), InvalidArgument,
                 outputs[i].name << " shares memory with " << in.name
                                 << ": outputs must not overlap inputs");
    for (size_t j = i + 1; j < outputs.size(); ++j)
      LOOM_CHECK(!may_share(outputs[i], outputs[j]), InvalidArgument,
                 outputs[i].name << " shares memory with " << outputs[j].name
                                 << ": outputs must not overlap each other");
  }
}

// What every rank of the cp group must agree on, exchanged once by the constructor: a rank built
// with another plan, strategy, degree, mask, scale or shape posted messages of other sizes or
// for other tokens, and the others accepted them (a receive may take a shorter message) and
// returned wrong attention without an error (a stripe plan against zigzag, rel. error 0.5).
// kernel threads and tile sizes are this rank's own: they change neither the messages nor the
// result. kAgreeSlots int64 in all, as loom.torch's own exchanges (gloo aborts on a message
// longer than its receive; a rank out of step then gets an error, not an abort).
constexpr int kAgreeSlots = 24;
constexpr int64_t kAgreeMagic = 0x6c6f6f6d10;  // "loom", CpAttention's constructor
enum AgreeField : int {
  kMagic,
  kLayout,
  kSeq,
  kDocCount,
  kDocHash,
  kStrategy,
  kDegree,
  kHeads,
  kKvHeads,
  kHeadDim,
  kCausal,
  kWindow,
  kScale,
  kPlanHash,
  kAgreeFields,
  // Not compared: what each rank says of the groups it was given (check_given_groups), and a
  // random word of each rank, from which the ranks of one cp group compute the same fingerprint.
  kInnerSize = kAgreeFields,  // the caller's inner group: its size (0: none given) ...
  kInnerRank,                 // ... and this rank's place in it (-1: none)
  kOuterSize,
  kOuterRank,
  kNonce,
  kSlotsUsed
};
static_assert(kSlotsUsed <= kAgreeSlots);

int64_t strategy_index(Strategy s) {
  const auto& all = strategies();
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].id == s) return static_cast<int64_t>(i);
  return -1;
}

// FNV-1a over every rank's tokens: which rank holds which token (the layout, seq and document
// lengths are compared on their own, so that the message can name them). A row's document and
// the segments follow from these (ShardPlan::check), and segments change no message.
int64_t plan_hash(const ShardPlan& plan) {
  uint64_t h = fnv1a64(nullptr, 0);
  for (const std::vector<int64_t>& t : plan.tokens) {
    const uint64_t n = t.size();
    h = fnv1a64(&n, sizeof n, h);
    if (!t.empty()) h = fnv1a64(t.data(), t.size() * sizeof(int64_t), h);
  }
  return static_cast<int64_t>(h);
}

// A word no other cp group draws (with overwhelming odds): the random device, the clock and
// this call's stack address, mixed.
int64_t random_word() {
  uint64_t x = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  try {
    std::random_device rd;
    x ^= (uint64_t{rd()} << 32) ^ rd();
  } catch (const std::exception&) {  // no random device: the clock and the address alone
  }
  int here = 0;
  x ^= static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&here));
  return static_cast<int64_t>(fnv1a64(&x, sizeof x));
}

std::vector<int64_t> agreement_record(const ShardPlan& plan, const CpConfig& cfg,
                                      const CpShape& shape, const cp_detail::StrategyEntry& entry,
                                      int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      const CpGroups& groups) {
  std::vector<int64_t> rec(kAgreeSlots, 0);
  rec[kInnerSize] = groups.inner ? groups.inner->size() : 0;
  rec[kInnerRank] = groups.inner ? groups.inner->rank() : -1;
  rec[kOuterSize] = groups.outer ? groups.outer->size() : 0;
  rec[kOuterRank] = groups.outer ? groups.outer->rank() : -1;
  rec[kNonce] = random_word();
  rec[kMagic] = kAgreeMagic;
  rec[kLayout] = static_cast<int64_t>(plan.layout);
  rec[kSeq] = plan.seq;
  // No document lengths and {seq} are one document alike.
  const std::vector<int64_t> docs = checked_doc_lengths(plan.seq, plan.doc_lengths);
  rec[kDocCount] = static_cast<int64_t>(docs.size());
  rec[kDocHash] = static_cast<int64_t>(fnv1a64(docs.data(), docs.size() * sizeof(int64_t)));
  rec[kStrategy] = strategy_index(cfg.strategy);
  rec[kDegree] = entry.degree.value ? cfg.*entry.degree.value : shape.inner;
  rec[kHeads] = heads;
  rec[kKvHeads] = kv_heads;
  rec[kHeadDim] = head_dim;
  rec[kCausal] = cfg.kernel.mask.causal;
  rec[kWindow] = cfg.kernel.mask.window;
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &cfg.kernel.scale, sizeof scale_bits);
  rec[kScale] = scale_bits;
  rec[kPlanHash] = plan_hash(plan);
  return rec;
}

// A field's value as the caller wrote it.
std::string agreement_value(int field, int64_t v, const CpConfig& cfg,
                            const cp_detail::StrategyEntry& entry) {
  std::ostringstream os;
  switch (field) {
    case kLayout:
      return v >= 0 && v <= static_cast<int64_t>(Layout::stripe) ? to_string(static_cast<Layout>(v))
                                                                 : std::to_string(v);
    case kDocCount:
      os << v << (v == 1 ? " document" : " documents");
      return os.str();
    case kStrategy:
      return v >= 0 && v < static_cast<int64_t>(strategies().size())
                 ? strategies()[static_cast<size_t>(v)].name
                 : "a strategy not registered here";
    case kDegree: {
      if (!entry.degree.value) return "inner degree " + std::to_string(v);
      return cp_detail::degree_text(entry, cfg, v);
    }
    case kCausal:
      return v ? "a causal mask" : "a non-causal mask";
    case kWindow:
      return v ? "window " + std::to_string(v) : "no window";
    case kScale: {
      float x = 0;
      const uint32_t bits = static_cast<uint32_t>(v);
      std::memcpy(&x, &bits, sizeof x);
      return "scale " + exact_text(x);
    }
    case kSeq:
      return "seq " + std::to_string(v);
    case kHeads:
      return std::to_string(v) + " heads";
    case kKvHeads:
      return std::to_string(v) + " kv heads";
    case kHeadDim:
      return "head dim " + std::to_string(v);
    default:
      return std::to_string(v);
  }
}

// Exchanges the records and throws InvalidArgument, the same on every rank, naming the first
// field in which a rank differs from rank 0. Returns every rank's record (rank r's at
// r * kAgreeSlots).
std::vector<int64_t> check_ranks_agree(Communicator& cp, const std::vector<int64_t>& mine,
                                       const CpConfig& cfg, const cp_detail::StrategyEntry& entry) {
  const int P = cp.size();
  if (P == 1) return mine;
  std::vector<int64_t> all(static_cast<size_t>(kAgreeSlots) * P);
  cp.all_gather(mine.data(), kAgreeSlots * sizeof(int64_t), all.data());
  const auto at = [&](int r, int f) { return all[static_cast<size_t>(r) * kAgreeSlots + f]; };
  static const char* const names[kAgreeFields] = {"",
                                                  "the layout",
                                                  "the sequence length",
                                                  "the number of documents",
                                                  "the document lengths",
                                                  "the strategy",
                                                  "the strategy's degree",
                                                  "the heads",
                                                  "the kv heads",
                                                  "the head dim",
                                                  "the mask",
                                                  "the window",
                                                  "the softmax scale",
                                                  "the shard plan (which tokens each rank holds)"};
  for (int r = 1; r < P; ++r) {
    LOOM_CHECK(at(r, kMagic) == kAgreeMagic && at(0, kMagic) == kAgreeMagic, InvalidArgument,
               "CpAttention: rank " << (at(r, kMagic) == kAgreeMagic ? 0 : r)
                                    << " is not constructing a CpAttention while the others are: "
                                       "every rank of the cp group must make the same calls in "
                                       "the same order");
    for (int f = 1; f < kAgreeFields; ++f) {
      if (at(r, f) == at(0, f)) continue;
      std::ostringstream os;
      os << "CpAttention: the ranks of the cp group disagree on " << names[f] << ": rank " << r;
      if (f == kDocHash || f == kPlanHash)  // hashes: nothing to show
        os << " has other " << (f == kDocHash ? "lengths" : "shards") << " than rank 0";
      else  // the strategy's degree is named by rank 0's strategy: they agree by then
        os << " has " << agreement_value(f, at(r, f), cfg, entry) << ", rank 0 "
           << agreement_value(f, at(0, f), cfg, entry);
      os << "; every rank must construct it with the same plan, strategy, degree, mask, scale "
            "and head counts";
      throw InvalidArgument(os.str(), __FILE__, __LINE__);
    }
  }
  return all;
}

// One axis of the strategy's shape as the caller may give it (CpGroups::inner or ::outer). Cp
// rank r = o * I + i (I = shape.inner): the inner axis is the group of cp ranks o I .. o I + I - 1
// and r must be rank i of it; the outer axis is the group of cp ranks i, I + i, 2 I + i, ... and
// r must be rank o of it. The strategies rely on both: hybrid's all-to-all gives the rows of the
// inner group's ranks in group order and its ring passes group o's block to o + 1; ring2d posts
// to (o, i + 1) and (o + 1, i) by their group ranks.
struct GivenAxis {
  bool inner;     // else outer
  int size;       // the ranks the axis needs
  int size_slot;  // kInnerSize or kOuterSize (the rank slot follows)
  Communicator* group;
  // cp rank r's place in its group, and the cp rank at place j of r's group.
  int place(int r, int I) const { return inner ? r % I : r / I; }
  int member(int r, int j, int I) const { return inner ? (r / I) * I + j : j * I + r % I; }
  const char* name() const { return inner ? "inner" : "outer"; }
  // "cp ranks 2, 3" / "cp ranks 1, 3, 5", at most a few named.
  std::string members_text(int r, int I) const {
    std::ostringstream os;
    os << "cp ranks ";
    for (int j = 0; j < size && j < 4; ++j) os << (j ? ", " : "") << member(r, j, I);
    if (size > 4) os << ", ... " << member(r, size - 1, I);
    return os.str();
  }
};

// The end of every group error: how to make groups that fit.
std::string groups_hint(const CpShape& shape) {
  std::ostringstream os;
  os << "; give the groups of build_mesh(world, {dp, tp, " << shape.inner << ", " << shape.outer
     << "}) (Mesh::ulysses as inner, Mesh::ring as outer), split them from cp (inner: color cp "
        "rank / "
     << shape.inner << ", key cp rank; outer: color cp rank % " << shape.inner
     << ", key cp rank), or give none";
  return os.str();
}

// Decides, the same on every rank (from the records every rank has), whether the caller's group
// of each axis is used, and checks that a used group is the axis: every rank gives one of the
// axis's size or none does (a mix made some ranks split a mesh from cp while the others did
// not); each rank has the place the strategy gives it (table check); and (one all-gather over
// each given group, then one of 32 bytes per rank over cp) each group holds the cp ranks of its
// axis, in order, all of this cp group. Groups of the right sizes but other members gave hybrid
// results off by 0.7 with no error and ring2d a timeout. Throws InvalidArgument on every rank
// naming the first rank whose group is wrong. Returns, per axis, the group to use or nullptr
// (split from cp).
std::vector<Communicator*> check_given_groups(Communicator& cp, const std::vector<int64_t>& all,
                                              const std::vector<GivenAxis>& axes,
                                              const CpShape& shape) {
  const int P = cp.size(), I = shape.inner, me = cp.rank();
  const auto at = [&](int r, int f) { return all[static_cast<size_t>(r) * kAgreeSlots + f]; };
  std::vector<Communicator*> used(axes.size(), nullptr);
  bool any = false;
  for (size_t a = 0; a < axes.size(); ++a) {
    const GivenAxis& ax = axes[a];
    const auto fits = [&](int r) { return at(r, ax.size_slot) == ax.size; };
    const auto given = [&](int r) {
      const int64_t n = at(r, ax.size_slot);
      return n == 0 ? std::string("no ") + ax.name() + " group"
                    : "an " + std::string(ax.name()) + " group of " + std::to_string(n) + " ranks";
    };
    for (int r = 1; r < P; ++r)
      LOOM_CHECK(fits(r) == fits(0), InvalidArgument,
                 "CpAttention: rank " << r << " gives " << given(r) << ", rank 0 " << given(0)
                                      << "; the " << ax.name() << " axis needs " << ax.size
                                      << " ranks, and every rank must give its group of it or "
                                         "none"
                                      << groups_hint(shape));
    if (!fits(0)) continue;  // none fits: split from cp, as the contract says
    for (int r = 0; r < P; ++r)
      LOOM_CHECK(at(r, ax.size_slot + 1) == ax.place(r, I), InvalidArgument,
                 "CpAttention: cp rank " << r << " is rank " << at(r, ax.size_slot + 1)
                                         << " of the " << ax.name() << " group it gives, but the "
                                         << ax.name() << " axis of " << I << " x " << shape.outer
                                         << " holds " << ax.members_text(r, I)
                                         << " in cp order, where it must be rank " << ax.place(r, I)
                                         << groups_hint(shape));
    used[a] = ax.group;
    any = true;
  }
  if (!any) return used;
  // The members: every rank's (fingerprint of its cp group, cp rank) over each used group.
  uint64_t fp = fnv1a64(nullptr, 0);
  for (int r = 0; r < P; ++r) {
    const int64_t nonce = at(r, kNonce);
    fp = fnv1a64(&nonce, sizeof nonce, fp);
  }
  // This rank's verdict: {axis + 1, place, the cp rank found there (-1: another cp group's),
  // the one the axis needs}; zeros when its groups hold what they must.
  int64_t verdict[4] = {0, 0, 0, 0};
  for (size_t a = 0; a < axes.size(); ++a) {
    if (!used[a]) continue;
    const GivenAxis& ax = axes[a];
    const int64_t mine[2] = {static_cast<int64_t>(fp), me};
    std::vector<int64_t> got(2 * static_cast<size_t>(ax.size));
    ax.group->all_gather(mine, sizeof mine, got.data());
    for (int j = 0; j < ax.size && verdict[0] == 0; ++j) {
      const bool ours = got[2 * j] == static_cast<int64_t>(fp);
      if (ours && got[2 * j + 1] == ax.member(me, j, I)) continue;
      verdict[0] = static_cast<int64_t>(a) + 1;
      verdict[1] = j;
      verdict[2] = ours ? got[2 * j + 1] : -1;
      verdict[3] = ax.member(me, j, I);
    }
  }
  std::vector<int64_t> verdicts(4 * static_cast<size_t>(P));
  cp.all_gather(verdict, sizeof verdict, verdicts.data());
  for (int r = 0; r < P; ++r) {
    const int64_t* v = verdicts.data() + 4 * static_cast<size_t>(r);
    if (v[0] == 0) continue;
    const GivenAxis& ax = axes[static_cast<size_t>(v[0] - 1)];
    std::ostringstream os;
    os << "CpAttention: the " << ax.name() << " group cp rank " << r << " gives holds ";
    if (v[2] < 0)
      os << "a rank of another cp group";
    else
      os << "cp rank " << v[2];
    os << " as its rank " << v[1] << ", but the " << ax.name() << " axis of " << I << " x "
       << shape.outer << " holds " << ax.members_text(r, I) << " in cp order, so its rank " << v[1]
       << " must be cp rank " << v[3] << groups_hint(shape);
    throw InvalidArgument(os.str(), __FILE__, __LINE__);
  }
  return used;
}

}  // namespace

CpAttention::CpAttention(Communicator& cp, const ShardPlan& plan, const CpConfig& cfg,
                         int64_t heads, int64_t kv_heads, int64_t head_dim)
    : CpAttention(CpGroups{&cp, nullptr, nullptr}, plan, cfg, heads, kv_heads, head_dim) {}

CpAttention::CpAttention(const CpGroups& groups, const ShardPlan& plan, const CpConfig& cfg,
                         int64_t heads, int64_t kv_heads, int64_t head_dim)
    : impl_(new Impl{plan, {}, nullptr, {}, nullptr, nullptr, {}}) {
  std::unique_ptr<Impl> guard(impl_);
  LOOM_CHECK(groups.cp != nullptr, InvalidArgument, "CpAttention needs a cp group");
  Communicator& cp = *groups.cp;
  const int P = cp.size();
  LOOM_CHECK(heads >= 1 && kv_heads >= 1 && head_dim >= 1, InvalidArgument,
             "heads, kv-heads and head-dim must be positive (got " << heads << ", " << kv_heads
                                                                   << ", " << head_dim << ")");
  LOOM_CHECK(
      head_dim <= kMaxHeadDim, InvalidArgument,
      "head-dim must be at most " << kMaxHeadDim << " (the kernels' limit), got " << head_dim);
  LOOM_CHECK(plan.ranks == P, InvalidArgument,
             "the shard plan is for " << plan.ranks << " ranks but the group has " << P);
  plan.check();
  // The kernels' own rules (scale from float32's smallest normal to 2.35e38, window, threads,
  // blocks), here rather than at the first forward: the constructor accepted scale inf and 1e-42.
  check_kernel_config(cfg.kernel);
  const CpShape shape = check_cp_config(cfg, P, heads, kv_heads);
  const cp_detail::StrategyEntry& entry = cp_detail::entry(cfg.strategy);
  // Before anything else crosses ranks: a rank that differs would post other messages.
  const std::vector<int64_t> all = check_ranks_agree(
      cp, agreement_record(plan, cfg, shape, entry, heads, kv_heads, head_dim, groups), cfg, entry);

  // The groups of the shape: the cp group itself for an axis that spans it, none for an axis of
  // one rank that nothing talks over, the caller's mesh groups when every rank gave one of the
  // axis's size (checked to be the axis), else a mesh built from cp (dp = tp = 1, ulysses =
  // inner, ring = outer; collective over cp).
  Communicator* inner = nullptr;
  Communicator* outer = nullptr;
  const bool want_inner = shape.inner > 1 || (entry.splits_heads && P > 1);
  const bool want_outer = shape.outer > 1;
  if (want_inner && shape.inner == P) inner = &cp;
  if (want_outer && shape.outer == P) outer = &cp;
  std::vector<GivenAxis> axes;
  if (want_inner && !inner) axes.push_back(GivenAxis{true, shape.inner, kInnerSize, groups.inner});
  if (want_outer && !outer) axes.push_back(GivenAxis{false, shape.outer, kOuterSize, groups.outer});
  if (!axes.empty()) {
    const std::vector<Communicator*> used = check_given_groups(cp, all, axes, shape);
    for (size_t a = 0; a < axes.size(); ++a) (axes[a].inner ? inner : outer) = used[a];
  }
  if ((want_inner && !inner) || (want_outer && !outer)) {
    impl_->mesh = detail::build_agreed_mesh(cp, MeshShape{1, 1, shape.inner, shape.outer});
    impl_->cp = &cp;
    if (want_inner && !inner) inner = impl_->mesh.ulysses.get();
    if (want_outer && !outer) outer = impl_->mesh.ring.get();
  }
  impl_->engine = std::make_unique<cp_detail::Engine>(impl_->plan, cfg, shape, heads, kv_heads,
                                                      head_dim, cp, inner, outer, impl_->metrics);
  impl_->strategy = entry.make(*impl_->engine);
  guard.release();
}

CpAttention::~CpAttention() {
  delete impl_;
}

CpMetrics& CpAttention::metrics() {
  return impl_->metrics;
}

namespace {

// The groups split from cp wait as long as cp does, as of each call: a split group copied cp's
// timeout when the constructor made it, so a later cp.set_timeout_s (loom.torch.set_timeout over
// an op it had cached) reached ring and ulysses but not hybrid or ring2d, which went on waiting
// the old timeout (60 s where 2 s was set; a Timeout after 1 s where 30 s was).
void follow_cp_timeout(CpAttention::Impl& s) {
  if (s.cp == nullptr) return;
  const double t = s.cp->timeout_s();
  for (Communicator* c : {s.mesh.tp.get(), s.mesh.ulysses.get(), s.mesh.ring.get(), s.mesh.cp.get(),
                          s.mesh.dp.get(), s.mesh.dp_cp.get()})
    if (c != nullptr && c->timeout_s() != t) c->set_timeout_s(t);
}

// Every call: all ranks must be in the same call (forward or backward) with the same storage
// type. A rank in the bf16 forward sent KV blocks half as long as an fp32 rank's receives, which
// took them (a receive may take a shorter message) and returned wrong attention (rel. error 0.35)
// while only the bf16 rank failed. One all-gather of 8 bytes per rank, before the strategy's
// first message (so every rank raises, and nothing is left in flight): 28 us beside a 17 ms ring
// forward of 4 ranks at S = 1024 (0.17 %), 36 us beside 202 ms at S = 4096 (H = 8, D = 64, local
// backend, one thread a rank, 2 shared cores). Skipped over one rank, and over the torch
// backend, which exists only inside loom.torch: its own exchange before every call compares the
// dtype and the call on every rank.
constexpr int64_t kCallMagic = int64_t{0x6c6f6f6d20} << 4;  // "loom", a CpAttention call
template <class T>
void check_same_call(CpAttention::Impl& s, bool backward) {
  Communicator& cp = s.engine->cp;
  const int P = cp.size();
  if (P == 1 || cp.backend() == "torch") return;
  const bool bf = std::is_same_v<T, bf16>;
  const int64_t mine = kCallMagic | (backward ? 2 : 0) | (bf ? 1 : 0);
  s.calls.resize(static_cast<size_t>(P));
  cp.all_gather(&mine, sizeof mine, s.calls.data());
  const auto name = [](int64_t w) -> std::string {
    if ((w & ~int64_t{3}) != kCallMagic) return "not in a CpAttention call";
    return std::string("in the ") + (w & 1 ? "bf16 " : "fp32 ") + (w & 2 ? "backward" : "forward");
  };
  for (int r = 1; r < P; ++r)
    LOOM_CHECK(s.calls[static_cast<size_t>(r)] == s.calls[0], InvalidArgument,
               "CpAttention: rank " << r << " is " << name(s.calls[static_cast<size_t>(r)])
                                    << ", rank 0 " << name(s.calls[0])
                                    << ": every rank of the cp group must make the same calls "
                                       "(forward or backward, fp32 or bf16) in the same order");
}

template <class T>
void forward_impl(CpAttention::Impl& s, View3<const T> q, View3<const T> k, View3<const T> v,
                  View3<T> out, float* lse) {
  const cp_detail::Engine& e = *s.engine;
  const int64_t n = s.plan.rows(e.me);
  check_view<T>("q", q, n, e.heads, e.dim);
  check_view<T>("k", k, n, e.kv_heads, e.dim);
  check_view<T>("v", v, n, e.kv_heads, e.dim);
  check_view<T>("out", View3<const T>(out), n, e.heads, e.dim);
  LOOM_CHECK(lse != nullptr || n == 0, InvalidArgument, "lse must not be null");
  check_output_view("out", out);
  check_no_overlap({footprint("out", out), footprint("lse", lse, e.heads * n)},
                   {footprint("q", q), footprint("k", k), footprint("v", v)});
  follow_cp_timeout(s);
  check_same_call<T>(s, false);
  s.engine->rec.begin();
  s.strategy->forward(cp_detail::ForwardArgs<T>{q, k, v, out, lse});
  s.engine->rec.end();
}

template <class T>
void backward_impl(CpAttention::Impl& s, View3<const T> q, View3<const T> k, View3<const T> v,
                   View3<const T> out, View3<const T> dout, const float* lse, View3<float> dq,
                   View3<float> dk, View3<float> dv) {
  const cp_detail::Engine& e = *s.engine;
  const int64_t n = s.plan.rows(e.me);
  check_view<T>("q", q, n, e.heads, e.dim);
  check_view<T>("k", k, n, e.kv_heads, e.dim);
  check_view<T>("v", v, n, e.kv_heads, e.dim);
  check_view<T>("out", out, n, e.heads, e.dim);
  check_view<T>("dout", dout, n, e.heads, e.dim);
  check_view<float>("dq", View3<const float>(dq), n, e.heads, e.dim);
  check_view<float>("dk", View3<const float>(dk), n, e.kv_heads, e.dim);
  check_view<float>("dv", View3<const float>(dv), n, e.kv_heads, e.dim);
  LOOM_CHECK(lse != nullptr || n == 0, InvalidArgument, "lse must not be null");
  check_output_view("dq", dq);
  check_output_view("dk", dk);
  check_output_view("dv", dv);
  check_no_overlap({footprint("dq", dq), footprint("dk", dk), footprint("dv", dv)},
                   {footprint("q", q), footprint("k", k), footprint("v", v), footprint("out", out),
                    footprint("dout", dout), footprint("lse", lse, e.heads * n)});
  follow_cp_timeout(s);
  check_same_call<T>(s, true);
  s.engine->rec.begin();
  s.strategy->backward(cp_detail::BackwardArgs<T>{q, k, v, out, dout, lse, dq, dk, dv});
  s.engine->rec.end();
}

}  // namespace

void CpAttention::forward(View3<const float> q, View3<const float> k, View3<const float> v,
                          View3<float> out, float* lse) {
  forward_impl<float>(*impl_, q, k, v, out, lse);
}

void CpAttention::forward(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                          View3<bf16> out, float* lse) {
  forward_impl<bf16>(*impl_, q, k, v, out, lse);
}

void CpAttention::backward(View3<const float> q, View3<const float> k, View3<const float> v,
                           View3<const float> out, View3<const float> dout, const float* lse,
                           View3<float> dq, View3<float> dk, View3<float> dv) {
  backward_impl<float>(*impl_, q, k, v, out, dout, lse, dq, dk, dv);
}

void CpAttention::backward(View3<const bf16> q, View3<const bf16> k, View3<const bf16> v,
                           View3<const bf16> out, View3<const bf16> dout, const float* lse,
                           View3<float> dq, View3<float> dk, View3<float> dv) {
  backward_impl<bf16>(*impl_, q, k, v, out, dout, lse, dq, dk, dv);
}

Tensor<float> gather_rows(Communicator& cp, const ShardPlan& plan, const Tensor<float>& local) {
  LOOM_CHECK(plan.ranks == cp.size(), InvalidArgument,
             "gather_rows: the shard plan is for " << plan.ranks << " ranks but the group has "
                                                   << cp.size());
  LOOM_CHECK(local.dim() == 3, InvalidArgument, "gather_rows needs a 3-d tensor");
  plan.check();
  const int me = cp.rank();
  const int64_t w = local.size(1) * local.size(2), max_n = plan.max_rows();
  LOOM_CHECK_EQ(local.size(0), plan.rows(me), InvalidArgument, "gather_rows: local rows");
  std::vector<float> mine(static_cast<size_t>(max_n * w), 0.0f);
  std::copy_n(local.data(), local.numel(), mine.data());
  std::vector<float> all(static_cast<size_t>(plan.ranks) * mine.size());
  cp.all_gather(mine.data(), mine.size() * sizeof(float), all.data());
  Tensor<float> global({plan.seq, local.size(1), local.size(2)});
  for (int r = 0; r < plan.ranks; ++r)
    for (int64_t i = 0; i < plan.rows(r); ++i)
      std::copy_n(all.data() + (r * max_n + i) * w, w, global.data() + plan.tokens[r][i] * w);
  return global;
}

}  // namespace loom
