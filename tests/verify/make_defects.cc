// make_defects DIR [CONVENTION P S]: writes the defect library to disk for `loom verify` runs:
// DIR/input/{q,k,v,dout}.npy (global) and one candidate folder per defect,
// DIR/<defect>/{out,lse,dq,dk,dv}.rank{r}.npy, per rank in CONVENTION (default zigzag, P = 4,
// S = 96, causal, H = 2, Hkv = 1, D = 16).
// make_defects --shard SRC DST CONVENTION P: SRC's global out/lse/dq/dk/dv.npy -> DST per rank.
// make_defects --bf16 SRC DST: SRC's q, k, v, dout rounded to bf16 (nearest even), as float32.
// make_defects --cu FILE L1,L2,...: cu_seqlens.npy [0, L1, L1+L2, ...] in int32, as torch
// writes it.
// make_defects --relayout SRC DST BSHD|HSD: global [S,H,D] files (and lse [H,S]) rewritten as
// [1,S,H,D] (lse [1,H,S]) or [H,S,D] (lse unchanged).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include "loom/bf16.h"
#include "loom/cp.h"
#include "loom/npy.h"
#include "unit/tolerance.h"
#include "verify/defect_ring.h"

using namespace loom;
using namespace loom::test;

namespace {

// Rank r's columns of an [A, S] lse (its rows of a [S, A, B] tensor: verify::gather_rows).
Tensor<float> cols(const Tensor<float>& g, const std::vector<int64_t>& t) {
  const int64_t A = g.size(0), S = g.size(1), n = static_cast<int64_t>(t.size());
  Tensor<float> y({A, n});
  for (int64_t a = 0; a < A; ++a)
    for (int64_t i = 0; i < n; ++i) y[a * n + i] = g[a * S + t[i]];
  return y;
}

}  // namespace

int shard_mode(int argc, char** argv) {
  if (argc != 6) return 2;
  const std::string src = argv[2], dst = argv[3], conv = argv[4];
  const int P = std::stoi(argv[5]);
  std::filesystem::create_directories(dst);
  int64_t S = -1;
  for (const char* n : {"out", "lse", "dq", "dk", "dv"}) {
    const std::string f = src + "/" + n + ".npy";
    if (!std::filesystem::exists(f)) continue;
    const Tensor<float> g = read_npy_f32(f);
    const bool lse = std::string(n) == "lse";
    S = lse ? g.size(1) : g.size(0);
    const auto sh = verify::make_sharding(conv, S, P);
    for (int r = 0; r < P; ++r)
      write_npy(dst + "/" + n + ".rank" + std::to_string(r) + ".npy",
                lse ? cols(g, sh.tokens[r]) : verify::gather_rows(g, sh.tokens[r]));
  }
  return S > 0 ? 0 : 1;
}

int relayout_mode(int argc, char** argv) {
  if (argc != 5) return 2;
  const std::string src = argv[2], dst = argv[3], dims = argv[4];
  std::filesystem::create_directories(dst);
  for (const char* n : {"q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv"}) {
    const std::string f = src + "/" + n + ".npy";
    if (!std::filesystem::exists(f)) continue;
    Tensor<float> g = read_npy_f32(f);
    if (std::string(n) == "lse") {
      if (dims == "BSHD") {
        Tensor<float> y({1, g.size(0), g.size(1)});
        y.vec() = g.vec();
        g = std::move(y);
      }
      write_npy(dst + "/" + n + ".npy", g);
      continue;
    }
    const int64_t S = g.size(0), H = g.size(1), D = g.size(2);
    Tensor<float> y;
    if (dims == "BSHD") {
      y = Tensor<float>({1, S, H, D});
      y.vec() = g.vec();
    } else {
      y = Tensor<float>({H, S, D});
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) y[(h * S + s) * D + d] = g[(s * H + h) * D + d];
    }
    write_npy(dst + "/" + n + ".npy", y);
  }
  return 0;
}

int bf16_mode(int argc, char** argv) {
  if (argc != 4) return 2;
  std::filesystem::create_directories(argv[3]);
  for (const char* n : {"q", "k", "v", "dout"}) {
    Tensor<float> g = read_npy_f32(std::string(argv[2]) + "/" + n + ".npy");
    for (float& x : g.vec()) x = to_float(to_bf16(x));
    write_npy(std::string(argv[3]) + "/" + n + ".npy", g);
  }
  return 0;
}

int cu_mode(int argc, char** argv) {
  if (argc != 4) return 2;
  const std::vector<int64_t> v = parse_doc_lengths(argv[3]);  // document lengths
  std::vector<int32_t> cu = {0};
  for (int64_t x : v) cu.push_back(cu.back() + static_cast<int32_t>(x));
  std::string header =
      "{'descr': '<i4', 'fortran_order': False, 'shape': (" + std::to_string(cu.size()) + ",), }";
  while ((10 + header.size() + 1) % 64) header += ' ';
  header += '\n';
  std::string bytes = "\x93NUMPY";
  bytes += '\x01';
  bytes += '\x00';
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(cu.data()), cu.size() * 4);
  write_file_atomic(argv[2], bytes);
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--cu") return cu_mode(argc, argv);
  if (argc >= 2 && std::string(argv[1]) == "--bf16") return bf16_mode(argc, argv);
  if (argc >= 2 && std::string(argv[1]) == "--shard") return shard_mode(argc, argv);
  if (argc >= 2 && std::string(argv[1]) == "--relayout") return relayout_mode(argc, argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: make_defects DIR [CONVENTION P S]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const std::string conv = argc > 2 ? argv[2] : "zigzag";
  const int P = argc > 3 ? std::stoi(argv[3]) : 4;
  const int64_t S = argc > 4 ? std::stoll(argv[4]) : 96;
  const int64_t H = 2, Hkv = 1, D = 16;
  RingInputs in;
  in.q = random_normal({S, H, D}, 101);
  in.k = random_normal({S, Hkv, D}, 102);
  in.v = random_normal({S, Hkv, D}, 103);
  in.dout = random_normal({S, H, D}, 104);
  in.mask.causal = true;
  in.scale = 1.0f / std::sqrt(static_cast<float>(D));
  namespace fs = std::filesystem;
  fs::create_directories(dir + "/input");
  write_npy(dir + "/input/q.npy", in.q);
  write_npy(dir + "/input/k.npy", in.k);
  write_npy(dir + "/input/v.npy", in.v);
  write_npy(dir + "/input/dout.npy", in.dout);
  const auto sh = verify::make_sharding(conv, S, P);
  struct Named {
    const char* name;
    Injected inj;
    bool backward;
  };
  const Named all[] = {
      {"correct", {}, true},
      {"dropped_step", {Defect::dropped_step, 2, P - 1, 0}, false},
      {"doubled_step", {Defect::doubled_step, 1, -1, 0}, false},
      {"mask_offset", {Defect::mask_offset, -1, -1, -1}, false},
      {"zigzag_order", {Defect::zigzag_order, -1, -1, 0}, false},
      {"bf16_steps", {Defect::bf16_steps, -1, -1, 0}, false},
      {"no_lse_merge", {Defect::no_lse_merge, -1, -1, 0}, false},
      {"stale_kv", {Defect::stale_kv, P - 1, -1, 0}, true},
      {"stale_kv_forward", {Defect::stale_kv_forward, 2, -1, 0}, false},
      {"wrong_scale", {Defect::wrong_scale, -1, -1, 0}, false},
      {"nan", {}, false},  // correct, except one NaN written into out (token 15, head 0)
  };
  for (const Named& n : all) {
    RingOutputs o = run_defect_ring(in, sh, n.inj, n.backward);
    if (std::string(n.name) == "nan") o.out[15 * H * D + 2] = std::nanf("");
    const std::string d = dir + "/" + n.name;
    fs::create_directories(d);
    for (int r = 0; r < P; ++r) {
      const std::string suffix = ".rank" + std::to_string(r) + ".npy";
      write_npy(d + "/out" + suffix, verify::gather_rows(o.out, sh.tokens[r]));
      if (n.inj.kind != Defect::no_lse_merge)
        write_npy(d + "/lse" + suffix, cols(o.lse, sh.tokens[r]));
      if (n.backward) {
        write_npy(d + "/dq" + suffix, verify::gather_rows(o.dq, sh.tokens[r]));
        write_npy(d + "/dk" + suffix, verify::gather_rows(o.dk, sh.tokens[r]));
        write_npy(d + "/dv" + suffix, verify::gather_rows(o.dv, sh.tokens[r]));
      }
    }
  }
  return 0;
}
