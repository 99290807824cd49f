// Context-parallel test bodies: every rank generates the global inputs with the counter-based RNG
// (identical on every rank), takes its shard, runs the strategy, and compares its rows of out,
// lse, dq, dk, dv with the fp64 one-process reference.
#include "cp_bodies.h"

#include <cmath>
#include <numeric>
#include <sstream>

#include "../unit/tolerance.h"
#include "loom/rng.h"

namespace loom::testing {

std::string CpCase::name() const {
  std::ostringstream os;
  os << to_string(strategy) << "_" << to_string(layout) << "_U" << ulysses << "_I" << inner << "_S"
     << S << "_H" << H << "_HKV" << HKV << "_D" << D << (causal ? "_causal" : "_full") << "_W"
     << window << "_docs" << docs.size();
  return os.str();
}

namespace {

// ||x - ref|| / ||ref|| over this rank's rows (x local [n, h, d], ref global [S, h, d]); -inf
// entries (lse of rows that see nothing) must match exactly.
double rel_err(const Tensor<float>& x, const Tensor<double>& ref, const std::vector<int64_t>& tok,
               bool* inf_mismatch) {
  const int64_t w = x.numel() / std::max<int64_t>(1, x.size(0));
  double num = 0, den = 0;
  for (size_t i = 0; i < tok.size(); ++i)
    for (int64_t c = 0; c < w; ++c) {
      const double a = x[static_cast<int64_t>(i) * w + c], b = ref[tok[i] * w + c];
      if (std::isinf(a) || std::isinf(b) || std::isnan(a)) {
        if (a != b) *inf_mismatch = true;
        continue;
      }
      num += (a - b) * (a - b);
      den += b * b;
    }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

std::vector<int64_t> run_cp_case(Communicator& world, const CpCase& c) {
  const int P = world.size(), me = world.rank();
  const ShardPlan plan = ShardPlan::make(c.layout, c.S, P, c.docs);
  std::vector<int64_t> all(c.S);
  std::iota(all.begin(), all.end(), 0);
  Tensor<float> q({c.S, c.H, c.D}), k({c.S, c.HKV, c.D}), v({c.S, c.HKV, c.D}),
      dout({c.S, c.H, c.D});
  fill_normal(q.view3(), all.data(), c.seed, "q");
  fill_normal(k.view3(), all.data(), c.seed, "k");
  fill_normal(v.view3(), all.data(), c.seed, "v");
  fill_normal(dout.view3(), all.data(), c.seed, "dout");
  if (c.bf16) {  // the reference sees exactly the bf16 values the kernels see
    for (Tensor<float>* t : {&q, &k, &v, &dout}) *t = convert<float>(convert<bf16>(*t));
  }

  // Reference on the whole sequence (every rank computes it; the sizes are small).
  std::vector<int32_t> doc;
  for (size_t d = 0; d < c.docs.size(); ++d)
    doc.insert(doc.end(), static_cast<size_t>(c.docs[d]), static_cast<int32_t>(d));
  const Tokens tok{all.data(), doc.empty() ? nullptr : doc.data(), c.S};
  Mask mask;
  mask.causal = c.causal;
  mask.window = c.window;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  // Construct first: invalid configurations must fail here, with CpAttention's message.
  CpConfig cfg;
  cfg.strategy = c.strategy;
  cfg.ulysses = c.ulysses;
  cfg.inner = c.inner;
  cfg.kernel.mask = mask;
  cfg.kernel.scale = static_cast<float>(scale);
  cfg.kernel.threads = 1;
  CpAttention att(world, plan, cfg, c.H, c.HKV, c.D);
  const Tensor<double> qd = convert<double>(q), kd = convert<double>(k), vd = convert<double>(v),
                       dod = convert<double>(dout);
  Tensor<double> rout({c.S, c.H, c.D}), rlse({c.H, c.S}), rdq({c.S, c.H, c.D}),
      rdk({c.S, c.HKV, c.D}), rdv({c.S, c.HKV, c.D});
  reference_forward(qd.view3(), kd.view3(), vd.view3(), tok, tok, mask, scale, rout.view3(),
                    rlse.data());
  reference_backward(qd.view3(), kd.view3(), vd.view3(), dod.view3(), tok, tok, mask, scale,
                     rdq.view3(), rdk.view3(), rdv.view3());
  Tensor<double> rlse_rows({c.S, c.H, 1});
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < c.S; ++i) rlse_rows[i * c.H + h] = rlse[h * c.S + i];

  const int64_t n = plan.rows(me);
  const Tensor<float> lq = plan.shard(q, me), lk = plan.shard(k, me), lv = plan.shard(v, me),
                      ldo = plan.shard(dout, me);
  Tensor<float> out({n, c.H, c.D}), lse({c.H, n}), dq({n, c.H, c.D}), dk({n, c.HKV, c.D}),
      dv({n, c.HKV, c.D});
  att.forward(lq.view3(), lk.view3(), lv.view3(), out.view3(), lse.data());
  const std::vector<int64_t> steps = att.metrics().step_tiles;
  att.backward(lq.view3(), lk.view3(), lv.view3(), out.view3(), ldo.view3(), lse.data(), dq.view3(),
               dk.view3(), dv.view3());
  Tensor<float> lse_rows({n, c.H, 1});
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < n; ++i) lse_rows[i * c.H + h] = lse[h * n + i];

  const std::vector<int64_t>& mine = plan.tokens[me];
  bool inf_mismatch = false;
  const double e_out = rel_err(out, rout, mine, &inf_mismatch);
  const double e_lse = rel_err(lse_rows, rlse_rows, mine, &inf_mismatch);
  const double e_dq = rel_err(dq, rdq, mine, &inf_mismatch);
  const double e_dk = rel_err(dk, rdk, mine, &inf_mismatch);
  const double e_dv = rel_err(dv, rdv, mine, &inf_mismatch);
  using namespace loom::test;
  const bool ok = c.bf16 ? e_out <= kBf16OutRelTol && e_lse <= kFp32RelTol &&
                               e_dq <= kBf16GradRelTol && e_dk <= kBf16GradRelTol &&
                               e_dv <= kBf16GradRelTol
                         : std::max({e_out, e_lse, e_dq, e_dk, e_dv}) <= kFp32RelTol;
  if (inf_mismatch || !ok) {
    std::ostringstream os;
    os << c.name() << " P=" << P << " rank " << me << ": out " << e_out << " lse " << e_lse
       << " dq " << e_dq << " dk " << e_dk << " dv " << e_dv
       << (inf_mismatch ? " (-inf/NaN mismatch)" : "")
       << (c.bf16 ? " (bf16 tolerances of tests/unit/tolerance.h)" : " (fp32 tolerance 1e-5)");
    throw Error(os.str());
  }
  return steps;
}

}  // namespace loom::testing
