// `loom plan`: predict and rank context-parallel configurations for a model, a sequence length
// and a cluster profile (src/plan), simulate one attention (--simulate), or measure this
// machine's profile (--calibrate).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "loom/comm.h"
#include "loom/io.h"
#include "loom/model/trainer.h"
#include "loom/npy.h"
#include "loom/plan.h"
#include "loom/rng.h"

namespace loom::tools {

namespace {

constexpr int64_t kMaxMeasureSteps = 1000000;  // --train-step's measured steps

struct PlanOptions {
  std::string model = "llama3-8b", profile, mode = "train", docs, json, svg, calibrate;
  std::string strategies;
  int64_t seq = 131072, window = 0;
  int devices = 8, top = 15, threads = 1, ranks_per_node = 2;
  double memory_limit_gb = 0;
  bool explain = false, zigzag_only = false;
  // --simulate: one attention case.
  bool simulate = false;
  std::string strategy = "ring", layout = "zigzag", dtype = "fp32";
  int ranks = 2;
  DegreeOptions degrees;  // the registry's degree options (--ulysses, --inner, ...)
  int64_t heads = 8, kv_heads = 0, head_dim = 64;
  bool causal = true, forward_only = false;
  // --train-step: loom train's step on meshes of this machine.
  bool train_step = false, checkpoint_activations = false;
  std::vector<std::string> meshes;
  int64_t batch = 8, measure_steps = 5;
};

// A model name or LAYERS,DIM,HEADS,KV_HEADS,FFN,VOCAB; FFN 0 is 4 x DIM, as loom train's --ffn 0.
plan::ModelShape parse_model(const std::string& s) {
  if (s == "llama3-8b") return {32, 4096, 32, 8, 14336, 128256};
  if (s == "llama3-70b") return {80, 8192, 64, 8, 28672, 128256};
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    errno = 0;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    const bool ffn = v.size() == 4;
    LOOM_CHECK(!item.empty() && end && *end == '\0' && errno == 0 && (x > 0 || (ffn && x == 0)),
               InvalidArgument,
               "--model '" << s << "': '" << item << "' is not a positive integer"
                           << (ffn ? " or 0 (ffn 0: 4 x dim)" : "")
                           << " (expected llama3-8b, llama3-70b or "
                              "layers,dim,heads,kv-heads,ffn,vocab)");
    v.push_back(x);
  }
  LOOM_CHECK(v.size() == 6, InvalidArgument,
             "--model '" << s << "' needs 6 numbers: layers,dim,heads,kv-heads,ffn,vocab");
  LOOM_CHECK(v[4] > 0 || v[1] <= (int64_t{1} << 60), InvalidArgument,
             "--model '" << s << "': dim " << v[1] << " is too large");
  return {v[0], v[1], v[2], v[3], v[4] > 0 ? v[4] : 4 * v[1], v[5]};
}

// The text report: standard output, unless an output is "-" (standard output): then the text
// stays off it, so that it holds that output alone (docs/cli.md, "Files"), as in loom attn.
// `--json -` mixed the table into the JSON.
bool text_report(const PlanOptions& o) {
  return o.json != "-" && o.svg != "-" && o.calibrate != "-";
}

// printf to standard output when `on`.
__attribute__((format(printf, 2, 3))) void text(bool on, const char* format, ...) {
  if (!on) return;
  va_list args;
  va_start(args, format);
  std::vprintf(format, args);
  va_end(args);
}

// One rank of a simulation, without its per-step tile counts.
nlohmann::json rank_json(const plan::RankSim& x, size_t r) {
  return {{"rank", r},
          {"forward_tiles", x.fwd_tiles},
          {"tiles", x.fwd_tiles + x.bwd_tiles},
          {"full_tiles", x.full_tiles},
          {"partial_tiles", x.partial_tiles},
          {"bytes_sent", x.bytes_sent},
          {"bytes_recv", x.bytes_recv},
          {"peak_buffer_bytes", x.peak_buffer_bytes},
          {"gathered_bytes", x.gathered_bytes},
          {"compute_s", x.compute_s},
          {"exposed_comm_s", x.comm_s},
          {"idle_s", x.idle_s},
          {"exposed_by_kind", x.comm_by_kind}};
}

nlohmann::json sim_json(const plan::AttnSim& s) {
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    nlohmann::json x = rank_json(s.ranks[r], r);
    x["step_tiles"] = s.ranks[r].step_tiles;
    ranks.push_back(std::move(x));
  }
  return {{"forward_s", s.forward_s},
          {"backward_s", s.backward_s},
          {"balance", s.balance()},
          {"ranks", ranks}};
}

// sim_json(s).dump(2), written rank by rank with each rank on one line: as one document the
// per-step tile counts of 8192 ranks (67 M numbers) took 3.6 GB and 22 s, and 809 MB on disk.
std::string sim_json_text(const plan::AttnSim& s) {
  auto num = [](double x) { return nlohmann::json(x).dump(); };
  std::string out = "{\n  \"backward_s\": " + num(s.backward_s) +
                    ",\n  \"balance\": " + num(s.balance()) +
                    ",\n  \"forward_s\": " + num(s.forward_s) + ",\n  \"ranks\": [";
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    std::string t = rank_json(s.ranks[r], r).dump();
    t.pop_back();  // the closing brace: the step counts go in before it
    t += ",\"step_tiles\":[";
    const std::vector<int64_t>& st = s.ranks[r].step_tiles;
    for (size_t i = 0; i < st.size(); ++i) (t += i ? "," : "") += std::to_string(st[i]);
    out += (r ? ",\n    " : "\n    ") + t + "]}";
  }
  out += s.ranks.empty() ? "]\n}\n" : "\n  ]\n}\n";
  return out;
}

nlohmann::json candidate_json(const plan::Candidate& c) {
  return {{"name", c.name()},
          {"dp", c.dp},
          {"tp", c.tp},
          {"ulysses", c.ulysses},
          {"ring", c.ring},
          {"inner", c.inner},
          {"strategy", c.strategy},
          {"layout", to_string(c.layout)},
          {"checkpoint", c.checkpoint},
          {"fits", c.fits},
          {"why_not", c.why_not},
          {"step_s", c.step_s},
          {"attention_s", c.attn_s},
          {"gemm_s", c.gemm_s},
          {"recompute_s", c.recompute_s},
          {"exposed_cp_comm_s", c.exposed_cp_s},
          {"exposed_by_kind", c.exposed_by_kind},
          {"tp_comm_s", c.tp_comm_s},
          {"dp_comm_s", c.dp_comm_s},
          {"cp_idle_s", c.cp_idle_s},
          {"memory_bytes", c.memory_bytes},
          {"mfu", c.mfu},
          {"tokens_per_s", c.tokens_per_s},
          {"balance", c.balance}};
}

// Stacked bars of the ranked candidates and the simulated timeline of the winner's attention.
std::string plan_svg(const plan::PlanResult& r, const PlanOptions& o, int top) {
  const int n = std::min<int>(top, static_cast<int>(r.ranked.size()));
  const int left = 260, width = 1100, plot_w = width - left - 40, bar_h = 18;
  const plan::AttnSim& s = r.best_attn;
  const int show_ranks = std::min<int>(16, static_cast<int>(s.ranks.size()));
  const int top_bars = 50, tl_top = top_bars + n * (bar_h + 6) + 90, row_h = 24;
  const int height = tl_top + show_ranks * row_h + 80;
  double tmax = 0;
  // Bars are seconds per sequence (step time / dp): the ranking is by tokens per second.
  for (int i = 0; i < n; ++i) tmax = std::max(tmax, r.ranked[i].step_s / r.ranked[i].dp);
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(2);
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
        "fill=\"white\"/>\n";
  os << "<text x=\"10\" y=\"22\" font-size=\"15\">loom plan: " << o.model << ", S=" << o.seq << ", "
     << o.devices << " devices, " << o.mode
     << " (predicted seconds per sequence = step time / dp)</text>\n";
  const char* names[] = {"attention compute", "exposed cp comm", "GEMMs",
                         "recompute",         "TP/SP comm",      "exposed DP all-reduce"};
  const char* colours[] = {"#3b73b9", "#d62728", "#2ca02c", "#9467bd", "#ff9f1c", "#8c564b"};
  for (int i = 0; i < n; ++i) {
    const plan::Candidate& c = r.ranked[i];
    const double k = 1.0 / c.dp;
    const double parts[] = {k * std::max(0.0, c.attn_s - c.exposed_cp_s),
                            k * c.exposed_cp_s,
                            k * c.gemm_s,
                            k * c.recompute_s,
                            k * c.tp_comm_s,
                            k * c.dp_comm_s};
    const int y = top_bars + i * (bar_h + 6);
    os << "<text x=\"10\" y=\"" << y + 13 << "\">" << i + 1 << ". " << c.name() << "</text>\n";
    double x = left;
    for (int k = 0; k < 6; ++k) {
      const double w = parts[k] / tmax * plot_w;
      if (w <= 0) continue;
      os << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << bar_h
         << "\" fill=\"" << colours[k] << "\"><title>" << names[k] << ": " << parts[k]
         << " s</title></rect>\n";
      x += w;
    }
    os << "<text x=\"" << x + 4 << "\" y=\"" << y + 13 << "\">" << c.step_s / c.dp << " s</text>\n";
  }
  const int ly = top_bars + n * (bar_h + 6) + 20;
  for (int k = 0; k < 6; ++k)
    os << "<rect x=\"" << 10 + 175 * k << "\" y=\"" << ly << "\" width=\"12\" height=\"12\" fill=\""
       << colours[k] << "\"/><text x=\"" << 26 + 175 * k << "\" y=\"" << ly + 11 << "\">"
       << names[k] << "</text>\n";
  // Timeline of the winner's attention (one layer, forward + backward), first ranks.
  double t_end = 0;
  for (const plan::Event& e : s.events) t_end = std::max(t_end, e.t1);
  t_end = std::max(t_end, 1e-12);
  os << "<text x=\"10\" y=\"" << tl_top - 20 << "\" font-size=\"14\">simulated timeline of the "
     << "winner's attention, one layer (first " << show_ranks << " of " << s.ranks.size()
     << " cp ranks), " << t_end * 1e3 << " ms</text>\n";
  for (int rk = 0; rk < show_ranks; ++rk) {
    const int y = tl_top + rk * row_h;
    os << "<text x=\"10\" y=\"" << y + 15 << "\">cp rank " << rk << "</text>\n<rect x=\"" << left
       << "\" y=\"" << y << "\" width=\"" << plot_w << "\" height=\"" << row_h - 4
       << "\" fill=\"#f4f4f4\"/>\n";
  }
  for (const plan::Event& e : s.events) {
    if (e.rank >= show_ranks) continue;
    const int y = tl_top + e.rank * row_h;
    const double a = left + e.t0 / t_end * plot_w;
    const double w = std::max(0.3, (e.t1 - e.t0) / t_end * plot_w);
    const bool comp = e.kind == "compute", wait = e.kind == "wait";
    const bool flight = e.kind == "send" || e.kind == "recv";
    os << "<rect x=\"" << a << "\" y=\"" << (flight ? y + 1 : y + 7) << "\" width=\"" << w
       << "\" height=\"" << (flight ? 5 : 12) << "\" fill=\""
       << (comp   ? (e.step % 2 ? "#6f9fd8" : "#3b73b9")
           : wait ? "#d62728"
                  : "#ff9f1c")
       << "\"><title>" << e.kind << " step " << e.step << ": " << (e.t1 - e.t0) * 1e3
       << " ms</title></rect>\n";
  }
  const int ay = tl_top + show_ranks * row_h + 20;
  os << "<rect x=\"10\" y=\"" << ay
     << "\" width=\"12\" height=\"12\" fill=\"#3b73b9\"/><text "
        "x=\"26\" y=\""
     << ay + 11 << "\">compute (steps in alternating shades)</text><rect x=\"270\" y=\"" << ay
     << "\" width=\"12\" height=\"12\" fill=\"#ff9f1c\"/><text x=\"286\" y=\"" << ay + 11
     << "\">transfer in flight / collective</text><rect x=\"520\" y=\"" << ay
     << "\" width=\"12\" height=\"12\" fill=\"#d62728\"/><text x=\"536\" y=\"" << ay + 11
     << "\">waiting (exposed communication)</text>\n</svg>\n";
  return os.str();
}

// --train-step: one rank of loom train's model measured here, then every --mesh predicted.
// Medians over `steps` steps after two warm-up steps, each figure the step's difference of the
// trainer's cumulative counters.
plan::TrainMeasure measure_one_rank(model::TrainConfig c, int64_t steps) {
  c.par.mesh = MeshShape{};
  c.par.strategy = Strategy::ring;
  c.par.inner = c.par.degree = 0;
  c.steps = steps + 2;
  // Synthetic text (the step time does not depend on which bytes): words of Philox letters.
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(1 << 20, 4 * (c.seq + 1)));
  std::string text(bytes, ' ');
  const uint64_t key = rng_key(c.seed, "train-step text");
  for (size_t i = 0; i < bytes; ++i) {
    const uint32_t x = philox4x32({static_cast<uint32_t>(i), 0, 0, 0}, key)[0];
    text[i] = x % 7 == 0 ? (x % 91 == 0 ? '\n' : ' ') : static_cast<char>('a' + (x >> 8) % 26);
  }
  const model::Corpus corpus = model::make_corpus(text, "synthetic text");
  std::vector<double> att, other, upd, rest;
  run_local(1, [&](Communicator& w) {
    model::Trainer t(w, c, corpus);
    for (int64_t i = 0; i < c.steps; ++i) {
      const model::RankReport a = t.reports()[0];
      const model::StepResult r = t.train_step();
      const model::RankReport b = t.reports()[0];
      if (i < 2) continue;
      const double fb = b.total_s - a.total_s, u = b.update_s - a.update_s;
      att.push_back(b.attention_s - a.attention_s);
      other.push_back(fb - (b.attention_s - a.attention_s));
      upd.push_back(u);
      rest.push_back(std::max(0.0, r.seconds - fb - u));
    }
  });
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return plan::TrainMeasure{median(att), median(other), median(upd), median(rest)};
}

// The largest size --mesh takes for each of dp, tp, ulysses and ring (far above any job); the
// message names it (2147483647 was "not an integer >= 1").
constexpr long kMaxMeshSize = 1 << 20;

MeshShape parse_mesh(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    errno = 0;
    const long x = std::strtol(item.c_str(), &end, 10);
    const bool integer = !item.empty() && end && *end == '\0' && errno == 0;
    LOOM_CHECK(
        integer && x >= 1 && x <= kMaxMeshSize, InvalidArgument,
        "--mesh '" << s << "': '" << item << "' is not an integer in [1, " << kMaxMeshSize << "]");
    v.push_back(static_cast<int>(x));
  }
  LOOM_CHECK(v.size() == 4, InvalidArgument,
             "--mesh '" << s << "' needs 4 numbers: dp,tp,ulysses,ring");
  // The world too (dp x tp x ulysses x ring, an int): 1048576 x 4 wrapped it.
  const double world = double(v[0]) * double(v[1]) * double(v[2]) * double(v[3]);
  LOOM_CHECK(world <= double(kMaxMeshSize), InvalidArgument,
             "--mesh '" << s << "' is a world of " << std::fixed << std::setprecision(0) << world
                        << " ranks, at most " << kMaxMeshSize);
  MeshShape m;
  m.dp = v[0];
  m.tp = v[1];
  m.ulysses = v[2];
  m.ring = v[3];
  return m;
}

// --profile: a file, as given; else, for a bare name ("h100_sxm" or "h100_sxm.json") no file
// has, the shipped profile of that name: installed in share/loom/profiles/ (found from the
// running executable, so an installed loom needs no source tree), then this build's source tree's
// plan/profiles/ (cmake/install.cmake defines both). IoError naming where it looked and the
// names found there when neither has it.
std::string profile_path(const std::string& given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (given.empty() || given == "-" || given == "." || given == ".." ||
      given.find('/') != std::string::npos || fs::exists(given, ec))
    return given;  // read as given (load_profile says what is wrong with it)
  std::vector<fs::path> dirs;
#ifdef LOOM_PROFILES_FROM_BIN
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back(exe.parent_path() / LOOM_PROFILES_FROM_BIN);
#endif
#ifdef LOOM_SOURCE_PROFILES
  dirs.emplace_back(LOOM_SOURCE_PROFILES);
#endif
  const std::string file = given.size() > 5 && given.compare(given.size() - 5, 5, ".json") == 0
                               ? given
                               : given + ".json";
  std::string looked, names;
  for (const fs::path& dir : dirs) {
    const fs::path candidate = (dir / file).lexically_normal();
    if (fs::is_regular_file(candidate, ec)) return candidate.string();
    if (!fs::is_directory(dir, ec)) continue;  // not installed, or no source tree here
    looked += (looked.empty() ? "" : ", ") + dir.lexically_normal().string();
    if (!names.empty()) continue;
    std::vector<std::string> found;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.path().extension() == ".json") found.push_back(entry.path().stem().string());
    }
    std::sort(found.begin(), found.end());
    for (const std::string& n : found) names += (names.empty() ? "" : ", ") + n;
  }
  throw IoError("cannot read profile " + given + ": no such file, and no shipped profile " + file +
                    (looked.empty() ? " (none installed)" : " in " + looked) +
                    (names.empty() ? "" : " (the shipped profiles: " + names + ")") +
                    "; give a profile file's path or a shipped profile's name",
                __FILE__, __LINE__);
}

int run_train_step(const CLI::App* app, const PlanOptions& o) {
  const bool show = text_report(o);
  LOOM_CHECK(!o.profile.empty(), InvalidArgument,
             "--train-step needs --profile FILE (one written by loom plan --calibrate)");
  LOOM_CHECK(!o.meshes.empty(), InvalidArgument,
             "--train-step needs at least one --mesh dp,tp,ulysses,ring");
  const plan::Profile prof = plan::load_profile(profile_path(o.profile));
  // loom train's defaults where the plan defaults (a cluster-sized model) do not apply.
  plan::ModelShape shape{4, 128, 4, 2, 512, 256};
  if (app->count("--model")) shape = parse_model(o.model);
  LOOM_CHECK(shape.vocab == 256, InvalidArgument,
             "--train-step: loom train is byte-level, so the model's vocab must be 256 (got "
                 << shape.vocab << ")");
  const int64_t seq = app->count("--seq") ? o.seq : 256;
  // Bounded: it counts steps run on this machine, and 2 warm-up steps are added (2^63 - 1 wrapped
  // to a negative count, refused as a "--steps" this command does not have).
  LOOM_CHECK(o.measure_steps >= 1 && o.measure_steps <= kMaxMeasureSteps, InvalidArgument,
             "--measure-steps must be in [1, " << kMaxMeasureSteps << "], got " << o.measure_steps);
  model::TrainConfig c;
  c.model.layers = shape.layers;
  c.model.dim = shape.dim;
  c.model.heads = shape.heads;
  c.model.kv_heads = shape.kv_heads;
  c.model.ffn = shape.ffn;
  c.seq = seq;
  c.batch = o.batch;
  c.precision = model::parse_precision(o.dtype);
  c.checkpoint_activations = o.checkpoint_activations;
  c.par.layout = parse_layout(o.layout);
  c.par.threads = o.threads;
  int inner = 0;  // ring2d's inner ring (--inner; 0 when not given)
  for (const auto& [name, value] : o.degrees.values())
    if (name == "inner" && app->count("--inner")) inner = value;
  // Every mesh is checked (as loom train would) before anything is measured.
  std::vector<plan::TrainCase> cases;
  for (const std::string& ms : o.meshes) {
    plan::TrainCase t;
    t.model = shape;
    t.model.ffn = c.model.ffn_dim();
    t.seq = seq;
    t.batch = o.batch;
    t.mesh = parse_mesh(ms);
    model::ParallelConfig par = c.par;
    par.mesh = t.mesh;
    par.strategy =
        app->count("--strategy") ? parse_strategy(o.strategy) : model::default_strategy(t.mesh);
    t.strategy = to_string(par.strategy);
    // As loom train: ring2d needs --inner, and --inner is ring2d's only (it was ignored).
    const bool ring2d = par.strategy == Strategy::ring2d;
    LOOM_CHECK(ring2d == (inner != 0), InvalidArgument,
               (ring2d ? "--strategy ring2d needs --inner N (ranks per inner ring)"
                       : "--inner is only for --strategy ring2d (mesh '" + ms + "' runs " +
                             t.strategy + ")"));
    t.inner = ring2d ? inner : 1;
    par.inner = ring2d ? inner : 0;
    model::validate(c.model, par, t.mesh.world(), seq);
    LOOM_CHECK(o.batch >= 1 && o.batch % t.mesh.dp == 0, InvalidArgument,
               "--batch " << o.batch << " must be a positive multiple of dp " << t.mesh.dp);
    t.layout = c.par.layout;
    t.dtype_bytes = c.precision == model::Precision::bf16 ? 2 : 4;
    t.checkpoint = o.checkpoint_activations;
    cases.push_back(t);
  }
  // The measured rank is a real one-rank loom train run: refuse, as loom train does, what does
  // not fit (--seq 1e9 ran on past 3.8 GB with no estimate), against --memory-limit GB or the
  // machine's available memory.
  {
    model::TrainConfig one = c;
    one.par.mesh = MeshShape{};
    const double text_bytes = std::max(double(1 << 20), 4.0 * (double(c.seq) + 1.0));
    check_memory(estimate_train_bytes(one, 1, text_bytes),
                 app->count("--memory-limit")
                     ? static_cast<int64_t>(std::min(o.memory_limit_gb * 1e9, 9e18))
                     : -1,
                 "loom plan --train-step (one measured rank of the model)", "--memory-limit",
                 blas_mapped_bytes(1, o.threads));
  }
  model::set_blas_threads(o.threads);
  std::fprintf(stderr, "loom plan: measuring one rank of the model (%lld steps)...\n",
               static_cast<long long>(o.measure_steps + 2));
  const plan::TrainMeasure one = measure_one_rank(c, o.measure_steps);
  text(show,
       "loom plan --train-step: model layers=%lld dim=%lld heads=%lld kv-heads=%lld ffn=%lld, "
       "seq %lld, batch %lld, %s%s, profile %s\n",
       static_cast<long long>(shape.layers), static_cast<long long>(shape.dim),
       static_cast<long long>(shape.heads), static_cast<long long>(shape.kv_heads),
       static_cast<long long>(c.model.ffn_dim()), static_cast<long long>(seq),
       static_cast<long long>(o.batch), o.dtype.c_str(),
       o.checkpoint_activations ? ", activation checkpointing" : "", prof.name.c_str());
  text(show,
       "  one rank, measured: attention %.2f ms, other forward+backward %.2f ms, update %.2f ms, "
       "rest %.2f ms per step\n",
       one.attention_s * 1e3, one.other_s * 1e3, one.update_s * 1e3, one.rest_s * 1e3);
  text(show, "  predicted per step, slowest rank (ms):\n");
  text(show, "  %-22s %9s %9s %9s %9s %9s %9s %9s\n", "mesh (dp tp u r)", "step", "attention",
       "other", "tp comm", "grads", "update", "rest");
  nlohmann::json out;
  out["one_rank"] = {{"attention_s", one.attention_s},
                     {"other_s", one.other_s},
                     {"update_s", one.update_s},
                     {"rest_s", one.rest_s}};
  out["meshes"] = nlohmann::json::array();
  for (size_t i = 0; i < cases.size(); ++i) {
    const plan::TrainCase& t = cases[i];
    const plan::TrainStepPrediction r = plan::predict_train_step(t, one, prof);
    char name[64];
    std::snprintf(name, sizeof name, "%d %d %d %d %s", t.mesh.dp, t.mesh.tp, t.mesh.ulysses,
                  t.mesh.ring, t.mesh.cp() > 1 ? t.strategy.c_str() : "");
    text(show, "  %-22s %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", name, r.step_s * 1e3,
         r.attention_s * 1e3, r.other_s * 1e3, r.tp_comm_s * 1e3, r.grad_comm_s * 1e3,
         r.update_s * 1e3, r.rest_s * 1e3);
    out["meshes"].push_back({{"mesh", o.meshes[i]},
                             {"strategy", t.strategy},
                             {"step_s", r.step_s},
                             {"attention_s", r.attention_s},
                             {"attention_scale", r.attention_scale},
                             {"other_s", r.other_s},
                             {"tp_comm_s", r.tp_comm_s},
                             {"grad_comm_s", r.grad_comm_s},
                             {"update_s", r.update_s},
                             {"rest_s", r.rest_s}});
  }
  if (!o.json.empty()) write_file_atomic(o.json, out.dump(2) + "\n");
  return 0;
}

void log_line(const char* s) {
  std::fprintf(stderr, "%s\n", s);
}

// The modes of loom plan, and which options each reads. An option given to a mode that does not
// read it is refused (--simulate ignored --model and --devices, the search ignored --heads).
enum Mode { kSearch = 1, kSimulate = 2, kCalibrate = 4, kTrainStep = 8 };

std::string mode_name(int mode) {
  switch (mode) {
    case kSimulate:
      return "--simulate";
    case kCalibrate:
      return "--calibrate";
    case kTrainStep:
      return "--train-step";
    default:
      return "the search";
  }
}

void check_mode_options(const CLI::App* app, int mode) {
  std::vector<std::pair<std::string, int>> table = {
      {"--model", kSearch | kTrainStep},
      {"--seq", kSearch | kSimulate | kTrainStep},
      {"--docs", kSearch | kSimulate},
      {"--window", kSearch | kSimulate},
      {"--devices", kSearch},
      {"--profile", kSearch | kSimulate | kTrainStep},
      {"--mode", kSearch},
      {"--memory-limit", kSearch | kTrainStep},
      {"--strategies", kSearch},
      {"--zigzag-only", kSearch},
      {"--top", kSearch},
      {"--explain", kSearch},
      {"--json", kSearch | kSimulate | kTrainStep},
      {"--svg", kSearch},
      {"--threads", kCalibrate | kTrainStep},
      {"--ranks-per-node", kCalibrate},
      {"--strategy", kSimulate | kTrainStep},
      {"--layout", kSimulate | kTrainStep},
      {"--ranks", kSimulate},
      {"--heads", kSimulate},
      {"--kv-heads", kSimulate},
      {"--head-dim", kSimulate},
      {"--dtype", kSimulate | kTrainStep},
      {"--causal", kSimulate},
      {"--forward-only", kSimulate},
      {"--mesh", kTrainStep},
      {"--batch", kTrainStep},
      {"--checkpoint-activations", kTrainStep},
      {"--measure-steps", kTrainStep},
  };
  // The registry's degree options are --simulate's; --inner (ring2d) is --train-step's too.
  for (const StrategyInfo& info : strategies())
    if (!info.option.empty())
      table.emplace_back(info.option, kSimulate | (info.option == "--inner" ? kTrainStep : 0));
  for (const auto& [name, modes] : table) {
    if (app->count(name) == 0 || (modes & mode)) continue;
    std::vector<std::string> names;
    for (int m : {kSearch, kSimulate, kCalibrate, kTrainStep})
      if (modes & m) names.push_back(mode_name(m));
    std::string owners;
    for (size_t i = 0; i < names.size(); ++i)
      owners += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
    throw InvalidArgument((name == "--causal" ? "--causal/--no-causal" : name) +
                          " does not apply to " + mode_name(mode) + " (it is an option of " +
                          owners + ")");
  }
}

// --docs L1,L2,... checked against --seq as loom attn does.
std::vector<int64_t> checked_docs(const CLI::App* app, const PlanOptions& o) {
  if (!app->count("--docs")) return {};
  std::vector<int64_t> docs = parse_doc_lengths(o.docs);
  int64_t sum = 0;
  for (int64_t l : docs)
    LOOM_CHECK(!__builtin_add_overflow(sum, l, &sum), InvalidArgument,
               "--docs lengths sum to more than 2^63 (the sequence has " << o.seq << " tokens)");
  LOOM_CHECK(
      sum == o.seq, InvalidArgument,
      "--docs lengths sum to " << sum << " but the sequence has " << o.seq << " tokens (--seq)");
  return docs;
}

// --simulate: one attention, with loom attn's rules for the problem and the strategy's options.
int run_simulate(const CLI::App* app, const PlanOptions& o, const plan::Profile& prof) {
  const bool show = text_report(o);
  LOOM_CHECK(o.seq >= 1, InvalidArgument, "--seq must be >= 1, got " << o.seq);
  LOOM_CHECK(o.heads >= 1, InvalidArgument, "--heads must be >= 1, got " << o.heads);
  LOOM_CHECK(!app->count("--kv-heads") || o.kv_heads >= 1, InvalidArgument,
             "--kv-heads must be >= 1, got " << o.kv_heads);
  const int64_t kv_heads = app->count("--kv-heads") ? o.kv_heads : o.heads;
  LOOM_CHECK(o.head_dim >= 1 && o.head_dim <= kMaxHeadDim, InvalidArgument,
             "--head-dim must be in [1, " << kMaxHeadDim << "], got " << o.head_dim);
  LOOM_CHECK(o.heads % kv_heads == 0, InvalidArgument,
             "--heads (" << o.heads << ") must be a multiple of --kv-heads (" << kv_heads << ")");
  LOOM_CHECK(o.window >= 0, InvalidArgument,
             "--window must be >= 0 (0 = no window), got " << o.window);
  LOOM_CHECK(o.ranks >= 1, InvalidArgument, "--ranks must be >= 1, got " << o.ranks);
  LOOM_CHECK(o.dtype == "fp32" || o.dtype == "bf16", InvalidArgument,
             "unknown --dtype '" << o.dtype << "' (choose fp32 or bf16)");
  const std::vector<std::string> known = plan::schedule_names();
  if (std::find(known.begin(), known.end(), o.strategy) == known.end()) {
    std::string names;
    for (const std::string& n : known) names += (names.empty() ? "" : ", ") + n;
    throw InvalidArgument("unknown strategy '" + o.strategy + "' (choose " + names + ")");
  }
  // The strategy's degree option given exactly when it takes one, and its head and group rules
  // (loom attn's checks: --ulysses with ring and hybrid without --ulysses were run anyway).
  CpConfig cfg;
  cfg.strategy = parse_strategy(o.strategy);
  o.degrees.apply(cfg, o.strategy);
  check_cp_config(cfg, o.ranks, o.heads, kv_heads);
  plan::AttnCase c;
  c.strategy = o.strategy;
  c.layout = parse_layout(o.layout);
  c.seq = o.seq;
  c.doc_lengths = checked_docs(app, o);
  c.ranks = o.ranks;
  c.ulysses = cfg.ulysses;
  c.inner = std::max(1, cfg.inner);
  c.heads = o.heads;
  c.kv_heads = kv_heads;
  c.head_dim = o.head_dim;
  c.mask.causal = o.causal;
  c.mask.window = o.window;
  c.dtype_bytes = o.dtype == "bf16" ? 2 : 4;
  c.backward = !o.forward_only;
  c.block_q = c.block_k = 64;
  const plan::AttnSim s = plan::simulate_attention(c, prof);
  text(show, "loom plan --simulate: %s / %s, %d ranks, S=%lld H=%lld HKV=%lld D=%lld %s\n",
       o.strategy.c_str(), o.layout.c_str(), o.ranks, static_cast<long long>(o.seq),
       static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads),
       static_cast<long long>(c.head_dim), o.dtype.c_str());
  text(show, "  predicted forward %.3f ms, backward %.3f ms (profile %s), balance %.3f\n",
       s.forward_s * 1e3, s.backward_s * 1e3, prof.name.c_str(), s.balance());
  // buffers: the memory seam's slots (loom attn's peak_buffer_bytes); gathered: the head-sliced
  // tensors Ulysses and hybrid gather outside the seam, which loom attn does not count.
  text(show, "  %-4s %10s %10s %12s %12s %12s %12s\n", "rank", "fwd tiles", "tiles", "sent", "recv",
       "buffers", "gathered");
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    const plan::RankSim& x = s.ranks[r];
    text(show, "  %-4zu %10lld %10lld %12lld %12lld %12lld %12lld\n", r,
         static_cast<long long>(x.fwd_tiles), static_cast<long long>(x.fwd_tiles + x.bwd_tiles),
         static_cast<long long>(x.bytes_sent), static_cast<long long>(x.bytes_recv),
         static_cast<long long>(x.peak_buffer_bytes), static_cast<long long>(x.gathered_bytes));
  }
  if (!o.json.empty()) write_file_atomic(o.json, sim_json_text(s));
  return 0;
}

int run_plan(const CLI::App* app, const PlanOptions& o) {
  // One mode per run: the others' options would be silently ignored.
  LOOM_CHECK(int(o.simulate) + int(o.train_step) + int(app->count("--calibrate") > 0) <= 1,
             InvalidArgument,
             "--simulate, --train-step and --calibrate are separate modes; give at most one");
  const int mode = o.simulate                  ? kSimulate
                   : o.train_step              ? kTrainStep
                   : app->count("--calibrate") ? kCalibrate
                                               : kSearch;
  check_mode_options(app, mode);
  LOOM_CHECK(o.top >= 1, InvalidArgument, "--top must be >= 1, got " << o.top);
  // At most a profile's largest memory (1e15 bytes): 1e300 GB became inf bytes, refused as "the
  // memory limit ... (0: the profile's), got inf".
  LOOM_CHECK(!app->count("--memory-limit") || (o.memory_limit_gb > 0 && o.memory_limit_gb <= 1e6),
             InvalidArgument,
             "--memory-limit must be a positive number of GB per device, at most 1e+06 (a "
             "profile's largest memory), got "
                 << exact_text(o.memory_limit_gb));
  // --calibrate's and --train-step's threads and ranks, before any banner or measurement
  // (--threads 2147483647 ended in libgomp's fatal error, --ranks-per-node 100000 grew past 4 GB).
  LOOM_CHECK(o.threads >= 1 && o.threads <= kMaxThreads, InvalidArgument,
             "--threads must be in [1, " << kMaxThreads << "], got " << o.threads);
  LOOM_CHECK(o.ranks_per_node >= 1 && o.ranks_per_node <= plan::kMaxCalibrateRanks, InvalidArgument,
             "--ranks-per-node must be in [1, " << plan::kMaxCalibrateRanks
                                                << "] (the node's ranks run at once as threads of "
                                                   "this process, about 3 MiB each), got "
                                                << o.ranks_per_node);
  // Distinct outputs, none of them the profile read (--json p.json --profile p.json replaced the
  // profile by the ranking; --json and --svg on one path kept only the SVG).
  check_distinct_outputs({{"--profile", o.profile},
                          {"--json", o.json},
                          {"--svg", o.svg},
                          {"--calibrate", o.calibrate}});
  // Unwritable outputs fail before the search, the measurement or the calibration.
  check_output_writable(o.json, "--json");
  check_output_writable(o.svg, "--svg");
  check_output_writable(o.calibrate, "--calibrate");
  // Under mpirun only --calibrate uses the other ranks (it measures the MPI links); in every
  // other mode each rank printed the report and rewrote --json and --svg (and --train-step timed
  // its rank beside all the others). Rank 0 runs those; the others end at once.
  if (mode != kCalibrate && launched_by_mpirun() && launcher_rank() > 0) return 0;
  if (o.train_step) return run_train_step(app, o);
  if (mode == kCalibrate) {
    LOOM_CHECK(!o.calibrate.empty(), InvalidArgument, "--calibrate needs a FILE to write");
    // The banner once: under mpirun rank 0 alone calibrates (every rank printed it).
    if (!launched_by_mpirun() || launcher_rank() <= 0)
      std::fprintf(stderr, "loom plan: calibrating this machine (%d thread%s per rank)...\n",
                   o.threads, o.threads == 1 ? "" : "s");
    if (launched_by_mpirun()) {
      // Under mpirun: the kernels and the node's local backend on rank 0, then the MPI
      // point-to-point and collectives of the whole world as the inter-node link.
      std::unique_ptr<Communicator> world = mpi_world();
      LOOM_CHECK(world->size() >= 2, InvalidArgument,
                 "--calibrate under mpirun needs >= 2 processes (got " << world->size() << ")");
      plan::Profile p;
      if (world->rank() == 0) p = plan::calibrate(o.threads, o.ranks_per_node, log_line);
      // The others wait while rank 0 calibrates: 3-5 s on a quiet node, more with many
      // --ranks-per-node, so not under the communication timeout (LOOM_TIMEOUT_S=2 failed a
      // healthy calibration); a rank 0 that fails ends the job at once (main.cc). Rank 0 comes
      // last, to ranks already waiting: the communication timeout (it waited 10 minutes too for
      // a rank that had stopped).
      world->barrier(world->rank() == 0 ? -1 : std::max(world->timeout_s(), 600.0));
      const plan::CommFigures f = plan::measure_comm(*world);
      if (world->rank() != 0) return 0;
      p.inter = plan::Link{f.bandwidth, f.latency};
      p.a2a_eff = std::min(p.a2a_eff, f.a2a_eff);
      p.allgather_eff = std::min(p.allgather_eff, f.allgather_eff);
      p.allreduce_eff = p.allgather_eff;
      const std::string how = "measured by loom plan --calibrate under mpirun (" +
                              std::to_string(world->size()) + " MPI processes)";
      p.sources["links.inter.bandwidth"] = p.sources["links.inter.latency_s"] = how;
      std::fprintf(stderr,
                   "  MPI: p2p latency %.1f us, bandwidth %.2f GB/s, a2a eff %.2f, "
                   "all_gather eff %.2f\n",
                   f.latency * 1e6, f.bandwidth * 1e-9, f.a2a_eff, f.allgather_eff);
      write_file_atomic(o.calibrate, plan::profile_json(p));
      if (o.calibrate != "-")
        std::printf("loom plan: wrote the profile of this machine to %s\n", o.calibrate.c_str());
      return 0;
    }
    plan::Profile p = plan::calibrate(o.threads, o.ranks_per_node, log_line);
    write_file_atomic(o.calibrate, plan::profile_json(p));
    if (o.calibrate != "-")
      std::printf("loom plan: wrote the profile of this machine to %s\n", o.calibrate.c_str());
    return 0;
  }
  LOOM_CHECK(!o.profile.empty(), InvalidArgument,
             "--profile FILE is required (a shipped profile's name, h100_sxm, h200, a100_80gb or "
             "cpu_epyc7763_node, or one written by --calibrate)");
  const plan::Profile prof = plan::load_profile(profile_path(o.profile));
  if (o.simulate) return run_simulate(app, o, prof);
  // The search: what would make every candidate invalid is refused here, naming it (a negative
  // --window or --docs not summing to --seq rejected every candidate, explained nowhere).
  LOOM_CHECK(o.mode == "train" || o.mode == "prefill", InvalidArgument,
             "--mode must be train or prefill, got '" << o.mode << "'");
  LOOM_CHECK(o.seq >= 1, InvalidArgument, "--seq must be >= 1, got " << o.seq);
  LOOM_CHECK(o.window >= 0, InvalidArgument,
             "--window must be >= 0 (0 = no window), got " << o.window);
  LOOM_CHECK(o.devices >= 1, InvalidArgument, "--devices must be >= 1, got " << o.devices);
  const std::vector<int64_t> docs = checked_docs(app, o);
  plan::PlanRequest req;
  req.model = parse_model(o.model);
  req.seq = o.seq;
  req.doc_lengths = docs;
  req.window = o.window;
  req.devices = o.devices;
  req.train = o.mode == "train";
  req.memory_limit = o.memory_limit_gb * 1e9;
  req.all_layouts = !o.zigzag_only;
  if (!o.strategies.empty()) {
    std::stringstream ss(o.strategies);
    std::string s;
    while (std::getline(ss, s, ',')) req.strategies.push_back(s);
  }
  // A long search says how far it is on stderr (a device count with many divisors, 720720,
  // searched for minutes without a word): every LOOM_PLAN_PROGRESS_S seconds (default 10, 0:
  // never).
  const double every = env_seconds("LOOM_PLAN_PROGRESS_S", 10, 0, 1e9);
  if (every > 0) {
    const auto start = std::chrono::steady_clock::now();
    auto next = start + std::chrono::duration<double>(every);
    req.progress = [start, next, every](double done) mutable {
      const auto now = std::chrono::steady_clock::now();
      if (now < next || done >= 1) return;
      next = now + std::chrono::duration<double>(every);
      const double t = std::chrono::duration<double>(now - start).count();
      std::fprintf(stderr, "loom plan: searching, %.0f %% done after %.0f s",
                   std::floor(100 * done), t);
      if (done > 0.01) std::fprintf(stderr, ", about %.0f s left", t * (1 - done) / done);
      std::fprintf(stderr, " (narrow it with --strategies or --zigzag-only)\n");
    };
  }
  const plan::PlanResult r = plan::plan(req, prof);
  const bool show = text_report(o);
  const plan::ModelShape& m = req.model;
  text(show,
       "loom plan: model %lld layers, dim %lld, %lld heads (%lld kv), ffn %lld, vocab %lld (%.2fB "
       "params); S=%lld, %d devices, profile %s, %s\n",
       static_cast<long long>(m.layers), static_cast<long long>(m.dim),
       static_cast<long long>(m.heads), static_cast<long long>(m.kv_heads),
       static_cast<long long>(m.ffn), static_cast<long long>(m.vocab), m.params() / 1e9,
       static_cast<long long>(o.seq), o.devices, prof.name.c_str(), o.mode.c_str());
  text(show, "  %zu candidates ranked, %zu rejected, planned in %.2f s\n", r.ranked.size(),
       r.rejected.size(), r.seconds);
  const int n = std::min<int>(o.top, static_cast<int>(r.ranked.size()));
  // The times in the unit of the slowest row shown: seconds, or ms / us for small problems
  // (a 40 us step read "0.000" in every time column).
  double slowest = 0;
  for (int i = 0; i < n; ++i) slowest = std::max(slowest, r.ranked[i].step_s);
  const char* unit = slowest >= 1 || n == 0 ? "s" : slowest >= 1e-3 ? "ms" : "us";
  const double per_s = slowest >= 1 || n == 0 ? 1 : slowest >= 1e-3 ? 1e3 : 1e6;
  auto head = [&](const char* what) { return std::string(what) + " " + unit; };
  text(show, "  %-3s %-38s %9s %6s %11s %7s %9s %9s %9s %9s %7s\n", "#", "configuration",
       head("step").c_str(), "MFU%", "tokens/s", "GB/dev", head("cp exp").c_str(),
       head("tp").c_str(), head("dp").c_str(), head("recomp").c_str(), "balance");
  for (int i = 0; i < n; ++i) {
    const plan::Candidate& c = r.ranked[i];
    text(show, "  %-3d %-38s %9.3f %6.1f %11.0f %7s %9.3f %9.3f %9.3f %9.3f %7.3f\n", i + 1,
         c.name().c_str(), c.step_s * per_s, 100 * c.mfu, c.tokens_per_s,
         plan::gb_text(c.memory_bytes).c_str(), c.exposed_cp_s * per_s, c.tp_comm_s * per_s,
         c.dp_comm_s * per_s, c.recompute_s * per_s, c.balance);
  }
  if (!r.ranked.empty()) {  // a winner without a cp group has none (the line was left empty)
    const auto& kinds = r.ranked.front().exposed_by_kind;
    text(show, "  exposed cp communication of #1 by kind:%s",
         kinds.empty() ? " none (no cp group)" : "");
    for (const auto& [k, v] : kinds) text(show, " %s %.3f %s", k.c_str(), v * per_s, unit);
    text(show, "\n");
  }
  int mem = 0;
  for (const plan::Candidate& c : r.rejected) mem += c.over_memory;
  if (!r.rejected.empty()) {
    text(show, "  rejected: %d do not fit in memory, %zu are invalid; for example:\n", mem,
         r.rejected.size() - mem);
    // Up to four examples, an invalid one among them where there is one (they came last, and
    // with many memory rejections no example said why the others were invalid).
    int shown = 0;
    std::string last;
    const bool memory_first = mem == 0 || mem == static_cast<int>(r.rejected.size());
    for (const bool memory_pass : {true, false}) {
      const int room = memory_pass && !memory_first ? 3 : 4;
      for (const plan::Candidate& c : r.rejected) {
        if (c.over_memory != memory_pass || c.why_not == last || shown >= room) continue;
        last = c.why_not;
        text(show, "    %s: %s\n", c.name().c_str(), c.why_not.c_str());
        ++shown;
      }
    }
  }
  const size_t invalid = r.rejected.size() - static_cast<size_t>(mem);
  if (r.ranked.empty())
    text(show, mem > 0 ? "  no configuration fits: raise --devices or --memory-limit, or shorten "
                         "--seq\n"
                       : "  no configuration is valid (the rejected list above says why)\n");
  if (o.explain && !r.ranked.empty()) text(show, "\n%s", r.explain.c_str());
  // Nothing ranked is an error (below), and an error writes nothing: --json was replaced by the
  // failed ranking while --svg kept the old plot.
  std::vector<std::pair<std::string, std::string>> outputs;
  if (!o.json.empty() && !r.ranked.empty()) {
    nlohmann::json j;
    j["model"] = {{"layers", m.layers},     {"dim", m.dim}, {"heads", m.heads},
                  {"kv_heads", m.kv_heads}, {"ffn", m.ffn}, {"vocab", m.vocab}};
    j["seq"] = o.seq;
    j["devices"] = o.devices;
    j["profile"] = prof.name;
    j["mode"] = o.mode;
    j["seconds"] = r.seconds;
    j["ranked"] = nlohmann::json::array();
    for (const auto& c : r.ranked) j["ranked"].push_back(candidate_json(c));
    j["rejected"] = nlohmann::json::array();
    for (const auto& c : r.rejected) j["rejected"].push_back(candidate_json(c));
    j["best_attention"] = sim_json(r.best_attn);
    j["explain"] = r.explain;
    outputs.emplace_back(o.json, j.dump(2) + "\n");
  }
  if (!o.svg.empty() && !r.ranked.empty()) outputs.emplace_back(o.svg, plan_svg(r, o, o.top));
  write_outputs(outputs);  // both or, as far as the file system allows, neither
  // Nothing ranked is an error: one line on stderr saying why (exit 1 came with nothing there).
  if (r.ranked.empty()) {
    const double limit = app->count("--memory-limit") ? o.memory_limit_gb * 1e9 : prof.memory_bytes;
    std::ostringstream why;
    if (mem > 0)
      why << "no configuration fits: " << mem << " candidate" << (mem > 1 ? "s need" : " needs")
          << " more than " << plan::gb_text(limit) << " GB per device"
          << (invalid > 0
                  ? " and " + std::to_string(invalid) + (invalid > 1 ? " are" : " is") + " invalid"
                  : std::string())
          << "; raise --devices or --memory-limit, or shorten --seq";
    else if (!r.rejected.empty())
      why << "no configuration is valid: all " << r.rejected.size()
          << " candidates were rejected (for example " << r.rejected.front().name() << ": "
          << r.rejected.front().why_not << ")";
    else
      why << "no configuration to rank for " << o.devices << " devices";
    throw InvalidArgument(why.str());
  }
  return 0;
}

void declare_plan(CLI::App* c, PlanOptions& opts) {
  PlanOptions* o = &opts;
  c->add_option("--model", o->model, "llama3-8b, llama3-70b or layers,dim,heads,kv-heads,ffn,vocab")
      ->capture_default_str();
  c->add_option("--seq", o->seq, "tokens per sequence S")->capture_default_str();
  c->add_option("--docs", o->docs, "packed documents: lengths L1,L2,... summing to S");
  c->add_option("--window", o->window, "sliding window W (0: none)")->capture_default_str();
  c->add_option("--devices", o->devices, "devices in the job")->capture_default_str();
  c->add_option("--profile", o->profile,
                "hardware profile: a JSON file, or a shipped profile's name (h100_sxm, h200, "
                "a100_80gb, cpu_epyc7763_node; installed in share/loom/profiles/)");
  c->add_option("--mode", o->mode, "train or prefill")->capture_default_str();
  c->add_option("--memory-limit", o->memory_limit_gb,
                "GB per device (default: the profile's memory)");
  c->add_option("--strategies", o->strategies, "only these strategies (comma separated)");
  c->add_flag("--zigzag-only", o->zigzag_only,
              "only the zigzag layout (a mesh without a cp group: contiguous)");
  c->add_option("--top", o->top, "rows of the table and bars of the SVG")->capture_default_str();
  c->add_flag("--explain", o->explain, "say in words why the winner wins");
  c->add_option("--json", o->json, "write the ranking as JSON to FILE");
  c->add_option("--svg", o->svg, "write stacked bars and the winner's timeline to FILE");
  c->add_option("--calibrate", o->calibrate, "measure this machine and write its profile to FILE");
  c->add_option("--threads", o->threads, "--calibrate: OpenMP threads per rank")
      ->capture_default_str();
  c->add_option("--ranks-per-node", o->ranks_per_node, "--calibrate: ranks on this machine")
      ->capture_default_str();
  c->add_flag("--simulate", o->simulate,
              "simulate one attention (--strategy --layout --ranks --heads ...) instead");
  c->add_option("--strategy", o->strategy, "--simulate: strategy")->capture_default_str();
  c->add_option("--layout", o->layout, "--simulate: layout")->capture_default_str();
  c->add_option("--ranks", o->ranks, "--simulate: cp ranks")->capture_default_str();
  o->degrees.add_to(c);  // --ulysses (hybrid), --inner (ring2d; --train-step too), ...
  c->add_option("--heads", o->heads, "--simulate: query heads")->capture_default_str();
  c->add_option("--kv-heads", o->kv_heads, "--simulate: kv heads (default: heads)");
  c->add_option("--head-dim", o->head_dim, "--simulate: head dim")->capture_default_str();
  c->add_option("--dtype", o->dtype, "--simulate: fp32 or bf16")->capture_default_str();
  c->add_flag("--causal{true},--no-causal{false}", o->causal,  // as add_mask_options
              "--simulate: causal mask, on by default (--no-causal: full attention)");
  c->add_flag("--forward-only", o->forward_only, "--simulate: no backward");
  c->add_flag("--train-step", o->train_step,
              "predict loom train's step time on this machine for each --mesh (--profile from "
              "--calibrate; --model, --seq, --batch, --dtype as loom train's, default its model)");
  c->add_option("--mesh", o->meshes, "--train-step: dp,tp,ulysses,ring (repeat for several)");
  c->add_option("--batch", o->batch, "--train-step: sequences per step")->capture_default_str();
  c->add_flag("--checkpoint-activations", o->checkpoint_activations,
              "--train-step: activation checkpointing");
  c->add_option("--measure-steps", o->measure_steps,
                "--train-step: measured one-rank steps (after 2 warm-up steps)")
      ->capture_default_str();
}

}  // namespace

void add_plan_command(CLI::App& app) {
  add_command<PlanOptions>(
      app, "plan", "predict and rank context-parallel configurations (or --simulate, --calibrate)",
      declare_plan, [](const CLI::App* c, PlanOptions& o) { return run_plan(c, o); });
}

}  // namespace loom::tools
