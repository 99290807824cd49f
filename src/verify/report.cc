// The verify report as JSON, as an SVG heat map, and as text.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/tolerance.h"
#include "loom/verify.h"

namespace loom::verify {

namespace {

nlohmann::json num(double x) {
  if (std::isfinite(x)) return x;
  return nullptr;  // JSON has no infinities: null means "not finite" (NaN/Inf in the candidate)
}

nlohmann::json nums(const std::vector<double>& v) {
  nlohmann::json a = nlohmann::json::array();
  for (double x : v) a.push_back(num(x));
  return a;
}

std::string fmt(double x) {
  if (!std::isfinite(x)) return "inf";
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", x);
  return b;
}

}  // namespace

std::string Report::to_json() const {
  nlohmann::json j;
  j["passed"] = passed;
  j["convention"] = convention;
  j["ranks"] = ranks;
  j["seq"] = seq;
  j["heads"] = heads;
  j["kv_heads"] = kv_heads;
  j["head_dim"] = head_dim;
  j["absent"] = absent;
  j["bounds"] = per_problem_bounds ? "per-problem" : "fixed";
  nlohmann::json ts = nlohmann::json::array();
  for (const auto& t : tensors) {
    if (!t.present) continue;
    nlohmann::json x;
    x["name"] = t.name;
    x["compared"] = t.compared;
    x["passed"] = t.passed;
    x["rel_err"] = num(t.rel_err);
    x["max_abs_err"] = num(t.max_abs_err);
    x["tolerance"] = num(t.tolerance);  // null: not computable
    x["sampled"] = t.sampled;
    x["scanned_only"] = t.scanned_only;
    x["non_finite"] = t.non_finite;
    x["inf_mismatch"] = t.inf_mismatch;
    x["per_rank"] = nums(t.per_rank);
    x["per_chunk"] = nums(t.per_chunk);
    x["per_head"] = nums(t.per_head);
    ts.push_back(x);
  }
  j["tensors"] = ts;
  nlohmann::json ds = nlohmann::json::array();
  for (const auto& d : diagnoses) {
    nlohmann::json x;
    x["kind"] = d.kind;
    x["text"] = d.text;
    x["residual"] = num(d.residual);
    x["ranks"] = d.ranks;
    x["steps"] = d.steps;
    x["q_chunks"] = d.q_chunks;
    x["kv_chunks"] = d.kv_chunks;
    if (d.kind == "wrong_scale") x["scale"] = d.value;
    ds.push_back(x);
  }
  j["diagnoses"] = ds;
  j["heat_tensor"] = heat_tensor;
  nlohmann::json h = nlohmann::json::array();
  for (const auto& row : heat) h.push_back(nums(row));
  j["heat"] = h;
  j["chunk_rank"] = chunk_rank;
  return j.dump(2) + "\n";
}

std::string Report::summary() const {
  std::ostringstream os;
  // A pass that left a present tensor uncompared says so on its first line (dk and dv above the
  // full-check limit): "PASSED" alone read as every tensor checked.
  std::string unchecked;
  for (const auto& t : tensors)
    if (t.present && !t.compared) unchecked += (unchecked.empty() ? "" : " and ") + t.name;
  os << "verify    " << (passed ? "PASSED" : "FAILED") << "  (" << convention << ", " << ranks
     << (ranks == 1 ? " rank" : " ranks") << ", S=" << seq << " H=" << heads << " Hkv=" << kv_heads
     << " D=" << head_dim << ")"
     << (unchecked.empty() ? "" : ", " + unchecked + " not compared (--full-check-max)") << "\n";
  if (per_problem_bounds)
    os << "  " << per_problem_why
       << ": each tensor is held to this problem's own bound (loom/tolerance.h)\n";
  for (const auto& t : tensors) {
    if (!t.present) continue;
    os << "  " << t.name << std::string(5 - std::min<size_t>(4, t.name.size()), ' ');
    if (!t.compared) {
      os << "not compared (dk and dv need every query row; the sequence is above the full-check "
            "limit, --full-check-max); no NaN or Inf in it\n";
      continue;
    }
    if (t.scanned_only) {  // compared only in that the scan found NaN or Inf: a failure
      os << "FAIL  " << t.non_finite << " non-finite (its values are not compared: dk and dv need "
         << "every query row; the sequence is above the full-check limit, --full-check-max)\n";
      continue;
    }
    os << (t.passed ? "pass" : "FAIL") << "  rel " << fmt(t.rel_err) << "  max abs "
       << fmt(t.max_abs_err) << "  tol "
       << (std::isfinite(t.tolerance) ? fmt(t.tolerance) : std::string("not computable"));
    // A bound that passes zeros passes only the exact values (verify.cc).
    if (!(t.tolerance < 1) && t.passed && t.rel_err == 0) os << "  (the exact values)";
    if (t.sampled) os << "  (sampled rows)";
    if (t.non_finite) os << "  " << t.non_finite << " non-finite";
    if (t.inf_mismatch) os << "  " << t.inf_mismatch << " -inf mismatches";
    os << "\n";
  }
  if (!absent.empty()) {
    os << "  absent: ";
    for (size_t i = 0; i < absent.size(); ++i) os << (i ? ", " : "") << absent[i];
    os << "\n";
  }
  for (size_t i = 0; i < diagnoses.size(); ++i) {
    const auto& d = diagnoses[i];
    os << (i == 0 ? "diagnosis " : "  or      ") << d.text;
    if (d.kind != "unexplained" && d.kind != "non_finite" && d.kind != "not_localised")
      os << "  [model leaves " << fmt(100 * d.residual) << "% of the error]";
    os << "\n";
  }
  return os.str();
}

std::string Report::heatmap_svg() const {
  const int n = static_cast<int>(heat.size());
  const int cell = n <= 8 ? 48 : (n <= 16 ? 32 : 20);
  const int left = 110, top = 100, legend = 40;
  const int W = std::max(840, left + n * cell + 30 + legend), H = top + n * cell + 60;
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
     << "\" viewBox=\"0 0 " << W << " " << H << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  os << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  os << "<text x=\"14\" y=\"18\" font-size=\"13\" font-weight=\"bold\">loom verify: "
     << "share of the " << heat_tensor << " error explained by each (query chunk, KV chunk) pair"
     << "</text>\n";
  // The diagnosis in up to three lines of ~110 characters.
  std::string diag = diagnoses.empty() ? std::string("passed") : diagnoses[0].text;
  for (char& ch : diag)
    if (ch == '<' || ch == '>' || ch == '&') ch = ' ';
  for (int line = 0; line < 3 && !diag.empty(); ++line) {
    size_t cut = diag.size();
    if (cut > 110) {
      cut = diag.rfind(' ', 110);
      if (cut == std::string::npos || cut == 0) cut = 110;
    }
    std::string part = diag.substr(0, cut);
    diag = cut < diag.size() ? diag.substr(cut + 1) : "";
    if (line == 2 && !diag.empty()) part += " ...";
    os << "<text x=\"" << 14 << "\" y=\"" << 38 + 15 * line << "\">" << part << "</text>\n";
  }
  os << "<text x=\"" << left + n * cell / 2 << "\" y=\"" << top - 22
     << "\" text-anchor=\"middle\">KV chunk (owner rank)</text>\n";
  os << "<text x=\"14\" y=\"" << top + n * cell / 2 << "\" transform=\"rotate(-90 14 "
     << top + n * cell / 2 << ")\" text-anchor=\"middle\">query chunk (rank)</text>\n";
  for (int b = 0; b < n; ++b)
    os << "<text x=\"" << left + b * cell + cell / 2 << "\" y=\"" << top - 6
       << "\" text-anchor=\"middle\">" << b << " (" << chunk_rank[b] << ")</text>\n";
  for (int a = 0; a < n; ++a) {
    os << "<text x=\"" << left - 6 << "\" y=\"" << top + a * cell + cell / 2 + 4
       << "\" text-anchor=\"end\">" << a << " (r" << chunk_rank[a] << ")</text>\n";
    for (int b = 0; b < n; ++b) {
      const double v = std::isfinite(heat[a][b]) ? std::clamp(heat[a][b], 0.0, 1.0) : 0.0;
      // White (0) to dark red (1).
      const int g = static_cast<int>(std::lround(255 * (1 - v)));
      const int r = static_cast<int>(std::lround(255 - 80 * v));
      os << "<rect x=\"" << left + b * cell << "\" y=\"" << top + a * cell << "\" width=\"" << cell
         << "\" height=\"" << cell << "\" fill=\"rgb(" << r << "," << g << "," << g
         << ")\" stroke=\"#bbb\"><title>query chunk " << a << " x KV chunk " << b << ": "
         << fmt(100 * v) << "%";
      if (ranks > 1)
        os << " (ring step " << ((chunk_rank[a] - chunk_rank[b]) % ranks + ranks) % ranks << ")";
      os << "</title></rect>\n";
      if (ranks > 1 && cell >= 32)
        os << "<text x=\"" << left + b * cell + 3 << "\" y=\"" << top + a * cell + 11
           << "\" font-size=\"8\" fill=\"#777\">s"
           << ((chunk_rank[a] - chunk_rank[b]) % ranks + ranks) % ranks << "</text>\n";
      if (v >= 0.01)
        os << "<text x=\"" << left + b * cell + cell / 2 << "\" y=\""
           << top + a * cell + cell / 2 + 4 << "\" text-anchor=\"middle\" font-size=\"10\" fill=\""
           << (v > 0.5 ? "white" : "black") << "\">" << static_cast<int>(std::lround(100 * v))
           << "</text>\n";
    }
  }
  // Legend.
  const int lx = left + n * cell + 20;
  for (int i = 0; i < 10; ++i) {
    const double v = 1.0 - i / 9.0;
    const int g = static_cast<int>(std::lround(255 * (1 - v)));
    const int r = static_cast<int>(std::lround(255 - 80 * v));
    os << "<rect x=\"" << lx << "\" y=\"" << top + i * (n * cell / 10)
       << "\" width=\"14\" height=\"" << n * cell / 10 + 1 << "\" fill=\"rgb(" << r << "," << g
       << "," << g << ")\"/>\n";
  }
  os << "<text x=\"" << lx << "\" y=\"" << top - 6 << "\">100%</text>\n";
  os << "<text x=\"" << lx << "\" y=\"" << top + n * cell + 14 << "\">0%</text>\n";
  os << "<text x=\"" << left << "\" y=\"" << top + n * cell + 30
     << "\">cell: % of the error energy the pair explains; sN: ring step of the pair</text>\n";
  os << "</svg>\n";
  return os.str();
}

}  // namespace loom::verify
