// The defect ring: see defect_ring.h.
#include "verify/defect_ring.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/bf16.h"

namespace loom::test {

namespace {

bool hits(const Injected& inj, Defect kind, int r, int s) {
  return inj.kind == kind && inj.step == s && (inj.rank < 0 || inj.rank == r);
}

}  // namespace

RingOutputs run_defect_ring(const RingInputs& in_, const verify::Sharding& sh, const Injected& inj,
                            bool backward) {
  // gqa_mapping: query heads permuted so that the kernels' h / group mapping reads the KV head
  // that h mod Hkv names; un-permuted at the end.
  const int64_t Hq = in_.q.size(1), Hk = in_.k.size(1), G = Hq / Hk;
  std::vector<int64_t> pi(Hq);
  for (int64_t kv = 0; kv < Hk; ++kv)
    for (int64_t j = 0; j < G; ++j) pi[kv * G + j] = j * Hk + kv;
  RingInputs permuted;
  if (inj.kind == Defect::gqa_mapping) {
    permuted = in_;
    const int64_t S_ = in_.q.size(0), D_ = in_.q.size(2);
    for (int64_t i = 0; i < S_; ++i)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t d = 0; d < D_; ++d)
          permuted.q[(i * Hq + h) * D_ + d] = in_.q[(i * Hq + pi[h]) * D_ + d];
  }
  const RingInputs& in = inj.kind == Defect::gqa_mapping ? permuted : in_;
  const int P = sh.ranks;
  const int64_t S = in.q.size(0), H = in.q.size(1), D = in.q.size(2), Hkv = in.k.size(1);
  KernelConfig cfg;
  cfg.mask = in.mask;
  cfg.scale = inj.kind == Defect::wrong_scale ? 1.0f / static_cast<float>(D) : in.scale;
  cfg.threads = 1;
  // Chunk length (mask_offset needs equal chunks) and the positions each rank's keys claim.
  const int64_t chunk = static_cast<int64_t>(sh.chunks[0].size());
  std::vector<std::vector<int64_t>> kpos(P);
  for (int r = 0; r < P; ++r) {
    kpos[r] = sh.tokens[r];
    if (inj.kind == Defect::mask_offset)
      for (auto& p : kpos[r]) p += inj.offset * chunk;
  }
  RingOutputs o;
  o.out = Tensor<float>({S, H, D});
  o.lse = Tensor<float>({H, S});
  std::vector<Tensor<float>> out_r(P), lse_r(P);
  for (int r = 0; r < P; ++r) {
    const int64_t n = static_cast<int64_t>(sh.tokens[r].size());
    const Tensor<float> q = verify::gather_rows(in.q, sh.tokens[r]);
    const Tokens qt{sh.tokens[r].data(), nullptr, n};
    out_r[r] = Tensor<float>({n, H, D});
    lse_r[r] = Tensor<float>({H, n});
    const bool per_step = inj.kind == Defect::bf16_steps || inj.kind == Defect::no_lse_merge;
    SoftmaxState st(n, H, D);
    Tensor<float> part({n, H, D}), part_lse({H, n});
    bool first = true;
    for (int s = 0; s < P; ++s) {
      // Stale KV: the block (data and positions) of the previous step is used again.
      const int src = hits(inj, Defect::stale_kv_forward, r, s) ? ((r - s + 1) % P + P) % P
                                                                : ((r - s) % P + P) % P;
      if (hits(inj, Defect::dropped_step, r, s)) continue;
      const Tensor<float> k = verify::gather_rows(in.k, sh.tokens[src]),
                          v = verify::gather_rows(in.v, sh.tokens[src]);
      Tokens kt{kpos[src].data(), nullptr, static_cast<int64_t>(kpos[src].size())};
      const int times = hits(inj, Defect::doubled_step, r, s) ? 2 : 1;
      if (!per_step) {
        // The mask defects: this step's keys without the causal mask, or at positions shifted.
        KernelConfig step_cfg = cfg;
        if (inj.kind == Defect::diagonal_unmasked && s == 0) step_cfg.mask.causal = false;
        std::vector<int64_t> shifted;
        if (inj.kind == Defect::token_offset &&
            (inj.step < 0 || (inj.step == 0 && s == 0) || (inj.step == 1 && s > 0))) {
          shifted = kpos[src];
          for (auto& p : shifted) p -= inj.offset;
          kt.pos = shifted.data();
        }
        for (int t = 0; t < times; ++t)
          attend(st.view(), q.view3(), k.view3(), v.view3(), qt, kt, step_cfg);
        continue;
      }
      // One finished partial per step.
      SoftmaxState ps(n, H, D);
      attend(ps.view(), q.view3(), k.view3(), v.view3(), qt, kt, cfg);
      finish(ps.view(), part.view3(), part_lse.data(), n);
      if (inj.kind == Defect::no_lse_merge) {
        for (int64_t e = 0; e < part.numel(); ++e) out_r[r][e] += part[e];
        continue;
      }
      if (first) {
        out_r[r] = part;
        lse_r[r] = part_lse;
        first = false;
      } else {
        merge(out_r[r].view3(), lse_r[r].data(), part.view3(), part_lse.data(), n);
      }
      for (int64_t e = 0; e < out_r[r].numel(); ++e) out_r[r][e] = to_float(to_bf16(out_r[r][e]));
    }
    if (!per_step) finish(st.view(), out_r[r].view3(), lse_r[r].data(), n);
    if (inj.kind == Defect::no_lse_merge) {
      // lse of the correct merge is not what this loop has; it only returns out.
      std::fill(lse_r[r].vec().begin(), lse_r[r].vec().end(), kNegInf);
    }
  }
  // Global order (zigzag_order: a rank's two chunks written in swapped order).
  for (int r = 0; r < P; ++r) {
    const int64_t n = static_cast<int64_t>(sh.tokens[r].size());
    std::vector<int64_t> dest = sh.tokens[r];
    if (inj.kind == Defect::zigzag_order)
      std::rotate(dest.begin(), dest.begin() + n / 2, dest.end());
    for (int64_t i = 0; i < n; ++i) {
      std::copy(out_r[r].data() + i * H * D, out_r[r].data() + (i + 1) * H * D,
                o.out.data() + dest[i] * H * D);
      for (int64_t h = 0; h < H; ++h) o.lse[h * S + dest[i]] = lse_r[r][h * n + i];
    }
  }
  if (inj.kind == Defect::gqa_mapping) {
    Tensor<float> out = o.out;
    for (int64_t i = 0; i < S; ++i)
      for (int64_t h = 0; h < H; ++h)
        std::copy(out.data() + (i * H + h) * D, out.data() + (i * H + h + 1) * D,
                  o.out.data() + (i * H + pi[h]) * D);
    Tensor<float> lse = o.lse;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < S; ++i) o.lse[pi[h] * S + i] = lse[h * S + i];
  }
  if (!backward) return o;

  o.dq = Tensor<float>({S, H, D});
  o.dk = Tensor<float>({S, Hkv, D});
  o.dv = Tensor<float>({S, Hkv, D});
  for (int r = 0; r < P; ++r) {
    const int64_t n = static_cast<int64_t>(sh.tokens[r].size());
    const Tensor<float> q = verify::gather_rows(in.q, sh.tokens[r]),
                        dout = verify::gather_rows(in.dout, sh.tokens[r]);
    const Tokens qt{sh.tokens[r].data(), nullptr, n};
    std::vector<float> delta(static_cast<size_t>(H * n));
    compute_delta(out_r[r].view3(), dout.view3(), delta.data(), n);
    Tensor<float> dq({n, H, D});
    for (int s = 0; s < P; ++s) {
      const int src = ((r - s) % P + P) % P;
      // Stale KV: the block (data and positions) of the previous step is used again.
      const int used = hits(inj, Defect::stale_kv, r, s) ? ((r - s + 1) % P + P) % P : src;
      const int64_t m = static_cast<int64_t>(sh.tokens[used].size());
      const Tensor<float> k = verify::gather_rows(in.k, sh.tokens[used]),
                          v = verify::gather_rows(in.v, sh.tokens[used]);
      const Tokens kt{sh.tokens[used].data(), nullptr, m};
      Tensor<float> dk({m, Hkv, D}), dv({m, Hkv, D});
      attend_backward(q.view3(), k.view3(), v.view3(), dout.view3(), lse_r[r].data(), delta.data(),
                      n, qt, kt, cfg, dq.view3(), dk.view3(), dv.view3());
      // The dK, dV accumulator travelling with block src gets this step's contribution.
      const auto& dest = sh.tokens[src];
      for (int64_t i = 0; i < std::min<int64_t>(m, static_cast<int64_t>(dest.size())); ++i)
        for (int64_t e = 0; e < Hkv * D; ++e) {
          o.dk[dest[i] * Hkv * D + e] += dk[i * Hkv * D + e];
          o.dv[dest[i] * Hkv * D + e] += dv[i * Hkv * D + e];
        }
    }
    for (int64_t i = 0; i < n; ++i)
      std::copy(dq.data() + i * H * D, dq.data() + (i + 1) * H * D,
                o.dq.data() + sh.tokens[r][i] * H * D);
  }
  return o;
}

verify::Problem to_problem(const RingInputs& in) {
  verify::Problem p;
  p.q = convert<double>(in.q);
  p.k = convert<double>(in.k);
  p.v = convert<double>(in.v);
  if (in.dout.numel()) p.dout = convert<double>(in.dout);
  p.mask = in.mask;
  p.scale = in.scale;
  return p;
}

verify::Candidate to_candidate(const RingOutputs& o, bool backward) {
  verify::Candidate c;
  c.out = convert<double>(o.out);
  c.lse = convert<double>(o.lse);
  if (backward) {
    c.dq = convert<double>(o.dq);
    c.dk = convert<double>(o.dk);
    c.dv = convert<double>(o.dv);
  }
  return c;
}

}  // namespace loom::test
