// The training loop: batch draw, gradient reductions over the mesh, global-norm clipping, AdamW
// with warmup + cosine, validation, and checkpoints of the full (mesh-independent) state.
#include "loom/model/trainer.h"

#include <algorithm>
#include <cmath>
#include <csignal>
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
constexpr const char* kCheckpointFormat = "loom train checkpoint 1";  // the header's "format"
constexpr double kPi = 3.14159265358979323846;
constexpr double kMaxLr = 10;  // AdamW steps are about lr per weight: beyond this, no training
// A checkpoint's JSON header is a few KiB; a far longer one is not a checkpoint.
constexpr size_t kMaxCheckpointHeader = size_t{16} << 20;
constexpr double kCheckpointWriteS = 600;  // the least a rank waits for rank 0 to write one
// Checkpoints are streamed in pieces of this size (a multiple of 4: whole floats), never held
// whole: a full copy of the weights and both moments on every rank, and the file as one string
// on rank 0, took a 4-rank run estimated at 347 MiB to 1.42 GiB.
constexpr size_t kIoChunk = size_t{1} << 20;
constexpr int kCheckpointTag = 0x636b;  // the tp pieces sent to world rank 0 for a checkpoint

// Index of the first non-finite value, or -1.
int64_t first_non_finite(const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) return static_cast<int64_t>(i);
  return -1;
}

// A value as the error lines show it: NaN as "nan" whatever its sign bit (it was "-nan").
std::string value_text(double x) {
  if (std::isnan(x)) return "nan";
  std::ostringstream o;
  o << x;
  return o.str();
}

// Elements of the largest parameter tensor (full, unsplit) of the model: the most a checkpoint
// holds at once beyond the trainer's own state.
int64_t largest_tensor(const ModelConfig& m) {
  return std::max({m.vocab * m.dim, m.dim * m.heads * m.head_dim(),
                   m.dim * m.kv_heads * m.head_dim(), m.dim * m.ffn_dim()});
}

// Bytes of a checkpoint's JSON header text and its parsed form: allowed for in the estimate.
double header_allowance(const ModelConfig& m) {
  return 64.0 * 1024 + 1024.0 * static_cast<double>(4 + 9 * m.layers);
}

// Runs f(), adding where in the run a communication error (CommError, Timeout: kept as such)
// happened to its message: " (in step N, <phase>)", or " (<phase>)" for step < 0. A timeout read
// "rank 0: barrier over the group of 4 ranks timed out after 3 s", naming neither the step nor
// whether the ranks were in a checkpoint save or the gradient reduction.
template <class F>
auto in_phase(int64_t step, const char* phase, F&& f) -> decltype(f()) {
  const auto where = [&](const char* what) {
    return std::string(what) + " (" +
           (step >= 0 ? "in step " + std::to_string(step) + ", " : std::string()) + phase + ")";
  };
  try {
    return f();
  } catch (const Timeout& e) {
    throw Timeout(where(e.what()), e.file(), e.line());
  } catch (const CommError& e) {
    throw CommError(where(e.what()), e.file(), e.line());
  }
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
  mesh_ = in_phase(-1, "building the mesh", [&] { return build_mesh(world, s); });
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
  const int64_t step = step_ + 1;
  in_phase(step, "forward and backward", [&] {
    for (int64_t b = mesh_.dp_rank * per_dp; b < (mesh_.dp_rank + 1) * per_dp; ++b)
      loss += m.forward_backward(seqs[b], scale, true);
  });
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
  double sums[2] = {loss, 0};
  in_phase(step, "gradient reduction", [&] {
    world_.all_reduce(g.data(), rep, DType::f32, ReduceOp::sum);
    mesh_.dp_cp->all_reduce(g.data() + rep, g.size() - rep, DType::f32, ReduceOp::sum);
    world_.all_reduce(sums, 1, DType::f64, ReduceOp::sum);
  });
  // Global gradient norm: split pieces are distinct per tp rank; replicated ones count once.
  double sq = 0;
  for (size_t i = rep; i < g.size(); ++i) sq += static_cast<double>(g[i]) * g[i];
  if (mesh_.tp_rank == 0)
    for (size_t i = 0; i < rep; ++i) sq += static_cast<double>(g[i]) * g[i];
  in_phase(step, "optimizer (gradient norm)",
           [&] { mesh_.tp->all_reduce(&sq, 1, DType::f64, ReduceOp::sum); });
  const double norm = std::sqrt(sq);
  // Every rank holds the same loss and norm: all stop together, before the update, so no
  // checkpoint is ever written from these values.
  if (!std::isfinite(sums[0]) || !std::isfinite(norm)) {
    double key = local_bad ? world_.size() - world_.rank() : 0;  // max: the first bad rank
    in_phase(step, "optimizer (non-finite check)",
             [&] { world_.all_reduce(&key, 1, DType::f64, ReduceOp::max); });
    LOOM_CHECK(false, Error,
               "non-finite training at step "
                   << step_ + 1 << ": loss " << value_text(sums[0] * scale) << ", gradient norm "
                   << value_text(norm)
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
  // The model's time counters are the summary's per-step columns (reports()): training steps
  // only. Evaluation's forward passes are not charged to them (--eval-every 1 --eval-batches 400
  // raised attention_s from 0.013 s to 0.329 s).
  struct KeepTimes {
    ModelStats& stats;
    const double attention_s = stats.attention_s, total_s = stats.total_s;
    ~KeepTimes() {
      stats.attention_s = attention_s;
      stats.total_s = total_s;
    }
  } keep{model_->stats()};
  const size_t dp = static_cast<size_t>(mesh_.shape.dp), mine = static_cast<size_t>(mesh_.dp_rank);
  in_phase(step_, "evaluation", [&] {
    for (size_t i = 0; i < offs.size(); ++i) {
      const Sequence s = make_sequence(corpus_.val, offs[i], cfg_.seq, cfg_.pack_documents);
      predicted += s.predicted();
      if (i % dp == mine) loss += model_->forward_backward(s, 0.0, false);
    }
    world_.all_reduce(&loss, 1, DType::f64, ReduceOp::sum);
  });
  if (predicted == 0) return std::nan("");
  // Every rank holds the same sum: all stop together. An Inf was logged as "val_loss": null.
  const double mean = loss / static_cast<double>(predicted);
  LOOM_CHECK(std::isfinite(mean), Error,
             "non-finite validation loss after step "
                 << step_ << ": " << value_text(mean)
                 << "; stopped before that step's log line and checkpoint (lower --lr or raise "
                    "--warmup)");
  return mean;
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

// World rank 0's checkpoint file as it is written: buffered, the checksum taken as it goes.
class CheckpointOut {
 public:
  explicit CheckpointOut(const std::string& path) : file_(path) { buf_.reserve(kIoChunk); }
  // Bytes the checksum covers (everything after the magic).
  void put(const void* p, size_t n) {
    sum_ = fnv1a64(p, n, sum_);
    raw(p, n);
  }
  void raw(const void* p, size_t n) {
    if (buf_.size() + n > kIoChunk) flush();
    if (n >= kIoChunk)
      file_.write(p, n);
    else
      buf_.append(static_cast<const char*>(p), n);
  }
  void commit() {
    raw(&sum_, sizeof sum_);
    flush();
    file_.commit();
  }

 private:
  void flush() {
    file_.write(buf_.data(), buf_.size());
    buf_.clear();
  }
  AtomicFileWriter file_;
  std::string buf_;
  uint64_t sum_ = 0xcbf29ce484222325ull;  // fnv1a64's offset basis
};

}  // namespace

double checkpoint_bytes(const TrainConfig& c, int ranks_here, bool resume) {
  // Loading: every rank reads in kIoChunk pieces and holds one tensor and the header at a time;
  // saving: world rank 0 alone holds one tensor's pieces, its write buffer and the header.
  const double one = static_cast<double>(kIoChunk) +
                     static_cast<double>(largest_tensor(c.model)) * sizeof(float) +
                     header_allowance(c.model);
  return resume ? ranks_here * one : one;
}

void Trainer::stream_full(const std::vector<float>& flat,
                          const std::function<void(const float*, size_t)>& emit, double timeout_s) {
  // The other tp groups hold the same weights and moments as world rank 0's: nothing to send.
  if (mesh_.dp_rank != 0 || mesh_.cp_rank() != 0) return;
  const bool writer = world_.rank() == 0;  // tp rank 0 of this group
  const int T = mesh_.shape.tp;
  std::vector<float> pieces, row;
  for (const ParamSpec& p : model_->specs()) {
    const float* mine = flat.data() + p.offset;
    const size_t local = static_cast<size_t>(p.local_size());
    if (p.split == ParamSpec::none) {
      if (writer) emit(mine, local);
      continue;
    }
    // A piece goes out when world rank 0 asks for it: sends complete at once on the local
    // backend, so unasked, every rank queued all its pieces of all three sets (a copy of its
    // state) ahead of rank 0's writes.
    // Only a wait for world rank 0, which may be writing the previous tensor to disk, gets
    // timeout_s; the rest wait the communication timeout: rank 0 has posted its receives before
    // it asks, and its peers wait for it with nothing else to do (rank 0 waited timeout_s, 10
    // minutes, for a tp peer that had stopped).
    char go = 0;
    if (!writer) {
      mesh_.tp->irecv(&go, 1, 0, kCheckpointTag)->wait(timeout_s);
      mesh_.tp->isend(mine, local * sizeof(float), 0, kCheckpointTag)->wait();
      continue;
    }
    pieces.resize(local * static_cast<size_t>(T));
    std::copy(mine, mine + local, pieces.begin());
    std::vector<WorkPtr> recvs;
    for (int t = 1; t < T; ++t)
      recvs.push_back(
          mesh_.tp->irecv(pieces.data() + t * local, local * sizeof(float), t, kCheckpointTag));
    for (int t = 1; t < T; ++t) mesh_.tp->isend(&go, 1, t, kCheckpointTag)->wait();
    for (WorkPtr& r : recvs) r->wait();
    if (p.split == ParamSpec::by_rows) {  // piece t is rows [t, t + 1) x local_rows: in order
      emit(pieces.data(), pieces.size());
      continue;
    }
    row.resize(static_cast<size_t>(p.cols));  // by columns: each row from every piece
    for (int64_t i = 0; i < p.rows; ++i) {
      for (int t = 0; t < T; ++t)
        std::copy_n(pieces.data() + t * local + i * p.local_cols, p.local_cols,
                    row.data() + t * p.local_cols);
      emit(row.data(), row.size());
    }
  }
}

std::string Trainer::save_checkpoint(const std::string& dir) {
  // Collective: a non-finite weight or moment on any rank means no checkpoint at all.
  double bad[3] = {double(first_non_finite(model_->params()) >= 0),
                   double(first_non_finite(adam_m_) >= 0), double(first_non_finite(adam_v_) >= 0)};
  in_phase(step_, "checkpoint save", [&] { world_.all_reduce(bad, 3, DType::f64, ReduceOp::max); });
  LOOM_CHECK(bad[0] == 0 && bad[1] == 0 && bad[2] == 0, Error,
             "step " << step_ << ": the " << (bad[0] ? "weights" : "AdamW moments")
                     << " hold NaN or Inf; no checkpoint written (lower --lr or raise --warmup)");
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld.ckpt", static_cast<long long>(step_));
  const std::string path = (std::filesystem::path(dir) / name).string();
  std::unique_ptr<CheckpointOut> out;
  if (world_.rank() == 0) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    LOOM_CHECK(std::filesystem::is_directory(dir), IoError,
               "cannot create --checkpoint-dir " << dir);
    size_t floats = 0;
    nlohmann::json names = nlohmann::json::array();
    for (const ParamSpec& p : model_->specs()) {
      names.push_back({p.name, p.rows, p.cols});
      floats += static_cast<size_t>(p.rows * p.cols);
    }
    nlohmann::json h;
    h["format"] = kCheckpointFormat;
    h["step"] = step_;
    h["run"] = run_identity(cfg_, data_hash_);
    h["floats_per_tensor"] = floats;
    h["params"] = names;
    const std::string header = h.dump();
    const uint64_t hl = header.size();
    out = std::make_unique<CheckpointOut>(path);
    out->raw(kMagic, sizeof kMagic);
    out->put(&hl, sizeof hl);
    out->put(header.data(), header.size());
  }
  // Test hook (docs/reliability.md): LOOM_TEST_STOP_IN_CHECKPOINT=N stops world rank 1
  // (SIGSTOP) in the save of step N, before it sends rank 0 anything, to prove that rank 0 waits
  // for a silent peer the communication timeout only.
  if (const char* e = std::getenv("LOOM_TEST_STOP_IN_CHECKPOINT");
      e && world_.rank() == 1 && std::atoll(e) == step_)
    std::raise(SIGSTOP);
  // The weights, then both moments, one tensor at a time: world rank 0 writes each as it
  // arrives, its tp group sends their pieces (a write taking longer than the communication
  // timeout is waited for, as the barrier below waits).
  const double wait_s = std::max(world_.timeout_s(), kCheckpointWriteS);
  const auto emit = [&](const float* v, size_t n) { out->put(v, n * sizeof(float)); };
  in_phase(step_, "checkpoint save", [&] {
    for (const std::vector<float>* v : {&model_->params(), &adam_m_, &adam_v_})
      stream_full(*v, emit, wait_s);
  });
  if (out) {
    out->commit();
    out.reset();
    write_file_atomic((std::filesystem::path(dir) / "latest").string(), std::string(name) + "\n");
  }
  // The other ranks wait while rank 0 writes and syncs the file: at least 10 minutes, as loom plan
  // --calibrate waits for its rank 0. Under the communication timeout a large checkpoint on a
  // slow disk failed the run after it was written (192 MB took 1.4 s here: a timeout of 1 s).
  // Rank 0 arrives last, to ranks that are already waiting: the communication timeout (it
  // waited 10 minutes too, for a rank that had stopped).
  in_phase(step_, "checkpoint save", [&] { world_.barrier(world_.rank() == 0 ? -1 : wait_s); });
  return path;
}

namespace {
// Text as a message may show it: a NUL as \0 (it ended the line in a terminal, or cut it).
std::string printable(const std::string& text) {
  std::string out;
  for (const char c : text) out += c == '\0' ? std::string("\\0") : std::string(1, c);
  return out;
}
}  // namespace

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
    // A NUL is no separator to >>, so "name\0text" was one name, opened as "name" (c_str).
    LOOM_CHECK(
        name.find('/') == std::string::npos && name.find('\0') == std::string::npos && rest.empty(),
        IoError,
        "--resume: " << where << "/latest must name one checkpoint file in " << where
                     << " (as loom train writes it), not '" << printable(name)
                     << (rest.empty() ? "" : " " + printable(rest)) << "'");
    path = (fs::path(where) / name).string();
  }
  size_t expect = 0, largest = 0;
  for (const ParamSpec& p : model_->specs()) {
    expect += static_cast<size_t>(p.rows * p.cols);
    largest = std::max(largest, static_cast<size_t>(p.rows * p.cols));
  }
  constexpr size_t kFixed = sizeof kMagic + 2 * sizeof(uint64_t);  // magic, length, checksum
  std::vector<char> chunk(kIoChunk);

  // Pass 1, nothing changed yet: the whole file in pieces for its checksum, its header, and its
  // first non-finite value. Every rank reads the file (node-local directories work) but holds
  // at most one piece of it (the whole file on every rank took a 1-rank run to 788 MiB).
  InputFile f(path, "checkpoint");
  LOOM_CHECK(f.regular(), IoError, "checkpoint " << path << " is not a regular file");
  const uint64_t size = static_cast<uint64_t>(f.size());
  // Bounded: a checkpoint of this model has a known size (plus its header).
  const uint64_t most = 3 * expect * sizeof(float) + kFixed + kMaxCheckpointHeader;
  LOOM_CHECK(size <= most, IoError,
             "checkpoint " << path << " has " << size << " bytes, more than a checkpoint of this "
                           << "model can (" << most << "); refusing to resume from it");
  char magic[sizeof kMagic] = {};
  if (size >= kFixed) f.read_exact(magic, sizeof magic);
  LOOM_CHECK(size >= kFixed && std::memcmp(magic, kMagic, sizeof kMagic) == 0, IoError,
             "checkpoint " << path << " is not a loom train checkpoint (bad magic or "
                           << "truncated)");
  uint64_t hl = 0;
  f.read_exact(&hl, sizeof hl);
  LOOM_CHECK(hl <= size - kFixed && hl <= kMaxCheckpointHeader, IoError,
             "checkpoint " << path << " is truncated or corrupt (header length " << hl << ")");
  std::string header(hl, '\0');
  f.read_exact(header.data(), hl);
  uint64_t sum = fnv1a64(&hl, sizeof hl);
  sum = fnv1a64(header.data(), header.size(), sum);
  const uint64_t payload = size - kFixed - hl;
  int64_t first_bad = -1;  // index of the payload's first non-finite float
  for (uint64_t done = 0; done < payload;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kIoChunk, payload - done));
    f.read_exact(chunk.data(), n);
    sum = fnv1a64(chunk.data(), n, sum);
    for (size_t i = 0; first_bad < 0 && i + sizeof(float) <= n; i += sizeof(float)) {
      float x;
      std::memcpy(&x, chunk.data() + i, sizeof x);
      if (!std::isfinite(x)) first_bad = static_cast<int64_t>((done + i) / sizeof(float));
    }
    done += n;
  }
  uint64_t stored = 0;
  f.read_exact(&stored, sizeof stored);
  LOOM_CHECK(sum == stored, IoError,
             "checkpoint " << path << " is corrupt: checksum mismatch (stored " << stored
                           << ", computed " << sum << "); refusing to resume from it");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    LOOM_CHECK(false, IoError, "checkpoint " << path << " has a malformed header: " << e.what());
  }
  header = std::string();
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
  // Another layout under the same magic is not read as this one (any format was taken).
  LOOM_CHECK(h.contains("format") && h["format"] == kCheckpointFormat, IoError,
             "checkpoint " << path << " has format "
                           << (h.contains("format") ? h["format"].dump() : "(none)") << ", not \""
                           << kCheckpointFormat
                           << "\" (written by another version of loom?); refusing to resume "
                              "from it");
  // Shown as written: a step of 2^64 - 1 was "at step -1".
  const nlohmann::json& js = h["step"];
  const bool step_ok = js.is_number_unsigned()
                           ? js.get<uint64_t>() <= static_cast<uint64_t>(cfg_.steps)
                           : js.get<int64_t>() >= 0 && js.get<int64_t>() <= cfg_.steps;
  LOOM_CHECK(step_ok, IoError,
             "checkpoint " << path << " is at step " << js.dump() << ", outside this run's 0.."
                           << cfg_.steps);
  const int64_t saved_step = js.get<int64_t>();
  const nlohmann::json want = run_identity(cfg_, data_hash_),
                       got = h.value("run", nlohmann::json{});
  for (auto it = want.begin(); it != want.end(); ++it)
    LOOM_CHECK(got.contains(it.key()) && got[it.key()] == it.value(), InvalidArgument,
               "--resume: checkpoint " << path << " was made with " << it.key() << " = "
                                       << (got.contains(it.key()) ? got[it.key()].dump() : "?")
                                       << " but this run has " << it.key() << " = "
                                       << it.value().dump());
  const size_t count = h.value("floats_per_tensor", size_t{0});
  LOOM_CHECK(payload == 3 * count * sizeof(float), IoError,
             "checkpoint " << path << " payload has " << payload << " bytes, expected "
                           << 3 * count * sizeof(float));
  LOOM_CHECK(count == expect, InvalidArgument,
             "checkpoint " << path << " holds " << count << " parameters, this model " << expect);
  static const char* const kWhat[3] = {"weights", "AdamW first moments", "AdamW second moments"};
  LOOM_CHECK(first_bad < 0, IoError,
             "checkpoint " << path << " holds a non-finite value in its "
                           << kWhat[first_bad / static_cast<int64_t>(count)] << " (index "
                           << first_bad % static_cast<int64_t>(count)
                           << "); refusing to resume from it");

  // Pass 2: the payload again, one tensor at a time, this rank's piece of each kept. Its
  // checksum must be pass 1's: a file replaced between the two is refused (after the state was
  // overwritten: the run stops).
  InputFile g(path, "checkpoint");
  uint64_t sum2 = 0xcbf29ce484222325ull;
  const auto read = [&](void* dst, size_t n) {
    g.read_exact(dst, n);
    sum2 = fnv1a64(dst, n, sum2);
  };
  g.read_exact(magic, sizeof magic);
  const bool same_magic = std::memcmp(magic, kMagic, sizeof kMagic) == 0;
  for (uint64_t done = 0; done < sizeof hl + hl;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kIoChunk, sizeof hl + hl - done));
    read(chunk.data(), n);
    done += n;
  }
  chunk = std::vector<char>();
  std::vector<float> block(largest);
  std::vector<float>* dst[3] = {&model_->params(), &adam_m_, &adam_v_};
  const int t = mesh_.tp_rank;
  for (std::vector<float>* flat : dst)
    for (const ParamSpec& p : model_->specs()) {
      read(block.data(), static_cast<size_t>(p.rows * p.cols) * sizeof(float));
      for (int64_t i = 0; i < p.local_rows; ++i)
        for (int64_t j = 0; j < p.local_cols; ++j) {
          const int64_t gi = p.split == ParamSpec::by_rows ? t * p.local_rows + i : i;
          const int64_t gj = p.split == ParamSpec::by_cols ? t * p.local_cols + j : j;
          (*flat)[p.offset + i * p.local_cols + j] = block[gi * p.cols + gj];
        }
    }
  uint64_t stored2 = 0;
  g.read_exact(&stored2, sizeof stored2);
  LOOM_CHECK(same_magic && sum2 == sum && stored2 == stored, IoError,
             "checkpoint " << path << " changed while it was read; refusing to resume from it");
  model_->params_changed();
  step_ = saved_step;
  // Every rank reads the checkpoint itself (node-local directories work): all must have read the
  // same one. Ranks resumed from different steps paired the collectives of different steps,
  // wrote wrong checkpoints and marked the run finished.
  const uint64_t mine[2] = {static_cast<uint64_t>(saved_step), sum};
  std::vector<uint64_t> all(2 * static_cast<size_t>(world_.size()));
  in_phase(-1, "--resume: comparing the checkpoints the ranks read",
           [&] { world_.all_gather(mine, sizeof mine, all.data()); });
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
  in_phase(-1, "gathering the summary after the last step",
           [&] { world_.all_gather(&mine, sizeof mine, all.data()); });
  return all;
}

}  // namespace loom::model
