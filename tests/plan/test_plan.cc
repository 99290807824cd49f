// The planner's exact quantities.
//
// 1. shard_chunks() equals ShardPlan::make()'s segments (every layout, odd sizes, documents).
// 2. count_tiles() equals the tiles the real kernel reports (KernelStats) for chunk pairs of
//    every layout and mask, odd tile sizes included.
// 3. For 51 configurations (every strategy x layout x P in {2, 3, 4, 8} x causal / window /
//    documents / full x GQA, and ring2d with inner rings of 1-4 on 2-8 ranks), the simulator's
//    per-rank tiles (forward + backward), forward tiles per step, bytes sent and received, and
//    peak buffer bytes (the memory seam's slots) equal what `loom attn --json` reports.
// 4. Time is charged per work tile of the kernels, and each call's packing on its own key chunk.
// 5. Every shipped profile parses and cites a source for every figure.
// 6. The loom train step model composes a one-rank measure with the mesh: hand-computed
//    figures for one rank, dp, tp, cp and checkpointing; bad meshes refused.
// 7. The pair tables (src/plan/sim.h): the work of every pair of shards, and of aligned groups
//    of shards summed from it, equals the chunk-by-chunk count; simulations sharing tables
//    through one PairCache equal simulations with their own, for cases that differ in one input;
//    a stripe table (every pair's tile count loops) of 2048 ranks over S = 2^28 is cheap.
// 8. The search ranks only what loom train runs (tp divides the heads, the kv heads and the FFN;
//    a training sequence of at least 2 tokens), and one rank runs the contiguous layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <tuple>

#include "../src/plan/sim.h"
#include "loom/plan.h"
#include "loom/rng.h"

namespace loom::plan {
namespace {

Profile shipped(const std::string& name) {
  return load_profile(std::string(LOOM_PROFILES) + "/" + name);
}

// A profile with every required figure (round numbers; tests override what they measure).
Profile valid_profile() {
  Profile p;
  p.name = "test";
  p.flops_bf16 = p.flops_fp32 = 1e12;
  p.memory_bytes = 1e11;
  p.mem_bandwidth = 1e11;
  p.intra = Link{1e10, 1e-6};
  p.inter = Link{1e9, 1e-5};
  return p;
}

TEST(PlanChunks, EqualShardPlanSegments) {
  const std::vector<std::vector<int64_t>> doc_sets = {{}, {5, 1, 9}, {100, 3, 250, 47}};
  for (Layout layout : {Layout::contiguous, Layout::zigzag, Layout::stripe})
    for (int64_t S : {1, 7, 100, 400, 1000})
      for (int P : {1, 2, 3, 4, 8})
        for (const auto& docs0 : doc_sets) {
          std::vector<int64_t> docs = docs0;
          int64_t sum = 0;
          for (int64_t l : docs) sum += l;
          if (!docs.empty() && sum != S) docs.push_back(S - sum > 0 ? S - sum : 0);
          if (!docs.empty() && docs.back() <= 0) continue;
          const ShardPlan sp = ShardPlan::make(layout, S, P, docs);
          const auto ch = shard_chunks(layout, S, P, docs);
          ASSERT_EQ(static_cast<int>(ch.size()), P);
          for (int r = 0; r < P; ++r) {
            ASSERT_EQ(ch[r].size(), sp.segments[r].size())
                << to_string(layout) << " S=" << S << " P=" << P << " r=" << r;
            for (size_t i = 0; i < ch[r].size(); ++i) {
              const Segment& g = sp.segments[r][i];
              ASSERT_EQ(ch[r][i].count, g.count);
              for (int64_t a = 0; a < g.count; ++a) {
                ASSERT_EQ(ch[r][i].first + ch[r][i].stride * a, sp.tokens[r][g.begin + a]);
                if (!docs.empty()) {
                  ASSERT_EQ(ch[r][i].doc, sp.docs[r][g.begin + a]);
                }
              }
            }
          }
        }
}

// The kernel's own count for rows q against keys k (one head, tiny D).
int64_t kernel_tiles(const Chunk& q, const Chunk& k, const Mask& mask, int64_t bq, int64_t bk) {
  std::vector<int64_t> qp(q.count), kp(k.count);
  for (int64_t a = 0; a < q.count; ++a) qp[a] = q.first + q.stride * a;
  for (int64_t b = 0; b < k.count; ++b) kp[b] = k.first + k.stride * b;
  std::vector<int32_t> qd(q.count, q.doc), kd(k.count, k.doc);
  Tensor<float> qt({q.count, 1, 4}), kt({k.count, 1, 4}), vt({k.count, 1, 4});
  for (int64_t i = 0; i < qt.numel(); ++i) qt[i] = 0.01f * static_cast<float>(i % 7);
  for (int64_t i = 0; i < kt.numel(); ++i) kt[i] = vt[i] = 0.02f * static_cast<float>(i % 5);
  SoftmaxState st(q.count, 1, 4);
  KernelConfig cfg;
  cfg.mask = mask;
  cfg.scale = 0.5f;
  cfg.threads = 1;
  cfg.block_q = bq;
  cfg.block_k = bk;
  const KernelStats ks =
      attend(st.view(), qt.view3(), kt.view3(), vt.view3(), Tokens{qp.data(), qd.data(), q.count},
             Tokens{kp.data(), kd.data(), k.count}, cfg);
  return ks.tiles;
}

TEST(PlanTiles, EqualKernelCounts) {
  std::mt19937_64 rng(14);
  int checked = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    auto pick = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    const int64_t stride = pick(0, 2) == 0 ? pick(2, 8) : 1;
    Chunk q{pick(0, 300), stride, pick(1, 150), 0};
    Chunk k{pick(0, 300), stride, pick(1, 150), 0};
    if (pick(0, 9) == 0) k.doc = 1;
    Mask mask;
    mask.causal = pick(0, 3) != 0;
    mask.window = pick(0, 2) == 0 ? pick(1, 90) : 0;
    const int64_t bq = pick(0, 2) == 0 ? pick(1, 40) : 64, bk = pick(0, 2) == 0 ? pick(1, 40) : 64;
    // The cp layer skips chunk pairs the mask separates; the kernel then counts no tile either,
    // except when different documents are skipped by the cp layer only.
    const TileCount tc = count_tiles(q, k, mask, bq, bk);
    const int64_t want = q.doc != k.doc ? 0 : kernel_tiles(q, k, mask, bq, bk);
    ASSERT_EQ(tc.total(), want) << "q " << q.first << "+" << q.stride << "x" << q.count << " k "
                                << k.first << "+" << k.stride << "x" << k.count << " causal "
                                << mask.causal << " window " << mask.window << " tiles " << bq
                                << "x" << bk;
    checked += want > 0;
  }
  EXPECT_GT(checked, 500);  // most trials had work to compare
}

// count_tiles checked none of its arguments: differing strides were counted although the
// contract requires equal ones, block_q 0 looped forever, stride 0 and block_k 0 divided by
// zero. Each is one InvalidArgument naming the values.
TEST(PlanTiles, BadArgumentsAreRefused) {
  const Mask causal{true, 0};
  const auto message = [](const Chunk& q, const Chunk& k, const Mask& m, int64_t bq, int64_t bk) {
    try {
      count_tiles(q, k, m, bq, bk);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Chunk one{0, 1, 10, 0};
  EXPECT_EQ(message(Chunk{0, 2, 10, 0}, Chunk{0, 3, 10, 0}, causal, 4, 4),
            "count_tiles: q and k chunks of more than one row need the same stride, got 2 and 3");
  // One row of either side has no stride to agree on.
  EXPECT_EQ(message(Chunk{5, 2, 1, 0}, Chunk{0, 3, 10, 0}, causal, 4, 4), "no error");
  EXPECT_EQ(message(one, one, causal, 0, 4),
            "count_tiles: block_q and block_k must be >= 1, got 0 and 4");
  EXPECT_EQ(message(one, one, causal, 4, 0),
            "count_tiles: block_q and block_k must be >= 1, got 4 and 0");
  EXPECT_EQ(message(one, one, causal, -1, 4),
            "count_tiles: block_q and block_k must be >= 1, got -1 and 4");
  EXPECT_EQ(message(Chunk{0, 0, 10, 0}, Chunk{0, 0, 10, 0}, causal, 4, 4),
            "count_tiles: q chunk needs stride >= 1, count >= 0 and first >= 0, got 0+0x10");
  EXPECT_EQ(message(one, Chunk{0, 1, -5, 0}, causal, 4, 4),
            "count_tiles: k chunk needs stride >= 1, count >= 0 and first >= 0, got 0+1x-5");
  EXPECT_EQ(message(Chunk{-3, 1, 10, 0}, one, causal, 4, 4),
            "count_tiles: q chunk needs stride >= 1, count >= 0 and first >= 0, got -3+1x10");
  EXPECT_EQ(message(one, one, Mask{false, -2}, 4, 4),
            "count_tiles: mask window must be >= 0 (0: unlimited), got -2");
  const int64_t big = std::numeric_limits<int64_t>::max();
  for (const Chunk& huge : {Chunk{big - 1, 1, 2, 0}, Chunk{0, big, 3, 0}, Chunk{0, 1, big, 0},
                            Chunk{int64_t{1} << 56, 1, 1, 0}})
    EXPECT_NE(message(huge, one, causal, 4, 4).find("has positions at or past 2^56"),
              std::string::npos)
        << huge.first << "+" << huge.stride << "x" << huge.count;
  // The largest positions and windows are counted without overflow: a window wider than every
  // position difference is no limit.
  const Chunk far{(int64_t{1} << 56) - 10, 1, 10, 0};
  for (const bool c : {false, true}) {
    const TileCount unlimited = count_tiles(far, far, Mask{c, 0}, 4, 4);
    for (const int64_t w : {int64_t{1} << 56, int64_t{1} << 62, big}) {
      const TileCount wide = count_tiles(far, far, Mask{c, w}, 4, 4);
      EXPECT_EQ(wide.full, unlimited.full) << c << " " << w;
      EXPECT_EQ(wide.partial, unlimited.partial) << c << " " << w;
    }
  }
  EXPECT_EQ(count_tiles(far, far, Mask{false, 0}, 4, 4).total(), 9);
}

struct Config {
  std::string strategy, layout;
  int P, U;
  int I = 0;  // ring2d: the inner ring
  int64_t S, H, HKV;
  bool causal;
  int64_t window;
  std::string docs;
  std::string dtype;
};

std::vector<Config> configs() {
  std::vector<Config> c;
  const char* layouts[] = {"zigzag", "contiguous", "stripe"};
  int i = 0;
  for (int P : {2, 3, 4, 8}) {
    for (const char* strategy : {"ring", "ulysses", "hybrid", "allgather"}) {
      if (std::string(strategy) == "hybrid" && P == 3)
        continue;  // U must divide P: U = 3 is ulysses
      for (int variant = 0; variant < 3; ++variant, ++i) {
        Config x;
        x.strategy = strategy;
        x.layout = layouts[(i + variant) % 3];
        x.P = P;
        x.U = std::string(strategy) == "hybrid" ? (P == 8 ? 4 : 2) : 0;
        x.S = 131 + 37 * (i % 7) + P;  // odd, uneven shards
        x.H = P == 3 ? 6 : 8;
        x.HKV = variant == 1 ? (P == 3 ? 3 : 2) : (P == 3 ? 6 : 8);  // GQA in one of three
        if (std::string(strategy) == "ulysses" && P == 8 && variant == 1) x.HKV = 4;  // replicate
        x.causal = variant != 2 || (i % 2 == 0);
        x.window = variant == 2 ? 29 + i : 0;
        x.dtype = i % 4 == 3 ? "bf16" : "fp32";
        if (variant == 1 || i % 5 == 0) {  // packed documents
          const int64_t a = x.S / 3, b = x.S / 5;
          x.docs = std::to_string(a) + "," + std::to_string(b) + "," + std::to_string(x.S - a - b);
        }
        c.push_back(x);
      }
    }
  }
  // The double ring: one inner ring (O = 1), rings of one (I = 1), and both axes > 1.
  const int ring2d[][2] = {{2, 2}, {4, 1}, {4, 2}, {6, 3}, {8, 2}, {8, 4}};
  for (const auto& [P, I] : ring2d) {
    Config x;
    x.strategy = "ring2d";
    x.layout = layouts[i % 3];
    x.P = P;
    x.U = 0;
    x.I = I;
    x.S = 141 + 29 * (i % 5) + P;
    x.H = 4;
    x.HKV = i % 2 ? 2 : 4;
    x.causal = i % 3 != 2;
    x.window = i % 3 == 1 ? 37 : 0;
    x.dtype = i % 2 ? "bf16" : "fp32";
    if (i % 2 == 0) x.docs = std::to_string(x.S / 2) + "," + std::to_string(x.S - x.S / 2);
    c.push_back(x);
    ++i;
  }
  return c;
}

nlohmann::json run_loom_attn(const Config& c, const std::string& json_path) {
  std::ostringstream cmd;
  cmd << LOOM_BIN << " attn --quiet --backward --iters 1 --warmup 0 --threads 1 --head-dim 16"
      << " --ranks " << c.P << " --strategy " << c.strategy << " --layout " << c.layout << " --seq "
      << c.S << " --heads " << c.H << " --kv-heads " << c.HKV << " --dtype " << c.dtype
      << (c.causal ? "" : " --no-causal") << " --window " << c.window;
  if (c.U) cmd << " --ulysses " << c.U;
  if (c.I) cmd << " --inner " << c.I;
  if (!c.docs.empty()) cmd << " --docs " << c.docs;
  cmd << " --json " << json_path << " > /dev/null";
  const int rc = std::system(cmd.str().c_str());
  EXPECT_EQ(rc, 0) << cmd.str();
  std::ifstream in(json_path);
  return nlohmann::json::parse(in);
}

std::vector<int64_t> split_docs(const std::string& s) {
  return s.empty() ? std::vector<int64_t>{} : parse_doc_lengths(s);
}

TEST(PlanExact, TilesAndBytesEqualLoomAttn) {
  const std::string dir =
      std::filesystem::temp_directory_path() / ("loom_plan_exact_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const Profile prof = shipped("h100_sxm.json");  // times do not matter here
  const auto list = configs();
  ASSERT_GE(list.size(), 30u);
  int n = 0;
  for (const Config& c : list) {
    SCOPED_TRACE(c.strategy + " " + c.layout + " P=" + std::to_string(c.P) +
                 " S=" + std::to_string(c.S) + " H=" + std::to_string(c.H) +
                 " HKV=" + std::to_string(c.HKV) + " window=" + std::to_string(c.window) +
                 " docs=" + c.docs + " " + c.dtype + (c.causal ? " causal" : " full"));
    const nlohmann::json j = run_loom_attn(c, dir + "/" + std::to_string(n++) + ".json");
    AttnCase a;
    a.strategy = c.strategy;
    a.layout = parse_layout(c.layout);
    a.seq = c.S;
    a.doc_lengths = split_docs(c.docs);
    a.ranks = c.P;
    a.ulysses = c.U ? c.U : 1;
    a.inner = c.I ? c.I : 1;
    a.heads = c.H;
    a.kv_heads = c.HKV;
    a.head_dim = 16;
    a.mask.causal = c.causal;
    a.mask.window = c.window;
    a.dtype_bytes = c.dtype == "bf16" ? 2 : 4;
    const AttnSim sim = simulate_attention(a, prof);
    ASSERT_EQ(j["ranks"].size(), static_cast<size_t>(c.P));
    for (int r = 0; r < c.P; ++r) {
      const auto& jr = j["ranks"][r];
      const RankSim& sr = sim.ranks[r];
      EXPECT_EQ(jr["tiles"].get<int64_t>(), sr.fwd_tiles + sr.bwd_tiles) << "rank " << r;
      EXPECT_EQ(jr["forward_tiles"].get<int64_t>(), sr.fwd_tiles) << "rank " << r;
      EXPECT_EQ(jr["step_tiles"].get<std::vector<int64_t>>(), sr.step_tiles) << "rank " << r;
      EXPECT_EQ(jr["bytes_sent"].get<int64_t>(), sr.bytes_sent) << "rank " << r;
      EXPECT_EQ(jr["bytes_recv"].get<int64_t>(), sr.bytes_recv) << "rank " << r;
      EXPECT_EQ(jr["peak_buffer_bytes"].get<int64_t>(), sr.peak_buffer_bytes) << "rank " << r;
      EXPECT_GT(sr.fwd_tiles, 0);
    }
  }
  std::filesystem::remove_all(dir);
}

// Time is charged per work tile (Profile::work_tile, the CPU kernels' 128 x 128 tiles of whole
// 64 x 64 config tiles), at the rate of the work tile's own classification. One causal chunk
// of 256 rows: config tiles 6 full + 4 partial per head; work tiles 1 full + 2 partial, each
// the area of 4 config tiles. Call overheads are off (0 s) and copies nearly free (the largest
// memory bandwidth a profile may give, 1e15 bytes/s: the 1 MB of packs and zero-fills cost about
// 1e-9 s, against the 1e-3 s a work tile changes).
TEST(PlanTime, KernelsAreChargedPerWorkTile) {
  Profile p = valid_profile();
  p.kind = "cpu";
  p.mem_bandwidth = 1e15;
  p.call_overhead = 0;
  p.block_q = p.block_k = 64;
  const double fwd_full = 1e-3, fwd_partial = 3e-3, bwd_full = 2e-3, bwd_partial = 5e-3;
  const double tiles[4] = {fwd_full, fwd_partial, bwd_full, bwd_partial};
  std::copy(tiles, tiles + 4, p.tile_s_fp32);
  AttnCase a;
  a.strategy = "ring";
  a.layout = Layout::contiguous;
  a.seq = 256;
  a.ranks = 1;
  a.heads = a.kv_heads = 2;
  a.head_dim = 64;
  a.mask.causal = true;
  for (int64_t work : {int64_t{0}, int64_t{128}}) {
    p.work_tile = work;
    const AttnSim sim = simulate_attention(a, p);
    const double full = work ? 4 * 1 : 6, partial = work ? 4 * 2 : 4;  // in config-tile areas
    EXPECT_NEAR(sim.forward_s, 2 * (full * fwd_full + partial * fwd_partial), 1e-8) << work;
    EXPECT_NEAR(sim.backward_s, 2 * (full * bwd_full + partial * bwd_partial), 1e-8) << work;
    EXPECT_EQ(sim.ranks[0].fwd_tiles, 2 * 10);  // the counts stay the config tiles'
  }
}

// Each kernel call packs its own key chunk (attend_blocks in src/cp/ring_pass.cc calls the
// kernel once per pair of segments), not the whole KV block: 128 documents of 256 tokens on one
// rank were charged 384 packs of all 32K rows, 1147 ms forward predicted against 120 ms measured.
// Here the bytes charged at the memory bandwidth, f(B1) - f(B2) = bytes (1 / B1 - 1 / B2), are
// the hand-counted ones: the softmax state and the finish (forward), delta, dq's and dk, dv's
// zeroing (backward), and the packs of every call's key chunk, k and v forward, k, v and k^T
// backward. Zigzag on one rank cuts a document of L tokens into c0 = ceil(L / 2) and c1 rows;
// the cp layer calls (0, 0), (1, 0), (1, 1): c0 + c0 + c1 key rows.
TEST(PlanTime, EachCallPacksItsOwnKeyChunk) {
  Profile p = valid_profile();
  p.kind = "cpu";
  p.call_overhead = 0;
  p.block_q = p.block_k = 64;
  const double tiles[4] = {1e-6, 2e-6, 3e-6, 4e-6};
  std::copy(tiles, tiles + 4, p.tile_s_fp32);
  AttnCase a;
  a.strategy = "ring";
  a.layout = Layout::zigzag;
  a.seq = 1000;
  a.doc_lengths = {101, 200, 300, 399};
  a.ranks = 1;
  a.heads = 4;
  a.kv_heads = 2;
  a.head_dim = 16;
  a.mask.causal = true;
  const double S = 1000, H = 4, Hkv = 2, D = 16, T = 4;
  double kv_rows = 0;
  for (int64_t L : a.doc_lengths) kv_rows += 2 * ((L + 1) / 2) + L / 2;
  EXPECT_EQ(kv_rows, 1000 + 51 + 100 + 150 + 200);
  const double B1 = 1e9, B2 = 2e9;
  p.mem_bandwidth = B1;
  const AttnSim s1 = simulate_attention(a, p);
  p.mem_bandwidth = B2;
  const AttnSim s2 = simulate_attention(a, p);
  const double per = 1 / B1 - 1 / B2;
  const double fwd_bytes = S * H * D * 4 + S * H * D * (4 + T) + 2 * kv_rows * Hkv * D * T;
  const double bwd_bytes =
      S * H * D * (2 * T + 4) + 2 * S * Hkv * D * 4 + 3 * kv_rows * Hkv * D * T;
  EXPECT_NEAR((s1.forward_s - s2.forward_s) / per, fwd_bytes, 1e-6 * fwd_bytes);
  EXPECT_NEAR((s1.backward_s - s2.backward_s) / per, bwd_bytes, 1e-6 * bwd_bytes);
  // Many short documents cost about what one document does (fewer tiles, a few more calls):
  // 128 x 256 tokens against 32768 in one, contiguous on one rank.
  a.layout = Layout::contiguous;
  a.seq = 32768;
  a.doc_lengths.assign(128, 256);
  p.mem_bandwidth = 1e10;
  const AttnSim docs = simulate_attention(a, p);
  a.doc_lengths.clear();
  const AttnSim one = simulate_attention(a, p);
  EXPECT_LT(docs.forward_s, one.forward_s);
  EXPECT_LT(docs.backward_s, one.backward_s);
}

// The work of q rows against k rows, chunk pair by chunk pair in order: the cp layer's skip of
// pairs the mask separates (segment_pair_empty in src/cp/ring.cc), the block tiles, and the
// kernels' work tiles (work_tile_side) weighted by their area in block tiles.
PairWork reference_work(const std::vector<Chunk>& qs, const std::vector<Chunk>& ks,
                        const PairKey& key) {
  Mask m;
  m.causal = key.causal;
  m.window = key.window;
  PairWork w;
  for (const Chunk& q : qs)
    for (const Chunk& k : ks) {
      if (q.doc != k.doc || (m.causal && k.first > q.last())) continue;
      if (m.window > 0 && (k.first - q.last() >= m.window || q.first - k.last() >= m.window))
        continue;
      ++w.calls;
      w.kv_rows += static_cast<double>(k.count);
      const TileCount tc = count_tiles(q, k, m, key.block_q, key.block_k);
      w.tiles += tc;
      const int64_t wq = work_tile_side(key.block_q, q.count, key.work_tile),
                    wk = work_tile_side(key.block_k, k.count, key.work_tile);
      const TileCount wt = count_tiles(q, k, m, wq, wk);
      const double area = static_cast<double>((wq / key.block_q) * (wk / key.block_k));
      w.full += area * static_cast<double>(wt.full);
      w.partial += area * static_cast<double>(wt.partial);
    }
  return w;
}

void expect_work_eq(const PairWork& got, const PairWork& want, const std::string& what) {
  EXPECT_EQ(got.tiles.full, want.tiles.full) << what;
  EXPECT_EQ(got.tiles.partial, want.tiles.partial) << what;
  EXPECT_EQ(got.calls, want.calls) << what;
  EXPECT_EQ(got.full, want.full) << what;  // exact: integers below 2^53
  EXPECT_EQ(got.partial, want.partial) << what;
  EXPECT_EQ(got.kv_rows, want.kv_rows) << what;
}

std::vector<Chunk> concat(const std::vector<std::vector<Chunk>>& shards, int first, int count) {
  std::vector<Chunk> out;
  for (int r = first; r < first + count; ++r)
    out.insert(out.end(), shards[r].begin(), shards[r].end());
  return out;
}

TEST(PlanPairs, TablesEqualTheChunkByChunkWork) {
  std::mt19937_64 rng(21);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const Profile prof = valid_profile();
  int groups = 0;
  for (int trial = 0; trial < 120; ++trial) {
    PairKey key;
    key.layout = static_cast<Layout>(pick(0, 2));
    key.ranks = static_cast<int>(pick(1, 12));
    key.seq = pick(1, 3000);
    if (pick(0, 2) == 0 && key.seq >= 3) {
      const int64_t a = pick(1, key.seq - 2), b = pick(1, key.seq - a - 1);
      key.doc_lengths = {a, b, key.seq - a - b};
    }
    key.causal = pick(0, 3) != 0;
    key.window = pick(0, 2) == 0 ? pick(1, 400) : 0;
    key.block_q = pick(0, 1) ? 64 : pick(8, 40);
    key.block_k = pick(0, 1) ? 64 : pick(8, 40);
    key.work_tile = std::vector<int64_t>{0, 0, 64, 100, 128}[pick(0, 4)];
    const auto shards = shard_chunks(key.layout, key.seq, key.ranks, key.doc_lengths);
    const PairTable table(key, shards);
    ASSERT_TRUE(table.exact_sums());
    const std::string what = "trial " + std::to_string(trial);
    for (int a = 0; a < key.ranks; ++a)
      for (int b = 0; b < key.ranks; ++b)
        expect_work_eq(table.at(a, b), reference_work(shards[a], shards[b], key),
                       what + " pair " + std::to_string(a) + "," + std::to_string(b));
    // Aligned groups (hybrid's and Ulysses'), summed from the table.
    AttnCase c;
    c.layout = key.layout;
    c.seq = key.seq;
    c.ranks = key.ranks;
    c.doc_lengths = key.doc_lengths;
    c.mask.causal = key.causal;
    c.mask.window = key.window;
    c.block_q = key.block_q;
    c.block_k = key.block_k;
    Profile p = prof;
    p.work_tile = key.work_tile;
    AttnSim out;
    const SimContext x(c, p, out);
    for (int g = 2; g <= key.ranks; ++g) {
      if (key.ranks % g != 0) continue;
      for (int i = 0; i < key.ranks; i += g)
        for (int j = 0; j < key.ranks; j += g) {
          expect_work_eq(x.pair_work(x.block(i, g), x.block(j, g)),
                         reference_work(concat(shards, i, g), concat(shards, j, g), key),
                         what + " groups of " + std::to_string(g));
          ++groups;
        }
    }
  }
  EXPECT_GT(groups, 200);
  // Past 2^53 a sum depends on its order: groups are counted chunk by chunk again. Full
  // attention over 2^27 tokens in 1-token tiles: (2^27)^2 tiles in all.
  PairKey big;
  big.layout = Layout::zigzag;
  big.ranks = 4;
  big.seq = int64_t{1} << 27;
  big.causal = false;
  big.block_q = big.block_k = 1;
  const auto shards = shard_chunks(big.layout, big.seq, big.ranks, {});
  EXPECT_FALSE(PairTable(big, shards).exact_sums());
  AttnCase c;
  c.seq = big.seq;
  c.ranks = big.ranks;
  c.mask.causal = false;
  c.block_q = c.block_k = 1;
  AttnSim out;
  const SimContext x(c, prof, out);
  expect_work_eq(x.pair_work(x.block(0, 2), x.block(2, 2)),
                 reference_work(concat(shards, 0, 2), concat(shards, 2, 2), big), "2^27 tokens");
}

void expect_sim_eq(const AttnSim& got, const AttnSim& want, bool step_tiles,
                   const std::string& what) {
  EXPECT_EQ(got.forward_s, want.forward_s) << what;
  EXPECT_EQ(got.backward_s, want.backward_s) << what;
  ASSERT_EQ(got.ranks.size(), want.ranks.size()) << what;
  for (size_t r = 0; r < got.ranks.size(); ++r) {
    const RankSim &g = got.ranks[r], &w = want.ranks[r];
    const std::string at = what + " rank " + std::to_string(r);
    EXPECT_EQ(g.fwd_tiles, w.fwd_tiles) << at;
    EXPECT_EQ(g.bwd_tiles, w.bwd_tiles) << at;
    EXPECT_EQ(g.full_tiles, w.full_tiles) << at;
    EXPECT_EQ(g.partial_tiles, w.partial_tiles) << at;
    EXPECT_EQ(g.step_tiles, step_tiles ? w.step_tiles : std::vector<int64_t>{}) << at;
    EXPECT_EQ(g.bytes_sent, w.bytes_sent) << at;
    EXPECT_EQ(g.bytes_recv, w.bytes_recv) << at;
    EXPECT_EQ(g.peak_buffer_bytes, w.peak_buffer_bytes) << at;
    EXPECT_EQ(g.gathered_bytes, w.gathered_bytes) << at;
    EXPECT_EQ(g.compute_s, w.compute_s) << at;
    EXPECT_EQ(g.comm_s, w.comm_s) << at;
    EXPECT_EQ(g.idle_s, w.idle_s) << at;
    EXPECT_EQ(g.comm_by_kind, w.comm_by_kind) << at;
    EXPECT_EQ(g.end_fwd_s, w.end_fwd_s) << at;
    EXPECT_EQ(g.end_s, w.end_s) << at;
  }
}

// The planner shares one PairCache over its whole search. Cases differing in exactly one input
// of the pair work (layout, length, ranks, documents, causality, window, tile sides, the
// profile's work tile) must each get their own table: a key missing one would hand a case
// another's table, and its tiles and times would differ from the case simulated alone.
TEST(PlanPairs, SharedTablesEqualOwnTables) {
  AttnCase base;
  base.strategy = "hybrid";
  base.ulysses = 2;
  base.layout = Layout::zigzag;
  base.seq = 1000;
  base.ranks = 4;
  base.heads = 4;
  base.kv_heads = 2;
  base.head_dim = 16;
  Profile prof = valid_profile();
  prof.devices_per_node = 2;
  std::vector<std::pair<AttnCase, Profile>> cases;
  auto add = [&](auto change) {
    AttnCase c = base;
    Profile p = prof;
    change(c, p);
    cases.emplace_back(c, p);
  };
  add([](AttnCase&, Profile&) {});
  add([](AttnCase& c, Profile&) { c.layout = Layout::contiguous; });
  add([](AttnCase& c, Profile&) { c.layout = Layout::stripe; });
  add([](AttnCase& c, Profile&) { c.seq = 1001; });
  add([](AttnCase& c, Profile&) { c.ranks = 8; });
  add([](AttnCase& c, Profile&) { c.doc_lengths = {300, 700}; });
  add([](AttnCase& c, Profile&) { c.mask.causal = false; });
  add([](AttnCase& c, Profile&) { c.mask.window = 90; });
  add([](AttnCase& c, Profile&) { c.block_q = 32; });
  add([](AttnCase& c, Profile&) { c.block_k = 32; });
  add([](AttnCase&, Profile& p) { p.work_tile = 128; });
  add([](AttnCase& c, Profile&) { c.strategy = "ring", c.ulysses = 1; });
  add([](AttnCase& c, Profile&) { c.strategy = "ring2d", c.ulysses = 1, c.inner = 2; });
  add([](AttnCase& c, Profile&) { c.strategy = "allgather", c.ulysses = 1; });
  add([](AttnCase& c, Profile&) { c.strategy = "ulysses", c.ulysses = 1; });
  std::vector<AttnSim> own;
  for (const auto& [c, p] : cases) own.push_back(simulate_attention(c, p));
  PairCache cache;
  for (int round = 0; round < 2; ++round)  // in order, then backwards
    for (size_t n = 0; n < cases.size(); ++n) {
      const size_t i = round == 0 ? n : cases.size() - 1 - n;
      const bool steps = round == 0;
      const AttnSim shared =
          simulate_attention(cases[i].first, cases[i].second, SimOptions{&cache, steps});
      expect_sim_eq(shared, own[i], steps, "case " + std::to_string(i));
    }
}

TEST(PlanProfiles, ShippedProfilesParseAndCiteEveryFigure) {
  int count = 0;
  for (const auto& e : std::filesystem::directory_iterator(LOOM_PROFILES)) {
    if (e.path().extension() != ".json") continue;
    ++count;
    const Profile p = load_profile(e.path().string());
    SCOPED_TRACE(e.path().string());
    std::ifstream in(e.path());
    const nlohmann::json j = nlohmann::json::parse(in);
    // Every number in the file, by its dotted path, has a citation.
    std::vector<std::string> missing;
    std::function<void(const nlohmann::json&, const std::string&)> walk =
        [&](const nlohmann::json& x, const std::string& path) {
          if (x.is_object()) {
            for (auto it = x.begin(); it != x.end(); ++it)
              if (it.key() != "sources" && it.key() != "notes")
                walk(it.value(), path.empty() ? it.key() : path + "." + it.key());
          } else if (x.is_number() || x.is_boolean() || x.is_array()) {
            if (!p.sources.count(path)) missing.push_back(path);
          }
        };
    walk(j, "");
    EXPECT_TRUE(missing.empty()) << "figures without a source: " << [&] {
      std::string s;
      for (auto& m : missing) s += m + " ";
      return s;
    }();
    for (const auto& [k, v] : p.sources) EXPECT_GE(v.size(), 10u) << k;
    EXPECT_GT(p.flops_bf16, 0);
    EXPECT_GT(p.intra.bandwidth, 0);
    // Round trip.
    const Profile q = parse_profile(profile_json(p), "round trip");
    EXPECT_EQ(q.flops_bf16, p.flops_bf16);
    EXPECT_EQ(q.inter.latency, p.inter.latency);
    EXPECT_EQ(q.sources, p.sources);
  }
  EXPECT_GE(count, 4);
}

TEST(PlanProfiles, BadProfilesAreRefusedByName) {
  EXPECT_THROW(parse_profile("{", "x"), IoError);
  EXPECT_THROW(parse_profile("{\"device\": {\"flops_bf16x\": 1}}", "x"), IoError);
  EXPECT_THROW(parse_profile("{\"device\": {\"flops_bf16\": -1}}", "x"), IoError);
  EXPECT_THROW(parse_profile("{\"kind\": \"tpu\"}", "x"), IoError);
  try {
    parse_profile("{\"links\": {\"intra\": {\"bandwidth\": \"fast\"}}}", "f.json");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("links.intra.bandwidth"), std::string::npos) << e.what();
  }
}

// Every figure of a profile is checked at load against its range, the error naming the field
// and the file. Before, a zero inter-node bandwidth made inter-node traffic free (a 16-rank
// simulation predicted 0.247 ms instead of 0.801 ms), a missing "links" gave every candidate an
// infinite step, memory 0 meant "no limit", and block_q 1e18 or 1.5 was taken as a tile side.
TEST(PlanProfiles, EveryFigureIsCheckedAtLoad) {
  std::ifstream in(std::string(LOOM_PROFILES) + "/h100_sxm.json");
  const nlohmann::json good = nlohmann::json::parse(in);
  const auto refused = [&](const nlohmann::json& j, const std::string& needle) {
    try {
      parse_profile(j.dump(), "bad.json");
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("bad.json: "), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
      return;
    }
    ADD_FAILURE() << "accepted: " << needle;
  };
  const std::vector<std::tuple<std::string, nlohmann::json, std::string>> cases = {
      {"/links/inter/bandwidth", 0, "field 'links.inter.bandwidth' must be a number in [1000"},
      // Far below any machine: 1e-300 passed "> 0" and the simulator's times became inf and NaN.
      {"/links/inter/bandwidth", 1e-300, "field 'links.inter.bandwidth' must be"},
      {"/device/mem_bandwidth", 1e-300, "field 'device.mem_bandwidth' must be"},
      {"/device/flops_bf16", 1e-300, "field 'device.flops_bf16' must be a number in [1e+06"},
      {"/device/flops_fp32", 999999, "field 'device.flops_fp32' must be"},
      {"/links/intra/bandwidth", 0, "field 'links.intra.bandwidth' must be"},
      {"/links/intra/bandwidth", 1e300, "field 'links.intra.bandwidth' must be"},
      {"/links/inter/latency_s", -1e-6, "field 'links.inter.latency_s' must be"},
      {"/device/mem_bandwidth", 0, "field 'device.mem_bandwidth' must be"},
      {"/device/memory_bytes", 0, "field 'device.memory_bytes' must be"},
      {"/device/flops_bf16", 0, "field 'device.flops_bf16' must be"},
      {"/device/attn_fwd_eff", 0, "field 'device.attn_fwd_eff' must be a number in [0.001, 1]"},
      // An efficiency of 1e-300 passed "> 0": --simulate printed a 300-digit forward time with
      // "backward 0.000 ms", or "inf ms" (1.5e307 s is finite, its ms are not), and a search
      // ranked a winner with a 7e297 s step and 0 tokens/s. A thousandth is the least.
      {"/device/attn_fwd_eff", 1e-300, "field 'device.attn_fwd_eff' must be a number in [0.001"},
      {"/device/attn_bwd_eff", 1e-300, "field 'device.attn_bwd_eff' must be a number in [0.001"},
      {"/device/gemm_eff", 9.99e-4, "field 'device.gemm_eff' must be a number in [0.001"},
      {"/device/partial_tile_cost", 1e-300,
       "field 'device.partial_tile_cost' must be a number in [0.001"},
      {"/collectives/a2a_eff", 1e-300, "field 'collectives.a2a_eff' must be a number in [0.001"},
      {"/collectives/allgather_eff", 1e-300, "field 'collectives.allgather_eff' must be"},
      {"/collectives/allreduce_eff", 1e-300, "field 'collectives.allreduce_eff' must be"},
      {"/device/attn_bwd_eff", 1.5, "field 'device.attn_bwd_eff' must be"},
      {"/device/gemm_eff", -0.1, "field 'device.gemm_eff' must be"},
      {"/device/partial_tile_cost", 0, "field 'device.partial_tile_cost' must be"},
      {"/device/call_overhead_s", -1, "field 'device.call_overhead_s' must be"},
      {"/device/block_q", 1e18,
       "field 'device.block_q' must be an integer in [1, 4096], got 1e+18"},
      {"/device/block_q", 1.5, "field 'device.block_q' must be an integer in [1, 4096], got 1.5"},
      {"/device/block_k", 0, "field 'device.block_k' must be an integer"},
      {"/device/work_tile", 64.5, "field 'device.work_tile' must be an integer"},
      {"/device/calib_head_dim", 512, "field 'device.calib_head_dim' must be an integer"},
      {"/device/threads", 0, "field 'device.threads' must be an integer"},
      {"/device/alone_speedup", 0.5, "field 'device.alone_speedup' must be"},
      {"/device/tile_s", {{"fp32", {1e-6, -1, 1e-6, 1e-6}}}, "field 'device.tile_s.fp32[1]'"},
      {"/devices_per_node", 2.5, "field 'devices_per_node' must be an integer"},
      {"/collectives/a2a_eff", 0, "field 'collectives.a2a_eff' must be"},
      {"/collectives/allreduce_eff", 1.2, "field 'collectives.allreduce_eff' must be"},
      // the value as given, not rounded to six digits ("got 1" read as in range)
      {"/collectives/a2a_eff", 1.0000001,
       "field 'collectives.a2a_eff' must be a number in [0.001, 1] (a fraction of the link), got "
       "1.0000001"},
      {"/links/inter/bandwidth", true, "field 'links.inter.bandwidth' must be a number"},
  };
  for (const auto& [pointer, value, needle] : cases) {
    nlohmann::json j = good;
    j[nlohmann::json::json_pointer(pointer)] = value;
    refused(j, needle);
  }
  // Required figures: missing is refused by name (links, memory and rates have no default).
  for (const char* pointer : {"/links", "/links/inter/latency_s", "/device/memory_bytes",
                              "/device/flops_fp32", "/device/mem_bandwidth"}) {
    nlohmann::json j = good;
    const nlohmann::json::json_pointer ptr(pointer);
    j[ptr.parent_pointer()].erase(ptr.back());
    std::string field = std::string(pointer).substr(1);
    std::replace(field.begin(), field.end(), '/', '.');
    refused(j, "missing field '" +
                   (field == "links" ? std::string("links.intra.bandwidth") : field) + "'");
  }
  EXPECT_NO_THROW(parse_profile(good.dump(), "good.json"));
}

// At every lower bound of the ranges (1 MFLOP/s, efficiencies of a thousandth, 1 kB/s links, 1 s
// latencies) a large problem's times are finite as printed (ms, us in the search's table), and the
// search ranks positive, finite tokens/s: the bounds exist for that (docs/planning.md).
TEST(PlanProfiles, LowestFiguresGiveFinitePrintableTimes) {
  Profile p = valid_profile();
  p.flops_bf16 = p.flops_fp32 = 1e6;
  p.attn_fwd_eff = p.attn_bwd_eff = p.gemm_eff = p.partial_tile_cost = 1e-3;
  p.a2a_eff = p.allgather_eff = p.allreduce_eff = 1e-3;
  p.mem_bandwidth = 1e3;
  p.intra = p.inter = Link{1e3, 1.0};
  p.memory_bytes = 1e15;
  p.devices_per_node = 1;
  for (const char* strategy : {"ring", "ulysses", "allgather"}) {
    AttnCase a;
    a.strategy = strategy;
    a.seq = int64_t{1} << 28;
    a.ranks = 4;
    a.heads = a.kv_heads = 65536;
    a.head_dim = kMaxHeadDim;
    const AttnSim s = simulate_attention(a, p);
    EXPECT_TRUE(std::isfinite(s.forward_s * 1e3) && s.forward_s > 0) << strategy;
    EXPECT_TRUE(std::isfinite(s.backward_s * 1e3) && s.backward_s > 0) << strategy;
  }
  PlanRequest req;
  req.model = ModelShape{80, 8192, 64, 8, 28672, 128256};  // Llama-3-70B
  req.seq = 1 << 20;
  req.devices = 16;
  req.strategies = {"ring"};
  req.all_layouts = false;
  const PlanResult r = plan(req, p);
  ASSERT_FALSE(r.ranked.empty());
  for (const Candidate& c : r.ranked) {
    EXPECT_TRUE(std::isfinite(c.step_s * 1e6) && c.step_s > 0) << c.name();
    EXPECT_TRUE(std::isfinite(c.tokens_per_s) && c.tokens_per_s > 0) << c.name();
  }
}

// A profile built in code meets the same ranges at the entries (plan, simulate_attention,
// predict_train_step): a zero bandwidth was free in the simulator and a division by zero in the
// planner (inf and NaN in the ranking, exit 0).
TEST(PlanProfiles, EntriesCheckTheirProfile) {
  Profile p = shipped("h100_sxm.json");
  p.inter.bandwidth = 0;
  AttnCase a;
  a.seq = 8192;
  a.ranks = 16;
  a.heads = 32;
  a.kv_heads = 8;
  a.head_dim = 128;
  a.dtype_bytes = 2;
  try {
    simulate_attention(a, p);
    ADD_FAILURE() << "simulated with a zero inter-node bandwidth";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("field 'links.inter.bandwidth'"), std::string::npos)
        << e.what();
  }
  PlanRequest req;
  req.seq = 8192;
  req.devices = 16;
  EXPECT_THROW(plan(req, p), InvalidArgument);
  p = shipped("h100_sxm.json");
  p.memory_bytes = 0;  // meant "no limit" (a winner at 90.7 GB per 80 GB device)
  EXPECT_THROW(plan(req, p), InvalidArgument);
  p = shipped("h100_sxm.json");
  p.attn_fwd_eff = 0;  // every candidate was rejected, explained nowhere
  EXPECT_THROW(plan(req, p), InvalidArgument);
  // The same problem with the real profile: inter-node transfers cost time.
  const AttnSim real = simulate_attention(a, shipped("h100_sxm.json"));
  EXPECT_GT(real.forward_s, 0.5e-3);
}

// The simulator refuses sizes whose counters would overflow int64 (--head-dim 2^63 - 1 reported
// -16777216 bytes sent) and a head dim past the kernels' 256; the largest accepted problem keeps
// every counter positive.
TEST(PlanSim, RefusesSizesThatOverflowTheCounters) {
  const Profile p = shipped("h100_sxm.json");
  AttnCase a;
  a.seq = 131072;
  a.ranks = 2;
  a.heads = a.kv_heads = 8;
  a.head_dim = INT64_MAX;
  EXPECT_THROW(simulate_attention(a, p), InvalidArgument);
  a.head_dim = kMaxHeadDim + 1;
  EXPECT_THROW(simulate_attention(a, p), InvalidArgument);
  a.head_dim = 64;
  a.seq = 100000000;
  a.heads = a.kv_heads = 100000000;  // tiles and bytes past 2^63
  EXPECT_THROW(simulate_attention(a, p), InvalidArgument);
  a.heads = a.kv_heads = 65536;
  a.seq = int64_t{1} << 30;  // 2^70 tiles
  EXPECT_THROW(simulate_attention(a, p), InvalidArgument);
  // At the limits: S = 2^28, 65536 heads, D = 256.
  a.seq = int64_t{1} << 28;
  a.head_dim = kMaxHeadDim;
  for (const char* strategy : {"ring", "ulysses", "allgather"}) {
    a.strategy = strategy;
    a.ranks = 4;
    const AttnSim s = simulate_attention(a, p);
    for (const RankSim& r : s.ranks) {
      EXPECT_GT(r.bytes_sent, 0) << strategy;
      EXPECT_GT(r.bytes_recv, 0) << strategy;
      EXPECT_GT(r.fwd_tiles, 0) << strategy;
      EXPECT_GT(r.bwd_tiles, 0) << strategy;
      EXPECT_GT(r.peak_buffer_bytes + r.gathered_bytes, 0) << strategy;
    }
    EXPECT_TRUE(std::isfinite(s.forward_s) && s.forward_s > 0) << strategy;
  }
}

// The placement's cp_stride is checked with the case: a negative stride indexed the node counters
// out of bounds (SIGSEGV in busy_scales), and -1000 or 2^30 threw std::length_error sizing them
// by the last rank's node. A stride far past the node size is accepted and places every rank on
// a node of its own, as a stride of one node does.
TEST(PlanSim, RefusesACpStrideOutsideTheWorld) {
  Profile shared = valid_profile();  // ranks on one node share it: busy_scales counts them
  shared.alone_speedup = 2;
  shared.devices_per_node = 8;
  for (const Profile& p : {shipped("h100_sxm.json"), shared}) {
    SCOPED_TRACE(p.name);
    AttnCase a;
    a.seq = 16384;
    a.ranks = 16;
    a.heads = a.kv_heads = 8;
    for (const int stride : {0, -1, -1000, 1 << 30, std::numeric_limits<int>::max()}) {
      a.cp_stride = stride;
      try {
        simulate_attention(a, p);
        ADD_FAILURE() << "cp_stride " << stride << " accepted";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("cp_stride must be in [1, "), std::string::npos)
            << e.what();
      }
    }
    a.cp_stride = p.devices_per_node;
    const AttnSim one_node_apart = simulate_attention(a, p);
    a.cp_stride = 1 << 20;
    const AttnSim far_apart = simulate_attention(a, p);
    EXPECT_EQ(far_apart.forward_s, one_node_apart.forward_s);
    EXPECT_EQ(far_apart.backward_s, one_node_apart.backward_s);
  }
}

// A Layout outside the enumeration (a cast integer) is refused as ShardPlan::make refuses it:
// shard_chunks gave every rank no chunks and simulate_attention simulated zero work.
TEST(PlanSim, RefusesALayoutOutsideTheEnumeration) {
  const Layout bad = static_cast<Layout>(7);
  const auto expect_refused = [](const std::function<void()>& call, const char* what) {
    try {
      call();
      ADD_FAILURE() << what << ": accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "layout must be contiguous, zigzag or stripe, got the value 7"),
                std::string::npos)
          << e.what();
    }
  };
  expect_refused([&] { shard_chunks(bad, 10, 2, {}); }, "shard_chunks");
  AttnCase a;
  a.seq = 1024;
  a.ranks = 4;
  a.heads = 8;
  a.kv_heads = 2;
  a.layout = bad;
  expect_refused([&] { simulate_attention(a, valid_profile()); }, "simulate_attention");
  a.ranks = 1;
  expect_refused([&] { simulate_attention(a, valid_profile()); }, "simulate_attention, one rank");
}

// What would make every candidate of the search invalid is refused up front, naming it (before:
// no candidate ranked, nothing on stderr, "raise --devices or --memory-limit"); S = 1 is planned
// (it was "0 candidates ranked, 0 rejected").
TEST(PlanSearch, RefusesUpFrontWhatNoCandidateCouldRun) {
  const Profile p = shipped("h100_sxm.json");
  PlanRequest req;
  req.seq = 8192;
  req.devices = 8;
  const auto refused = [&](const PlanRequest& r, const std::string& needle) {
    try {
      plan(r, p);
      ADD_FAILURE() << "planned: " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  PlanRequest r = req;
  r.window = -1;
  refused(r, "--window must be >= 0");
  r = req;
  r.doc_lengths = {4096};
  refused(r, "document lengths sum to 4096 but the sequence has 8192 tokens");
  r = req;
  r.model = ModelShape{2, 4096, 8, 8, 1024, 256};  // head dim 512
  refused(r, "head dim (dim 4096 / 8 heads = 512) must be at most 256");
  // An odd head dim: loom train's rotary embeddings refuse it (model::validate), so a training
  // plan does too (head dim 15 was ranked); prefill plans it.
  r = req;
  r.model = ModelShape{2, 30, 2, 2, 120, 256};
  refused(r, "head dim (dim 30 / 2 heads = 15) must be even to plan training");
  r.train = false;
  EXPECT_FALSE(plan(r, p).ranked.empty());
  r = req;
  r.memory_limit = -1;
  refused(r, "memory limit");
  // One token: loom train refuses a sequence under 2 (model::validate), so a training plan does
  // too (it ranked dp and tp meshes); prefill plans it.
  r = req;
  r.seq = 1;
  refused(r, "--seq must be >= 2 to plan training (loom train's shortest sequence), got 1");
  r.train = false;
  const PlanResult one = plan(r, p);
  ASSERT_FALSE(one.ranked.empty());
  for (const Candidate& c : one.ranked) {
    EXPECT_EQ(c.ring * c.ulysses, 1) << c.name();
    EXPECT_TRUE(std::isfinite(c.step_s) && c.step_s > 0) << c.name();
    EXPECT_TRUE(std::isfinite(c.tokens_per_s) && c.tokens_per_s > 0) << c.name();
  }
}

// The gradient all-reduce runs over the dp x cp ranks that hold the same tp piece (each cp rank's
// gradients are those of its own tokens, summed as loom train sums them over its dp_cp group),
// and the optimizer state is sharded over the same ranks. Before, the search charged it over dp
// alone: every dp1 plan with cp > 1 had no all-reduce, and `--model 4,4096,32,8,0,32000 --seq
// 8192 --devices 16` ranked dp1 tp1 r16 i8 ring2d first at 7.9 ms per step (it needs >= 110 ms
// for its all-reduce; dp16 wins).
TEST(PlanSearch, GradientsAreSummedOverDpTimesCp) {
  const Profile p = shipped("h100_sxm.json");
  const auto ring_allreduce = [](double bytes, int n, const Link& l, double eff) {
    return 2.0 * (n - 1) * l.latency + 2.0 * (n - 1) / n * bytes / (l.bandwidth * eff);
  };
  PlanRequest req;
  req.seq = 8192;
  req.devices = 16;
  // One layer: the exposed all-reduce is the whole all-reduce (only the last layer's share of it
  // is never overlapped), so it equals the formula.
  req.model = ModelShape{1, 4096, 32, 8, 16384, 32000};
  const PlanResult one = plan(req, p);
  int with_cp = 0;
  for (const Candidate& c : one.ranked) {
    const int n = c.dp * c.ulysses * c.ring;  // dp x cp (ring2d: ring is the whole cp group)
    ASSERT_EQ(n * c.tp, req.devices) << c.name();
    const double want =
        ring_allreduce(2.0 * req.model.params() / c.tp, n, p.inter, p.allreduce_eff);
    EXPECT_NEAR(c.dp_comm_s, want, 1e-12 * want) << c.name();
    with_cp += c.dp == 1 && n > 1;
  }
  EXPECT_GT(with_cp, 10);
  // The probe's case: dp16 wins; the dp1 x cp16 double ring pays its all-reduce.
  req.model = ModelShape{4, 4096, 32, 8, 16384, 32000};
  const PlanResult four = plan(req, p);
  ASSERT_FALSE(four.ranked.empty());
  EXPECT_EQ(four.ranked.front().name(), "dp16 tp1 u1 r1 none/contiguous");
  bool seen = false;
  for (const Candidate& c : four.ranked)
    if (c.name() == "dp1 tp1 u1 r16 i8 ring2d/stripe") {
      seen = true;
      EXPECT_GT(c.dp_comm_s, 0.11) << c.name();
    }
  EXPECT_TRUE(seen);
  // Memory: fp32 master weights and Adam moments (12 B per parameter / tp) sharded over dp x cp.
  // dp1 x cp2 and dp2 x cp2 differ only in that share: 12 P (1/2 - 1/4) (over dp alone: 12 P / 2).
  req.model = ModelShape{2, 1024, 8, 8, 4096, 1000};
  const auto memory_of = [&](int devices, const std::string& name) {
    PlanRequest r = req;
    r.devices = devices;
    for (const Candidate& c : plan(r, p).ranked)
      if (c.name() == name) return c.memory_bytes;
    ADD_FAILURE() << name << " not ranked on " << devices << " devices";
    return 0.0;
  };
  const double P = req.model.params();
  EXPECT_NEAR(memory_of(2, "dp1 tp1 u1 r2 ring/zigzag") - memory_of(4, "dp2 tp1 u1 r2 ring/zigzag"),
              12.0 * P * (1.0 / 2 - 1.0 / 4), 1e-6 * P);
}

// Every ranked plan is one loom train can run: tp divides the heads and the kv heads (its rule,
// model::validate). A tp above the kv heads was ranked: `--model 2,256,8,2,0,256 --devices 8`
// ranked dp2 tp4, which loom train and --train-step --mesh 2,4,1,1 refuse.
TEST(PlanSearch, TpDividesTheKvHeadsAsLoomTrainRequires) {
  const Profile p = shipped("h100_sxm.json");
  PlanRequest req;
  req.seq = 8192;
  req.devices = 8;
  req.model = ModelShape{2, 256, 8, 2, 1024, 256};
  const PlanResult r = plan(req, p);
  ASSERT_FALSE(r.ranked.empty());
  for (const Candidate& c : r.ranked) EXPECT_EQ(req.model.kv_heads % c.tp, 0) << c.name();
  int refused = 0;
  for (const Candidate& c : r.rejected)
    if (c.tp == 4 || c.tp == 8) {
      ++refused;
      EXPECT_EQ(c.why_not, "tp " + std::to_string(c.tp) +
                               " does not divide both the 8 heads and the 2 kv heads (loom "
                               "train's rule)");
    }
  EXPECT_EQ(refused, 2);
}

// And tp divides the FFN size (model::validate: "the MLP hidden size ... must be divisible by
// --tp"): `--model 8,4096,32,8,16386,256 --seq 128 --devices 4 --memory-limit 8` ranked dp1 tp4
// first, which loom train refuses.
TEST(PlanSearch, TpDividesTheFfnAsLoomTrainRequires) {
  const Profile p = shipped("h100_sxm.json");
  PlanRequest req;
  req.seq = 128;
  req.devices = 4;
  req.memory_limit = 16e9;                             // the probe's 8 GB: tp 4 alone fitted
  req.model = ModelShape{8, 4096, 32, 8, 16386, 256};  // 16386 = 2 x 8193
  const PlanResult r = plan(req, p);
  ASSERT_FALSE(r.ranked.empty());
  for (const Candidate& c : r.ranked) EXPECT_EQ(req.model.ffn % c.tp, 0) << c.name();
  int refused = 0;
  for (const Candidate& c : r.rejected)
    if (c.tp == 4) {
      ++refused;
      EXPECT_EQ(c.why_not, "tp 4 does not divide the FFN size 16386 (loom train's rule)");
    }
  EXPECT_EQ(refused, 1);
}

// tp stays inside a node: a tp above devices_per_node is rejected with its reason (it was dropped
// without a word: a profile of one device per node ranked nothing and blamed the memory).
TEST(PlanSearch, TpAboveTheNodeIsRejectedWithItsReason) {
  Profile p = shipped("h100_sxm.json");
  p.devices_per_node = 2;
  PlanRequest req;
  req.seq = 8192;
  req.devices = 8;
  req.model = ModelShape{2, 256, 8, 8, 1024, 256};  // tp 1, 2, 4, 8 all divide heads and FFN
  const PlanResult r = plan(req, p);
  ASSERT_FALSE(r.ranked.empty());
  for (const Candidate& c : r.ranked) EXPECT_LE(c.tp, 2) << c.name();
  std::vector<int> refused;
  for (const Candidate& c : r.rejected)
    if (c.tp > 2) {
      refused.push_back(c.tp);
      EXPECT_EQ(c.why_not, "tp " + std::to_string(c.tp) +
                               " spans more than a node's 2 devices (tp stays inside a node: the "
                               "profile's devices_per_node)");
    }
  EXPECT_EQ(refused, (std::vector<int>{4, 8}));
}

// A mesh without a cp group runs one rank over the whole sequence: contiguous, every document in
// one piece (the search tried zigzag alone there, which cut each document in two: three kernel
// calls per document instead of one). loom train runs it (--layout contiguous with cp 1).
TEST(PlanSearch, OneRankRunsTheContiguousLayout) {
  const Profile p = shipped("h100_sxm.json");
  PlanRequest req;
  req.seq = 32768;
  req.devices = 2;
  req.doc_lengths.assign(128, 256);
  req.model = ModelShape{2, 256, 4, 2, 1024, 256};
  for (bool all : {true, false}) {  // --zigzag-only too
    req.all_layouts = all;
    const PlanResult r = plan(req, p);
    int none = 0;
    for (const std::vector<Candidate>* list : {&r.ranked, &r.rejected})
      for (const Candidate& c : *list)
        if (c.strategy == "none") {
          ++none;
          EXPECT_EQ(c.layout, Layout::contiguous) << c.name();
        }
    EXPECT_EQ(none, 2 * 2) << all;  // dp2 tp1 and dp1 tp2, with and without checkpointing
  }
  // Its attention is the contiguous simulation's, cheaper than zigzag's on one rank.
  AttnCase a;
  a.layout = Layout::contiguous;
  a.seq = req.seq;
  a.doc_lengths = req.doc_lengths;
  a.heads = 4;
  a.kv_heads = 2;
  a.head_dim = 64;
  a.block_q = p.block_q;
  a.block_k = p.block_k;
  a.dtype_bytes = req.dtype_bytes;
  a.backward = true;
  const AttnSim contiguous = simulate_attention(a, p);
  a.layout = Layout::zigzag;
  const AttnSim zigzag = simulate_attention(a, p);
  EXPECT_LT(contiguous.forward_s + contiguous.backward_s, zigzag.forward_s + zigzag.backward_s);
  req.all_layouts = true;
  int seen = 0;
  for (const Candidate& c : plan(req, p).ranked) {
    if (c.name() != "dp2 tp1 u1 r1 none/contiguous") continue;
    EXPECT_NEAR(c.attn_s, 2 * (contiguous.forward_s + contiguous.backward_s), 1e-12);
    ++seen;
  }
  EXPECT_EQ(seen, 1);
}

// Stripe shards interleave, so every pair's tile count loops over its q-tiles: P^2 pairs of
// S / P rows (S = 2^28 on 8192 ranks ran for hours). The loops are few distinct ones, each run
// once: a table of 2048 stripe ranks over S = 2^28 is P^2 cheap pairs.
TEST(PlanPairs, StripeTablesAreCheap) {
  PairKey key;
  key.layout = Layout::stripe;
  key.ranks = 2048;
  key.seq = int64_t{1} << 28;
  key.block_q = key.block_k = 64;
  key.work_tile = 128;
  const auto shards = shard_chunks(key.layout, key.seq, key.ranks, {});
  const PairTable table(key, shards);
  // Every one of the 2^22 pairs ran its own loop of 2^11 q-tile steps before (99 s); pairs of one
  // loop shape now share a run. Counted, not timed (no timed assertions in tests).
  EXPECT_LE(table.loops_run(), size_t{16});  // 4 here
  for (int a : {0, 1, 1023, 2047})
    for (int b : {0, 1, 1024, 2047})
      expect_work_eq(table.at(a, b), reference_work(shards[a], shards[b], key),
                     "pair " + std::to_string(a) + "," + std::to_string(b));
}

// "-" is not a profile: InputFile reads it as standard input, where a pipe that never closes
// blocked for ever; refused as not a regular file, before anything is read.
TEST(PlanProfiles, StandardInputIsNotAProfile) {
  try {
    load_profile("-");
    ADD_FAILURE() << "read a profile from standard input";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot read profile -: is not a regular file"),
              std::string::npos)
        << e.what();
  }
}

// The search reports its progress: 0 first, then rising to exactly 1 at its end, and the same
// ranking with or without a listener.
TEST(PlanSearch, ReportsProgressFromZeroToOne) {
  const Profile p = shipped("h100_sxm.json");
  PlanRequest req;
  req.seq = 16384;
  req.devices = 24;  // tp 3 is refused (32 heads), cp up to 24: hybrid and ring2d shapes
  const PlanResult quiet = plan(req, p);
  std::vector<double> seen;
  req.progress = [&](double f) { seen.push_back(f); };
  const PlanResult heard = plan(req, p);
  ASSERT_GE(seen.size(), 10u);
  EXPECT_EQ(seen.front(), 0.0);
  EXPECT_DOUBLE_EQ(seen.back(), 1.0);
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_GT(seen[i], seen[i - 1]) << i;
  ASSERT_EQ(quiet.ranked.size(), heard.ranked.size());
  ASSERT_EQ(quiet.rejected.size(), heard.rejected.size());
  for (size_t i = 0; i < quiet.ranked.size(); ++i) {
    EXPECT_EQ(quiet.ranked[i].name(), heard.ranked[i].name());
    EXPECT_EQ(quiet.ranked[i].step_s, heard.ranked[i].step_s);
  }
}

// A cpu profile with round numbers: 2 ranks per node, a lone rank 1.25x faster.
Profile train_profile() {
  Profile p = valid_profile();
  p.kind = "cpu";
  p.block_q = p.block_k = 64;
  const double tiles[4] = {1e-4, 2e-4, 3e-4, 5e-4};
  std::copy(tiles, tiles + 4, p.tile_s_fp32);
  p.calib_head_dim = 32;
  p.alone_speedup = 1.25;
  p.devices_per_node = 2;
  p.intra = Link{1e9, 1e-5};
  p.inter = p.intra;
  p.allgather_eff = 0.5;
  p.allreduce_eff = 0.5;
  p.overlap = false;
  return p;
}

TrainCase train_case(int dp, int tp, int u, int r) {
  TrainCase c;
  c.model = ModelShape{2, 128, 4, 2, 512, 256};
  c.seq = 512;
  c.batch = 4;
  c.mesh = MeshShape{dp, tp, u, r};
  c.strategy = u > 1 ? "ulysses" : "ring";
  return c;
}

TEST(PlanTrainStep, OneRankReturnsTheMeasure) {
  const Profile p = train_profile();
  const TrainMeasure one{0.3, 0.5, 0.04, 0.01};
  const TrainStepPrediction r = predict_train_step(train_case(1, 1, 1, 1), one, p);
  EXPECT_NEAR(r.attention_s, 0.3, 1e-12);
  EXPECT_NEAR(r.other_s, 0.5, 1e-12);
  EXPECT_NEAR(r.update_s, 0.04, 1e-12);
  EXPECT_NEAR(r.rest_s, 0.01, 1e-12);
  EXPECT_EQ(r.tp_comm_s, 0.0);
  EXPECT_EQ(r.grad_comm_s, 0.0);
  EXPECT_NEAR(r.step_s, 0.85, 1e-12);
  // The scale is the measured attention over the simulator's lone-rank figure.
  AttnCase a;
  a.seq = 512;
  a.heads = 4;
  a.kv_heads = 2;
  a.head_dim = 32;
  a.mask.causal = true;
  const AttnSim s = simulate_attention(a, p);
  EXPECT_NEAR(r.attention_scale, 0.3 / (2 * 4 * (s.forward_s + s.backward_s) / 1.25), 1e-9);
}

TEST(PlanTrainStep, MeshesComposeTheMeasure) {
  const Profile p = train_profile();
  const TrainMeasure one{0.3, 0.5, 0.04, 0.01};
  const TrainStepPrediction base = predict_train_step(train_case(1, 1, 1, 1), one, p);
  const double d = 128, kv = 64, split = 2 * (2 * d * d + 2 * d * kv + 3 * d * 512);
  const double all = ModelShape{2, 128, 4, 2, 512, 256}.params(), rep = all - split;
  // Ring all-reduce of B bytes over 2 ranks: 2 latencies + B / (bandwidth x efficiency).
  const auto ar2 = [](double bytes) { return 2 * 1e-5 + bytes / (1e9 * 0.5); };
  {  // dp 2: half the sequences per rank, both cores busy, all gradients summed over 2 ranks.
    const TrainStepPrediction r = predict_train_step(train_case(2, 1, 1, 1), one, p);
    EXPECT_NEAR(r.other_s, 0.5 / 2 * 1.25, 1e-12);
    EXPECT_NEAR(r.rest_s, 0.01 / 2 * 1.25, 1e-12);
    EXPECT_NEAR(r.attention_s, 0.3 / 2 * 1.25, 1e-9);
    EXPECT_NEAR(r.update_s, 0.04 * 1.25, 1e-12);
    EXPECT_NEAR(r.grad_comm_s, ar2(4 * rep) + ar2(4 * split), 1e-12);
    EXPECT_EQ(r.tp_comm_s, 0.0);
  }
  {  // tp 2: half of every token's work, 8 collectives per layer and sequence of 256 x 128
     // fp32 rows per rank (one latency + the part at the effective bandwidth each).
    const TrainStepPrediction r = predict_train_step(train_case(1, 2, 1, 1), one, p);
    EXPECT_NEAR(r.other_s, 0.5 / 2 * 1.25, 1e-12);
    EXPECT_NEAR(r.tp_comm_s, 2 * 4 * 8 * (1e-5 + 256 * 128 * 4 / (1e9 * 0.5)), 1e-12);
    EXPECT_NEAR(r.grad_comm_s, ar2(4 * rep), 1e-12);
    EXPECT_NEAR(r.update_s, 0.04 * (rep + split / 2) / all * 1.25, 1e-12);
    // Two query heads and one kv head per rank: half the one-rank attention, shared cores.
    EXPECT_NEAR(r.attention_s, 0.3 / 2 * 1.25, 1e-9);
  }
  {  // ring cp 2: the simulator's two-rank attention at the one-rank run's scale.
    const TrainStepPrediction r = predict_train_step(train_case(1, 1, 1, 2), one, p);
    EXPECT_NEAR(r.other_s, 0.5 / 2 * 1.25, 1e-12);
    EXPECT_NEAR(r.attention_s,
                base.attention_scale * 2 * 4 * (r.attention.forward_s + r.attention.backward_s),
                1e-9);
    EXPECT_GT(r.attention.ranks[0].bytes_sent, 0);
    EXPECT_NEAR(r.grad_comm_s, ar2(4 * rep) + ar2(4 * split), 1e-12);
  }
  {  // Checkpointing: the one-rank measure already holds the recompute; the mesh's attention
     // adds the recomputed forward on the simulator's side too.
    TrainCase c = train_case(1, 1, 1, 2);
    c.checkpoint = true;
    const TrainStepPrediction r = predict_train_step(c, one, p);
    const double layer = 2 * r.attention.forward_s + r.attention.backward_s;
    EXPECT_NEAR(r.attention_s, r.attention_scale * 2 * 4 * layer, 1e-9);
    EXPECT_NEAR(r.tp_comm_s, 0.0, 0.0);
  }
}

TEST(PlanTrainStep, BadMeshesAreRefused) {
  const Profile p = train_profile();
  const TrainMeasure one{0.3, 0.5, 0.04, 0.01};
  TrainCase c = train_case(3, 1, 1, 1);  // batch 4 over dp 3
  EXPECT_THROW(predict_train_step(c, one, p), InvalidArgument);
  EXPECT_THROW(predict_train_step(train_case(1, 3, 1, 1), one, p), InvalidArgument);  // 4 heads
  c = train_case(1, 1, 1, 2);
  c.strategy = "nope";
  EXPECT_THROW(predict_train_step(c, one, p), InvalidArgument);
  EXPECT_THROW(predict_train_step(train_case(1, 1, 1, 1), TrainMeasure{0.3, 0, 0, 0}, p),
               InvalidArgument);
}

}  // namespace
}  // namespace loom::plan
