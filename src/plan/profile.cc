// Hardware profiles: JSON in, JSON out. Every field has a fixed place; unknown fields are
// refused (a typo must not silently fall back to a default); every figure is checked against its
// meaningful range; the rates, the memory and the links are required (they have no meaningful
// default), the other missing fields keep their defaults.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iomanip>
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

// The meaningful range of every field (docs/planning.md, "Hardware profiles"). A zero rate or
// bandwidth was read as "free" by the simulator and divided by in the planner (inf and NaN in the
// ranking); a fractional or huge tile side was truncated or overflowed the tile counts; memory 0
// meant "no limit". The upper bounds are far above any machine and keep every product finite.
// The rates' and bandwidths' lower bounds are far below any machine too (a 1 MFLOP/s device, a
// 1 kB/s link): a rate of 1e-300 passed "> 0", and the simulator's times (work over rate)
// overflowed to inf, then NaN (`--simulate` printed "forward inf ms, backward -nan ms", exit 0).
// Above them, every time the simulator and the planner compute is finite.
constexpr double kMinRate = 1e6;        // FLOP/s of one device
constexpr double kMaxRate = 1e18;       // FLOP/s of one device
constexpr double kMaxBytes = 1e15;      // bytes of device memory
constexpr double kMinBandwidth = 1e3;   // bytes/s of a link or of memory
constexpr double kMaxBandwidth = 1e15;  // bytes/s of a link or of memory
constexpr double kMaxSeconds = 1.0;     // a latency, a call's overhead, one tile's time
// The efficiencies (a kernel's or a collective's fraction of its peak) and a masked tile's cost
// over a full one's: at least a thousandth. "> 0" let 1e-300 through, and the times, work over
// rate x efficiency, came out 300 digits long ("forward 6.6e+298 ms", with the backward lost to
// the forward's rounding: "backward 0.000 ms"), printed as "inf ms" (1.5e307 s is finite, its ms
// are not), or ranked a winner with a 7e297 s step and 0 tokens/s. No kernel, GEMM or collective
// worth planning for runs below a thousandth of its peak (--calibrate clamps the collectives'
// at 0.05); with the rates' and bandwidths' lower bounds it keeps every predicted time, in the
// unit it is printed in, finite.
constexpr double kMinFraction = 1e-3;
constexpr int64_t kMaxTileSide = 4096;  // block_q, block_k, work_tile
constexpr int64_t kMaxCount = 65536;    // threads, devices per node

// One field's value and its range: lo < value (lo_open) or lo <= value, value <= hi.
struct Rule {
  std::string path;
  double value;
  double lo, hi;
  bool lo_open, integer;
  const char* unit;
  bool required;  // no meaningful default: the file must give it
};

std::vector<Rule> rules(const Profile& p) {
  std::vector<Rule> r;
  const auto num = [&](const std::string& path, double v, double lo, bool open, double hi,
                       const char* unit, bool required = false) {
    r.push_back(Rule{path, v, lo, hi, open, false, unit, required});
  };
  const auto integer = [&](const std::string& path, int64_t v, int64_t lo, int64_t hi,
                           const char* unit) {
    r.push_back(Rule{path, static_cast<double>(v), static_cast<double>(lo), static_cast<double>(hi),
                     false, true, unit, false});
  };
  num("device.flops_bf16", p.flops_bf16, kMinRate, false, kMaxRate, "FLOP/s", true);
  num("device.flops_fp32", p.flops_fp32, kMinRate, false, kMaxRate, "FLOP/s", true);
  num("device.attn_fwd_eff", p.attn_fwd_eff, kMinFraction, false, 1, "a fraction of peak");
  num("device.attn_bwd_eff", p.attn_bwd_eff, kMinFraction, false, 1, "a fraction of peak");
  num("device.partial_tile_cost", p.partial_tile_cost, kMinFraction, false, 100,
      "a masked tile's time over a full one's");
  num("device.gemm_eff", p.gemm_eff, kMinFraction, false, 1, "a fraction of peak");
  num("device.memory_bytes", p.memory_bytes, 0, true, kMaxBytes, "bytes", true);
  num("device.mem_bandwidth", p.mem_bandwidth, kMinBandwidth, false, kMaxBandwidth, "bytes/s",
      true);
  integer("device.block_q", p.block_q, 1, kMaxTileSide, "rows");
  integer("device.block_k", p.block_k, 1, kMaxTileSide, "columns");
  integer("device.work_tile", p.work_tile, 0, kMaxTileSide, "rows; 0: the block tiles");
  num("device.call_overhead_s", p.call_overhead, 0, false, kMaxSeconds, "seconds");
  for (int i = 0; i < 4; ++i) {
    num("device.tile_s.fp32[" + std::to_string(i) + "]", p.tile_s_fp32[i], 0, false, kMaxSeconds,
        "seconds");
    num("device.tile_s.bf16[" + std::to_string(i) + "]", p.tile_s_bf16[i], 0, false, kMaxSeconds,
        "seconds");
  }
  integer("device.calib_head_dim", p.calib_head_dim, 1, kMaxHeadDim, "the head dim");
  integer("device.threads", p.threads_per_device, 1, kMaxCount, "threads");
  num("device.alone_speedup", p.alone_speedup, 1, false, 1000, "a speedup");
  integer("devices_per_node", p.devices_per_node, 1, kMaxCount, "devices");
  for (auto [name, l] :
       {std::pair<const char*, const Link*>{"intra", &p.intra}, {"inter", &p.inter}}) {
    num(std::string("links.") + name + ".bandwidth", l->bandwidth, kMinBandwidth, false,
        kMaxBandwidth, "bytes/s", true);
    num(std::string("links.") + name + ".latency_s", l->latency, 0, false, kMaxSeconds, "seconds",
        true);
  }
  num("collectives.a2a_eff", p.a2a_eff, kMinFraction, false, 1, "a fraction of the link");
  num("collectives.allgather_eff", p.allgather_eff, kMinFraction, false, 1,
      "a fraction of the link");
  num("collectives.allreduce_eff", p.allreduce_eff, kMinFraction, false, 1,
      "a fraction of the link");
  return r;
}

// v with as few significant digits as name it exactly (a2a_eff 1.0000001 was "got 1", a value
// that reads as in range).
std::string exact_text(double v) {
  std::ostringstream o;
  for (int digits = 6; digits <= 17; ++digits) {
    o.str("");
    o << std::setprecision(digits) << v;
    if (std::strtod(o.str().c_str(), nullptr) == v) break;
  }
  return o.str();
}

// "must be a number in [1000, 1e+15] (bytes/s), got 0", or empty when the value is in range (NaN
// never is).
std::string violation(const Rule& r) {
  const bool above_lo = r.lo_open ? r.value > r.lo : r.value >= r.lo;
  if (above_lo && r.value <= r.hi) return "";
  std::ostringstream o;
  o << "must be " << (r.integer ? "an integer" : "a number") << " in " << (r.lo_open ? "(" : "[")
    << r.lo << ", " << r.hi << "] (" << r.unit << "), got " << exact_text(r.value);
  return o.str();
}

// The first field of p out of its range, as "field 'x' must be ..., got v" (a field absent from
// the file, `present` given: "missing field 'x' (...)"); empty when p is valid.
std::string first_problem(const Profile& p, const std::set<std::string>* present) {
  if (p.kind != "gpu" && p.kind != "cpu")
    return "field 'kind' must be \"gpu\" or \"cpu\", got \"" + p.kind + "\"";
  for (const Rule& r : rules(p)) {
    const std::string v = violation(r);
    const std::string field = r.path.substr(0, r.path.find('['));
    const bool missing = present && !present->count(field);
    if (v.empty() && !(missing && r.required)) continue;
    if (missing) {
      std::ostringstream o;
      o << "missing field '" << field << "' (a number in " << (r.lo_open ? "(" : "[") << r.lo
        << ", " << r.hi << "], " << r.unit << ")";
      return o.str();
    }
    return "field '" + r.path + "' " + v;
  }
  return "";
}

void refuse_unknown(const json& j, const std::set<std::string>& known, const std::string& where,
                    const std::string& path) {
  for (auto it = j.begin(); it != j.end(); ++it)
    LOOM_CHECK(known.count(it.key()) > 0, IoError,
               where << ": unknown field '" << path << it.key() << "'");
}

// Reads j[key] into out when present (recording path + key in `present`).
template <class T>
void get(const json& j, const char* key, T& out, const std::string& where, const std::string& path,
         std::set<std::string>& present) {
  if (!j.contains(key)) return;
  present.insert(path + key);
  try {
    out = j.at(key).get<T>();
  } catch (const json::exception&) {
    throw IoError(where + ": field '" + path + key + "' has the wrong type");
  }
}

// A number (never a boolean or a string); the range is checked with the others afterwards.
void get_number(const json& j, const char* key, double& out, const std::string& where,
                const std::string& path, std::set<std::string>& present) {
  if (!j.contains(key)) return;
  LOOM_CHECK(j.at(key).is_number(), IoError,
             where << ": field '" << path << key << "' must be a number");
  get(j, key, out, where, path, present);
}

// An integer in [lo, hi]: 1.5 was truncated to 1 and 1e18 accepted as a tile side.
template <class T>
void get_integer(const json& j, const char* key, T& out, int64_t lo, int64_t hi,
                 const std::string& where, const std::string& path,
                 std::set<std::string>& present) {
  if (!j.contains(key)) return;
  present.insert(path + key);
  const json& x = j.at(key);
  LOOM_CHECK(x.is_number(), IoError,
             where << ": field '" << path << key << "' must be an integer in [" << lo << ", " << hi
                   << "]");
  const double v = x.get<double>();
  const bool exact = x.is_number_integer()
                         ? !(x.is_number_unsigned() && x.get<uint64_t>() > uint64_t(INT64_MAX))
                         : std::floor(v) == v;
  LOOM_CHECK(exact && v >= static_cast<double>(lo) && v <= static_cast<double>(hi), IoError,
             where << ": field '" << path << key << "' must be an integer in [" << lo << ", " << hi
                   << "], got " << x.dump());
  out = static_cast<T>(x.is_number_integer() ? x.get<int64_t>() : static_cast<int64_t>(v));
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

void get_link(const json& j, const char* key, Link& l, const std::string& where,
              std::set<std::string>& present) {
  const json* x = object_field(j, key, where, "links.", {"bandwidth", "latency_s"});
  if (!x) return;
  const std::string path = std::string("links.") + key + ".";
  get_number(*x, "bandwidth", l.bandwidth, where, path, present);
  get_number(*x, "latency_s", l.latency, where, path, present);
}

void get_tiles(const json& j, const char* key, double* out, const std::string& where,
               std::set<std::string>& present) {
  if (!j.contains(key)) return;
  present.insert(std::string("device.tile_s.") + key);
  const json& x = j.at(key);
  LOOM_CHECK(x.is_array() && x.size() == 4, IoError,
             where << ": field 'device.tile_s." << key
                   << "' must be [fwd full, fwd partial, bwd full, bwd partial] seconds");
  for (int i = 0; i < 4; ++i) {
    LOOM_CHECK(x[i].is_number(), IoError,
               where << ": field 'device.tile_s." << key << "' must hold numbers (seconds)");
    out[i] = x[i].get<double>();
  }
}

}  // namespace

void check_profile(const Profile& p) {
  const std::string problem = first_problem(p, nullptr);
  LOOM_CHECK(problem.empty(), InvalidArgument, "profile '" << p.name << "': " << problem);
}

Profile parse_profile(const std::string& text, const std::string& where) {
  // Read strictly, as .npy headers are: the parser stopped at a NUL and took what followed for
  // nothing, and a key given twice silently took its last value ("memory_bytes" 80e9, then 1e9).
  const size_t nul = text.find('\0');
  LOOM_CHECK(nul == std::string::npos, IoError,
             where << ": a NUL byte at offset " << nul << " (a profile is JSON text)");
  json j;
  std::vector<std::set<std::string>> keys;  // the keys of each object being read
  std::string twice;
  auto strict = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    if (event == json::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    if (event == json::parse_event_t::key && !keys.empty() &&
        !keys.back().insert(parsed.get<std::string>()).second && twice.empty())
      twice = parsed.get<std::string>();
    return true;
  };
  try {
    j = json::parse(text, strict);
  } catch (const json::exception& e) {
    throw IoError(where + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  LOOM_CHECK(twice.empty(), IoError,
             where << ": the key \"" << twice << "\" is given twice in one object");
  LOOM_CHECK(j.is_object(), IoError, where << ": a profile must be a JSON object");
  refuse_unknown(j,
                 {"name", "kind", "device", "devices_per_node", "links", "collectives", "overlap",
                  "sources", "notes"},
                 where, "");
  Profile p;
  std::set<std::string> present;  // the fields the file gives
  get(j, "name", p.name, where, "", present);
  get(j, "kind", p.kind, where, "", present);
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
      get_number(d, key, *field, where, at, present);
    get_integer(d, "block_q", p.block_q, 1, kMaxTileSide, where, at, present);
    get_integer(d, "block_k", p.block_k, 1, kMaxTileSide, where, at, present);
    get_integer(d, "work_tile", p.work_tile, 0, kMaxTileSide, where, at, present);
    get_integer(d, "calib_head_dim", p.calib_head_dim, 1, kMaxHeadDim, where, at, present);
    get_integer(d, "threads", p.threads_per_device, 1, kMaxCount, where, at, present);
    if (const json* t = object_field(d, "tile_s", where, at, {"fp32", "bf16"})) {
      get_tiles(*t, "fp32", p.tile_s_fp32, where, present);
      get_tiles(*t, "bf16", p.tile_s_bf16, where, present);
    }
  }
  get_integer(j, "devices_per_node", p.devices_per_node, 1, kMaxCount, where, "", present);
  if (const json* l = object_field(j, "links", where, "", {"intra", "inter"})) {
    get_link(*l, "intra", p.intra, where, present);
    get_link(*l, "inter", p.inter, where, present);
  }
  if (const json* c = object_field(j, "collectives", where, "",
                                   {"a2a_eff", "allgather_eff", "allreduce_eff"})) {
    for (auto [key, field] : {std::pair<const char*, double*>{"a2a_eff", &p.a2a_eff},
                              {"allgather_eff", &p.allgather_eff},
                              {"allreduce_eff", &p.allreduce_eff}})
      get_number(*c, key, *field, where, "collectives.", present);
  }
  get(j, "overlap", p.overlap, where, "", present);
  // Every figure in its range; a required one (no meaningful default: rates, memory, links)
  // named as missing.
  const std::string problem = first_problem(p, &present);
  LOOM_CHECK(problem.empty(), IoError, where << ": " << problem);
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
  // shipped profiles are a few KiB. "-" too: InputFile reads it as standard input, where a pipe
  // that never closes blocked for ever (and /dev/stdin on a pipe is refused as not a regular file).
  LOOM_CHECK(path != "-", IoError,
             "cannot read profile -: is not a regular file ('-' is standard input); loom reads a "
             "profile only from a regular file");
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
