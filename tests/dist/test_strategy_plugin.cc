// A strategy defined and registered outside src/cp, the way docs/strategies.md ("How to add a
// strategy") says: this file's class and its StrategyEntry, and one register_strategy call. It
// must then run through CpAttention forward and backward and match the fp64 reference like the
// built-ins, and parse_strategy, strategies(), strategy_choices() and the unknown-name error must
// show it, with no edit anywhere else in the tree.
//
// The strategy, allgather_sum, is an all-gather variant built from engine calls only: K,V are
// all-gathered and attended block by block from the last rank's to the first's (the built-in
// allgather goes the other way), and in backward every rank's dK,dV partials of all blocks are
// summed with one all_reduce instead of a reduce-scatter.
#include <gtest/gtest.h>

#include <cmath>
#include <new>
#include <string>
#include <vector>

#include "../src/cp/strategies/strategy.h"
#include "cp_bodies.h"

namespace loom::testing {
namespace {

using cp_detail::BackwardArgs;
using cp_detail::Block;
using cp_detail::CpStrategyOf;
using cp_detail::Engine;
using cp_detail::ForwardArgs;
using cp_detail::kSlotDelta;
using cp_detail::kSlotOwn;

class AllgatherSum : public CpStrategyOf<AllgatherSum> {
 public:
  explicit AllgatherSum(Engine& e)
      : e_(e), per_(static_cast<size_t>(2 * e.plan.max_rows() * e.kv_heads * e.dim)) {}

  template <class T>
  void fwd(const ForwardArgs<T>& a) {
    const T* all = gather_kv<T>(a.k, a.v);
    const Block& qb = e_.shards[e_.me];
    const StateView st = e_.fresh_state(qb.rows, e_.heads);
    e_.rec.steps(e_.P);
    for (int s = 0; s < e_.P; ++s) {
      const int j = e_.P - 1 - s;  // last rank's block first
      e_.rec.forward_step(s, [&] {
        return cp_detail::attend_blocks<T>(st, a.q, qb, k_of<const T>(all, j),
                                           v_of<const T>(all, j), e_.shards[j], e_.cfg.kernel);
      });
    }
    finish(st, a.out, a.lse, qb.rows);
  }

  template <class T>
  void bwd(const BackwardArgs<T>& a) {
    const Block& qb = e_.shards[e_.me];
    float* delta = e_.mem.buffer<float>(kSlotDelta, static_cast<size_t>(e_.heads * qb.rows));
    compute_delta(a.out, a.dout, delta, qb.rows);
    const T* all = gather_kv<T>(a.k, a.v);
    float* dkv = e_.mem.buffer<float>(kSlotOwn + 2, e_.P * per_);
    e_.mem.zero(dkv, e_.P * per_);
    e_.mem.zero(a.dq);
    for (int s = 0; s < e_.P; ++s) {
      const int j = e_.P - 1 - s;
      e_.rec.backward_step(s, [&] {
        return cp_detail::attend_backward_blocks<T>(
            a.q, qb, k_of<const T>(all, j), v_of<const T>(all, j), e_.shards[j], a.dout, a.lse,
            delta, e_.cfg.kernel, a.dq, k_of<float>(dkv, j), v_of<float>(dkv, j));
      });
    }
    e_.rec.collective(SpanKind::reduce_scatter,
                      [&] { e_.cp.all_reduce(dkv, e_.P * per_, DType::f32, ReduceOp::sum); });
    const float* mine = dkv + static_cast<size_t>(e_.me) * per_;
    e_.mem.unpack<float>(mine, a.dk);
    e_.mem.unpack<float>(mine + qb.rows * e_.kv_heads * e_.dim, a.dv);
  }

 private:
  // The padded gather of K and V: [P][2 max_rows Hkv D] (rank j's k rows, then its v rows).
  template <class T>
  const T* gather_kv(View3<const T> k, View3<const T> v) {
    T* mine = e_.mem.buffer<T>(kSlotOwn, per_);
    e_.mem.pack<T>(k, mine);
    e_.mem.pack<T>(v, mine + k.s * e_.kv_heads * e_.dim);
    T* all = e_.mem.buffer<T>(kSlotOwn + 1, e_.P * per_);
    e_.rec.collective(SpanKind::allgather, [&] { e_.cp.all_gather(mine, per_ * sizeof(T), all); });
    return all;
  }
  template <class T, class P>
  View3<T> k_of(P* all, int j) const {
    return e_.rows_view<T>(all + static_cast<size_t>(j) * per_, e_.shards[j].rows, e_.kv_heads);
  }
  template <class T, class P>
  View3<T> v_of(P* all, int j) const {
    const int64_t nj = e_.shards[j].rows;
    return e_.rows_view<T>(all + static_cast<size_t>(j) * per_ + nj * e_.kv_heads * e_.dim, nj,
                           e_.kv_heads);
  }

  Engine& e_;
  size_t per_ = 0;  // elements of one rank's padded K,V
};

// The whole gather (k, v and, in backward, their partials) on every rank.
double allgather_sum_bytes(const CpProblem& p) {
  const cp_detail::RowBytes b(p);
  return b.q + 8.0 * double(p.seq) * double(p.kv_heads) * double(p.head_dim) * (p.backward ? 2 : 1);
}

const cp_detail::StrategyEntry kAllgatherSumEntry{
    .id = Strategy{"allgather_sum"},
    .summary = "all-gather K,V, attend last block first, all-reduce dK,dV (a test plug-in)",
    .inner_degree = cp_detail::no_inner_axis,
    .make = cp_detail::make_strategy<AllgatherSum>,
    .working_bytes = allgather_sum_bytes};

// The same strategy with a degree option of its own (CpConfig::degree, no header field): its
// inner degree G groups consecutive ranks, which allgather_sum's calls do not need, so the
// results are the same; it shows the option's path from the entry to CpShape. The registry
// checks 1 <= G and P % G == 0 before it calls this.
int grouped_inner(int, const CpConfig& cfg) {
  return cfg.degree;
}
const cp_detail::StrategyEntry kGroupedEntry{
    .id = Strategy{"allgather_sum_grouped"},
    .summary = "allgather_sum over groups of --group consecutive ranks (a test plug-in)",
    .degree = {"--group", "ranks per group", &CpConfig::degree},
    .inner_degree = grouped_inner,
    .make = cp_detail::make_strategy<AllgatherSum>,
    .working_bytes = allgather_sum_bytes};

// The registration lines.
const bool registered = [] {
  cp_detail::register_strategy(kAllgatherSumEntry);
  cp_detail::register_strategy(kGroupedEntry);
  return true;
}();

TEST(StrategyPlugin, RegistryShowsIt) {
  ASSERT_TRUE(registered);
  const Strategy id = parse_strategy("allgather_sum");
  EXPECT_EQ(id, Strategy{"allgather_sum"});
  EXPECT_FALSE(id == Strategy::allgather);
  EXPECT_EQ(to_string(id), "allgather_sum");
  ASSERT_EQ(strategies().size(), 7u);
  EXPECT_EQ(strategies()[5].name, "allgather_sum");
  EXPECT_EQ(strategies()[5].summary, kAllgatherSumEntry.summary);
  EXPECT_EQ(strategies()[5].option, "");
  EXPECT_EQ(strategies()[6].option, "--group");
  EXPECT_EQ(strategies()[6].option_help, "ranks per group");
  EXPECT_EQ(strategy_choices(),
            "ring, ulysses, hybrid, allgather, ring2d, allgather_sum or allgather_sum_grouped");
  try {
    parse_strategy("allgather_prod");
    ADD_FAILURE() << "allgather_prod parsed";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "(choose ring, ulysses, hybrid, allgather, ring2d, allgather_sum or "
                  "allgather_sum_grouped)"),
              std::string::npos)
        << e.what();
  }
  // A name is registered once; an entry without its functions is refused.
  EXPECT_THROW(cp_detail::register_strategy(kAllgatherSumEntry), InvalidArgument);
  cp_detail::StrategyEntry bare = kAllgatherSumEntry;
  bare.id = Strategy{"bare"};
  bare.make = nullptr;
  EXPECT_THROW(cp_detail::register_strategy(bare), InvalidArgument);
  EXPECT_THROW(parse_strategy("bare"), InvalidArgument);
  // A degree option is a flag --name: errors spell it "--name N" or "name=N".
  for (const char* flag : {"", "group", "-g", "--", "---group"}) {
    cp_detail::StrategyEntry odd = kGroupedEntry;
    odd.id = Strategy{"odd_flag"};
    odd.degree.flag = flag;
    try {
      cp_detail::register_strategy(odd);
      ADD_FAILURE() << "option '" << flag << "' registered";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("which is not of the form --name"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(parse_strategy("odd_flag"), InvalidArgument);
}

TEST(StrategyPlugin, DegreeOptionAndMemoryEstimate) {
  CpConfig cfg;
  cfg.strategy = parse_strategy("allgather_sum_grouped");
  set_degree(cfg, 2);
  EXPECT_EQ(cfg.degree, 2);
  EXPECT_EQ(cfg.inner, 0);
  EXPECT_EQ(cfg.ulysses, 1);
  const CpShape s = check_cp_config(cfg, 4, 4, 2);
  EXPECT_EQ(s.inner, 2);
  EXPECT_EQ(s.outer, 2);
  set_degree(cfg, 3);
  try {
    check_cp_config(cfg, 4, 4, 2);
    ADD_FAILURE() << "--group 3 of 4 ranks accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("allgather_sum_grouped: --group 3 must divide the "
                                         "number of ranks 4"),
              std::string::npos)
        << e.what();
  }
  cfg.option_spelling = OptionSpelling::keyword;  // as the Python op names it
  try {
    check_cp_config(cfg, 4, 4, 2);
    ADD_FAILURE() << "group=3 of 4 ranks accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("allgather_sum_grouped: group=3 must divide the number "
                                         "of ranks 4"),
              std::string::npos)
        << e.what();
  }
  cfg.option_spelling = OptionSpelling::flag;
  cfg.strategy = parse_strategy("allgather_sum");
  EXPECT_THROW(set_degree(cfg, 2), InvalidArgument);  // it takes no degree option
  // The built-ins' options set their own fields.
  cfg.strategy = Strategy::ring2d;
  set_degree(cfg, 2);
  EXPECT_EQ(cfg.inner, 2);
  cfg.strategy = Strategy::hybrid;
  set_degree(cfg, 4);
  EXPECT_EQ(cfg.ulysses, 4);
  // The estimate is the entry's: the whole gathered K,V (and partials) on every rank.
  cfg.strategy = parse_strategy("allgather_sum");
  const CpProblem p{1000, 252, 8, 2, 64, 4, true};
  const double q = 4.0 * 252 * 8 * 64, all_kv = 8.0 * 1000 * 2 * 64;
  EXPECT_DOUBLE_EQ(strategy_working_bytes(cfg, p), q + 2 * all_kv);
  // The built-ins' count the kernels' workspace too: ring's is smaller than all-gathering's at
  // P = 4.
  cfg.strategy = Strategy::allgather;
  const double gathered = strategy_working_bytes(cfg, p);
  cfg.strategy = Strategy::ring;
  EXPECT_LT(strategy_working_bytes(cfg, p), gathered);
  // Negative sizes (the estimate went negative: "fits" under any limit), ranks or threads < 1 and
  // a storage other than fp32 or bf16 are refused.
  for (CpProblem bad :
       {CpProblem{-1000, 252, 8, 2, 64, 4, true}, CpProblem{1000, -252, 8, 2, 64, 4, true},
        CpProblem{1000, 252, 8, 2, -64, 4, true}, CpProblem{1000, 252, 8, 2, 64, 0, true},
        CpProblem{1000, 252, 8, 2, 64, 4, true, 4, 0}, CpProblem{1000, 252, 8, 2, 64, 4, true, 3}})
    EXPECT_THROW(strategy_working_bytes(cfg, bad), InvalidArgument);
}

// Forward and backward through CpAttention against the fp64 reference (run_cp_case throws on a
// mismatch beyond the written tolerances), for every layout, odd sizes, masks, GQA and bf16.
TEST(StrategyPlugin, MatchesReference) {
  struct MaskCase {
    bool causal;
    int64_t window;
    std::vector<int64_t> docs;  // for S = 51
  };
  const std::vector<MaskCase> masks = {
      {true, 0, {}}, {false, 0, {}}, {true, 7, {}}, {true, 0, {20, 1, 30}}};
  int cases = 0;
  for (int P : {1, 2, 3, 4}) {
    for (Layout layout : {Layout::contiguous, Layout::zigzag, Layout::stripe}) {
      for (size_t m = 0; m < masks.size(); ++m) {
        for (int64_t hkv : {int64_t{4}, int64_t{2}, int64_t{1}}) {
          for (bool bf16 : {false, true}) {
            if (bf16 && (hkv != 2 || m > 1)) continue;
            CpCase c;
            c.strategy = parse_strategy("allgather_sum");
            c.layout = layout;
            c.S = 51;
            c.H = 4;
            c.HKV = hkv;
            c.D = 16;
            c.causal = masks[m].causal;
            c.window = masks[m].window;
            c.docs = masks[m].docs;
            c.bf16 = bf16;
            c.seed = 11 + static_cast<uint64_t>(cases);
            SCOPED_TRACE(c.name() + " P=" + std::to_string(P));
            EXPECT_NO_THROW(run_local(P, [&](Communicator& w) { run_cp_case(w, c); })) << c.name();
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 3 * (4 * 3 + 2));
}

// The grouped variant, built with its own degree (--group 2 of 4 ranks: CpAttention builds the
// inner groups from the entry's inner degree), computes what allgather_sum computes, bit for
// bit (the same kernel calls in the same order).
TEST(StrategyPlugin, GroupedDegreeRuns) {
  const int64_t S = 37, H = 4, HKV = 2, D = 16;
  const ShardPlan plan = ShardPlan::make(Layout::zigzag, S, 4);
  run_local(4, [&](Communicator& w) {
    const int64_t n = plan.rows(w.rank());
    Tensor<float> q({n, H, D}), k({n, HKV, D}), v({n, HKV, D});
    for (int64_t i = 0; i < q.numel(); ++i) q.data()[i] = float(std::sin(0.37 * double(i + n)));
    for (int64_t i = 0; i < k.numel(); ++i) k.data()[i] = float(std::cos(0.11 * double(i + n)));
    for (int64_t i = 0; i < v.numel(); ++i) v.data()[i] = float(std::sin(0.05 * double(i) + 1));
    std::vector<Tensor<float>> outs;
    for (const char* name : {"allgather_sum", "allgather_sum_grouped"}) {
      CpConfig cfg;
      cfg.strategy = parse_strategy(name);
      if (std::string(name) == "allgather_sum_grouped") set_degree(cfg, 2);
      cfg.kernel.scale = 0.25f;
      cfg.kernel.threads = 1;
      CpAttention att(w, plan, cfg, H, HKV, D);
      Tensor<float> out({n, H, D});
      std::vector<float> lse(static_cast<size_t>(H * n));
      att.forward(q.view3(), k.view3(), v.view3(), out.view3(), lse.data());
      outs.push_back(std::move(out));
    }
    for (int64_t i = 0; i < outs[0].numel(); ++i)
      LOOM_CHECK(outs[0].data()[i] == outs[1].data()[i], Error,
                 "rank " << w.rank() << " element " << i << ": " << outs[0].data()[i]
                         << " != " << outs[1].data()[i]);
  });
}

// A strategy's buffers come from the memory seam (Engine::mem): a buffer the machine cannot give
// is OutOfMemory naming its size and slot, as error.h promises (it was std::bad_alloc), and the
// slot stays usable for a size that fits.
TEST(StrategyPlugin, AFailedStrategyBufferIsOutOfMemoryNamingItsSize) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers abort on an allocation of 2^62 bytes instead of failing it";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  GTEST_SKIP() << "the sanitizers abort on an allocation of 2^62 bytes instead of failing it";
#endif
#endif
  cp_detail::Memory mem;
  float* small = mem.buffer<float>(3, 16);
  ASSERT_NE(small, nullptr);
  std::string error;
  try {
    mem.buffer<float>(3, size_t{1} << 60);  // 2^62 bytes: past any address space
  } catch (const OutOfMemory& e) {
    error = e.what();
  } catch (const std::bad_alloc&) {
    error = "std::bad_alloc";
  }
  EXPECT_NE(error.find("out of memory for a strategy buffer of 4194304.00 TiB (slot 3)"),
            std::string::npos)
      << (error.empty() ? "no error" : error);
  float* again = mem.buffer<float>(3, 1024);
  ASSERT_NE(again, nullptr);
  again[1023] = 1.0f;
  EXPECT_EQ(mem.held_bytes(), 1024 * sizeof(float));
}

}  // namespace
}  // namespace loom::testing
