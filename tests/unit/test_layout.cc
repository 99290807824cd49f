// Layouts: every token on exactly one rank, the chunk rules of cp.h, per-document zigzag,
// shard/unshard round trips, and the --docs parser.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <string>

#include "loom/cp.h"

namespace loom {
namespace {

void expect_partition(const ShardPlan& p) {
  std::vector<int> seen(p.seq, 0);
  for (int r = 0; r < p.ranks; ++r) {
    int64_t in_segments = 0;
    for (const Segment& s : p.segments[r]) {
      in_segments += s.count;
      for (int64_t i = s.begin + 1; i < s.begin + s.count; ++i)
        EXPECT_LT(p.tokens[r][i - 1], p.tokens[r][i]);  // increasing inside a segment
    }
    EXPECT_EQ(in_segments, p.rows(r));
    for (int64_t t : p.tokens[r]) ++seen[t];
    if (!p.doc_lengths.empty()) {
      EXPECT_EQ(p.docs[r].size(), p.tokens[r].size());
    }
  }
  for (int64_t t = 0; t < p.seq; ++t) EXPECT_EQ(seen[t], 1) << "token " << t;
}

TEST(Layout, ZigzagChunks) {
  const ShardPlan p = ShardPlan::make(Layout::zigzag, 16, 4);
  expect_partition(p);
  EXPECT_EQ(p.tokens[0], (std::vector<int64_t>{0, 1, 14, 15}));
  EXPECT_EQ(p.tokens[1], (std::vector<int64_t>{2, 3, 12, 13}));
  EXPECT_EQ(p.tokens[3], (std::vector<int64_t>{6, 7, 8, 9}));
  EXPECT_EQ(p.segments[0].size(), 2u);
}

TEST(Layout, UnevenSizesFollowTheStatedRule) {
  // 10 tokens in 2P = 4 chunks: 3, 3, 2, 2.
  const ShardPlan z = ShardPlan::make(Layout::zigzag, 10, 2);
  expect_partition(z);
  EXPECT_EQ(z.tokens[0], (std::vector<int64_t>{0, 1, 2, 8, 9}));
  EXPECT_EQ(z.tokens[1], (std::vector<int64_t>{3, 4, 5, 6, 7}));
  const ShardPlan c = ShardPlan::make(Layout::contiguous, 10, 3);
  expect_partition(c);
  EXPECT_EQ(c.rows(0), 4);
  EXPECT_EQ(c.rows(2), 3);
  const ShardPlan s = ShardPlan::make(Layout::stripe, 10, 3);
  expect_partition(s);
  EXPECT_EQ(s.tokens[1], (std::vector<int64_t>{1, 4, 7}));
  // More ranks than tokens: empty shards are allowed.
  const ShardPlan e = ShardPlan::make(Layout::zigzag, 3, 4);
  expect_partition(e);
}

TEST(Layout, PerDocumentZigzag) {
  const ShardPlan p = ShardPlan::make(Layout::zigzag, 12, 2, {8, 4});
  expect_partition(p);
  // doc 0 (tokens 0-7) in 4 chunks of 2; doc 1 (8-11) in 4 chunks of 1.
  EXPECT_EQ(p.tokens[0], (std::vector<int64_t>{0, 1, 6, 7, 8, 11}));
  EXPECT_EQ(p.docs[0], (std::vector<int32_t>{0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(p.tokens[1], (std::vector<int64_t>{2, 3, 4, 5, 9, 10}));
  EXPECT_EQ(p.segments[0].size(), 4u);
  for (Layout l : {Layout::contiguous, Layout::stripe})
    expect_partition(ShardPlan::make(l, 12, 3, {5, 1, 6}));
}

TEST(Layout, ShardUnshardRoundTrip) {
  Tensor<float> g({13, 2, 3});
  std::iota(g.vec().begin(), g.vec().end(), 0.0f);
  for (Layout l : {Layout::contiguous, Layout::zigzag, Layout::stripe}) {
    const ShardPlan p = ShardPlan::make(l, 13, 3);
    Tensor<float> back({13, 2, 3}, -1.0f);
    for (int r = 0; r < 3; ++r) p.unshard(p.shard(g, r), r, back);
    EXPECT_EQ(back.vec(), g.vec()) << to_string(l);
  }
}

// lse is [H, n] per rank, [H, seq] globally: rank r's column i is token tokens[r][i] of every
// head, and the columns of all ranks cover the sequence once.
TEST(Layout, ShardUnshardLse) {
  Tensor<float> g({2, 13});
  std::iota(g.vec().begin(), g.vec().end(), 0.0f);
  for (Layout l : {Layout::contiguous, Layout::zigzag, Layout::stripe}) {
    const ShardPlan p = ShardPlan::make(l, 13, 3, {4, 9});
    Tensor<float> back({2, 13}, -1.0f);
    for (int r = 0; r < 3; ++r) {
      const Tensor<float> local = p.shard_lse(g, r);
      ASSERT_EQ(local.shape(), (std::vector<int64_t>{2, p.rows(r)}));
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < p.rows(r); ++i)
          EXPECT_EQ(local[h * p.rows(r) + i], g[h * 13 + p.tokens[r][i]]) << to_string(l);
      p.unshard_lse(local, r, back);
    }
    EXPECT_EQ(back.vec(), g.vec()) << to_string(l);
  }
  const ShardPlan p = ShardPlan::make(Layout::zigzag, 13, 3);
  Tensor<float> global({2, 13});
  EXPECT_THROW(p.shard_lse(Tensor<float>({13, 2}), 0), InvalidArgument);
  EXPECT_THROW(p.unshard_lse(Tensor<float>({2, p.rows(0) + 1}), 0, global), InvalidArgument);
  EXPECT_THROW(p.unshard_lse(Tensor<float>({3, p.rows(0)}), 0, global), InvalidArgument);
}

TEST(Layout, Errors) {
  EXPECT_THROW(ShardPlan::make(Layout::zigzag, 10, 2, {4, 5}), InvalidArgument);
  EXPECT_THROW(ShardPlan::make(Layout::zigzag, 0, 2), InvalidArgument);
  // A value outside the enumeration gave a plan with no tokens on any rank.
  EXPECT_THROW(ShardPlan::make(static_cast<Layout>(7), 10, 2), InvalidArgument);
  EXPECT_THROW(parse_layout("spiral"), InvalidArgument);
  EXPECT_THROW(parse_strategy("tree"), InvalidArgument);
  EXPECT_EQ(parse_doc_lengths("3,1,20"), (std::vector<int64_t>{3, 1, 20}));
  for (const char* bad : {"", "3,,4", "3,-1", "a", "0", "3, 4", "99999999999999999999"})
    EXPECT_THROW(parse_doc_lengths(bad), InvalidArgument) << bad;
}

// rows, token_info, shard, unshard and their lse forms take a rank of the plan; any other is
// refused, naming it and the plan's ranks (r == ranks read past the plan's vectors).
TEST(Layout, RanksOutsideThePlanAreRefused) {
  const ShardPlan p = ShardPlan::make(Layout::zigzag, 10, 2);
  Tensor<float> global({10, 1, 1});
  const Tensor<float> local({5, 1, 1});
  for (int r : {2, 5, -1, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()}) {
    const std::string range = "rank " + std::to_string(r) + " is outside the plan's ranks [0, 2)";
    auto expect_refused = [&](const std::function<void()>& call, const std::string& what) {
      try {
        call();
        ADD_FAILURE() << what << " accepted rank " << r;
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(std::string(e.what()), "ShardPlan::" + what + ": " + range);
      }
    };
    expect_refused([&] { p.rows(r); }, "rows");
    expect_refused([&] { p.token_info(r); }, "token_info");
    expect_refused([&] { p.shard(global, r); }, "shard");
    expect_refused([&] { p.unshard(local, r, global); }, "unshard");
    expect_refused([&] { p.shard_lse(Tensor<float>({1, 10}), r); }, "shard_lse");
    Tensor<float> lse({1, 10});
    expect_refused([&] { p.unshard_lse(Tensor<float>({1, 5}), r, lse); }, "unshard_lse");
  }
  EXPECT_EQ(p.rows(1), 5);
  EXPECT_EQ(p.token_info(1).n, 5);
}

}  // namespace
}  // namespace loom
