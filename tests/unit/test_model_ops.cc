// The trainer's single-rank pieces: every layer's backward against central finite differences
// in double (the very code the trainer runs, instantiated for double), the GEMM wrappers against
// plain loops, the bf16 GEMM, the corpus split and the sequence draw, and the whole model's
// gradient (fp32, one rank) against finite differences of its loss.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm.h"
#include "loom/error.h"
#include "loom/model/data.h"
#include "loom/model/gpt.h"
#include "loom/model/trainer.h"
#include "ops.h"

namespace loom::model {
namespace {

// Finite differences in double: step 1e-6 gives ~1e-9 relative truncation + rounding error.
constexpr double kFdStep = 1e-6;
constexpr double kFdRelTol = 1e-6;

std::vector<double> randn(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = d(gen);
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Checks analytic gradient `grad` of f at x against central differences, coordinate-wise,
// as a normwise relative error.
template <class F>
void expect_fd(const char* what, std::vector<double>& x, const std::vector<double>& grad, F f) {
  ASSERT_EQ(x.size(), grad.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + kFdStep;
    const double fp = f();
    x[i] = keep - kFdStep;
    const double fm = f();
    x[i] = keep;
    const double fd = (fp - fm) / (2 * kFdStep);
    num += (fd - grad[i]) * (fd - grad[i]);
    den += fd * fd;
  }
  EXPECT_LE(std::sqrt(num / den), kFdRelTol) << what;
}

TEST(ModelOps, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t n = 3, c = 7;
  std::vector<double> x = randn(n * c, 1), g = randn(c, 2), dy = randn(n * c, 3);
  std::vector<double> y(n * c), r(n), dx(n * c), dg(c, 0.0);
  auto loss = [&] {
    rmsnorm_forward(x.data(), g.data(), n, c, 1e-5, y.data(), r.data());
    return dot(y, dy);
  };
  loss();
  rmsnorm_backward(x.data(), g.data(), r.data(), dy.data(), n, c, dx.data(), dg.data(), false);
  expect_fd("rmsnorm dx", x, dx, loss);
  expect_fd("rmsnorm dg", g, dg, loss);
  // accumulate = true adds to what dx holds.
  std::vector<double> acc(n * c, 1.0);
  std::vector<double> dg2(c, 0.0);
  rmsnorm_backward(x.data(), g.data(), r.data(), dy.data(), n, c, acc.data(), dg2.data(), true);
  for (int64_t i = 0; i < n * c; ++i) EXPECT_NEAR(acc[i], dx[i] + 1.0, 1e-12);
}

TEST(ModelOps, RopeBackwardIsTheInverseRotation) {
  const int64_t n = 4, h = 3, d = 8;
  const std::vector<int64_t> pos = {0, 5, 17, 1000};
  std::vector<double> x = randn(n * h * d, 4), dy = randn(n * h * d, 5);
  auto loss = [&] {
    std::vector<double> y = x;
    rope(y.data(), n, h, d, pos.data(), 10000.0, false);
    return dot(y, dy);
  };
  std::vector<double> dx = dy;
  rope(dx.data(), n, h, d, pos.data(), 10000.0, true);
  expect_fd("rope dx", x, dx, loss);
  // Position 0 is the identity; a rotation keeps norms.
  std::vector<double> y = x;
  rope(y.data(), n, h, d, pos.data(), 10000.0, false);
  for (int64_t i = 0; i < h * d; ++i) EXPECT_DOUBLE_EQ(y[i], x[i]);
  EXPECT_NEAR(dot(y, y), dot(x, x), 1e-9);
}

TEST(ModelOps, SwigluBackwardMatchesFiniteDifferences) {
  const int64_t count = 19;
  std::vector<double> u = randn(count, 6, 2.0), g = randn(count, 7), da = randn(count, 8);
  auto loss = [&] {
    std::vector<double> a(count);
    swiglu_forward(u.data(), g.data(), count, a.data());
    return dot(a, da);
  };
  std::vector<double> du(count), dg(count);
  swiglu_backward(u.data(), g.data(), da.data(), count, du.data(), dg.data());
  expect_fd("swiglu du", u, du, loss);
  expect_fd("swiglu dg", g, dg, loss);
}

TEST(ModelOps, CrossEntropyBackwardMatchesFiniteDifferences) {
  const int64_t n = 4, v = 11;
  std::vector<double> logits = randn(n * v, 9, 3.0);
  const std::vector<int32_t> target = {3, -1, 10, 0};
  const double scale = 0.25;
  std::vector<double> dl(n * v);
  auto loss = [&] {
    std::vector<double> scratch(n * v);
    return scale * cross_entropy(logits.data(), target.data(), n, v, scale, scratch.data());
  };
  const double l = cross_entropy(logits.data(), target.data(), n, v, scale, dl.data());
  expect_fd("cross-entropy dlogits", logits, dl, loss);
  for (int64_t j = 0; j < v; ++j) EXPECT_EQ(dl[v + j], 0.0) << "ignored row has no gradient";
  // Uniform logits: each predicted row costs log(v).
  std::vector<double> flat(n * v, 0.5), d2(n * v);
  EXPECT_NEAR(cross_entropy(flat.data(), target.data(), n, v, 1.0, d2.data()), 3 * std::log(v),
              1e-12);
  EXPECT_GT(l, 0);
}

TEST(ModelOps, GemmMatchesPlainLoopsForEveryTranspose) {
  const int64_t m = 5, n = 7, k = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      std::vector<double> a = randn(m * k, 10), b = randn(k * n, 11), c = randn(m * n, 12);
      std::vector<double> want(m * n);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t p = 0; p < k; ++p)
            s += (ta ? a[p * m + i] : a[i * k + p]) * (tb ? b[j * k + p] : b[p * n + j]);
          want[i * n + j] = 2.0 * s + 0.5 * c[i * n + j];
        }
      gemm(ta, tb, m, n, k, 2.0, a.data(), ta ? m : k, b.data(), tb ? k : n, 0.5, c.data(), n);
      for (int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(c[i], want[i], 1e-12) << ta << tb;
      // fp32 and bf16 paths on bf16-representable inputs give the fp32 result.
      std::vector<float> af(a.size()), bf(b.size()), cf(m * n, 0.0f), cb(m * n, 0.0f);
      std::vector<bf16> ab(a.size()), bb(b.size());
      for (size_t i = 0; i < a.size(); ++i) af[i] = to_float(loom::to_bf16(float(a[i])));
      for (size_t i = 0; i < b.size(); ++i) bf[i] = to_float(loom::to_bf16(float(b[i])));
      to_bf16(af.data(), int64_t(af.size()), ab.data());
      to_bf16(bf.data(), int64_t(bf.size()), bb.data());
      gemm(ta, tb, m, n, k, 1.0f, af.data(), ta ? m : k, bf.data(), tb ? k : n, 0.0f, cf.data(), n);
      gemm(ta, tb, m, n, k, 1.0f, ab.data(), ta ? m : k, bb.data(), tb ? k : n, 0.0f, cb.data(), n);
      for (int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(cb[i], cf[i], 1e-5f * (1 + std::fabs(cf[i])));
    }
}

// ---------------------------------------------------------------------------------------------
// Data.

TEST(ModelData, BibleBooksAreDocumentsAndValidationIsEachBooksTail) {
  std::string text;
  for (const char* book : {"Ge", "Exo", "1Sm"})
    for (int c = 1; c <= 2; ++c)
      for (int v = 1; v <= 20; ++v)
        text += std::string(book) + std::to_string(c) + ":" + std::to_string(v) +
                " And it came to pass that the verse was written.\n";
  const Corpus k = make_corpus(text, "kjv");
  EXPECT_EQ(k.documents, 3);
  EXPECT_EQ(k.train.doc_starts.size(), 3u);
  EXPECT_EQ(k.val.doc_starts.size(), 3u);
  EXPECT_EQ(k.train.size() + k.val.size(), static_cast<int64_t>(text.size()));
  // Every validation piece starts at a line start and is about kValFraction of its book.
  for (size_t d = 0; d < 3; ++d) {
    const int64_t b = k.val.doc_starts[d];
    const int64_t e = d + 1 < 3 ? k.val.doc_starts[d + 1] : k.val.size();
    EXPECT_TRUE(std::isalnum(k.val.bytes[b]));
    EXPECT_NEAR(double(e - b) / (double(text.size()) / 3), kValFraction, 0.03);
  }
  const Corpus p = make_corpus("one two\n\nthree four five\n\n\nsix", "paragraphs");
  EXPECT_EQ(p.documents, 3);
  EXPECT_EQ(make_corpus("no separators here", "x").documents, 1);
  // CRLF text: "\r\n\r\n" is a blank line too (a CRLF file was one document); a run of blank
  // lines is one separator, and the next document starts at its first byte.
  const Corpus crlf = make_corpus("one two\r\n\r\nthree four five\r\n\r\n\r\nsix\r\n", "crlf");
  EXPECT_EQ(crlf.documents, 3);
  const Corpus mixed = make_corpus("one\n\r\ntwo\r\n\nthree\r\nstill three", "mixed");
  EXPECT_EQ(mixed.documents, 3);
  EXPECT_EQ(make_corpus("one\r\ntwo\r\nthree\r\n", "lines").documents, 1);
  EXPECT_THROW(make_corpus("", "empty"), IoError);
  EXPECT_THROW(load_corpus("/nonexistent/loom/corpus.txt"), IoError);
}

TEST(ModelData, PackedSequencesMaskTargetsAndRestartPositions) {
  Split s;
  const std::string t = "abcdefghij";
  s.bytes.assign(t.begin(), t.end());
  s.doc_starts = {0, 4, 7};
  const Sequence plain = make_sequence(s, 2, 6, false);  // window "cdefghi"
  EXPECT_EQ(plain.predicted(), 6);
  EXPECT_TRUE(plain.doc_lengths.empty());
  EXPECT_EQ(plain.rope_pos, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  const Sequence packed = make_sequence(s, 2, 6, true);  // "cd|efg|h" (+ target i)
  EXPECT_EQ(packed.doc_lengths, (std::vector<int64_t>{2, 3, 1}));
  EXPECT_EQ(packed.target, (std::vector<int32_t>{'d', -1, 'f', 'g', -1, 'i'}));
  EXPECT_EQ(packed.rope_pos, (std::vector<int64_t>{0, 1, 0, 1, 2, 0}));
  // Draws depend only on (seed, step, index) and stay in range.
  for (int64_t step = 0; step < 50; ++step) {
    const int64_t o = train_offset(s, 6, 7, step, 1);
    EXPECT_EQ(o, train_offset(s, 6, 7, step, 1));
    EXPECT_GE(o, 0);
    EXPECT_LE(o + 6 + 1, s.size());
  }
  EXPECT_EQ(val_offsets(s, 6, 3), (std::vector<int64_t>{0, 1, 3}));
  EXPECT_TRUE(val_offsets(s, 10, 3).empty());
  // More windows than the split has (4 here) give each once, without first making `count`
  // offsets (--eval-batches 99999999999 grew past 7.9 GB).
  EXPECT_EQ(val_offsets(s, 6, 5), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(val_offsets(s, 6, int64_t{1} << 62), (std::vector<int64_t>{0, 1, 2, 3}));
}

// A window past the split's end read beyond its bytes (heap overflow), seq == size divided by
// zero in train_offset and seq > size gave a negative offset, and seq -1 ended in an uncaught
// std::length_error: each is now one InvalidArgument naming the values.
TEST(ModelData, WindowsOutsideTheSplitAreRefused) {
  const Corpus c = make_corpus(std::string(200, 'a'), "mem");
  const Split& s = c.train;
  const int64_t n = s.size();
  ASSERT_GT(n, 20);
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no InvalidArgument");
  };
  // The last window that fits, then one byte past it.
  EXPECT_EQ(make_sequence(s, n - 11, 10, false).input.size(), 10u);
  EXPECT_EQ(make_sequence(s, n - 11, 10, true).input.size(), 10u);
  std::string m = message([&] { make_sequence(s, n - 10, 10, false); });
  EXPECT_NE(m.find("offset " + std::to_string(n - 10)), std::string::npos) << m;
  EXPECT_NE(m.find(std::to_string(n) + " bytes"), std::string::npos) << m;
  for (const auto& [offset, seq] :
       std::vector<std::pair<int64_t, int64_t>>{{n - 5, 10},
                                                {-1, 10},
                                                {0, n},
                                                {n, 1},
                                                {1, std::numeric_limits<int64_t>::max()},
                                                {std::numeric_limits<int64_t>::max(), 1}})
    for (const bool pack : {false, true})
      EXPECT_THROW(make_sequence(s, offset, seq, pack), InvalidArgument) << offset << " " << seq;
  for (const int64_t seq : {int64_t{-1}, int64_t{0}, std::numeric_limits<int64_t>::min()}) {
    m = message([&] { make_sequence(s, 0, seq, false); });
    EXPECT_NE(m.find("sequence length must be >= 1, got " + std::to_string(seq)), std::string::npos)
        << m;
  }
  // train_offset: seq == size (a division by zero), seq > size (a negative offset), seq <= 0.
  EXPECT_EQ(train_offset(s, n - 1, 1, 0, 0), 0);  // one window: offset 0
  for (const int64_t seq : {n, n + 5, int64_t{0}, int64_t{-3}, std::numeric_limits<int64_t>::max(),
                            std::numeric_limits<int64_t>::min()}) {
    m = message([&] { train_offset(s, seq, 1, 0, 0); });
    EXPECT_NE(m.find("sequence length " + std::to_string(seq) + " does not fit the split of " +
                     std::to_string(n) + " bytes"),
              std::string::npos)
        << m;
  }
  EXPECT_THROW(val_offsets(s, 0, 3), InvalidArgument);
  EXPECT_THROW(val_offsets(s, -5, 3), InvalidArgument);
  EXPECT_EQ(val_offsets(s, n - 1, 3), (std::vector<int64_t>{0}));
}

// ---------------------------------------------------------------------------------------------
// The whole model on one rank: fp32 gradient of every parameter tensor against central finite
// differences of the loss along a random direction. fp32 loss evaluations limit the agreement
// to about 1e-3 relative; wiring errors give O(1) errors.
constexpr double kModelFdRelTol = 2e-2;

std::string fixture_text() {
  static const char* words[] = {"the", "lord",   "said", "unto", "moses", "and",   "people",
                                "of",  "israel", "went", "out",  "land",  "water", "light"};
  std::mt19937 gen(3);
  std::string t;
  for (int para = 0; para < 6; ++para) {
    for (int s = 0; s < 5; ++s) {
      const int len = 4 + static_cast<int>(gen() % 6);
      for (int w = 0; w < len; ++w) t += std::string(w ? " " : "") + words[gen() % 14];
      t += ". ";
    }
    t += "\n\n";
  }
  return t;
}

// The model of the gradient tests: 2 layers, dim 16, 4 query heads over 2 KV heads.
ModelConfig small_model() {
  ModelConfig mc;
  mc.layers = 2;
  mc.dim = 16;
  mc.heads = 4;
  mc.kv_heads = 2;
  return mc;
}

// One rank, one thread.
ParallelConfig one_thread() {
  ParallelConfig par;
  par.threads = 1;
  return par;
}

TEST(ModelGrad, EveryParameterTensorMatchesFiniteDifferences) {
  const Corpus corpus = make_corpus(fixture_text(), "fixture");
  ModelConfig mc = small_model();
  mc.ffn = 24;
  const ParallelConfig par = one_thread();
  set_blas_threads(1);
  run_local(1, [&](Communicator& world) {
    Mesh mesh = build_mesh(world, par.mesh);
    Gpt m(mc, par, mesh, Precision::fp32, false, 5);
    const Sequence seq = make_sequence(corpus.train, 10, 24, true);
    const double scale = 1.0 / static_cast<double>(seq.predicted());
    m.zero_grads();
    m.forward_backward(seq, scale, true);
    const std::vector<float> g = m.grads();
    std::vector<float>& w = m.params();
    std::mt19937 gen(11);
    std::normal_distribution<float> nd;
    for (const ParamSpec& p : m.specs()) {
      std::vector<float> u(static_cast<size_t>(p.local_size()));
      double unorm = 0, analytic = 0;
      for (float& x : u) {
        x = nd(gen);
        unorm += double(x) * x;
      }
      for (size_t i = 0; i < u.size(); ++i) {
        u[i] = static_cast<float>(u[i] / std::sqrt(unorm));
        analytic += double(g[p.offset + i]) * u[i];
      }
      const std::vector<float> keep(w.begin() + p.offset, w.begin() + p.offset + p.local_size());
      const double eps = 1e-2;
      auto loss_at = [&](double sign) {
        for (size_t i = 0; i < u.size(); ++i)
          w[p.offset + i] = static_cast<float>(keep[i] + sign * eps * u[i]);
        m.params_changed();
        return m.forward_backward(seq, scale, false) * scale;
      };
      const double fd = (loss_at(1) - loss_at(-1)) / (2 * eps);
      std::copy(keep.begin(), keep.end(), w.begin() + p.offset);
      m.params_changed();
      EXPECT_LE(std::fabs(fd - analytic), kModelFdRelTol * std::max(std::fabs(fd), 1e-3))
          << p.name << ": finite difference " << fd << " vs backward " << analytic;
    }
  });
}

// Packed documents: the loss of document B's tokens depends on nothing in the document before
// it (not its bytes, not its length), because attention is masked by document and rotary
// positions restart; without packing it does depend on them.
TEST(ModelGrad, PackedDocumentsAreIndependent) {
  const ModelConfig mc = small_model();
  const ParallelConfig par = one_thread();
  const std::string b = "and the people went out of the land";
  auto make = [&](const std::string& a, bool pack) {
    Sequence s;
    const std::string text = a + b + ".";
    for (size_t t = 0; t + 1 < text.size(); ++t) {
      s.input.push_back(static_cast<uint8_t>(text[t]));
      const bool in_b = t >= a.size();
      s.target.push_back(in_b ? static_cast<uint8_t>(text[t + 1]) : -1);
      s.rope_pos.push_back(pack && in_b ? int64_t(t - a.size()) : int64_t(t));
    }
    if (pack) s.doc_lengths = {int64_t(a.size()), int64_t(b.size())};
    return s;
  };
  run_local(1, [&](Communicator& world) {
    Mesh mesh = build_mesh(world, par.mesh);
    Gpt m(mc, par, mesh, Precision::fp32, false, 9);
    const double l1 = m.forward_backward(make("In the beginning ", true), 1.0, false);
    const double l2 = m.forward_backward(make("Moses said unto them, lo ", true), 1.0, false);
    EXPECT_NEAR(l1, l2, 1e-5 * l1);
    const double p1 = m.forward_backward(make("In the beginning ", false), 1.0, false);
    const double p2 = m.forward_backward(make("Moses said unto them, lo ", false), 1.0, false);
    EXPECT_GT(std::fabs(p1 - p2), 1e-3 * p1) << "without packing the prefix must matter";
  });
}

TEST(ModelConfigCheck, InvalidShapesAreOneClearError) {
  ModelConfig mc;
  ParallelConfig par;
  mc.heads = 4;
  mc.kv_heads = 3;
  EXPECT_THROW(validate(mc, par, 1, 64), InvalidArgument);
  mc.kv_heads = 2;
  par.mesh.tp = 4;
  EXPECT_THROW(validate(mc, par, 4, 64), InvalidArgument);  // kv-heads 2 not divisible by tp 4
  par.mesh.tp = 2;
  EXPECT_THROW(validate(mc, par, 3, 64), InvalidArgument);  // mesh product 2 != world 3
  EXPECT_NO_THROW(validate(mc, par, 2, 64));
  mc.dim = 60;  // head dim 15 is odd: no rotary pairs
  EXPECT_THROW(validate(mc, par, 2, 64), InvalidArgument);
  EXPECT_THROW(parse_precision("fp16"), InvalidArgument);
}

// vocab 100 was accepted and forward_backward wrote past the logits (byte targets go to 255);
// a negative or NaN norm_eps and a NaN rope_theta were accepted and gave a NaN loss.
TEST(ModelConfigCheck, VocabNormEpsAndRopeThetaAreChecked) {
  const auto message = [](const ModelConfig& mc) {
    try {
      validate(mc, ParallelConfig{}, 1, 64);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const ModelConfig good;
  EXPECT_EQ(message(good), "no error");
  for (const int64_t vocab : {int64_t{100}, int64_t{255}, int64_t{257}, int64_t{0}, int64_t{-1}}) {
    ModelConfig mc = good;
    mc.vocab = vocab;
    EXPECT_EQ(message(mc), "the model is byte-level, so its vocab must be 256 (got " +
                               std::to_string(vocab) + ")");
  }
  for (const float eps : {-1.0f, 0.0f, std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()}) {
    ModelConfig mc = good;
    mc.norm_eps = eps;
    const std::string m = message(mc);
    EXPECT_NE(m.find("norm_eps must be finite and > 0, got "), std::string::npos) << eps << m;
  }
  for (const double theta : {-1.0, 0.0, std::numeric_limits<double>::quiet_NaN(),
                             std::numeric_limits<double>::infinity()}) {
    ModelConfig mc = good;
    mc.rope_theta = theta;
    const std::string m = message(mc);
    EXPECT_NE(m.find("rope_theta must be finite and > 0, got "), std::string::npos) << theta << m;
  }
  // The model refuses them too, before any forward_backward.
  run_local(1, [&](Communicator& world) {
    const ParallelConfig par = one_thread();
    Mesh mesh = build_mesh(world, par.mesh);
    ModelConfig mc = small_model();
    mc.vocab = 100;
    EXPECT_THROW(Gpt(mc, par, mesh, Precision::fp32, false, 1), InvalidArgument);
    mc = small_model();
    mc.norm_eps = -1;
    EXPECT_THROW(Gpt(mc, par, mesh, Precision::fp32, false, 1), InvalidArgument);
  });
}

// The strategy's rules speak of the cp group's ranks and of one tp rank's heads, and the message
// says which: a ring2d --inner error in a 4-rank tp 2 x ring 2 run said "the number of ranks 2"
// and blamed the heads.
TEST(ModelConfig, StrategyErrorsNameTheContextParallelGroup) {
  const auto message = [](const ModelConfig& mc, const ParallelConfig& par, int world) {
    try {
      validate(mc, par, world, 64);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ModelConfig mc;
  mc.dim = 32;
  mc.heads = 4;
  mc.kv_heads = 2;
  ParallelConfig par;
  par.mesh.tp = 2;
  par.mesh.ring = 2;
  par.strategy = Strategy::ring2d;
  par.inner = 4;
  std::string m = message(mc, par, 4);
  EXPECT_NE(m.find("ring2d: --inner 4 must divide the number of ranks 2 (the context-parallel "
                   "group: ulysses 1 x ring 2 = 2 of the 4 ranks)"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("heads of one tp rank"), std::string::npos) << m;
  // A rule about heads names the heads of one tp rank: Ulysses over 4 ranks, 2 heads per tp rank.
  par = ParallelConfig{};
  par.mesh.tp = 2;
  par.mesh.ulysses = 4;
  par.strategy = Strategy::ulysses;
  m = message(mc, par, 8);
  EXPECT_NE(m.find("(heads of one tp rank: --heads 4 and --kv-heads 2 over --tp 2)"),
            std::string::npos)
      << m;
}

}  // namespace
}  // namespace loom::model
