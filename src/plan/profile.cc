// Hardware profiles: JSON in, JSON out. Every field has a fixed place; unknown fields are
// refused (a typo must not silently fall back to a default), missing ones keep their defaults.
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "loom/error.h"
#include "loom/io.h"
#include "loom/plan.h"

namespace loom::plan {

namespace {

using nlohmann::json;

constexpr size_t kMaxProfileBytes = size_t{16} << 20;

void refuse_unknown(const json& j, const std::set<std::string>& known, const std::string& where,
                    const std::string& path) {
  for (auto it = j.begin(); it != j.end(); ++it)
    LOOM_CHECK(known.count(it.key()) > 0, IoError,
               where << ": unknown field '" << path << it.key() << "'");
}

template <class T>
void get(const json& j, const char* key, T& out, const std::string& where,
         const std::string& path) {
  if (!j.contains(key)) return;
  try {
    out = j.at(key).get<T>();
  } catch (const json::exception&) {
    throw IoError(where + ": field '" + path + key + "' has the wrong type");
  }
}

void get_positive(const json& j, const char* key, double& out, const std::string& where,
                  const std::string& path) {
  get(j, key, out, where, path);
  LOOM_CHECK(out >= 0, IoError,
             where << ": field '" << path << key << "' must be >= 0, got " << out);
}

// The object j[key] (field path + key) holding only `known` fields, or null when absent.
const json* object_field(const json& j, const char* key, const std::string& where,
                         const std::string& path, const std::set<std::string>& known) {
  if (!j.contains(key)) return nullptr;
  const json& x = j.at(key);
  LOOM_CHECK(x.is_object(), IoError, where << ": field '" << path << key << "' must be an object");
  refuse_unknown(x, known, where, path + key + ".");
  return &x;
}

void get_link(const json& j, const char* key, Link& l, const std::string& where) {
  const json* x = object_field(j, key, where, "links.", {"bandwidth", "latency_s"});
  if (!x) return;
  const std::string path = std::string("links.") + key + ".";
  get_positive(*x, "bandwidth", l.bandwidth, where, path);
  get_positive(*x, "latency_s", l.latency, where, path);
}

void get_tiles(const json& j, const char* key, double* out, const std::string& where) {
  if (!j.contains(key)) return;
  const json& x = j.at(key);
  LOOM_CHECK(x.is_array() && x.size() == 4, IoError,
             where << ": field 'device.tile_s." << key
                   << "' must be [fwd full, fwd partial, bwd full, bwd partial] seconds");
  for (int i = 0; i < 4; ++i) {
    LOOM_CHECK(x[i].is_number() && x[i].get<double>() >= 0, IoError,
               where << ": field 'device.tile_s." << key << "' must hold numbers >= 0");
    out[i] = x[i].get<double>();
  }
}

}  // namespace

Profile parse_profile(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw IoError(where + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  LOOM_CHECK(j.is_object(), IoError, where << ": a profile must be a JSON object");
  refuse_unknown(j,
                 {"name", "kind", "device", "devices_per_node", "links", "collectives", "overlap",
                  "sources", "notes"},
                 where, "");
  Profile p;
  get(j, "name", p.name, where, "");
  get(j, "kind", p.kind, where, "");
  LOOM_CHECK(p.kind == "gpu" || p.kind == "cpu", IoError,
             where << ": field 'kind' must be \"gpu\" or \"cpu\", got \"" << p.kind << "\"");
  if (const json* dp = object_field(
          j, "device", where, "",
          {"flops_bf16", "flops_fp32", "attn_fwd_eff", "attn_bwd_eff", "partial_tile_cost",
           "gemm_eff", "memory_bytes", "mem_bandwidth", "block_q", "block_k", "work_tile",
           "call_overhead_s", "tile_s", "calib_head_dim", "threads", "alone_speedup"})) {
    const json& d = *dp;
    const std::string at = "device.";
    for (auto [key, field] : {std::pair<const char*, double*>{"flops_bf16", &p.flops_bf16},
                              {"flops_fp32", &p.flops_fp32},
                              {"attn_fwd_eff", &p.attn_fwd_eff},
                              {"attn_bwd_eff", &p.attn_bwd_eff},
                              {"partial_tile_cost", &p.partial_tile_cost},
                              {"gemm_eff", &p.gemm_eff},
                              {"memory_bytes", &p.memory_bytes},
                              {"mem_bandwidth", &p.mem_bandwidth},
                              {"call_overhead_s", &p.call_overhead},
                              {"alone_speedup", &p.alone_speedup}})
      get_positive(d, key, *field, where, at);
    for (auto [key, field] : {std::pair<const char*, int64_t*>{"block_q", &p.block_q},
                              {"block_k", &p.block_k},
                              {"work_tile", &p.work_tile},
                              {"calib_head_dim", &p.calib_head_dim}})
      get(d, key, *field, where, at);
    LOOM_CHECK(p.work_tile >= 0, IoError, where << ": device.work_tile must be >= 0");
    get(d, "threads", p.threads_per_device, where, at);
    LOOM_CHECK(p.alone_speedup >= 1, IoError, where << ": device.alone_speedup must be >= 1");
    LOOM_CHECK(p.block_q >= 1 && p.block_k >= 1, IoError,
               where << ": device.block_q and device.block_k must be >= 1");
    LOOM_CHECK(p.attn_fwd_eff <= 1 && p.attn_bwd_eff <= 1 && p.gemm_eff <= 1, IoError,
               where << ": efficiencies are fractions of peak (<= 1)");
    if (const json* t = object_field(d, "tile_s", where, at, {"fp32", "bf16"})) {
      get_tiles(*t, "fp32", p.tile_s_fp32, where);
      get_tiles(*t, "bf16", p.tile_s_bf16, where);
    }
  }
  get(j, "devices_per_node", p.devices_per_node, where, "");
  LOOM_CHECK(p.devices_per_node >= 1, IoError, where << ": devices_per_node must be >= 1");
  if (const json* l = object_field(j, "links", where, "", {"intra", "inter"})) {
    get_link(*l, "intra", p.intra, where);
    get_link(*l, "inter", p.inter, where);
  }
  if (const json* c = object_field(j, "collectives", where, "",
                                   {"a2a_eff", "allgather_eff", "allreduce_eff"})) {
    for (auto [key, field] : {std::pair<const char*, double*>{"a2a_eff", &p.a2a_eff},
                              {"allgather_eff", &p.allgather_eff},
                              {"allreduce_eff", &p.allreduce_eff}})
      get_positive(*c, key, *field, where, "collectives.");
    LOOM_CHECK(p.a2a_eff > 0 && p.allgather_eff > 0 && p.allreduce_eff > 0, IoError,
               where << ": collective efficiencies must be > 0");
  }
  get(j, "overlap", p.overlap, where, "");
  if (j.contains("sources")) {
    LOOM_CHECK(j.at("sources").is_object(), IoError,
               where << ": field 'sources' must map field names to citations");
    for (auto it = j.at("sources").begin(); it != j.at("sources").end(); ++it) {
      LOOM_CHECK(it.value().is_string(), IoError,
                 where << ": sources." << it.key() << " must be a string");
      p.sources[it.key()] = it.value().get<std::string>();
    }
  }
  return p;
}

Profile load_profile(const std::string& path) {
  // A regular file only (a FIFO or /dev/zero would block or never end), and a bounded read: the
  // shipped profiles are a few KiB.
  std::string text;
  try {
    InputFile in(path, "profile");
    text = in.read_rest(kMaxProfileBytes);
  } catch (const IoError& e) {
    throw IoError(std::string("cannot read ") + e.what(), __FILE__, __LINE__);
  }
  return parse_profile(text, path);
}

std::string profile_json(const Profile& p) {
  json j;
  j["name"] = p.name;
  j["kind"] = p.kind;
  j["device"] = {{"flops_bf16", p.flops_bf16},
                 {"flops_fp32", p.flops_fp32},
                 {"attn_fwd_eff", p.attn_fwd_eff},
                 {"attn_bwd_eff", p.attn_bwd_eff},
                 {"partial_tile_cost", p.partial_tile_cost},
                 {"gemm_eff", p.gemm_eff},
                 {"memory_bytes", p.memory_bytes},
                 {"mem_bandwidth", p.mem_bandwidth},
                 {"block_q", p.block_q},
                 {"block_k", p.block_k},
                 {"work_tile", p.work_tile},
                 {"call_overhead_s", p.call_overhead},
                 {"calib_head_dim", p.calib_head_dim},
                 {"threads", p.threads_per_device},
                 {"alone_speedup", p.alone_speedup},
                 {"tile_s",
                  {{"fp32", std::vector<double>(p.tile_s_fp32, p.tile_s_fp32 + 4)},
                   {"bf16", std::vector<double>(p.tile_s_bf16, p.tile_s_bf16 + 4)}}}};
  j["devices_per_node"] = p.devices_per_node;
  j["links"] = {{"intra", {{"bandwidth", p.intra.bandwidth}, {"latency_s", p.intra.latency}}},
                {"inter", {{"bandwidth", p.inter.bandwidth}, {"latency_s", p.inter.latency}}}};
  j["collectives"] = {{"a2a_eff", p.a2a_eff},
                      {"allgather_eff", p.allgather_eff},
                      {"allreduce_eff", p.allreduce_eff}};
  j["overlap"] = p.overlap;
  j["sources"] = p.sources;
  return j.dump(2) + "\n";
}

}  // namespace loom::plan
