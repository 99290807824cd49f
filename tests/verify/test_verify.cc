// loom verify, the library: sharding conventions on hand-worked examples, and the defect library
// (tests/verify/defect_ring.h): every injected defect must be named, every correct candidate must
// pass.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "loom/bf16.h"
#include "loom/verify.h"
#include "unit/tolerance.h"
#include "verify/defect_ring.h"

namespace loom::test {
namespace {

using Tok = std::vector<std::vector<int64_t>>;

Tok tokens(const std::string& conv, int64_t S, int P, const std::vector<int64_t>& docs = {}) {
  return verify::make_sharding(conv, S, P, docs).tokens;
}

// ---------------------------------------------------------------------------------------------
// Conventions, worked by hand from each project's code (see loom/verify.h for the citations).

TEST(Conventions, LoomLayouts) {
  // contiguous: the first S mod P ranks one token longer.
  EXPECT_EQ(tokens("contiguous", 10, 3), (Tok{{0, 1, 2, 3}, {4, 5, 6}, {7, 8, 9}}));
  // zigzag: 2P chunks of 3,3,2,2; rank r takes chunks r and 2P-1-r.
  EXPECT_EQ(tokens("zigzag", 10, 2), (Tok{{0, 1, 2, 8, 9}, {3, 4, 5, 6, 7}}));
  EXPECT_EQ(tokens("stripe", 7, 3), (Tok{{0, 3, 6}, {1, 4}, {2, 5}}));
  const auto z = verify::make_sharding("zigzag", 10, 2);
  ASSERT_EQ(z.chunks.size(), 4u);
  EXPECT_EQ(z.chunks[3], (std::vector<int64_t>{8, 9}));
  EXPECT_EQ(z.chunk_rank, (std::vector<int>{0, 1, 1, 0}));
}

TEST(Conventions, RingFlashAttentionZigzag) {
  // value.chunk(4) of 10 tokens: chunks of ceil(10/4) = 3: [0,1,2] [3,4,5] [6,7,8] [9].
  EXPECT_EQ(tokens("rfa-zigzag", 10, 2), (Tok{{0, 1, 2, 9}, {3, 4, 5, 6, 7, 8}}));
  EXPECT_EQ(tokens("rfa-zigzag", 8, 2), (Tok{{0, 1, 6, 7}, {2, 3, 4, 5}}));
  // 9 tokens: torch.chunk(4) returns only 3 chunks of 3, extract_local would fail.
  EXPECT_THROW(tokens("rfa-zigzag", 9, 2), InvalidArgument);
  // Varlen: per sequence of cu_seqlens [0, 8, 20].
  EXPECT_EQ(tokens("rfa-zigzag", 20, 2, {8, 12}),
            (Tok{{0, 1, 6, 7, 8, 9, 10, 17, 18, 19}, {2, 3, 4, 5, 11, 12, 13, 14, 15, 16}}));
}

TEST(Conventions, TransformerEngineThd) {
  // thd_partition_indices_kernel, cu_seqlens [0, 8, 12], world 2: local cu = [0, 4, 6];
  // rank 0: seq 0 halves from chunks 0 and 3 -> 0,1,6,7; seq 1 -> 8, 11.
  EXPECT_EQ(tokens("te-thd", 12, 2, {8, 4}), (Tok{{0, 1, 6, 7, 8, 11}, {2, 3, 4, 5, 9, 10}}));
  EXPECT_THROW(tokens("te-thd", 10, 2, {6, 4}), InvalidArgument);  // 6 % 4 != 0
  EXPECT_EQ(tokens("te-thd", 8, 2), (Tok{{0, 1, 6, 7}, {2, 3, 4, 5}}));
}

TEST(Conventions, TorchHeadTail) {
  // _HeadTailLoadBalancer._generate_indices, S = 8, W = 2: chunks view(4, 2), pairs (0,3),(1,2)
  // -> [0,1,6,7, 2,3,4,5], sharded contiguously.
  EXPECT_EQ(tokens("torch-headtail", 8, 2), (Tok{{0, 1, 6, 7}, {2, 3, 4, 5}}));
  EXPECT_THROW(tokens("torch-headtail", 10, 2), InvalidArgument);
  // _PerDocumentHeadTailLoadBalancer, documents [8, 4]: rank-major per document.
  EXPECT_EQ(tokens("torch-headtail", 12, 2, {8, 4}),
            (Tok{{0, 1, 6, 7, 8, 11}, {2, 3, 4, 5, 9, 10}}));
}

TEST(Conventions, Megatron) {
  // get_batch_on_this_cp_rank: view [6, 2], index_select [r, 5 - r].
  EXPECT_EQ(tokens("megatron", 12, 3), (Tok{{0, 1, 10, 11}, {2, 3, 8, 9}, {4, 5, 6, 7}}));
  EXPECT_THROW(tokens("megatron", 10, 3), InvalidArgument);
  EXPECT_THROW(tokens("nonsense", 10, 3), InvalidArgument);
}

TEST(Conventions, RoundTrip) {
  // Every convention: each token on exactly one rank, chunks partition the sequence, and
  // unshard(shard(x)) == x.
  for (const auto& conv : verify::convention_names()) {
    for (int P : {1, 2, 3, 4}) {
      const int64_t S = 24 * P;
      const auto sh = verify::make_sharding(conv, S, P);
      std::vector<int> seen(S, 0), in_chunk(S, 0);
      for (const auto& t : sh.tokens)
        for (int64_t x : t) ++seen[x];
      for (const auto& c : sh.chunks)
        for (int64_t x : c) ++in_chunk[x];
      for (int64_t i = 0; i < S; ++i) {
        EXPECT_EQ(seen[i], 1) << conv << " P=" << P << " token " << i;
        EXPECT_EQ(in_chunk[i], 1) << conv << " P=" << P << " token " << i;
      }
      Tensor<double> g({S, 2, 3});
      for (int64_t i = 0; i < g.numel(); ++i) g[i] = static_cast<double>(i);
      std::vector<Tensor<double>> local, local_lse;
      for (int r = 0; r < P; ++r) {
        const int64_t n = static_cast<int64_t>(sh.tokens[r].size());
        Tensor<double> t({n, 2, 3}), l({2, n});
        for (int64_t i = 0; i < n; ++i)
          for (int64_t e = 0; e < 6; ++e) t[i * 6 + e] = g[sh.tokens[r][i] * 6 + e];
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t i = 0; i < n; ++i)
            l[h * n + i] = static_cast<double>(h * S + sh.tokens[r][i]);
        local.push_back(t);
        local_lse.push_back(l);
      }
      EXPECT_EQ(verify::unshard_rows(sh, local, "x").vec(), g.vec()) << conv;
      const Tensor<double> lse = verify::unshard_cols(sh, local_lse, "lse");
      for (int64_t e = 0; e < lse.numel(); ++e) EXPECT_EQ(lse[e], static_cast<double>(e)) << conv;
    }
  }
}

TEST(Conventions, GatherRowsIsShardingsInverse) {
  // gather_rows(x, rank r's tokens) is rank r's shard: unshard_rows of the shards gives x back.
  const auto sh = verify::make_sharding("zigzag", 10, 2);
  Tensor<double> x({10, 2, 3});
  std::iota(x.vec().begin(), x.vec().end(), 0.0);
  std::vector<Tensor<double>> local;
  for (int r = 0; r < 2; ++r) local.push_back(verify::gather_rows(x, sh.tokens[r]));
  ASSERT_EQ(local[1].shape(), (std::vector<int64_t>{5, 2, 3}));
  EXPECT_EQ(local[1][0], 3 * 6.0);  // rank 1's first token is 3
  EXPECT_EQ(verify::unshard_rows(sh, local, "x").vec(), x.vec());
  EXPECT_THROW(verify::gather_rows(x, {10}), InvalidArgument);
  EXPECT_THROW(verify::gather_rows(Tensor<double>({4, 6}), {0}), InvalidArgument);
}

TEST(Conventions, WrongRowCountIsRefused) {
  const auto sh = verify::make_sharding("zigzag", 16, 2);
  std::vector<Tensor<double>> local = {Tensor<double>({8, 1, 1}), Tensor<double>({7, 1, 1})};
  EXPECT_THROW(verify::unshard_rows(sh, local, "out"), InvalidArgument);
}

// The message of an unshard call that throws InvalidArgument ("" when it does not throw).
template <class F>
std::string unshard_error(F f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Conventions, WrongRankIsNamedWithTheExpectedShape) {
  // Rank 0's sizes were taken as the expected ones: a wrong rank 0 was blamed on rank 1, with rank
  // 0's wrong sizes ("dq.rank1 has shape [8, 4, 2] ... gives rank 1 8 rows of [2, 2]"). Given
  // q's (or k's) sizes, the wrong rank is named with the right shape.
  const auto sh = verify::make_sharding("zigzag", 16, 2);
  const std::vector<Tensor<double>> rows = {Tensor<double>({8, 2, 2}), Tensor<double>({8, 4, 2})};
  const std::string e1 = unshard_error([&] { verify::unshard_rows(sh, rows, "dq", {4, 2}); });
  EXPECT_NE(e1.find("dq.rank0 has shape [8, 2, 2] but zigzag with 2 ranks gives rank 0 8 rows of "
                    "[4, 2]"),
            std::string::npos)
      << e1;
  // lse of every rank transposed ([n, H]): rank 0 named, with [H, n] from q's H.
  const std::vector<Tensor<double>> cols = {Tensor<double>({8, 4}), Tensor<double>({8, 4})};
  const std::string e2 = unshard_error([&] { verify::unshard_cols(sh, cols, "lse", 4); });
  EXPECT_NE(e2.find("lse.rank0 has shape [8, 4] but zigzag with 2 ranks gives rank 0 [4, 8]"),
            std::string::npos)
      << e2;
  // Right shapes pass.
  const std::vector<Tensor<double>> ok = {Tensor<double>({8, 4, 2}), Tensor<double>({8, 4, 2})};
  EXPECT_EQ(verify::unshard_rows(sh, ok, "dq", {4, 2}).shape(), (std::vector<int64_t>{16, 4, 2}));
}

TEST(Conventions, ContiguousWithDocumentsSaysItIsPerDocument) {
  // contiguous cuts each document (as loom's ShardPlan does): files cut in P runs of the packed
  // sequence have other row counts, and the error says why.
  const auto sh = verify::make_sharding("contiguous", 12, 2, {5, 7});
  EXPECT_EQ(sh.tokens[0], (std::vector<int64_t>{0, 1, 2, 5, 6, 7, 8}));
  const std::vector<Tensor<double>> runs = {Tensor<double>({6, 1, 1}), Tensor<double>({6, 1, 1})};
  const std::string e = unshard_error([&] { verify::unshard_rows(sh, runs, "out", {1, 1}); });
  EXPECT_NE(e.find("out.rank0 has shape [6, 1, 1] but contiguous with 2 ranks gives rank 0 7 rows "
                   "of [1, 1] (with 2 documents, contiguous cuts each document into 2 pieces"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("a contiguous split of the packed sequence is not a convention"),
            std::string::npos)
      << e;
}

// ---------------------------------------------------------------------------------------------
// The defect library.

RingInputs inputs(int64_t S, int64_t H, int64_t Hkv, int64_t D, bool causal, uint32_t seed) {
  RingInputs in;
  in.q = random_normal({S, H, D}, seed);
  in.k = random_normal({S, Hkv, D}, seed + 1);
  in.v = random_normal({S, Hkv, D}, seed + 2);
  in.dout = random_normal({S, H, D}, seed + 3);
  in.mask.causal = causal;
  in.scale = 1.0f / std::sqrt(static_cast<float>(D));
  return in;
}

verify::Options options(const std::string& conv, int P) {
  verify::Options opt;
  opt.convention = conv;
  opt.ranks = P;
  return opt;
}

// The defect ring's outputs on in, sharded by conv over P ranks, with inj injected.
RingOutputs ring(const RingInputs& in, const std::string& conv, int P, const Injected& inj,
                 bool backward) {
  return run_defect_ring(in, verify::make_sharding(conv, in.q.size(0), P), inj, backward);
}

// A candidate of out alone (lse, dq, dk and dv absent).
verify::Candidate out_only(const Tensor<float>& out) {
  verify::Candidate c;
  c.out = convert<double>(out);
  return c;
}

verify::Report check(const RingInputs& in, const std::string& conv, int P, const Injected& inj,
                     bool backward = false) {
  verify::Candidate c = to_candidate(ring(in, conv, P, inj, backward), backward);
  if (inj.kind == Defect::no_lse_merge) c.lse.reset();  // the seed's loop returns no lse
  return verify::verify(to_problem(in), c, options(conv, P));
}

std::string first_kind(const verify::Report& r) {
  return r.diagnoses.empty() ? "none" : r.diagnoses[0].kind;
}

struct Case {
  std::string conv;
  int P;
  int64_t S;
  bool causal;
};

// One parameterised case: H = 2, Hkv = 1, D = 16 inputs of the case's length and mask (seeded)
// through the defect ring with inj, then checked.
verify::Report check_case(const Case& k, uint32_t seed, const Injected& inj,
                          bool backward = false) {
  return check(inputs(k.S, 2, 1, 16, k.causal, seed), k.conv, k.P, inj, backward);
}

class DefectLibrary : public ::testing::TestWithParam<Case> {};

TEST_P(DefectLibrary, CorrectRingPasses) {
  const auto r = check_case(GetParam(), 11, {}, true);
  EXPECT_TRUE(r.passed) << r.summary();
  EXPECT_TRUE(r.diagnoses.empty());
}

TEST_P(DefectLibrary, DroppedStepOnOneRank) {
  const Case& k = GetParam();
  const RingInputs in = inputs(k.S, 2, 1, 16, k.causal, 12);
  // The last rank's step 1 (never empty: its queries are the latest ones).
  const int r0 = k.P - 1;
  const auto r = check(in, k.conv, k.P, {Defect::dropped_step, 1, r0, 0});
  ASSERT_FALSE(r.passed);
  ASSERT_EQ(first_kind(r), "dropped_step") << r.summary();
  EXPECT_EQ(r.diagnoses[0].ranks, std::vector<int>{r0});
  EXPECT_EQ(r.diagnoses[0].steps, std::vector<int>{1});
  EXPECT_NE(r.diagnoses[0].text.find("rank " + std::to_string(r0) + "'s queries lack"),
            std::string::npos)
      << r.diagnoses[0].text;
  EXPECT_LT(r.diagnoses[0].residual, 0.01);
}

TEST_P(DefectLibrary, DroppedStepEverywhere) {
  const auto r = check_case(GetParam(), 13, {Defect::dropped_step, 1, -1, 0});
  ASSERT_EQ(first_kind(r), "dropped_step") << r.summary();
  EXPECT_TRUE(r.diagnoses[0].ranks.empty()) << r.diagnoses[0].text;
  EXPECT_EQ(r.diagnoses[0].steps, std::vector<int>{1});
}

TEST_P(DefectLibrary, DoubledStep) {
  const auto r = check_case(GetParam(), 14, {Defect::doubled_step, 0, 0, 0});
  ASSERT_EQ(first_kind(r), "doubled_step") << r.summary();
  EXPECT_EQ(r.diagnoses[0].ranks, std::vector<int>{0});
  EXPECT_EQ(r.diagnoses[0].steps, std::vector<int>{0});
}

TEST_P(DefectLibrary, Bf16BetweenSteps) {
  const auto r = check_case(GetParam(), 15, {Defect::bf16_steps, -1, -1, 0});
  ASSERT_FALSE(r.passed);
  EXPECT_EQ(first_kind(r), "bf16_between_steps") << r.summary();
}

TEST_P(DefectLibrary, NoLseMerge) {
  const auto r = check_case(GetParam(), 16, {Defect::no_lse_merge, -1, -1, 0});
  ASSERT_FALSE(r.passed);
  EXPECT_EQ(first_kind(r), "no_lse_merge") << r.summary();
  EXPECT_NE(r.summary().find("missing log-sum-exp merge"), std::string::npos);
}

TEST_P(DefectLibrary, WrongScale) {
  const auto r = check_case(GetParam(), 17, {Defect::wrong_scale, -1, -1, 0});
  ASSERT_EQ(first_kind(r), "wrong_scale") << r.summary();
  EXPECT_NEAR(r.diagnoses[0].value, 1.0 / 16, 1e-4);
}

TEST_P(DefectLibrary, StaleKvInBackward) {
  const Case& k = GetParam();
  const RingInputs in = inputs(k.S, 2, 1, 16, k.causal, 18);
  const auto r = check(in, k.conv, k.P, {Defect::stale_kv, k.P - 1, -1, 0}, true);
  ASSERT_FALSE(r.passed);
  EXPECT_TRUE(r.tensors[0].passed);  // the forward is right
  ASSERT_EQ(first_kind(r), "stale_kv_backward") << r.summary();
  EXPECT_EQ(r.diagnoses[0].steps, std::vector<int>{k.P - 1});
}

TEST_P(DefectLibrary, StaleKvInForward) {
  // The forward reuses step s - 1's block at step s: it was named "every rank skipped ring step
  // s" with half the error unexplained. With P = 2, out is exactly a dropped step 1 (the one
  // block left is normalised alone), which is named then.
  const Case& k = GetParam();
  const RingInputs in = inputs(k.S, 2, 1, 16, k.causal, 19);
  const auto r = check(in, k.conv, k.P, {Defect::stale_kv_forward, k.P - 1, -1, 0});
  ASSERT_FALSE(r.passed);
  if (k.P == 2) {
    ASSERT_EQ(first_kind(r), "dropped_step") << r.summary();
  } else {
    ASSERT_EQ(first_kind(r), "stale_kv_forward") << r.summary();
    EXPECT_LT(r.diagnoses[0].residual, 0.01) << r.summary();
    const std::string want = "stale KV in the forward: at ring step " + std::to_string(k.P - 1) +
                             " every rank computed with the KV block of step " +
                             std::to_string(k.P - 2) + " again";
    EXPECT_NE(r.diagnoses[0].text.find(want), std::string::npos) << r.summary();
  }
  EXPECT_EQ(r.diagnoses[0].steps, std::vector<int>{k.P - 1});
  EXPECT_TRUE(r.diagnoses[0].ranks.empty()) << r.summary();
  // On one rank.
  if (k.P > 2) {
    const auto r1 = check(in, k.conv, k.P, {Defect::stale_kv_forward, 1, k.P - 1, 0});
    ASSERT_EQ(first_kind(r1), "stale_kv_forward") << r1.summary();
    EXPECT_EQ(r1.diagnoses[0].ranks, std::vector<int>{k.P - 1});
    EXPECT_EQ(r1.diagnoses[0].steps, std::vector<int>{1});
  }
}

INSTANTIATE_TEST_SUITE_P(Verify, DefectLibrary,
                         ::testing::Values(Case{"zigzag", 4, 96, true}, Case{"zigzag", 3, 90, true},
                                           Case{"contiguous", 3, 87, false},
                                           Case{"rfa-zigzag", 2, 64, true},
                                           Case{"megatron", 4, 64, true}));

// Layout-specific defects: the causal mask off by one chunk and the zigzag order.
TEST(DefectLibraryZigzag, MaskOffByOneChunk) {
  for (int offset : {-1, +1}) {
    const RingInputs in = inputs(96, 2, 1, 16, true, 21);
    const auto r = check(in, "zigzag", 4, {Defect::mask_offset, -1, -1, offset});
    ASSERT_FALSE(r.passed);
    ASSERT_EQ(first_kind(r), "mask_offset") << offset << "\n" << r.summary();
    EXPECT_EQ(r.diagnoses[0].value, offset);
    EXPECT_NE(r.diagnoses[0].text.find("the diagonal blocks are masked with the wrong offset"),
              std::string::npos);
  }
}

// The causal mask one token off, or not applied on the diagonal step. An off-by-one between
// blocks (key i + 1 on another rank visible) was "no known defect explains the out error", with no
// pair named (the pair is one the true mask hides entirely: no heat-map direction covers it); a
// diagonal block without its mask was "mask shifted one chunk into the future" (half of it false).
TEST(DefectLibraryZigzag, CausalMaskOneTokenOffOrNotApplied) {
  struct MaskCase {
    Injected inj;
    const char* kind;
    double value;
    const char* text;
  };
  const MaskCase cases[] = {
      {{Defect::diagonal_unmasked, -1, -1, 0},
       "diagonal_unmasked",
       0,
       "the diagonal step is attended without the causal mask"},
      {{Defect::token_offset, 1, -1, 1},
       "mask_off_by_one",
       1,
       "the causal mask is one token off on the other ranks' blocks"},
      {{Defect::token_offset, 0, -1, 1},
       "mask_off_by_one",
       1,
       "the causal mask is one token off on the diagonal step"},
      {{Defect::token_offset, -1, -1, 1},
       "mask_off_by_one",
       1,
       "the causal mask is one token off (key j <= i + 1 instead of j <= i): every query"},
      {{Defect::token_offset, 0, -1, -1},
       "mask_off_by_one",
       -1,
       "the causal mask is strict (key j < i instead of j <= i)"},
  };
  for (const auto& [conv, P] : {std::pair<std::string, int>{"zigzag", 4}, {"contiguous", 3}}) {
    const RingInputs in = inputs(96, 2, 1, 16, true, 25);
    for (const MaskCase& m : cases) {
      const auto r = check(in, conv, P, m.inj);
      ASSERT_FALSE(r.passed) << conv << " " << m.text;
      ASSERT_EQ(first_kind(r), m.kind) << conv << " " << m.text << "\n" << r.summary();
      EXPECT_EQ(r.diagnoses[0].value, m.value) << r.summary();
      EXPECT_LT(r.diagnoses[0].residual, 0.01) << r.summary();
      EXPECT_NE(r.diagnoses[0].text.find(m.text), std::string::npos) << r.summary();
    }
  }
}

TEST(DefectLibraryZigzag, WrongGqaMapping) {
  RingInputs in = inputs(96, 4, 2, 16, true, 24);
  const auto r = check(in, "zigzag", 4, {Defect::gqa_mapping, -1, -1, 0});
  ASSERT_FALSE(r.passed);
  ASSERT_EQ(first_kind(r), "gqa_mapping") << r.summary();
  EXPECT_LT(r.diagnoses[0].residual, 0.01);
  // With the same GQA heads, the other defects are still named as themselves.
  EXPECT_EQ(first_kind(check(in, "zigzag", 4, {Defect::dropped_step, 1, 2, 0})), "dropped_step");
  EXPECT_EQ(first_kind(check(in, "zigzag", 4, {Defect::no_lse_merge, -1, -1, 0})), "no_lse_merge");
  EXPECT_EQ(first_kind(check(in, "zigzag", 4, {Defect::wrong_scale, -1, -1, 0})), "wrong_scale");
}

TEST(DefectLibraryZigzag, WrongZigzagOrder) {
  const RingInputs in = inputs(96, 2, 1, 16, true, 22);
  const auto r = check(in, "zigzag", 4, {Defect::zigzag_order, -1, -1, 0});
  ASSERT_FALSE(r.passed);
  ASSERT_EQ(first_kind(r), "row_order") << r.summary();
  EXPECT_NE(r.diagnoses[0].text.find("wrong zigzag order"), std::string::npos);
  EXPECT_EQ(r.diagnoses[0].ranks.size(), 4u);
}

TEST(DefectLibraryZigzag, HeatMapPointsAtTheDroppedPair) {
  // Rank 2 drops step 1: it lacks rank 1's block, chunks 1 and 6 (zigzag, P = 4). Rank 2 holds
  // query chunks 2 and 5. The heat map's largest cells must be in those rows and columns.
  const RingInputs in = inputs(96, 2, 1, 16, true, 23);
  const auto r = check(in, "zigzag", 4, {Defect::dropped_step, 1, 2, 0});
  ASSERT_EQ(r.heat.size(), 8u);
  double in_pairs = 0, total = 0;
  for (int a = 0; a < 8; ++a)
    for (int b = 0; b < 8; ++b) {
      total += r.heat[a][b];
      if ((a == 2 || a == 5) && (b == 1 || b == 6)) in_pairs += r.heat[a][b];
    }
  EXPECT_GT(in_pairs, 0.8 * total);
  EXPECT_GT(total, 0.5);
  const std::string svg = r.heatmap_svg();
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("query chunk 2 x KV chunk 1"), std::string::npos);
}

TEST(Verify, Bf16StorageCheckedAsFp32IsNamed) {
  // A correct ring whose out is rounded once to bf16 (as a bf16 implementation stores it):
  // fails the fp32 tolerance, passes the bf16 one, and is named as bf16 storage, not a defect.
  const RingInputs in = inputs(96, 2, 1, 16, true, 33);
  RingOutputs o = ring(in, "zigzag", 4, {}, false);
  for (float& x : o.out.vec()) x = to_float(to_bf16(x));
  const verify::Candidate c = out_only(o.out);
  verify::Options opt = options("zigzag", 4);
  const auto r = verify::verify(to_problem(in), c, opt);
  ASSERT_FALSE(r.passed);
  EXPECT_EQ(first_kind(r), "bf16_storage") << r.summary();
  opt.dtype = "bf16";
  EXPECT_TRUE(verify::verify(to_problem(in), c, opt).passed);
}

TEST(Verify, Bf16StorageWithInnerRoundingIsNamed) {
  // out as a bf16 implementation that also rounds inside gives it (bf16 dot products round the
  // probabilities of p v): every value a bf16 number, with more error than one rounding of the
  // exact answer explains, yet within the bf16 tolerance. Named as bf16 storage, with the model's
  // residual above the naming threshold.
  const RingInputs in = inputs(96, 2, 1, 16, true, 35);
  RingOutputs o = ring(in, "zigzag", 4, {}, false);
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> noise(-1.5 * kBf16Unit, 1.5 * kBf16Unit);
  for (float& x : o.out.vec()) x = to_float(to_bf16(static_cast<float>(x * (1.0 + noise(gen)))));
  const verify::Candidate c = out_only(o.out);
  verify::Options opt = options("zigzag", 4);
  const auto r = verify::verify(to_problem(in), c, opt);
  ASSERT_FALSE(r.passed);
  ASSERT_EQ(first_kind(r), "bf16_storage") << r.summary();
  EXPECT_GT(r.diagnoses[0].residual, 0.5) << r.summary();
  EXPECT_NE(r.diagnoses[0].text.find("more than one rounding"), std::string::npos) << r.summary();
  opt.dtype = "bf16";
  EXPECT_TRUE(verify::verify(to_problem(in), c, opt).passed);
  // The same error in values that are not all bf16 numbers is not bf16 storage.
  o.out.vec()[5] = std::nextafter(o.out.vec()[5], 1e9f);
  const auto r2 = verify::verify(to_problem(in), out_only(o.out), options("zigzag", 4));
  ASSERT_FALSE(r2.passed);
  EXPECT_NE(first_kind(r2), "bf16_storage") << r2.summary();
}

TEST(Verify, Bf16GradientsCheckedAsFp32AreNamed) {
  // dq, dk, dv of a correct ring rounded once to bf16 with out absent (or right): held to fp32's
  // 1e-5 they fail, and the diagnosis said only "no known defect" (localising dq) or "only dk, dv
  // failed". Named as bf16 storage, in the caller's spelling of the option.
  const RingInputs in = inputs(96, 2, 1, 16, true, 34);
  RingOutputs o = ring(in, "zigzag", 4, {}, true);
  for (Tensor<float>* t : {&o.dq, &o.dk, &o.dv})
    for (float& x : t->vec()) x = to_float(to_bf16(x));
  verify::Candidate c = to_candidate(o, true);
  c.out.reset();
  c.lse.reset();
  verify::Options opt = options("zigzag", 4);
  const auto r = verify::verify(to_problem(in), c, opt);
  ASSERT_FALSE(r.passed);
  ASSERT_EQ(first_kind(r), "bf16_storage") << r.summary();
  EXPECT_NE(r.diagnoses[0].text.find("dq, dk and dv are stored in bf16 (every value is a bf16 "
                                     "number, the exact answer rounded once)"),
            std::string::npos)
      << r.summary();
  EXPECT_NE(r.diagnoses[0].text.find("check it with --dtype bf16"), std::string::npos);
  // dk and dv alone (no localisation: "only dk, dv failed"), in loom.torch.verify's spelling.
  c.dq.reset();
  opt.option_spelling = OptionSpelling::keyword;
  const auto r2 = verify::verify(to_problem(in), c, opt);
  ASSERT_EQ(first_kind(r2), "bf16_storage") << r2.summary();
  EXPECT_NE(r2.diagnoses[0].text.find("dk and dv are stored in bf16"), std::string::npos);
  EXPECT_NE(r2.diagnoses[0].text.find("check it with dtype=\"bf16\""), std::string::npos)
      << r2.summary();
  opt.dtype = "bf16";
  EXPECT_TRUE(verify::verify(to_problem(in), c, opt).passed);
  // A gradient that is not all bf16 numbers is not named so.
  c.dk->vec()[3] = std::nextafter(static_cast<float>(c.dk->vec()[3]), 1e9f);
  opt.dtype = "fp32";
  EXPECT_NE(first_kind(verify::verify(to_problem(in), c, opt)), "bf16_storage");
}

TEST(Verify, NonFiniteValuesAreNamedAndNothingElse) {
  // The models see a NaN as 0, an error it makes up: an out of NaN was named "rows are in the
  // wrong order" after the NaN diagnosis, and one NaN in a correct out added "no known defect
  // explains the out error". The NaN or Inf is named, with where the first is, and nothing else.
  const RingInputs in = inputs(96, 2, 1, 16, true, 36);
  RingOutputs o = ring(in, "zigzag", 4, {}, false);
  RingOutputs all_nan = o;
  for (float& x : all_nan.out.vec()) x = std::nanf("");
  o.out.vec()[15 * 2 * 16 + 2] = -std::numeric_limits<float>::infinity();  // token 15, head 0
  for (const RingOutputs* x : {&all_nan, &o}) {
    const auto r = verify::verify(to_problem(in), out_only(x->out), options("zigzag", 4));
    ASSERT_FALSE(r.passed);
    ASSERT_EQ(r.diagnoses.size(), 1u) << r.summary();
    EXPECT_EQ(r.diagnoses[0].kind, "non_finite") << r.summary();
    EXPECT_TRUE(r.heat.empty());
  }
  const auto r = verify::verify(to_problem(in), out_only(o.out), options("zigzag", 4));
  EXPECT_NE(r.diagnoses[0].text.find("out has 1 non-finite value (NaN or Inf); the first at token "
                                     "15, head 0"),
            std::string::npos)
      << r.summary();
}

TEST(Verify, ShapeMismatchIsUnusable) {
  const RingInputs in = inputs(32, 2, 1, 8, true, 31);
  verify::Candidate c;
  c.out = Tensor<double>({31, 2, 8});
  verify::Options opt;
  EXPECT_THROW(verify::verify(to_problem(in), c, opt), InvalidArgument);
  verify::Candidate none;
  EXPECT_THROW(verify::verify(to_problem(in), none, opt), InvalidArgument);
}

TEST(Verify, FullCheckMaxBelowOneIsRefused) {
  // 0 or -1 made every sequence "sampled": dk and dv went uncompared and a dk of 123s passed.
  const RingInputs in = inputs(32, 2, 1, 8, true, 38);
  verify::Candidate c = to_candidate(ring(in, "zigzag", 2, {}, true), true);
  for (double& x : c.dk->vec()) x = 123.0;
  verify::Options opt = options("zigzag", 2);
  EXPECT_FALSE(verify::verify(to_problem(in), c, opt).passed);
  for (const int64_t bad : {int64_t{0}, int64_t{-1}}) {
    opt.full_check_max = bad;
    for (const OptionSpelling spelling : {OptionSpelling::flag, OptionSpelling::keyword}) {
      opt.option_spelling = spelling;
      try {
        verify::verify(to_problem(in), c, opt);
        ADD_FAILURE() << "full_check_max " << bad << " was accepted";
      } catch (const InvalidArgument& e) {
        const std::string want = spelling == OptionSpelling::flag ? "--full-check-max must be >= 1"
                                                                  : "full_check_max must be >= 1";
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
    }
  }
}

TEST(Verify, NonFiniteInputsAreUnusable) {
  // A NaN input reached the reference and was reported as scores that overflow float64.
  const RingInputs in = inputs(32, 2, 1, 8, true, 37);
  const verify::Candidate c = out_only(ring(in, "zigzag", 2, {}, false).out);
  verify::Problem p = to_problem(in);
  p.k[(5 * 1 + 0) * 8 + 3] = std::numeric_limits<double>::quiet_NaN();  // token 5, head 0, dim 3
  try {
    verify::verify(p, c, options("zigzag", 2));
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("k holds a NaN or Inf (token 5, head 0, dim 3): inputs "
                                         "must be finite"),
              std::string::npos)
        << e.what();
  }
}

// Problem::scale -1 or NaN silently became the default 1/sqrt(D) (only 0 means the default):
// they are refused, as infinity is, by name.
TEST(Verify, ScaleMustBeZeroOrPositiveAndFinite) {
  const RingInputs in = inputs(32, 2, 1, 8, true, 41);
  const verify::Candidate c = out_only(ring(in, "zigzag", 2, {}, false).out);
  verify::Problem p = to_problem(in);
  p.scale = 0;  // the default, 1/sqrt(8): the ring's scale
  EXPECT_TRUE(verify::verify(p, c, options("zigzag", 2)).passed);
  for (const double bad :
       {-1.0, -1.0 / std::sqrt(8.0), std::numeric_limits<double>::quiet_NaN(),
        std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
    p.scale = bad;
    try {
      verify::verify(p, c, options("zigzag", 2));
      ADD_FAILURE() << "scale " << bad << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "scale must be 0 (the default, 1/sqrt(D)) or a positive finite number, got "),
                std::string::npos)
          << e.what();
    }
  }
}

// tolerance() of an unknown tensor name returned a gradient's tolerance.
TEST(Verify, ToleranceNamesItsTensorsAndDtypes) {
  for (const char* t : {"out", "lse", "dq", "dk", "dv"}) {
    EXPECT_EQ(verify::tolerance(t, "fp32"), kFp32RelTol) << t;
    EXPECT_EQ(verify::tolerance(t, "bf16"), std::string(t) == "lse" ? kFp32RelTol : kBf16GradRelTol)
        << t;
  }
  for (const char* bad : {"dz", "", "OUT", "q"}) {
    for (const char* dtype : {"fp32", "bf16"}) {
      try {
        verify::tolerance(bad, dtype);
        ADD_FAILURE() << bad << " accepted";
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(std::string(e.what()),
                  "unknown tensor '" + std::string(bad) + "' (choose out, lse, dq, dk or dv)");
      }
    }
  }
  EXPECT_THROW(verify::tolerance("out", "fp16"), InvalidArgument);
}

TEST(Verify, AbsentTensorsAreReported) {
  const RingInputs in = inputs(40, 2, 2, 8, true, 32);
  const verify::Candidate c = out_only(ring(in, "zigzag", 2, {}, false).out);
  const auto r = verify::verify(to_problem(in), c, options("zigzag", 2));
  EXPECT_TRUE(r.passed);
  EXPECT_EQ(r.absent, (std::vector<std::string>{"lse", "dq", "dk", "dv"}));
}

}  // namespace
}  // namespace loom::test
