// The recorder's bounds, and a soak: nothing grows with iterations or training steps (issue 11,
// item 3). Spans are off unless asked for, and bounded by span_limit when on. The resident set
// size after N iterations must be within kRssBound of its size after N / 10: for CpAttention
// (4 local ranks, ring2d, forward + backward) and for the trainer (4 local ranks, ring). A
// control run that keeps every span (span_limit unbounded, as loom did before) must grow past
// the bound, so the measurement can see a leak of the size the issue reported.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "loom/comm.h"
#include "loom/cp.h"
#include "loom/model/trainer.h"
#include "loom/rng.h"
#include "loom/timer.h"

namespace loom {
namespace {

constexpr int64_t kRssBound = 2 << 20;  // bytes, the bound

// One rank's ring2d attention (4 ranks, inner rings of 2) on seeded inputs, forward + backward.
struct RankAttention {
  const ShardPlan& plan;
  CpAttention att;
  int64_t rows;
  Tensor<float> q, k, v, dout, out, lse, dq, dk, dv;

  RankAttention(Communicator& w, const ShardPlan& p)
      : plan(p),
        att(w, p, config(), 2, 1, 16),
        rows(p.rows(w.rank())),
        q({rows, 2, 16}),
        k({rows, 1, 16}),
        v({rows, 1, 16}),
        dout({rows, 2, 16}),
        out({rows, 2, 16}),
        lse({2, rows}),
        dq({rows, 2, 16}),
        dk({rows, 1, 16}),
        dv({rows, 1, 16}) {
    const int64_t* tok = p.tokens[w.rank()].data();
    fill_normal(q.view3(), tok, 5, "q");
    fill_normal(k.view3(), tok, 5, "k");
    fill_normal(v.view3(), tok, 5, "v");
    fill_normal(dout.view3(), tok, 5, "dout");
  }
  static CpConfig config() {
    CpConfig cfg;
    cfg.strategy = Strategy::ring2d;
    cfg.inner = 2;
    cfg.kernel.scale = 0.25f;
    cfg.kernel.threads = 1;
    return cfg;
  }
  void forward() { att.forward(q.view3(), k.view3(), v.view3(), out.view3(), lse.data()); }
  void backward() {
    att.backward(q.view3(), k.view3(), v.view3(), out.view3(), dout.view3(), lse.data(), dq.view3(),
                 dk.view3(), dv.view3());
  }
};

TEST(Recorder, SpansOffByDefaultAndBounded) {
  const ShardPlan plan = ShardPlan::make(Layout::zigzag, 64, 4);
  run_local(4, [&](Communicator& w) {
    RankAttention a(w, plan);
    CpMetrics& m = a.att.metrics();
    for (int i = 0; i < 20; ++i) a.forward();
    EXPECT_FALSE(m.record_spans);
    EXPECT_TRUE(m.spans.empty());
    EXPECT_EQ(m.spans_dropped, 0);
    EXPECT_GT(m.comm_window_s(), 0.0);   // kept without spans
    EXPECT_EQ(m.step_tiles.size(), 4u);  // one per (outer, inner) step of the last forward
    m.clear_counters();
    m.record_spans = true;
    m.span_limit = 10;
    for (int i = 0; i < 5; ++i) a.forward();
    EXPECT_EQ(m.spans.size(), 10u);
    EXPECT_GT(m.spans_dropped, 0);
    bool compute = false, comm = false;
    for (const CpMetrics::Span& s : m.spans) {
      compute = compute || s.kind == SpanKind::compute;
      comm = comm || is_comm(s.kind);
      EXPECT_LE(s.t0, s.t1);
    }
    EXPECT_TRUE(compute && comm);
  });
}

// RSS growth between iteration n / 10 and iteration n of attention on 4 local ranks, with the
// metrics' span settings given.
int64_t attention_growth(int n, bool record_spans, size_t span_limit) {
  const ShardPlan plan = ShardPlan::make(Layout::zigzag, 64, 4);
  int64_t at_tenth = 0, at_end = 0;
  run_local(4, [&](Communicator& w) {
    RankAttention a(w, plan);
    a.att.metrics().record_spans = record_spans;
    a.att.metrics().span_limit = span_limit;
    for (int i = 1; i <= n; ++i) {
      a.forward();
      a.backward();
      if (i == n / 10 || i == n) {
        w.barrier();  // every rank is at the same iteration
        if (w.rank() == 0) (i == n ? at_end : at_tenth) = current_rss_bytes();
        w.barrier();
      }
    }
  });
  return at_end - at_tenth;
}

TEST(SoakRss, AttentionFlatWithSpansOffOrBounded) {
  ASSERT_GT(current_rss_bytes(), 0) << "no VmRSS on this system";
  const int n = 1000;
  const int64_t off = attention_growth(n, false, size_t{1} << 16);
  EXPECT_LT(off, kRssBound) << "spans off: RSS grew by " << off << " bytes over " << n
                            << " iterations";
  const int64_t bounded = attention_growth(n, true, 1000);
  EXPECT_LT(bounded, kRssBound) << "spans bounded: RSS grew by " << bounded << " bytes";
  const int64_t unbounded = attention_growth(n, true, std::numeric_limits<size_t>::max());
  EXPECT_GT(unbounded, kRssBound) << "control: keeping every span must grow (" << unbounded
                                  << " bytes); otherwise this test cannot see a leak";
  std::printf("RSS growth over %d iterations: spans off %lld B, bounded %lld B, unbounded %lld B\n",
              n, static_cast<long long>(off), static_cast<long long>(bounded),
              static_cast<long long>(unbounded));
}

std::string soak_text() {
  std::string t;
  for (int i = 0; t.size() < 20000; ++i)
    t += "in the beginning was the word " + std::to_string(i % 97) + " and the word was good.\n";
  return t;
}

TEST(SoakRss, TrainerFlatOverSteps) {
  const model::Corpus corpus = model::make_corpus(soak_text(), "soak");
  model::TrainConfig c;
  c.model.layers = 1;
  c.model.dim = 16;
  c.model.heads = 2;
  c.model.kv_heads = 1;
  c.model.ffn = 16;
  c.par.mesh = MeshShape{1, 1, 1, 4};
  c.par.strategy = Strategy::ring;
  c.par.threads = 1;
  c.seq = 32;
  c.batch = 1;
  c.steps = 1000;
  model::set_blas_threads(1);
  int64_t at_tenth = 0, at_end = 0;
  run_local(4, [&](Communicator& w) {
    model::Trainer tr(w, c, corpus);
    for (int64_t s = 1; s <= c.steps; ++s) {
      tr.train_step();
      if (s == c.steps / 10 || s == c.steps) {
        w.barrier();
        if (w.rank() == 0) (s == c.steps ? at_end : at_tenth) = current_rss_bytes();
        w.barrier();
      }
    }
  });
  EXPECT_LT(at_end - at_tenth, kRssBound) << "RSS " << at_tenth << " B at step " << c.steps / 10
                                          << ", " << at_end << " B at step " << c.steps;
  std::printf("trainer RSS: %lld B at step %lld, %lld B at step %lld\n",
              static_cast<long long>(at_tenth), static_cast<long long>(c.steps / 10),
              static_cast<long long>(at_end), static_cast<long long>(c.steps));
}

}  // namespace
}  // namespace loom
