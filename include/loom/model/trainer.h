// model/trainer.h: the training loop of `loom train` on one rank of a mesh.
//
// One step: every rank draws the same global batch (--batch sequences, split evenly over the dp
// ranks; the draw depends only on (seed, step)), runs forward and backward on its part, and the
// gradients are summed (replicated parameters over the whole world, tp-split ones over the
// ranks holding the same tp piece). The loss is the mean cross-entropy over every predicted token
// of the global batch: each rank divides its sum by the global count, which every rank knows
// because every rank holds the whole token sequence. Then: global gradient norm over all ranks,
// clipping, AdamW (fp32 master weights and fp32 moments) with a warmup + cosine learning rate.
//
// Checkpoints hold the FULL (unsplit) parameters and AdamW moments, the step and the run's
// configuration, so a run may resume on another mesh. File: "LOOMCKP1", a little-endian u64
// header length, a JSON header, the fp32 payload, and a u64 FNV-1a checksum of header and
// payload. Written atomically by world rank 0, streamed one tensor at a time (its tp group sends
// it their pieces); read by every rank in pieces, twice (checked whole, then this rank's pieces
// kept), so saving or loading adds about one tensor and 1 MiB per rank (checkpoint_bytes), not a
// copy of the state. A file that is short, has another magic, another "format" or a wrong
// checksum is refused with IoError; one from a different model, data or schedule with
// InvalidArgument naming the field. Since the data draw and the schedule depend
// only on the step, resuming reproduces the uninterrupted run's losses exactly (same mesh and
// backend) or as closely as two meshes agree (another mesh or backend: to fp32 rounding, or to
// bf16 rounding with Precision::bf16; docs/train.md).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm.h"
#include "loom/model/data.h"
#include "loom/model/gpt.h"

namespace loom::model {

struct TrainConfig {
  ModelConfig model;
  ParallelConfig par;
  int64_t seq = 256;
  int64_t batch = 4;  // sequences per step, global (divisible by dp)
  int64_t steps = 200;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  int64_t warmup = -1;        // steps; < 0: min(100, steps / 10)
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, adam_eps = 1e-8;
  double clip = 1.0;  // global gradient norm; 0: no clipping
  uint64_t seed = 1;
  Precision precision = Precision::fp32;
  bool checkpoint_activations = false;
  bool pack_documents = false;
  int64_t eval_batches = 4;  // validation windows per evaluation
  int64_t warmup_steps() const { return warmup >= 0 ? warmup : std::min<int64_t>(100, steps / 10); }
};

// The learning rate of step `step` (0-based).
double learning_rate(const TrainConfig& c, int64_t step);

struct StepResult {
  int64_t step = 0;  // 1-based number of the step just done
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;  // before clipping
  int64_t tokens = 0;    // predicted tokens of the global batch
  double seconds = 0;    // wall time of the step on this rank
};

// Per-rank figures for the summary (gathered to every rank), of the training steps only
// (evaluate() is not counted).
struct RankReport {
  double attention_s = 0, total_s = 0;  // CpAttention; all of forward + backward
  double update_s = 0;                  // gradient reductions, clipping and AdamW
  double act_bytes_peak = 0;            // activations kept for backward, peak
  double state_bytes = 0;               // params + grads + AdamW moments (+ bf16 copies)
  double peak_rss = 0;  // this rank's PROCESS peak RSS (local ranks share one process)
};

// Refuses (InvalidArgument) a configuration no run can take on `world` ranks: the model and
// mesh (model::validate), --batch, --steps, token counts past int64, --lr, --weight-decay,
// --clip, --warmup, --ffn, --eval-batches. The Trainer checks it too; callers check first to
// refuse before any estimate or allocation.
void validate(const TrainConfig& cfg, int world);

// Peak bytes that checkpoints add to a process holding `ranks_here` ranks of the run (world
// rank 0's among them, the worst case): saving, world rank 0's one tensor in flight and its write
// buffer; with `resume`, loading too, on every rank at once (one tensor, a read buffer and the
// header each). For the memory estimate of `loom train`.
double checkpoint_bytes(const TrainConfig& c, int ranks_here, bool resume);

class Trainer {
 public:
  // Collective over world. Validates the configuration (InvalidArgument) and the corpus size.
  // `world` and `corpus` must outlive the trainer.
  Trainer(Communicator& world, const TrainConfig& cfg, const Corpus& corpus);
  ~Trainer();

  StepResult train_step();
  // Mean validation loss over the fixed validation windows; NaN when they predict no token (the
  // split is too short, or, packed, every document's part of it is a byte). Collective. A
  // non-finite mean is an Error on every rank (it was written to the log as null). Leaves the
  // model's time counters (model().stats(), reports()) as they were: they count training only.
  double evaluate();
  int64_t step() const { return step_; }
  const TrainConfig& config() const { return cfg_; }
  Gpt& model() { return *model_; }
  const Mesh& mesh() const { return mesh_; }

  // Full parameters (or gradients) in spec order, unsplit; the same on every mesh. Collective.
  std::vector<float> full_params();
  std::vector<float> full_grads();

  // Collective: world rank 0 writes DIR/step-NNNNNNNN.ckpt and then DIR/latest atomically.
  // Returns the checkpoint path.
  std::string save_checkpoint(const std::string& dir);
  // Collective: every rank reads `path` (or DIR/latest's target when path is a directory).
  void load_checkpoint(const std::string& path);

  std::vector<RankReport> reports();  // collective
  double seconds_training() const { return train_s_; }
  int64_t tokens_trained() const { return tokens_; }

 private:
  std::vector<float> gather_full(const std::vector<float>& flat);
  // Passes a flat tensor set (weights or a moment) to `emit` on world rank 0, full and in spec
  // order, in pieces of at most one tensor; the rest of world rank 0's tp group sends it their
  // pieces, waiting up to timeout_s; every other rank returns at once. Collective.
  void stream_full(const std::vector<float>& flat,
                   const std::function<void(const float*, size_t)>& emit, double timeout_s);
  std::vector<Sequence> batch_sequences(int64_t step);

  Communicator& world_;
  TrainConfig cfg_;
  const Corpus& corpus_;
  Mesh mesh_;
  std::unique_ptr<Gpt> model_;
  std::vector<float> adam_m_, adam_v_;
  int64_t step_ = 0;
  double train_s_ = 0;
  double update_s_ = 0;
  int64_t tokens_ = 0;
  uint64_t data_hash_ = 0;
};

}  // namespace loom::model
