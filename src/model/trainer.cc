// The training loop: batch draw, gradient reductions over the mesh, global-norm clipping, AdamW
// with warmup + cosine, validation, and checkpoints of the full (mesh-independent) state.
#include "loom/model/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/error.h"
#include "loom/io.h"
#include "loom/npy.h"
#include "loom/rng.h"
#include "loom/timer.h"

namespace loom::model {

namespace {
constexpr char kMagic[8] = {'L', 'O', 'O', 'M', 'C', 'K', 'P', '1'};
constexpr double kPi = 3.14159265358979323846;
constexpr double kMaxLr = 10;  // AdamW steps are about lr per weight: beyond this, no training
// A checkpoint's JSON header is a few KiB; a far longer one is not a checkpoint.
constexpr size_t kMaxCheckpointHeader = size_t{16} << 20;
constexpr double kCheckpointWriteS = 600;  // the least a rank waits for rank 0 to write one

// Index of the first non-finite value, or -1.
int64_t first_non_finite(const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) return static_cast<int64_t>(i);
  return -1;
}

}  // namespace

double learning_rate(const TrainConfig& c, int64_t step) {
  const int64_t warm = c.warmup_steps();
  if (step < warm) return c.lr * static_cast<double>(step + 1) / static_cast<double>(warm);
  const double span = static_cast<double>(std::max<int64_t>(1, c.steps - warm));
  const double progress = std::min(1.0, static_cast<double>(step - warm) / span);
  const double lo = c.lr * c.min_lr_ratio;
  return lo + 0.5 * (c.lr - lo) * (1.0 + std::cos(kPi * progress));
}

void validate(const TrainConfig& cfg, int world) {
  validate(cfg.model, cfg.par, world, cfg.seq);
  const MeshShape& s = cfg.par.mesh;
  LOOM_CHECK(cfg.batch >= 1 && cfg.batch % s.dp == 0, InvalidArgument,
             "--batch " << cfg.batch << " must be a positive multiple of --dp " << s.dp);
  LOOM_CHECK(cfg.steps >= 1, InvalidArgument, "--steps must be >= 1, got " << cfg.steps);
  // The run's token counts (per step and in all) are int64: --batch 2^63 - 1 wrapped them and
  // ran a step of 9e18 windows instead of refusing.
  int64_t step_tokens = 0, run_tokens = 0;
  LOOM_CHECK(!__builtin_mul_overflow(cfg.batch, cfg.seq, &step_tokens) &&
                 !__builtin_mul_overflow(step_tokens, cfg.steps, &run_tokens),
             InvalidArgument,
             "--batch " << cfg.batch << " x --seq " << cfg.seq << " x --steps " << cfg.steps
                        << " tokens do not fit 64 bits");
  LOOM_CHECK(cfg.lr > 0 && cfg.lr <= kMaxLr, InvalidArgument,
             "--lr must be in (0, " << kMaxLr << "], got " << exact_text(cfg.lr));
  LOOM_CHECK(cfg.weight_decay >= 0 && cfg.lr * cfg.weight_decay <= 1, InvalidArgument,
             "--weight-decay must be >= 0 with --lr x --weight-decay <= 1 (a larger decay step "
             "flips the weights' sign), got "
                 << exact_text(cfg.weight_decay));
  LOOM_CHECK(cfg.clip >= 0 && std::isfinite(cfg.clip), InvalidArgument,
             "--clip must be a finite number >= 0 (0: off), got " << cfg.clip);
  LOOM_CHECK(cfg.warmup >= -1, InvalidArgument,
             "--warmup must be >= 0, or -1 for the default, got " << cfg.warmup);
  LOOM_CHECK(cfg.model.ffn >= 0, InvalidArgument,
             "--ffn must be >= 0 (0: 4 x dim), got " << cfg.model.ffn);
  LOOM_CHECK(cfg.eval_batches >= 1, InvalidArgument,
             "--eval-batches must be >= 1, got " << cfg.eval_batches);
}

Trainer::Trainer(Communicator& world, const TrainConfig& cfg, const Corpus& corpus)
    : world_(world), cfg_(cfg), corpus_(corpus) {
  validate(cfg, world.size());
  const MeshShape& s = cfg.par.mesh;
  LOOM_CHECK(corpus.train.size() >= cfg.seq + 1, InvalidArgument,
             "the training split of " << corpus.source << " has " << corpus.train.size()
                                      << " bytes; --seq " << cfg.seq << " needs at least "
                                      << cfg.seq + 1);
  mesh_ = build_mesh(world, s);
  model_ = std::make_unique<Gpt>(cfg.model, cfg.par, mesh_, cfg.precision,
                                 cfg.checkpoint_activations, cfg.seed);
  adam_m_.assign(model_->params().size(), 0.0f);
  adam_v_.assign(model_->params().size(), 0.0f);
  data_hash_ = fnv1a64(corpus.train.bytes.data(), corpus.train.bytes.size());
}

Trainer::~Trainer() = default;

std::vector<Sequence> Trainer::batch_sequences(int64_t step) {
  std::vector<Sequence> out;
  for (int64_t b = 0; b < cfg_.batch; ++b)
    out.push_back(make_sequence(corpus_.train,
                                train_offset(corpus_.train, cfg_.seq, cfg_.seed, step, b), cfg_.seq,
                                cfg_.pack_documents));
  return out;
}

StepResult Trainer::train_step() {
  Stopwatch sw;
  Gpt& m = *model_;
  m.zero_grads();
  const std::vector<Sequence> seqs = batch_sequences(step_);
  int64_t predicted = 0;
  for (const Sequence& s : seqs) predicted += s.predicted();
  const double scale = predicted > 0 ? 1.0 / static_cast<double>(predicted) : 0.0;
  const int64_t per_dp = cfg_.batch / mesh_.shape.dp;
  double loss = 0;
  for (int64_t b = mesh_.dp_rank * per_dp; b < (mesh_.dp_rank + 1) * per_dp; ++b)
    loss += m.forward_backward(seqs[b], scale, true);
  ScopedTimer update_timer(update_s_);

  // Sums: replicated parameters over the world, tp-split ones over the same-tp-piece group.
  std::vector<float>& g = m.grads();
  // Test hook (docs/reliability.md): LOOM_TEST_NAN_AT_STEP=N makes world rank 0's gradient NaN
  // at step N, to prove the stop below on every rank.
  if (const char* e = std::getenv("LOOM_TEST_NAN_AT_STEP");
      e && world_.rank() == 0 && std::atoll(e) == step_ + 1 && !g.empty())
    g[0] = std::nanf("");
  // Which rank's own loss or gradient went non-finite first (read only when the sums are).
  const bool local_bad = !std::isfinite(loss) || first_non_finite(g) >= 0;
  const size_t rep = static_cast<size_t>(m.replicated_size());
  world_.all_reduce(g.data(), rep, DType::f32, ReduceOp::sum);
  mesh_.dp_cp->all_reduce(g.data() + rep, g.size() - rep, DType::f32, ReduceOp::sum);
  double sums[2] = {loss, 0};
  world_.all_reduce(sums, 1, DType::f64, ReduceOp::sum);
  // Global gradient norm: split pieces are distinct per tp rank; replicated ones count once.
  double sq = 0;
  for (size_t i = rep; i < g.size(); ++i) sq += static_cast<double>(g[i]) * g[i];
  if (mesh_.tp_rank == 0)
    for (size_t i = 0; i < rep; ++i) sq += static_cast<double>(g[i]) * g[i];
  mesh_.tp->all_reduce(&sq, 1, DType::f64, ReduceOp::sum);
  const double norm = std::sqrt(sq);
  // Every rank holds the same loss and norm: all stop together, before the update, so no
  // checkpoint is ever written from these values.
  if (!std::isfinite(sums[0]) || !std::isfinite(norm)) {
    double key = local_bad ? world_.size() - world_.rank() : 0;  // max: the first bad rank
    world_.all_reduce(&key, 1, DType::f64, ReduceOp::max);
    LOOM_CHECK(false, Error,
               "non-finite training at step "
                   << step_ + 1 << ": loss " << sums[0] * scale << ", gradient norm " << norm
                   << (key > 0 ? " (first on rank " + std::to_string(world_.size() - int(key)) + ")"
                               : std::string())
                   << "; stopped before the update and before any checkpoint of it (lower --lr "
                      "or raise --warmup)");
  }
  const double clip = cfg_.clip > 0 && norm > cfg_.clip ? cfg_.clip / (norm + 1e-6) : 1.0;

  // AdamW on fp32 master weights.
  const double lr = learning_rate(cfg_, step_);
  const double t = static_cast<double>(step_ + 1);
  const double bc1 = 1.0 - std::pow(cfg_.beta1, t), bc2 = 1.0 - std::pow(cfg_.beta2, t);
  std::vector<float>& w = m.params();
  for (const ParamSpec& p : m.specs()) {
    const double decay = p.decay ? cfg_.weight_decay : 0.0;
    for (int64_t i = p.offset; i < p.offset + p.local_size(); ++i) {
      const double gi = static_cast<double>(g[i]) * clip;
      const double mi = cfg_.beta1 * adam_m_[i] + (1.0 - cfg_.beta1) * gi;
      const double vi = cfg_.beta2 * adam_v_[i] + (1.0 - cfg_.beta2) * gi * gi;
      adam_m_[i] = static_cast<float>(mi);
      adam_v_[i] = static_cast<float>(vi);
      const double update = (mi / bc1) / (std::sqrt(vi / bc2) + cfg_.adam_eps) + decay * w[i];
      w[i] = static_cast<float>(w[i] - lr * update);
    }
  }
  m.params_changed();

  StepResult r;
  r.step = ++step_;
  r.loss = sums[0] * scale;
  r.lr = lr;
  r.grad_norm = norm;
  r.tokens = predicted;
  r.seconds = sw.elapsed_s();
  train_s_ += r.seconds;
  tokens_ += predicted;
  return r;
}

double Trainer::evaluate() {
  const std::vector<int64_t> offs = val_offsets(corpus_.val, cfg_.seq, cfg_.eval_batches);
  if (offs.empty()) return std::nan("");
  // Windows are dealt round-robin to dp ranks; every cp/tp group runs its windows together. One
  // window is built at a time (every rank counts every window's predicted tokens), so memory does
  // not grow with --eval-batches.
  int64_t predicted = 0;
  double loss = 0;
  const size_t dp = static_cast<size_t>(mesh_.shape.dp), mine = static_cast<size_t>(mesh_.dp_rank);
  for (size_t i = 0; i < offs.size(); ++i) {
    const Sequence s = make_sequence(corpus_.val, offs[i], cfg_.seq, cfg_.pack_documents);
    predicted += s.predicted();
    if (i % dp == mine) loss += model_->forward_backward(s, 0.0, false);
  }
  world_.all_reduce(&loss, 1, DType::f64, ReduceOp::sum);
  return predicted > 0 ? loss / static_cast<double>(predicted) : std::nan("");
}

// ---------------------------------------------------------------------------------------------
// Full (unsplit) state.

std::vector<float> Trainer::gather_full(const std::vector<float>& flat) {
  const Gpt& m = *model_;
  const int T = mesh_.shape.tp;
  const size_t rep = static_cast<size_t>(m.replicated_size()), split = flat.size() - rep;
  std::vector<float> pieces(split * T);
  if (T > 1)
    mesh_.tp->all_gather(flat.data() + rep, split * sizeof(float), pieces.data());
  else
    std::copy(flat.begin() + static_cast<std::ptrdiff_t>(rep), flat.end(), pieces.begin());
  std::vector<float> full;
  for (const ParamSpec& p : m.specs()) {
    if (p.split == ParamSpec::none) {
      full.insert(full.end(), flat.begin() + p.offset, flat.begin() + p.offset + p.local_size());
      continue;
    }
    const size_t base = full.size();
    full.resize(base + static_cast<size_t>(p.rows * p.cols));
    for (int t = 0; t < T; ++t) {
      const float* src = pieces.data() + t * split + (p.offset - static_cast<int64_t>(rep));
      for (int64_t i = 0; i < p.local_rows; ++i)
        for (int64_t j = 0; j < p.local_cols; ++j) {
          const int64_t gi = p.split == ParamSpec::by_rows ? t * p.local_rows + i : i;
          const int64_t gj = p.split == ParamSpec::by_cols ? t * p.local_cols + j : j;
          full[base + gi * p.cols + gj] = src[i * p.local_cols + j];
        }
    }
  }
  return full;
}

void Trainer::scatter_full(const std::vector<float>& full, std::vector<float>& flat) {
  const int t = mesh_.tp_rank;
  size_t base = 0;
  for (const ParamSpec& p : model_->specs()) {
    for (int64_t i = 0; i < p.local_rows; ++i)
      for (int64_t j = 0; j < p.local_cols; ++j) {
        const int64_t gi = p.split == ParamSpec::by_rows ? t * p.local_rows + i : i;
        const int64_t gj = p.split == ParamSpec::by_cols ? t * p.local_cols + j : j;
        flat[p.offset + i * p.local_cols + j] = full[base + gi * p.cols + gj];
      }
    base += static_cast<size_t>(p.rows * p.cols);
  }
}

std::vector<float> Trainer::full_params() {
  return gather_full(model_->params());
}
std::vector<float> Trainer::full_grads() {
  return gather_full(model_->grads());
}

// ---------------------------------------------------------------------------------------------
// Checkpoints.

namespace {

nlohmann::json run_identity(const TrainConfig& c, uint64_t data_hash) {
  const ModelConfig& m = c.model;
  return {{"vocab", m.vocab},
          {"layers", m.layers},
          {"dim", m.dim},
          {"heads", m.heads},
          {"kv_heads", m.kv_heads},
          {"ffn", m.ffn_dim()},
          {"seq", c.seq},
          {"batch", c.batch},
          {"steps", c.steps},
          {"lr", c.lr},
          {"warmup", c.warmup_steps()},
          {"weight_decay", c.weight_decay},
          {"clip", c.clip},
          {"seed", c.seed},
          {"dtype", to_string(c.precision)},
          {"pack_documents", c.pack_documents},
          {"data_fnv1a64", std::to_string(data_hash)}};
}

}  // namespace

std::string Trainer::save_checkpoint(const std::string& dir) {
  // Collective: a non-finite weight or moment on any rank means no checkpoint at all.
  double bad[3] = {double(first_non_finite(model_->params()) >= 0),
                   double(first_non_finite(adam_m_) >= 0), double(first_non_finite(adam_v_) >= 0)};
  world_.all_reduce(bad, 3, DType::f64, ReduceOp::max);
  LOOM_CHECK(bad[0] == 0 && bad[1] == 0 && bad[2] == 0, Error,
             "step " << step_ << ": the " << (bad[0] ? "weights" : "AdamW moments")
                     << " hold NaN or Inf; no checkpoint written (lower --lr or raise --warmup)");
  const std::vector<float> w = gather_full(model_->params());
  const std::vector<float> mo = gather_full(adam_m_);
  const std::vector<float> ve = gather_full(adam_v_);
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld.ckpt", static_cast<long long>(step_));
  const std::string path = (std::filesystem::path(dir) / name).string();
  if (world_.rank() == 0) {
    nlohmann::json h;
    h["format"] = "loom train checkpoint 1";
    h["step"] = step_;
    h["run"] = run_identity(cfg_, data_hash_);
    h["floats_per_tensor"] = w.size();
    nlohmann::json names = nlohmann::json::array();
    for (const ParamSpec& p : model_->specs()) names.push_back({p.name, p.rows, p.cols});
    h["params"] = names;
    const std::string header = h.dump();
    std::string bytes(kMagic, sizeof kMagic);
    const uint64_t hl = header.size();
    bytes.append(reinterpret_cast<const char*>(&hl), sizeof hl);
    bytes += header;
    for (const auto* v : {&w, &mo, &ve})
      bytes.append(reinterpret_cast<const char*>(v->data()), v->size() * sizeof(float));
    const uint64_t sum = fnv1a64(bytes.data() + sizeof kMagic, bytes.size() - sizeof kMagic);
    bytes.append(reinterpret_cast<const char*>(&sum), sizeof sum);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    LOOM_CHECK(std::filesystem::is_directory(dir), IoError,
               "cannot create --checkpoint-dir " << dir);
    write_file_atomic(path, bytes);
    write_file_atomic((std::filesystem::path(dir) / "latest").string(), std::string(name) + "\n");
  }
  // The other ranks wait while rank 0 writes and syncs the file: at least 10 minutes, as loom plan
  // --calibrate waits for its rank 0. Under the communication timeout a large checkpoint on a
  // slow disk failed the run after it was written (192 MB took 1.4 s here: a timeout of 1 s).
  world_.barrier(std::max(world_.timeout_s(), kCheckpointWriteS));
  return path;
}

void Trainer::load_checkpoint(const std::string& where) {
  namespace fs = std::filesystem;
  std::string path = where;
  if (fs::is_directory(where)) {
    std::string name, rest;
    bool readable = true;
    try {
      InputFile l((fs::path(where) / "latest").string(), "checkpoint pointer");
      std::istringstream in(l.read_rest(4096));
      in >> name >> rest;
    } catch (const IoError&) {
      readable = false;
    }
    LOOM_CHECK(readable && !name.empty(), IoError,
               "--resume: " << where << " has no readable 'latest' checkpoint pointer");
    // The pointer names one file of this directory, as save_checkpoint writes it: a path (it
    // was called unreadable) or text after the name (it was taken) is not such a pointer.
    LOOM_CHECK(name.find('/') == std::string::npos && rest.empty(), IoError,
               "--resume: " << where << "/latest must name one checkpoint file in " << where
                            << " (as loom train writes it), not '" << name
                            << (rest.empty() ? "" : " " + rest) << "'");
    path = (fs::path(where) / name).string();
  }
  size_t expect_floats = 0;
  for (const ParamSpec& p : model_->specs()) expect_floats += static_cast<size_t>(p.rows * p.cols);
  // Bounded: a checkpoint of this model has a known size (plus its header).
  InputFile f(path, "checkpoint");
  const std::string bytes =
      f.read_rest(3 * expect_floats * sizeof(float) + 3 * sizeof(uint64_t) + kMaxCheckpointHeader);
  uint64_t hl = 0;
  LOOM_CHECK(bytes.size() >= sizeof kMagic + 2 * sizeof(uint64_t) &&
                 std::memcmp(bytes.data(), kMagic, sizeof kMagic) == 0,
             IoError,
             "checkpoint " << path << " is not a loom train checkpoint (bad magic or "
                           << "truncated)");
  std::memcpy(&hl, bytes.data() + sizeof kMagic, sizeof hl);
  LOOM_CHECK(hl <= bytes.size() - sizeof kMagic - 2 * sizeof(uint64_t), IoError,
             "checkpoint " << path << " is truncated or corrupt (header length " << hl << ")");
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + bytes.size() - sizeof stored, sizeof stored);
  const uint64_t sum =
      fnv1a64(bytes.data() + sizeof kMagic, bytes.size() - sizeof kMagic - sizeof stored);
  LOOM_CHECK(sum == stored, IoError,
             "checkpoint " << path << " is corrupt: checksum mismatch (stored " << stored
                           << ", computed " << sum << "); refusing to resume from it");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(bytes.substr(sizeof kMagic + sizeof hl, hl));
  } catch (const nlohmann::json::exception& e) {
    LOOM_CHECK(false, IoError, "checkpoint " << path << " has a malformed header: " << e.what());
  }
  // The header's fields, typed (a checksum proves only that the bytes are as written): a header
  // that is not an object, or a step outside [0, steps], made the run fail with a raw JSON
  // type_error, "train" from step -4 into NaN, or "resume" at step 1000 of 2 and exit 0 having
  // trained nothing.
  LOOM_CHECK(h.is_object() && h.contains("step") && h["step"].is_number_integer() &&
                 h.contains("floats_per_tensor") && h["floats_per_tensor"].is_number_unsigned() &&
                 (!h.contains("run") || h["run"].is_object()),
             IoError,
             "checkpoint " << path
                           << " has a malformed header (no object with an integer step, "
                              "floats_per_tensor and run)");
  const int64_t saved_step = h["step"].get<int64_t>();
  LOOM_CHECK(saved_step >= 0 && saved_step <= cfg_.steps, IoError,
             "checkpoint " << path << " is at step " << saved_step << ", outside this run's 0.."
                           << cfg_.steps);
  const nlohmann::json want = run_identity(cfg_, data_hash_),
                       got = h.value("run", nlohmann::json{});
  for (auto it = want.begin(); it != want.end(); ++it)
    LOOM_CHECK(got.contains(it.key()) && got[it.key()] == it.value(), InvalidArgument,
               "--resume: checkpoint " << path << " was made with " << it.key() << " = "
                                       << (got.contains(it.key()) ? got[it.key()].dump() : "?")
                                       << " but this run has " << it.key() << " = "
                                       << it.value().dump());
  const size_t count = h.value("floats_per_tensor", size_t{0});
  const size_t payload = bytes.size() - sizeof kMagic - sizeof hl - hl - sizeof stored;
  LOOM_CHECK(payload == 3 * count * sizeof(float), IoError,
             "checkpoint " << path << " payload has " << payload << " bytes, expected "
                           << 3 * count * sizeof(float));
  size_t expect = 0;
  for (const ParamSpec& p : model_->specs()) expect += static_cast<size_t>(p.rows * p.cols);
  LOOM_CHECK(count == expect, InvalidArgument,
             "checkpoint " << path << " holds " << count << " parameters, this model " << expect);
  const char* base = bytes.data() + sizeof kMagic + sizeof hl + hl;
  std::vector<float> full(count);
  std::vector<float>* dst[3] = {&model_->params(), &adam_m_, &adam_v_};
  static const char* const kWhat[3] = {"weights", "AdamW first moments", "AdamW second moments"};
  for (int i = 0; i < 3; ++i) {
    std::memcpy(full.data(), base + i * count * sizeof(float), count * sizeof(float));
    const int64_t bad = first_non_finite(full);
    LOOM_CHECK(bad < 0, IoError,
               "checkpoint " << path << " holds a non-finite value in its " << kWhat[i]
                             << " (index " << bad << "); refusing to resume from it");
    scatter_full(full, *dst[i]);
  }
  model_->params_changed();
  step_ = saved_step;
  // Every rank reads the checkpoint itself (node-local directories work): all must have read the
  // same one. Ranks resumed from different steps paired the collectives of different steps,
  // wrote wrong checkpoints and marked the run finished.
  const uint64_t mine[2] = {static_cast<uint64_t>(saved_step), sum};
  std::vector<uint64_t> all(2 * static_cast<size_t>(world_.size()));
  world_.all_gather(mine, sizeof mine, all.data());
  for (int r = 1; r < world_.size(); ++r)
    LOOM_CHECK(all[2 * r] == all[0] && all[2 * r + 1] == all[1], InvalidArgument,
               "--resume: rank " << r << " read a checkpoint of step " << all[2 * r]
                                 << " (checksum " << all[2 * r + 1] << "), rank 0 one of step "
                                 << all[0] << " (checksum " << all[1]
                                 << "): every rank must resume from the same checkpoint");
}

std::vector<RankReport> Trainer::reports() {
  const ModelStats& s = model_->stats();
  RankReport mine;
  mine.attention_s = s.attention_s;
  mine.total_s = s.total_s;
  mine.update_s = update_s_;
  mine.act_bytes_peak = static_cast<double>(s.act_bytes_peak);
  const double params = static_cast<double>(model_->params().size());
  mine.state_bytes = params * 4 * sizeof(float) +
                     (cfg_.precision == Precision::bf16 ? params * sizeof(bf16) : 0.0);
  mine.peak_rss = static_cast<double>(peak_rss_bytes());
  std::vector<RankReport> all(static_cast<size_t>(world_.size()));
  world_.all_gather(&mine, sizeof mine, all.data());
  return all;
}

}  // namespace loom::model
