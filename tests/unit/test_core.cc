// core: bf16 rounding, Philox RNG shard invariance, .npy round trips and every malformed case,
// error macros.
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loom/bf16.h"
#include "loom/error.h"
#include "loom/io.h"
#include "loom/npy.h"
#include "loom/rng.h"
#include "loom/tensor.h"
#include "loom/timer.h"

namespace loom {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(to_bf16(from_bits(0x3f808000u)).bits, 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6: ties to even (up).
  EXPECT_EQ(to_bf16(from_bits(0x3f818000u)).bits, 0x3f82);
  // Just above halfway rounds up, just below rounds down.
  EXPECT_EQ(to_bf16(from_bits(0x3f808001u)).bits, 0x3f81);
  EXPECT_EQ(to_bf16(from_bits(0x3f807fffu)).bits, 0x3f80);
  EXPECT_EQ(to_bf16(-2.5f).bits, 0xc020);
  EXPECT_TRUE(std::isnan(to_float(to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(to_float(to_bf16(INFINITY))));
  EXPECT_TRUE(std::isinf(to_float(to_bf16(3.4e38f))));  // past the largest bf16
  for (float x : {0.0f, 1.0f, -3.0f, 0.15625f, 1e-20f}) {
    const float r = to_float(to_bf16(x));
    EXPECT_LE(std::fabs(r - x), std::fabs(x) * (1.0f / 256.0f)) << x;
  }
}

// A double is rounded to bf16 once: through the nearest float it was rounded twice
// (1 + 2^-8 + 2^-30 became 1, not 1 + 2^-7). Checked against the nearest of the bf16 values around
// each of many random doubles, ties to even, distances in long double (exact here).
TEST(Bf16, DoubleRoundsOnceToNearestEven) {
  EXPECT_EQ(to_bf16(1.0 + 0x1p-8 + 0x1p-30).bits, 0x3f81);
  EXPECT_EQ(to_bf16(1.0 + 0x1p-8).bits, 0x3f80);  // a true tie: to even
  EXPECT_EQ(to_bf16(1.0 + 0x1p-8 - 0x1p-40).bits, 0x3f80);
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(-130, 127);
  for (int i = 0; i < 200000; ++i) {
    double d = std::ldexp(mant(gen), expo(gen)) * (i % 2 ? -1 : 1);
    if (i % 5 == 0)
      d = static_cast<double>(to_float(to_bf16(static_cast<float>(d)))) +
          std::ldexp(1.0, expo(gen) - 9);  // near a tie
    const uint16_t got = to_bf16(d).bits;
    // The candidates: the bf16 values next to the truncation of d.
    uint32_t u;
    const float t = static_cast<float>(d);
    std::memcpy(&u, &t, 4);
    const uint16_t base = static_cast<uint16_t>(u >> 16);
    uint16_t best = base;
    long double best_err = -1;
    for (int delta = -2; delta <= 2; ++delta) {
      const uint16_t c = static_cast<uint16_t>(base + delta);
      if (((c >> 15) & 1) != (base >> 15)) continue;  // stay on d's side of zero
      const float cf = to_float(bf16{c});
      if (!std::isfinite(cf)) continue;
      const long double err = std::fabs(static_cast<long double>(cf) - static_cast<long double>(d));
      if (best_err < 0 || err < best_err || (err == best_err && (c & 1) == 0)) {
        best = c;
        best_err = err;
      }
    }
    if (std::fabs(d) < 3.3e38) {
      ASSERT_EQ(got, best) << std::hexfloat << d;
    }
  }
}

TEST(Rng, PhiloxKnownAnswer) {
  // Random123's known-answer vector for philox4x32-10: counter and key all 0.
  const auto r = philox4x32({0, 0, 0, 0}, 0);
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
}

TEST(Rng, ShardedEqualsWhole) {
  const int64_t S = 37, H = 3, D = 5;
  Tensor<float> whole({S, H, D});
  std::vector<int64_t> t(S);
  for (int64_t i = 0; i < S; ++i) t[i] = i;
  fill_normal(whole.view3(), t.data(), 42, "q");
  // A stripe shard: tokens 1, 4, 7, ...
  std::vector<int64_t> shard_t;
  for (int64_t i = 1; i < S; i += 3) shard_t.push_back(i);
  Tensor<float> shard({static_cast<int64_t>(shard_t.size()), H, D});
  fill_normal(shard.view3(), shard_t.data(), 42, "q");
  for (size_t r = 0; r < shard_t.size(); ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d)
        EXPECT_EQ(shard.view3()(static_cast<int64_t>(r), h, d), whole.view3()(shard_t[r], h, d));
  // Another name or seed gives other values.
  Tensor<float> other({S, H, D});
  fill_normal(other.view3(), t.data(), 42, "k");
  EXPECT_NE(other[0], whole[0]);
  fill_normal(other.view3(), t.data(), 43, "q");
  EXPECT_NE(other[0], whole[0]);
}

TEST(Rng, LooksNormal) {
  const int64_t n = 200000;
  const uint64_t key = rng_key(1, "x");
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = normal_at(key, i, 0, 0);
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.02);
}

class Npy : public ::testing::Test {
 protected:
  std::string path(const std::string& name) {
    return ::testing::TempDir() + "loom_npy_" + std::to_string(::getpid()) + "_" + name;
  }
  void write_raw(const std::string& p, const std::string& bytes) {
    std::ofstream f(p, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  // A hand-built v1 .npy image with the given dict and payload.
  static std::string image(const std::string& dict, const std::string& payload) {
    std::string d = dict;
    while ((10 + d.size() + 1) % 64) d.push_back(' ');
    d.push_back('\n');
    std::string out("\x93NUMPY\x01\x00", 8);
    out.push_back(static_cast<char>(d.size() & 0xff));
    out.push_back(static_cast<char>(d.size() >> 8));
    return out + d + payload;
  }
  // `bytes` in a file, read by read(path): an IoError naming the file and saying `needle`.
  template <class Read>
  void expect_read_error(const std::string& bytes, const std::string& needle, const Read& read) {
    const std::string p = path("bad.npy");
    write_raw(p, bytes);
    try {
      read(p);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
    std::remove(p.c_str());
  }
  void expect_io_error(const std::string& bytes, const std::string& needle) {
    expect_read_error(bytes, needle, [](const std::string& p) { read_npy_f32(p); });
  }
};

TEST_F(Npy, RoundTripF32AndF64) {
  Tensor<float> x({3, 2, 5});
  for (int64_t i = 0; i < x.numel(); ++i) x[i] = 0.25f * static_cast<float>(i) - 3.0f;
  const std::string p = path("x.npy");
  write_npy(p, x);
  const Tensor<float> y = read_npy_f32(p);
  EXPECT_EQ(y.shape(), x.shape());
  EXPECT_EQ(y.vec(), x.vec());
  Tensor<double> xd({7});
  for (int64_t i = 0; i < 7; ++i) xd[i] = 1.0 / (i + 1);
  write_npy(p, xd);
  const Tensor<double> yd = read_npy_f64(p);
  EXPECT_EQ(yd.shape(), xd.shape());
  EXPECT_EQ(yd.vec(), xd.vec());
  // Empty and scalar-like shapes.
  Tensor<float> e({0, 4});
  write_npy(p, e);
  EXPECT_EQ(read_npy_f32(p).shape(), e.shape());
  std::remove(p.c_str());
}

// A default-constructed Tensor (shape [] but no element, unlike the 0-d Tensor({}) with one) was
// written as a header "shape ()" with no body, without an error; neither loom nor numpy could read
// the file. It is refused before anything is written; 0-d and empty tensors round-trip.
TEST_F(Npy, TensorsWhoseDataIsNotTheirShapeAreRefusedAndNothingIsWritten) {
  const std::string p = path("empty.npy");
  std::remove(p.c_str());
  for (int dtype = 0; dtype < 2; ++dtype) {
    try {
      if (dtype == 0) write_npy(p, Tensor<float>{});
      if (dtype == 1) write_npy(p, Tensor<double>{});
      ADD_FAILURE() << "a default-constructed Tensor was written";
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(p), std::string::npos) << what;
      EXPECT_NE(what.find("shape [] (1 elements) but holds 0"), std::string::npos) << what;
      EXPECT_NE(what.find("default-constructed"), std::string::npos) << what;
    }
    EXPECT_FALSE(std::ifstream(p).good()) << "a file was left at " << p;
  }
  Tensor<float> resized({2, 3});
  resized.vec().resize(5);  // by hand: the shape no longer describes the data
  EXPECT_THROW(write_npy(p, resized), InvalidArgument);
  EXPECT_FALSE(std::ifstream(p).good());
  // What is described round-trips: a 0-d tensor (one element) and an empty one.
  Tensor<float> scalar(std::vector<int64_t>{}, 2.5f);
  write_npy(p, scalar);
  Tensor<float> back = read_npy_f32(p);
  EXPECT_EQ(back.shape(), std::vector<int64_t>{});
  ASSERT_EQ(back.numel(), 1);
  EXPECT_EQ(back[0], 2.5f);
  write_npy(p, Tensor<float>({0}));
  back = read_npy_f32(p);
  EXPECT_EQ(back.shape(), std::vector<int64_t>{0});
  EXPECT_EQ(back.numel(), 0);
  std::remove(p.c_str());
}

// A finite float64 beyond float32's range became Inf on reading and was then reported as "a
// non-finite value (NaN or Inf)": it is named for what it is.
TEST_F(Npy, Float64BeyondFloat32IsNamedNotCalledNonFinite) {
  const std::string p = path("big.npy");
  Tensor<double> x({2, 3});
  for (int64_t i = 0; i < x.numel(); ++i) x[i] = 1.0;
  x[4] = -1e300;
  write_npy(p, x);
  EXPECT_EQ(read_npy_f64(p)[4], -1e300);
  try {
    read_npy_f32(p);
    ADD_FAILURE() << "1e300 read as float32";
  } catch (const IoError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("holds -1e+300 at flat index 4, which is finite but does not fit float32"),
              std::string::npos)
        << m;
  }
  x[4] = 3.4e38;  // fits
  write_npy(p, x);
  EXPECT_EQ(read_npy_f32(p)[4], 3.4e38f);
  x[4] = INFINITY;  // not finite: read as Inf, for the caller to refuse as such
  write_npy(p, x);
  EXPECT_TRUE(std::isinf(read_npy_f32(p)[4]));
  std::remove(p.c_str());
}

TEST_F(Npy, ReadsNumpyWrittenHeaderVariants) {
  std::string payload(8, '\0');
  const float a = 1.5f, b = -2.0f;
  std::memcpy(payload.data(), &a, 4);
  std::memcpy(payload.data() + 4, &b, 4);
  const std::string p = path("v.npy");
  write_raw(p, image("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", payload));
  Tensor<float> t = read_npy_f32(p);
  ASSERT_EQ(t.shape(), std::vector<int64_t>{2});
  EXPECT_EQ(t[0], 1.5f);
  EXPECT_EQ(t[1], -2.0f);
  // Keys in another order, as some writers do.
  write_raw(p, image("{'shape': (1, 2), 'fortran_order': False, 'descr': '<f4'}", payload));
  EXPECT_EQ(read_npy_f32(p).shape(), (std::vector<int64_t>{1, 2}));
  std::remove(p.c_str());
}

TEST_F(Npy, RefusesMalformed) {
  const std::string f4x2(8, '\0');
  expect_io_error("hello world, not npy", "bad magic");
  // Only the magic and version: truncated, not "bad magic".
  expect_io_error(std::string("\x93NUMPY\x01\x00", 8), "truncated npy header");
  // A NUL in the descr is shown escaped (it cut the message to "dtype <f4").
  expect_io_error(
      image(std::string("{'descr': '<f4\0', 'fortran_order': False, 'shape': (2,), }", 58), f4x2),
      "dtype <f4\\x00 is not supported");
  expect_io_error(image("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", f4x2),
                  "Fortran");
  expect_io_error(image("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", f4x2),
                  "big-endian");
  expect_io_error(image("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", f4x2),
                  "dtype <i4");
  expect_io_error(image("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", f4x2),
                  "truncated");
  expect_io_error(image("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", f4x2),
                  "header says shape [1]");
  expect_io_error(image("{'descr': '<f4', 'fortran_order': False}", f4x2), "'shape'");
  expect_io_error(image("{'descr': '<f4', 'fortran_order': False, 'shape': (a,), }", f4x2),
                  "malformed shape");
  // loom's tensors have at most 4 dimensions: a 5-d array is the file's error (IoError), not a
  // tensor's (the fuzzer found the InvalidArgument escaping parse_npy).
  expect_io_error(
      image("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 2), }", f4x2),
      "has more than 4 dimensions");
  // The dict read strictly, as numpy does: two 'fortran_order' entries were read by the first
  // (numpy takes the last: a Fortran array read as C order), two 'shape's likewise, and unknown
  // keys, text after the '}' and a quoted 'False' were accepted.
  expect_io_error(
      image("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'fortran_order': True}", f4x2),
      "'fortran_order' given twice");
  expect_io_error(
      image("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'shape': (1, 2)}", f4x2),
      "'shape' given twice");
  expect_io_error(image("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", f4x2),
                  "unknown key 'x'");
  expect_io_error(image("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk", f4x2),
                  "text after the dict");
  expect_io_error(image("{'descr': '<f4', 'fortran_order': 'False', 'shape': (2,)}", f4x2),
                  "malformed fortran_order");
  expect_io_error(image("{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}", f4x2),
                  "no ',' or '}' after 'descr'");
  expect_io_error(std::string("\x93NUMPY\x01\x00\xff\x00{", 11), "truncated npy header");
  expect_io_error(std::string("\x93NUMPY\x09\x00\x10\x00", 10), "version 9");
}

// Index arrays (cu_seqlens): int32 and int64 as torch writes them, whole floats; everything else
// refused with the file's name, and a FIFO without blocking (loom verify read them with an
// unbounded std::ifstream: a FIFO hung, /dev/zero never ended, a malformed shape was "stoll").
TEST_F(Npy, ReadsIndexArraysAndRefusesTheRest) {
  const std::string p = path("cu.npy");
  auto raw = [](const auto& values) {
    return std::string(reinterpret_cast<const char*>(values.data()),
                       values.size() * sizeof(values[0]));
  };
  const std::vector<int32_t> i4 = {0, 40, 96};
  write_raw(p, image("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }", raw(i4)));
  EXPECT_EQ(read_npy_index(p), (std::vector<int64_t>{0, 40, 96}));
  const std::vector<int64_t> i8 = {0, int64_t{1} << 40};
  write_raw(p, image("{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", raw(i8)));
  EXPECT_EQ(read_npy_index(p), i8);
  const std::vector<double> f8 = {0, 7, 12};
  write_raw(p, image("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", raw(f8)));
  EXPECT_EQ(read_npy_index(p), (std::vector<int64_t>{0, 7, 12}));
  auto refused = [&](const std::string& bytes, const std::string& needle) {
    expect_read_error(bytes, needle, [](const std::string& f) { read_npy_index(f); });
  };
  refused(image("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }",
                raw(std::vector<double>{0, 1.5, 3})),
          "entry 1 is not a whole number");
  refused(image("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
                raw(std::vector<double>{0, 1e300})),
          "entry 1 is not a whole number that fits 64 bits");
  refused(image("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
                raw(std::vector<double>{0, NAN})),
          "entry 1 is not a whole number");
  refused(image("{'descr': '<i8', 'fortran_order': False, 'shape': (1, 2), }", raw(i8)),
          "must be a 1-d array");
  refused(image("{'descr': '<i8', 'fortran_order': False, 'shape': (,), }", raw(i8)),
          "malformed shape (,)");  // numpy refuses it too
  refused(image("{'descr': '<i8', 'fortran_order': False, 'shape': (99999999999999999999,), }",
                raw(i8)),
          "is too large");
  refused(image("{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", raw(i8)), "truncated");
  refused(image("{'descr': '<u2', 'fortran_order': False, 'shape': (2,), }", raw(i4)),
          "dtype <u2 is not supported");
  std::remove(p.c_str());
  ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(read_npy_index(p), IoError);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  std::remove(p.c_str());
}

TEST_F(Npy, RoleShapeAndMissingFile) {
  Tensor<float> x({4, 2});
  const std::string p = path("q.npy");
  write_npy(p, x);
  try {
    read_npy_role_shape(p, "q", 3);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("q must be [S, H, D]"), std::string::npos) << e.what();
  }
  std::remove(p.c_str());
  EXPECT_THROW(read_npy_f32(path("does_not_exist.npy")), IoError);
  EXPECT_THROW(write_npy("/nonexistent-dir/x.npy", x), IoError);
}

TEST(Errors, CheckMacrosRecordValues) {
  try {
    const int h = 6, hkv = 4;
    LOOM_CHECK_EQ(h % hkv, 0, InvalidArgument, "heads must be a multiple of kv-heads");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "heads must be a multiple of kv-heads (h % hkv = 2, 0 = 0)");
    EXPECT_GT(e.line(), 0);
  }
  EXPECT_THROW(LOOM_CHECK(false, NotSupported, "x"), Error);
  EXPECT_NO_THROW(LOOM_CHECK(true, NotSupported, "x"));
  // Timeout is a CommError.
  EXPECT_THROW(throw Timeout("t"), CommError);
}

TEST(TensorTest, ViewsAndConvert) {
  Tensor<float> x({4, 3, 2});
  for (int64_t i = 0; i < x.numel(); ++i) x[i] = static_cast<float>(i);
  auto v = x.view3();
  EXPECT_EQ(v(2, 1, 1), 2 * 6 + 1 * 2 + 1);
  auto r = v.rows(1, 2).heads(1, 2);
  EXPECT_EQ(r(0, 0, 0), v(1, 1, 0));
  EXPECT_EQ(r(1, 1, 1), v(2, 2, 1));
  EXPECT_FALSE(r.contiguous());
  EXPECT_TRUE(v.contiguous());
  Tensor<bf16> b = convert<bf16>(x);
  Tensor<float> back = convert<float>(b);
  EXPECT_EQ(back.vec(), x.vec());  // small integers are exact in bf16
  EXPECT_THROW(Tensor<float>({2, -1}), InvalidArgument);
  EXPECT_EQ(shape_str({2, 3}), "[2, 3]");
}

}  // namespace
}  // namespace loom

// ---------------------------------------------------------------------------------------------
// Safe output, bounded input, memory estimates (issue 11). Each test fails on the code before
// loom/io.h: writes replaced devices and symlinks, reads blocked on FIFOs and read bodies whole.
namespace loom {
namespace {

namespace fs = std::filesystem;

class Io : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "loom_io_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string at(const std::string& name) const { return dir_ + "/" + name; }
  static std::string slurp(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  // Names in the directory other than `except`.
  std::vector<std::string> others(const std::vector<std::string>& except) const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string n = e.path().filename().string();
      if (std::find(except.begin(), except.end(), n) == except.end()) out.push_back(n);
    }
    return out;
  }
  std::string dir_;
};

// A pid that is certainly not running: a child that has exited and been reaped.
long dead_pid() {
  const pid_t c = ::fork();
  if (c == 0) ::_exit(0);
  int status = 0;
  ::waitpid(c, &status, 0);
  return c;
}

TEST_F(Io, RegularFileIsReplacedAtomicallyWithNoTemporaryLeft) {
  write_output(at("a.json"), "old");
  write_output(at("a.json"), "new contents");
  EXPECT_EQ(slurp(at("a.json")), "new contents");
  EXPECT_TRUE(others({"a.json"}).empty());
}

// The atomic replacement is a new file: it made a private (0600) file 0666 & ~umask (0644 here),
// readable by everyone. It keeps the replaced file's permission bits now; a new file gets the
// umask's.
TEST_F(Io, ReplacedFileKeepsItsMode) {
  write_output(at("private.json"), "old");
  ASSERT_EQ(::chmod(at("private.json").c_str(), 0600), 0);
  write_output(at("private.json"), "new");
  struct stat st;
  ASSERT_EQ(::stat(at("private.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(slurp(at("private.json")), "new");
  ASSERT_EQ(::chmod(at("private.json").c_str(), 0640), 0);
  write_output(at("private.json"), "newer");
  ASSERT_EQ(::stat(at("private.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  const mode_t mask = ::umask(022);
  write_output(at("fresh.json"), "x");
  ::umask(mask);
  ASSERT_EQ(::stat(at("fresh.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  EXPECT_TRUE(others({"private.json", "fresh.json"}).empty());
}

TEST_F(Io, SymlinkIsFollowedNotReplaced) {
  write_output(at("target.json"), "x");
  fs::create_symlink("target.json", at("link.json"));
  write_output(at("link.json"), "through the link");
  EXPECT_TRUE(fs::is_symlink(at("link.json")));
  EXPECT_EQ(slurp(at("target.json")), "through the link");
  // A dangling symlink: its target is created.
  fs::create_symlink("new.json", at("dangling.json"));
  write_output(at("dangling.json"), "made");
  EXPECT_TRUE(fs::is_symlink(at("dangling.json")));
  EXPECT_EQ(slurp(at("new.json")), "made");
}

TEST_F(Io, DevicesAreWrittenDirectlyNeverReplaced) {
  write_output("/dev/null", "discarded");
  struct stat st;
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "/dev/null was replaced";
  // A full device reports the failed write instead of losing it.
  try {
    write_output("/dev/full", "lost?");
    ADD_FAILURE() << "writing /dev/full succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/dev/full: write failed"), std::string::npos) << e.what();
  }
  ASSERT_EQ(::stat("/dev/full", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST_F(Io, FifoWithoutReaderIsRefusedAtOnceAndWithReaderWrittenDirectly) {
  ASSERT_EQ(::mkfifo(at("pipe").c_str(), 0600), 0);
  EXPECT_THROW(write_output(at("pipe"), "nobody reads"), IoError);
  std::string got;
  std::thread reader([&] {
    std::ifstream f(at("pipe"));
    got.assign((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  });
  // The reader may not have opened yet: retry the write for a bounded time.
  bool wrote = false;
  for (int i = 0; i < 200 && !wrote; ++i) {
    try {
      write_output(at("pipe"), "through the fifo");
      wrote = true;
    } catch (const IoError&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  reader.join();
  EXPECT_TRUE(wrote);
  EXPECT_EQ(got, "through the fifo");
  struct stat st;
  ASSERT_EQ(::stat(at("pipe").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

TEST_F(Io, DirectoryIsRefused) {
  fs::create_directories(at("d"));
  EXPECT_THROW(write_output(at("d"), "x"), IoError);
  EXPECT_TRUE(fs::is_directory(at("d")));
}

TEST_F(Io, StaleTemporariesOfDeadProcessesAreRemoved) {
  const long dead = dead_pid();
  const std::string stale = at("out.npy.tmp." + std::to_string(dead) + "-0");
  const std::string stale_dir = at("o.tmp." + std::to_string(dead) + "-3");
  const std::string live = at("out.npy.tmp." + std::to_string(::getppid()) + "-1");
  write_output(stale, "partial");
  fs::create_directories(stale_dir);
  write_output(stale_dir + "/a.npy", "a staging directory's file");
  // A kill while b.npy was being written leaves b.npy's own temporary in the staging directory
  // (the directory was then kept for ever).
  write_output(stale_dir + "/b.npy.tmp." + std::to_string(dead) + "-4", "half of b");
  // Another name in a staging directory is not loom's: that directory stays.
  const std::string foreign_dir = at("o.tmp." + std::to_string(dead) + "-5");
  fs::create_directories(foreign_dir);
  write_output(foreign_dir + "/a.npy", "a");
  write_output(foreign_dir + "/b.npy.tmp.x", "not a temporary of loom's");
  write_output(live, "someone else's, still running");
  write_output(at("out.npy"), "complete");
  clean_stale_temps(at("out.npy"));
  clean_stale_temps(at("o"), {"a.npy", "b.npy"});
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(stale_dir));
  EXPECT_TRUE(fs::exists(foreign_dir + "/b.npy.tmp.x"));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_EQ(slurp(at("out.npy")), "complete");
}

// A file name of up to NAME_MAX bytes is written: the temporary's suffix (".tmp.<pid>-<n>") took
// a 250-byte name past it ("cannot write into ... (File name too long)"). Its temporaries carry a
// shortened stem, which the stale clean-up finds too.
TEST_F(Io, LongestFileNamesAreWrittenAndTheirTemporariesCleaned) {
  const std::string name = std::string(250, 'n') + ".json";
  EXPECT_NO_THROW(check_output_writable(at(name), "--json"));
  write_output(at(name), "long");
  EXPECT_EQ(slurp(at(name)), "long");
  EXPECT_TRUE(others({name}).empty()) << "left " << others({name}).front();
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx",
                static_cast<unsigned long long>(fnv1a64(name.data(), name.size())));
  const std::string suffix = ".tmp." + std::to_string(dead_pid()) + "-1";
  const std::string mine = name.substr(0, 200) + "~" + hash + suffix;
  const std::string foreign = std::string(200, 'n') + "~0123456789abcdef" + suffix;
  write_output(at(mine), "partial");
  write_output(at(foreign), "another long name's");
  clean_stale_temps(at(name));
  EXPECT_FALSE(fs::exists(at(mine)));
  EXPECT_TRUE(fs::exists(at(foreign)));
}

// Only what loom leaves under a temporary's name is removed: a directory where write_output's
// temporary file would be, or a "staging directory" holding anything but regular files of the
// set's names, is someone else's (a directory of that name was removed with all it held).
TEST_F(Io, StaleTemporaryNamesHoldingOthersFilesAreLeftAlone) {
  const std::string dead = std::to_string(dead_pid());
  const std::string file_dir = at("r.json.tmp." + dead + "-0");
  fs::create_directories(file_dir);
  write_output(file_dir + "/x", "mine");
  clean_stale_temps(at("r.json"));
  EXPECT_EQ(slurp(file_dir + "/x"), "mine");
  const std::vector<std::string> names = {"a.npy", "b.npy"};
  const std::string foreign = at("o.tmp." + dead + "-1"), nested = at("o.tmp." + dead + "-2");
  fs::create_directories(foreign);
  write_output(foreign + "/a.npy", "a");
  write_output(foreign + "/notes.txt", "mine");
  fs::create_directories(nested + "/a.npy/photos");
  write_output(nested + "/a.npy/photos/p.jpg", "mine");
  clean_stale_temps(at("o"), names);
  EXPECT_EQ(slurp(foreign + "/notes.txt"), "mine");
  EXPECT_EQ(slurp(foreign + "/a.npy"), "a");
  EXPECT_EQ(slurp(nested + "/a.npy/photos/p.jpg"), "mine");
}

// Only the names loom gives its temporaries are removed, exactly: "<name>.tmp.<pid>-<n>" (and
// "-s<n>", earlier versions' staged files), decimal numbers without a leading zero, a pid below
// pid_max. Any digits and then anything after a '-' were taken for a dead run's: a user's
// a.json.tmp.2024-06-01, a.json.tmp.2024-06-01.bak and a.json.tmp.99999999 were deleted.
TEST_F(Io, OnlyLoomsOwnTemporaryNamesAreRemoved) {
  const std::string dead = std::to_string(dead_pid());
  const std::vector<std::string> loom = {"a.json.tmp." + dead + "-0", "a.json.tmp." + dead + "-17",
                                         "a.json.tmp." + dead + "-s2"};
  const std::vector<std::string> users = {"a.json.tmp.2024-06-01",
                                          "a.json.tmp.2024-06-01.bak",
                                          "a.json.tmp.99999999",
                                          "a.json.tmp.99999999-1",
                                          "a.json.tmp." + dead,
                                          "a.json.tmp." + dead + "-",
                                          "a.json.tmp." + dead + "-07",
                                          "a.json.tmp.0" + dead + "-1",
                                          "a.json.tmp." + dead + "-1x",
                                          "a.json.tmp." + dead + "-s",
                                          "a.json.tmp.0-1",
                                          "a.json.tmp.-1-1",
                                          "a.json.tmp." + dead + "-1-2"};
  for (const auto& n : loom) write_output(at(n), "partial");
  for (const auto& n : users) write_output(at(n), "mine");
  clean_stale_temps(at("a.json"));
  for (const auto& n : loom) EXPECT_FALSE(fs::exists(at(n))) << n;
  for (const auto& n : users) EXPECT_EQ(slurp(at(n)), "mine") << n;
  // The same names inside an OutputSet's old staging directory: it is loom's only when all are.
  const std::string set = at("o.tmp." + dead + "-3");
  fs::create_directories(set);
  write_output(set + "/a.npy", "a");
  write_output(set + "/a.npy.tmp.2024-06-01", "mine");
  clean_stale_temps(at("o"), {"a.npy"});
  EXPECT_EQ(slurp(set + "/a.npy.tmp.2024-06-01"), "mine");
}

TEST_F(Io, TwoOutputsOnOnePathAreRefused) {
  EXPECT_THROW(check_distinct_outputs({{"--json", at("r.json")}, {"--trace", at("r.json")}}),
               InvalidArgument);
  write_output(at("r.json"), "x");
  fs::create_symlink("r.json", at("l.json"));
  EXPECT_THROW(check_distinct_outputs({{"--json", at("r.json")}, {"--trace", at("l.json")}}),
               InvalidArgument);
  EXPECT_NO_THROW(check_distinct_outputs(
      {{"--json", at("r.json")}, {"--trace", at("t.json")}, {"--timeline", ""}}));
  // A hard link is the same file under another name (a --log linked to --data cut the corpus).
  fs::create_hard_link(at("r.json"), at("h.json"));
  try {
    check_distinct_outputs({{"--data", at("r.json")}, {"--log", at("h.json")}});
    ADD_FAILURE() << "hard links to one file passed as two outputs";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("hard links to one file"), std::string::npos) << e.what();
  }
  write_output(at("copy.json"), "x");  // equal bytes, another file
  EXPECT_NO_THROW(check_distinct_outputs({{"--data", at("r.json")}, {"--log", at("copy.json")}}));
  // Inputs (the leading entries) may alias each other (q.npy a link to k.npy was refused as two
  // outputs on one file), never an output.
  EXPECT_NO_THROW(check_distinct_outputs(
      {{"q.npy", at("r.json")}, {"k.npy", at("h.json")}, {"--json", at("t.json")}}, 2));
  EXPECT_THROW(check_distinct_outputs(
                   {{"q.npy", at("r.json")}, {"k.npy", at("t.json")}, {"--json", at("h.json")}}, 2),
               InvalidArgument);
}

// "-" is standard output, descriptor 1, as /dev/stdout, /dev/fd/1 and /proc/self/fd/1 are: two
// outputs on it are refused however each is named (`--json - --trace /dev/stdout` wrote both into
// one stream, unparseable, exit 0), with standard output a regular file, a pipe, a terminal or
// closed; and "-" with the file standard output is redirected to, by name or a hard link.
TEST_F(Io, StandardOutputUnderAnyNameIsOneOutput) {
  auto refused = [](const std::string& a, const std::string& b) {
    try {
      check_distinct_outputs({{"--json", a}, {"--trace", b}});
      return false;
    } catch (const InvalidArgument&) {
      return true;
    }
  };
  const std::vector<std::string> names = {"/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"};
  std::fflush(stdout);
  const int saved = ::dup(STDOUT_FILENO);
  ASSERT_GE(saved, 0);
  // Each case points descriptor 1 elsewhere, records, and restores it before any EXPECT prints.
  struct Case {
    std::string what;
    std::vector<bool> with_names;  // "-" and each of `names`: refused?
    bool alone = false, other = true, file = false, link = false;
  };
  std::vector<Case> cases;
  auto record = [&](const std::string& what) {
    Case c{what, {}};
    for (const std::string& n : names) c.with_names.push_back(refused("-", n));
    c.alone = refused("-", "");
    c.other = refused("-", at("other.json"));
    cases.push_back(c);
    return &cases.back();
  };
  write_output(at("out.txt"), "x");
  fs::create_hard_link(at("out.txt"), at("hard.txt"));
  const int file = ::open(at("out.txt").c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  ASSERT_GE(file, 0);
  ::dup2(file, STDOUT_FILENO);
  Case* c = record("a regular file");
  c->file = refused("-", at("out.txt"));
  c->link = refused("-", at("hard.txt"));
  ::close(file);
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  ::dup2(pipe_fds[1], STDOUT_FILENO);
  record("a pipe");
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  const int tty = ::posix_openpt(O_RDWR | O_NOCTTY);
  int tty_slave = -1;
  if (tty >= 0 && ::grantpt(tty) == 0 && ::unlockpt(tty) == 0)
    tty_slave = ::open(::ptsname(tty), O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (tty_slave >= 0) {
    ::dup2(tty_slave, STDOUT_FILENO);
    record("a terminal");
    ::close(tty_slave);
  }
  if (tty >= 0) ::close(tty);
  ::close(STDOUT_FILENO);
  record("closed");
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  EXPECT_GE(cases.size(), 3u);
  for (const Case& k : cases) {
    for (size_t i = 0; i < names.size(); ++i)
      EXPECT_TRUE(k.with_names[i]) << "- and " << names[i] << ", standard output " << k.what;
    EXPECT_FALSE(k.alone) << k.what;
    EXPECT_FALSE(k.other) << k.what;
  }
  EXPECT_TRUE(cases[0].file) << "- and the file standard output is redirected to";
  EXPECT_TRUE(cases[0].link) << "- and a hard link to the file standard output is redirected to";
  EXPECT_FALSE(refused("-", at("out.txt"))) << "standard output restored: out.txt is another file";
}

// A path whose symlinks lead to one of the process's own streams is that stream: a link to
// /dev/stdout was followed through /proc/self/fd/1 to the file standard output was appended to,
// and a new file renamed over it (its lines lost, exit 0), or to a pipe's "pipe:[N]" ("cannot
// write into /proc/self/fd"). The chain is walked one link at a time, never through the last.
TEST_F(Io, SymlinksToTheProcessStreamsAreThoseStreams) {
  fs::create_symlink("/dev/stdout", at("so"));
  fs::create_symlink("so", at("so2"));  // a chain
  fs::create_symlink("/dev/stderr", at("se"));
  fs::create_symlink("/dev/fd/2", at("fd2"));
  fs::create_symlink("/proc/self/fd/1", at("pfd1"));
  // Relative, through ".." up to the root (deep enough for any TempDir) and down to /dev.
  std::string up;
  for (int i = 0; i < 64; ++i) up += "../";
  fs::create_symlink(up + "dev/stdout", at("rel"));
  write_output(at("file"), "x");
  fs::create_symlink("file", at("to_file"));
  EXPECT_EQ(own_stream_fd(at("so")), 1);
  EXPECT_EQ(own_stream_fd(at("so2")), 1);
  EXPECT_EQ(own_stream_fd(at("se")), 2);
  EXPECT_EQ(own_stream_fd(at("fd2")), 2);
  EXPECT_EQ(own_stream_fd(at("pfd1")), 1);
  EXPECT_EQ(own_stream_fd(at("rel")), 1);
  EXPECT_EQ(own_stream_fd("/dev/../dev/stdout"), 1);
  EXPECT_EQ(own_stream_fd("/proc/" + std::to_string(::getpid()) + "/fd/1"), 1);
  EXPECT_EQ(own_stream_fd(at("to_file")), -1);
  EXPECT_EQ(own_stream_fd(at("file")), -1);
  EXPECT_EQ(own_stream_fd(at("missing")), -1);
  EXPECT_EQ(own_stream_fd(at("stdout")), -1);  // a file of that name elsewhere is a file
  // Standard output appended to a file: written through the link, the file keeps its lines.
  write_output(at("log.txt"), "precious\n");
  std::fflush(stdout);
  const int saved = ::dup(STDOUT_FILENO);
  ASSERT_GE(saved, 0);
  const int log = ::open(at("log.txt").c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  ASSERT_GE(log, 0);
  ::dup2(log, STDOUT_FILENO);
  ::close(log);
  bool refused_as_one = false, writable = false;
  try {
    check_distinct_outputs({{"--json", "-"}, {"--trace", at("so2")}});
  } catch (const InvalidArgument&) {
    refused_as_one = true;
  }
  try {
    check_output_writable(at("so"), "--json");
    write_output(at("so"), "report\n");
    writable = true;
  } catch (const Error&) {
  }
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  EXPECT_TRUE(refused_as_one) << "- and a link to /dev/stdout passed as two outputs";
  EXPECT_TRUE(writable);
  EXPECT_EQ(slurp(at("log.txt")), "precious\nreport\n");
  EXPECT_TRUE(fs::is_symlink(at("so")));
}

// A report inside the --output directory was swapped away with the old set or, written after
// the swap, replaced one of its files (loom attn --output D --json D/out.npy); --json inside
// loom verify's --candidate directory replaced a candidate file.
TEST_F(Io, OutputsInsideAReplacedOrReadDirectoryAreRefused) {
  fs::create_directories(at("set"));
  fs::create_symlink("set", at("link"));
  for (const std::string& p : {at("set/out.npy"), at("set/sub/t.json"), at("link/r.json")})
    EXPECT_THROW(check_output_outside("--json", p, "--output", at("set"), "replaced"),
                 InvalidArgument)
        << p;
  EXPECT_THROW(check_output_outside("--json", at("set/a"), "--output", at("set/"), "replaced"),
               InvalidArgument);
  EXPECT_THROW(check_output_outside("--json", at("set/a"), "--output", at("link"), "replaced"),
               InvalidArgument);
  try {
    check_output_outside("--json", at("set/out.npy"), "--output", at("set"), "which is replaced");
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is inside --output " + at("set") + ", which is replaced"),
              std::string::npos)
        << e.what();
  }
  // A sibling whose name starts with the directory's is not inside it.
  for (const std::string& p : {at("set2/a"), at("r.json"), std::string("-"), std::string()})
    EXPECT_NO_THROW(check_output_outside("--json", p, "--output", at("set"), "replaced")) << p;
  EXPECT_NO_THROW(check_output_outside("--json", at("set/a"), "--output", "", "replaced"));
}

// A foreign name in an --output directory is refused before the run, not after it.
TEST_F(Io, OutputSetNamesAreCheckedBeforeTheRun) {
  const std::vector<std::string> names = {"a.npy", "b.npy"};
  EXPECT_NO_THROW(check_output_set(at("new"), names));
  fs::create_directories(at("set"));
  write_output(at("set/a.npy"), "a");
  EXPECT_NO_THROW(check_output_set(at("set"), names));
  write_output(at("set/notes.txt"), "mine");
  EXPECT_THROW(check_output_set(at("set"), names), IoError);
  // One of the set's names that is not a regular file is not loom's: a directory b.npy (removed
  // with all it held when the old set was), a link (its target survived, the link went).
  fs::remove(at("set/notes.txt"));
  fs::create_directories(at("set/b.npy/photos"));
  write_output(at("set/b.npy/photos/p.jpg"), "mine");
  EXPECT_THROW(check_output_set(at("set"), names), IoError);
  EXPECT_THROW(OutputSet(at("set"), names), IoError);
  EXPECT_EQ(slurp(at("set/b.npy/photos/p.jpg")), "mine");
  fs::remove_all(at("set/b.npy"));
  fs::create_symlink(at("set/a.npy"), at("set/b.npy"));
  EXPECT_THROW(check_output_set(at("set"), names), IoError);
  fs::remove(at("set/b.npy"));
  EXPECT_NO_THROW(check_output_set(at("set"), names));
  write_output(at("file"), "x");
  EXPECT_THROW(check_output_set(at("file"), names), IoError);
  // A name is a plain file name of the set: "../escape.npy" was written outside it.
  for (const std::string bad : {"../escape.npy", "sub/a.npy", "..", ".", ""}) {
    EXPECT_THROW(OutputSet(at("set2"), {"a.npy", bad}), InvalidArgument) << bad;
    EXPECT_FALSE(fs::exists(at("escape.npy")));
  }
}

// access() says yes to root on /proc and /sys, and the run went ahead and failed at the write;
// the check now creates (and removes) the temporary the write needs.
TEST_F(Io, UnwritableOutputsAreFoundByCreatingTheTemporary) {
  if (fs::exists("/proc/version")) {
    EXPECT_THROW(check_output_writable("/proc/version", "--json"), IoError);
    EXPECT_THROW(check_output_writable("/proc/loom-x", "--output", true), IoError);
  }
  EXPECT_NO_THROW(check_output_writable(at("r.json"), "--json"));
  EXPECT_NO_THROW(check_output_writable(at("set"), "--output", true));
  EXPECT_TRUE(others({}).empty()) << "the probe left " << others({}).front();
}

TEST_F(Io, OutputSetIsSwappedInWholeOrNotAtAll) {
  const std::vector<std::string> names = {"a.npy", "b.npy"};
  {
    OutputSet s(at("out"), names);
    write_output(s.path("a.npy"), "a1");
    write_output(s.path("b.npy"), "b1");
    s.commit();
  }
  EXPECT_EQ(slurp(at("out/a.npy")), "a1");
  {  // a run that fails after writing half its set changes nothing
    OutputSet s(at("out"), names);
    write_output(s.path("a.npy"), "a2");
  }
  EXPECT_EQ(slurp(at("out/a.npy")), "a1");
  EXPECT_EQ(slurp(at("out/b.npy")), "b1");
  {  // a set without b replaces the old set: no stale b from the run before
    OutputSet s(at("out"), names);
    write_output(s.path("a.npy"), "a3");
    s.commit();
  }
  EXPECT_EQ(slurp(at("out/a.npy")), "a3");
  EXPECT_FALSE(fs::exists(at("out/b.npy")));
  EXPECT_TRUE(others({"out"}).empty()) << "staging directories left behind";
  // Someone else's file in the directory: refused before anything is written.
  write_output(at("out/notes.txt"), "mine");
  EXPECT_THROW(OutputSet(at("out"), names), IoError);
  EXPECT_EQ(slurp(at("out/notes.txt")), "mine");
}

// The set keeps the permission bits of the directory and files it replaces, as write_output keeps
// a replaced file's: a private 0700 directory became 0755 and a 0600 file 0644.
// A failed write of a set's file names it as the user named the set, not by the staging
// directory: a full disk said "set.tmp.5170-1/out.npy: write failed (No space left on device)".
TEST_F(Io, OutputSetFilesAreNamedAsTheUserNamedTheSet) {
  const std::vector<std::string> names = {"a.npy"};
  OutputSet s(at("set") + "/", names);
  fs::create_directories(s.path("a.npy"));  // a directory where the file goes: write_output fails
  try {
    write_output(s.path("a.npy"), "a");
    ADD_FAILURE() << "a directory was written as a file";
  } catch (const IoError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find("--output " + at("set") + "/a.npy: is a directory"), 0u) << m;
    EXPECT_EQ(m.find(".tmp."), std::string::npos) << m;
  }
}

// write_outputs' staged files: named as write_output's temporaries whatever the name's length (a
// name of 201 to 255 bytes was written directly, so with a full disk --json was replaced and
// --trace failed), the targets untouched until commit_staged.
TEST_F(Io, StagedOutputsOfLongNamesAreTemporariesUntilCommitted) {
  const std::string a = std::string(210, 'a') + ".json", b = std::string(250, 'b') + ".json";
  write_output(at(a), "old a");
  const std::string ta = stage_output(at(a), "new a");
  const std::string tb = stage_output(at(b), "new b");
  EXPECT_EQ(slurp(at(a)), "old a");
  EXPECT_FALSE(fs::exists(at(b)));
  EXPECT_EQ(fs::path(ta).parent_path(), fs::path(at(a)).parent_path());
  EXPECT_EQ(slurp(ta), "new a");
  commit_staged(ta, at(a));
  commit_staged(tb, at(b));
  EXPECT_EQ(slurp(at(a)), "new a");
  EXPECT_EQ(slurp(at(b)), "new b");
  EXPECT_TRUE(others({a, b}).empty()) << "left " << others({a, b}).front();
  // A staged file that is never committed (the process killed) is the next run's to remove.
  const std::string left = stage_output(at(b), "half");
  ASSERT_TRUE(fs::exists(left));
  const std::string name = fs::path(left).filename().string();
  const std::string stem = name.substr(0, name.rfind(".tmp.") + 5);  // "<stem>.tmp."
  fs::rename(left, at(stem + std::to_string(dead_pid()) + "-5"));
  clean_stale_temps(at(b));
  EXPECT_TRUE(others({a, b}).empty()) << "left " << others({a, b}).front();
}

TEST_F(Io, OutputSetKeepsThePermissionBitsItReplaces) {
  const std::vector<std::string> names = {"a.npy", "b.npy"};
  fs::create_directories(at("priv"));
  ::chmod(at("priv").c_str(), 0700);
  write_output(at("priv/a.npy"), "a0");
  ::chmod(at("priv/a.npy").c_str(), 0600);
  {
    OutputSet s(at("priv"), names);
    write_output(s.path("a.npy"), "a1");
    write_output(s.path("b.npy"), "b1");
    s.commit();
  }
  auto mode = [](const std::string& p) {
    struct stat st;
    return ::stat(p.c_str(), &st) == 0 ? static_cast<int>(st.st_mode & 07777) : -1;
  };
  EXPECT_EQ(slurp(at("priv/a.npy")), "a1");
  EXPECT_EQ(mode(at("priv")), 0700);
  EXPECT_EQ(mode(at("priv/a.npy")), 0600);
  EXPECT_NE(mode(at("priv/b.npy")), -1);  // new: the default mode
}

// Runs body as an unprivileged user and returns what it returns ("" for success): as root, who
// may write anywhere, in a child that became nobody (uid and gid 65534) in the test's directory,
// handed to it; as anyone else, here.
std::string as_unprivileged(const std::string& dir, const std::function<std::string()>& body) {
  if (::geteuid() != 0) return body();
  if (::chown(dir.c_str(), 65534, 65534) != 0) return "cannot hand the directory to nobody";
  int fds[2];
  if (::pipe(fds) != 0) return "no pipe";
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    std::string r = ::setgroups(0, nullptr) == 0 && ::setgid(65534) == 0 && ::setuid(65534) == 0
                        ? body()
                        : "cannot become nobody";
    if (r.empty()) r = "ok";
    const ssize_t w = ::write(fds[1], r.data(), r.size());
    ::_exit(w == static_cast<ssize_t>(r.size()) ? 0 : 1);
  }
  ::close(fds[1]);
  std::string r;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) r.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return r == "ok" ? "" : r.empty() ? "the child failed" : r;
}

// A read-only DIR (0555) of the user who runs loom is replaced as a read-only file is: DIR's bits
// went onto the staging directory before its files were written, and the run failed after all
// its work ("--output s/out.npy: cannot write (Permission denied)"). The bits now go on at
// commit(), and the old set, read-only too, is made writable to be removed.
TEST_F(Io, ReadOnlyOutputSetOfItsOwnerIsReplaced) {
  const std::vector<std::string> names = {"a.npy"};
  const std::string failed = as_unprivileged(dir_, [&]() -> std::string {
    try {
      {
        OutputSet s(at("ro"), names);
        write_output(s.path("a.npy"), "a1");
        s.commit();
      }
      if (::chmod(at("ro").c_str(), 0555) != 0) return "chmod";
      std::string left;
      {
        OutputSet s(at("ro"), names);
        write_output(s.path("a.npy"), "a2");
        left = s.commit();
      }
      struct stat st;
      if (!left.empty()) return "commit said: " + left;
      if (slurp(at("ro/a.npy")) != "a2") return "the set was not replaced";
      if (::stat(at("ro").c_str(), &st) != 0 || (st.st_mode & 07777) != 0555)
        return "DIR's bits were not kept";
      if (!others({"ro"}).empty()) return "left " + others({"ro"}).front();
      return "";
    } catch (const std::exception& e) {
      return e.what();
    }
  });
  ::chmod(at("ro").c_str(), 0755);  // for TearDown
  EXPECT_EQ(failed, "");
}

// The old set could not be removed (another user's files: only that user may delete them) and
// stayed as DIR.tmp.PID-N without a word; commit() now says so in one line naming it.
TEST_F(Io, AnOldSetThatCannotBeRemovedIsNamed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs another user's files: run as root";
  const std::vector<std::string> names = {"a.npy"};
  {
    OutputSet s(at("set"), names);  // root's set
    write_output(s.path("a.npy"), "root's");
    s.commit();
  }
  const std::string failed = as_unprivileged(dir_, [&]() -> std::string {
    try {
      OutputSet s(at("set"), names);
      write_output(s.path("a.npy"), "mine");
      const std::string left = s.commit();
      if (slurp(at("set/a.npy")) != "mine") return "the new set is not in place";
      const std::vector<std::string> rest = others({"set"});
      if (rest.size() != 1) return "expected the old set beside the new one";
      const std::string want = "--output " + at("set") +
                               ": the new set is in place, but the old one could not be removed "
                               "(Permission denied) and is left in " +
                               at(rest[0]) + "; remove it yourself";
      if (left != want) return "commit said: '" + left + "', not '" + want + "'";
      return "";
    } catch (const std::exception& e) {
      return e.what();
    }
  });
  EXPECT_EQ(failed, "");
}

// A mount point cannot be renamed onto (EBUSY): --output onto a mounted file system (or --trace
// onto a bind-mounted file) was refused only after the whole run, once the other outputs had
// been replaced. /proc is a mount point on every Linux.
TEST_F(Io, MountPointsAreRefusedBeforeTheRun) {
  if (!fs::exists("/proc/self")) GTEST_SKIP() << "no /proc";
  for (const auto& check : std::vector<std::function<void()>>{
           [] { check_output_writable("/proc", "--output", true); },
           [] { check_output_writable("/proc/", "--output", true); },
           [] { check_output_set("/proc", {"a.npy"}); }, [] { OutputSet("/proc", {"a.npy"}); }}) {
    try {
      check();
      ADD_FAILURE() << "/proc was taken as an output directory";
    } catch (const IoError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(": is a mount point (something is mounted on it)"), std::string::npos) << m;
      EXPECT_NE(m.find("name a directory inside it, e.g. /proc/set"), std::string::npos) << m;
    }
  }
  EXPECT_NO_THROW(check_output_writable(at("set"), "--output", true));
}

// A FIFO whose reader opened it and then stopped reading held the write for ever (LOOM_TIMEOUT_S
// did not apply): `loom attn --trace ff` and `loom train --log ff` never ended.
TEST_F(Io, WritesToAReaderThatStopsReadingTimeOut) {
  const char* saved = std::getenv("LOOM_TIMEOUT_S");
  const std::string restore = saved ? saved : "";
  ASSERT_EQ(::mkfifo(at("ff").c_str(), 0600), 0);
  const int reader = ::open(at("ff").c_str(), O_RDONLY | O_NONBLOCK);  // open, never read
  ASSERT_GE(reader, 0);
  ::setenv("LOOM_TIMEOUT_S", "0.3", 1);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    write_output(at("ff"), std::string(size_t{1} << 20, 'x'));
    ADD_FAILURE() << "1 MiB went into a FIFO nobody reads";
  } catch (const IoError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find(at("ff") + ": write timed out: its reader took nothing for 0.3 s " +
                     "(LOOM_TIMEOUT_S)"),
              0u)
        << m;
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(took, 0.3);
  EXPECT_LT(took, 10.0);
  ::close(reader);
  ::setenv("LOOM_TIMEOUT_S", "garbage", 1);
  EXPECT_THROW(output_timeout_s(), InvalidArgument);
  if (saved)
    ::setenv("LOOM_TIMEOUT_S", restore.c_str(), 1);
  else
    ::unsetenv("LOOM_TIMEOUT_S");
  // A pipe, written directly: the timeout counts from the last byte the reader took, so a reader
  // that keeps reading (slowly) gets everything.
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  EXPECT_THROW(write_nonblocking(p[1], std::string(size_t{1} << 20, 'x').data(), size_t{1} << 20,
                                 "pipe", 0.2),
               IoError);
  ::close(p[0]);
  ::close(p[1]);
  ASSERT_EQ(::pipe(p), 0);
  std::string got;
  std::thread slow([&] {
    char buf[4096];
    for (ssize_t n; (n = ::read(p[0], buf, sizeof buf)) > 0;) {
      got.append(buf, static_cast<size_t>(n));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  const std::string bytes(size_t{1} << 20, 'y');
  EXPECT_NO_THROW(write_nonblocking(p[1], bytes.data(), bytes.size(), "pipe", 0.2));
  ::close(p[1]);
  slow.join();
  ::close(p[0]);
  EXPECT_EQ(got, bytes);
}

// "link/" (a symlink to a directory, trailing '/') was resolved as given, lstat followed the link,
// and commit() renamed the set onto the link itself: "Not a directory" after the whole run.
TEST_F(Io, OutputSetThroughASymlinkWithATrailingSlash) {
  const std::vector<std::string> names = {"a.npy"};
  fs::create_directories(at("real"));
  fs::create_directory_symlink("real", at("link"));
  fs::create_directory_symlink("real/", at("link2"));
  for (const std::string& dir : {at("link/"), at("link2/"), at("link2//")}) {
    EXPECT_NO_THROW(check_output_writable(dir, "--output", true)) << dir;
    EXPECT_NO_THROW(check_output_set(dir, names)) << dir;
    OutputSet s(dir, names);
    write_output(s.path("a.npy"), dir);
    EXPECT_NO_THROW(s.commit()) << dir;
    EXPECT_EQ(slurp(at("real/a.npy")), dir);
    EXPECT_TRUE(fs::is_symlink(at("link")) && fs::is_symlink(at("link2")));
  }
}

// "-", "/", "." and ".." (as the last component, given or through a link) cannot be renamed
// onto: --output . was refused only when the set was swapped in, after the run.
TEST_F(Io, OutputSetRefusesDotsAndStandardOutputBeforeTheRun) {
  const std::vector<std::string> names = {"a.npy"};
  fs::create_directories(at("d/sub"));
  fs::create_directory_symlink(".", at("self"));
  for (const std::string& dir :
       {std::string("-"), std::string("."), std::string("./"), std::string("/"), at("d/."),
        at("d/sub/.."), at("d/sub/./"), at("self")}) {
    EXPECT_THROW(check_output_writable(dir, "--output", true), InvalidArgument) << dir;
    EXPECT_THROW(check_output_set(dir, names), InvalidArgument) << dir;
    EXPECT_THROW(OutputSet(dir, names), InvalidArgument) << dir;
  }
  EXPECT_NO_THROW(check_output_writable("-", "--json"));  // a file output may be standard output
  EXPECT_TRUE(fs::is_empty(at("d/sub")));
}

TEST_F(Io, ConcurrentOutputSetsNeverMix) {
  const std::vector<std::string> names = {"a.npy", "b.npy"};
  for (int round = 0; round < 20; ++round) {
    std::vector<std::thread> ts;
    for (int w = 0; w < 2; ++w)
      ts.emplace_back([&, w] {
        OutputSet s(at("out"), names);
        write_output(s.path("a.npy"), std::to_string(w));
        write_output(s.path("b.npy"), std::to_string(w));
        s.commit();
      });
    for (auto& t : ts) t.join();
    EXPECT_EQ(slurp(at("out/a.npy")), slurp(at("out/b.npy"))) << "round " << round;
  }
}

TEST_F(Io, InputFileRefusesFifosAndDirectoriesWithoutBlocking) {
  ASSERT_EQ(::mkfifo(at("q.npy").c_str(), 0600), 0);
  const double t0 = now_s();
  EXPECT_THROW(read_npy_f32(at("q.npy")), IoError);
  EXPECT_THROW(InputFile(at("q.npy"), "--data"), IoError);
  EXPECT_LT(now_s() - t0, 5.0);
  fs::create_directories(at("dir.npy"));
  try {
    read_npy_f32(at("dir.npy"));
    ADD_FAILURE() << "a directory was read";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("dir.npy: is a directory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(InputFile("/dev/zero", "--data"), IoError);
}

// One holder at a time: a second lock on the same directory (another open, as another process
// makes) is an IoError naming the option and the path, until the first is released.
TEST_F(Io, DirectoryLockIsExclusiveUntilReleased) {
  auto first = std::make_unique<DirectoryLock>(dir_, "--checkpoint-dir");
  try {
    DirectoryLock second(dir_, "--checkpoint-dir");
    ADD_FAILURE() << "a second lock on a held directory was granted";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("--checkpoint-dir " + dir_ + " is in use"),
              std::string::npos)
        << e.what();
  }
  first.reset();
  EXPECT_NO_THROW(DirectoryLock again(dir_, "--checkpoint-dir"));
  // A file's lock likewise; a missing directory locks nothing and is not an error here.
  write_output(at("log.jsonl"), "");
  const int a = ::open(at("log.jsonl").c_str(), O_RDWR | O_CLOEXEC);
  const int b = ::open(at("log.jsonl").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  EXPECT_NO_THROW(lock_or_refuse(a, at("log.jsonl"), "--log"));
  EXPECT_THROW(lock_or_refuse(b, at("log.jsonl"), "--log"), IoError);
  ::close(a);
  EXPECT_NO_THROW(lock_or_refuse(b, at("log.jsonl"), "--log"));
  ::close(b);
  EXPECT_NO_THROW(DirectoryLock none(at("missing"), "--checkpoint-dir"));
}

TEST_F(Io, ReadRestIsBounded) {
  write_output(at("d.txt"), std::string(1000, 'x'));
  {
    InputFile f(at("d.txt"), "--data");
    EXPECT_EQ(f.read_rest(1000).size(), 1000u);
  }
  InputFile f(at("d.txt"), "--data");
  try {
    f.read_rest(999, "--data-limit");
    ADD_FAILURE() << "read past the limit";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("--data-limit"), std::string::npos) << e.what();
  }
}

TEST_F(Io, NpyHeaderIsCheckedBeforeTheBodyIsRead) {
  // 40 GiB without the magic (sparse: no disk used) is refused at once, not read whole.
  const std::string big = at("big.npy");
  {
    const int fd = ::open(big.c_str(), O_WRONLY | O_CREAT, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, off_t{40} << 30), 0);
    ::close(fd);
  }
  const double t0 = now_s();
  EXPECT_THROW(read_npy_f32(big), IoError);
  EXPECT_LT(now_s() - t0, 5.0);
  // A valid header that declares far more data than the file has: refused before allocating.
  std::string h("\x93NUMPY\x01\x00", 8);
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,), }";
  dict.append(64 - (10 + dict.size() + 1) % 64, ' ');
  dict.push_back('\n');
  h.push_back(static_cast<char>(dict.size() & 0xff));
  h.push_back(static_cast<char>(dict.size() >> 8));
  write_output(at("lying.npy"), h + dict + std::string(16, '\0'));
  try {
    read_npy_f32(at("lying.npy"));
    ADD_FAILURE() << "a truncated file was accepted";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

TEST(Memory, EstimatesAreRefusedInOneLineNamingEstimateLimitAndOption) {
  try {
    check_memory(3.0 * (1ull << 30), int64_t{1} << 30, "loom attn", "--memory-limit");
    ADD_FAILURE() << "no refusal";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("3.00 GiB"), std::string::npos) << m;
    EXPECT_NE(m.find("1.00 GiB"), std::string::npos) << m;
    EXPECT_NE(m.find("--memory-limit"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_NO_THROW(check_memory(1e6, int64_t{1} << 30, "x", "--memory-limit"));
  EXPECT_GT(available_memory_bytes(), 0);
  EXPECT_THROW(check_memory(1e30, -1, "x", "--memory-limit"), InvalidArgument);
  EXPECT_EQ(parse_size("8G", "--memory-limit"), int64_t{8} << 30);
  EXPECT_EQ(parse_size("512M", "--memory-limit"), int64_t{512} << 20);
  EXPECT_EQ(parse_size("1048576", "--memory-limit"), int64_t{1} << 20);
  EXPECT_EQ(parse_size("64KiB", "--max-bytes"), int64_t{64} << 10);
  EXPECT_EQ(parse_size("2GiB", "--max-bytes"), int64_t{2} << 30);
  for (const char* bad : {"", "x", "-1G", "0", "nan", "1Q", "1e30G", "1QiB", "1Ki"})
    EXPECT_THROW(parse_size(bad, "--memory-limit"), InvalidArgument) << bad;
}

// parse_size took whatever std::stod read ("0x10" as 16, "1e3" as 1000, "+5", " 5", "1.5G")
// and refused 8388607T (2^63 - 2^40, below 8 EiB) by a floating-point bound: now decimal
// digits with an optional suffix, bounded exactly by 2^63 - 1.
// Under an address-space limit (ulimit -v) an allocation past it fails, and OpenBLAS retries its
// own for ever (a run hung): the estimate, with what the run only maps, is held against what the
// limit leaves, and the refusal names the limit.
TEST(Memory, AnAddressSpaceLimitBoundsEveryEstimate) {
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &saved), 0);
  // The limit: what is mapped now and 256 MiB (the soft limit only, restored below).
  std::ifstream status("/proc/self/status");
  std::string key;
  int64_t vm_kib = -1;
  while (status >> key)
    if (key == "VmSize:" && (status >> vm_kib)) break;
  ASSERT_GT(vm_kib, 0);
  struct rlimit lowered = saved;
  lowered.rlim_cur = static_cast<rlim_t>(vm_kib * 1024 + (int64_t{256} << 20));
  if (saved.rlim_max != RLIM_INFINITY && lowered.rlim_cur > saved.rlim_max)
    GTEST_SKIP() << "the hard limit is below what the test needs";
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &lowered), 0);
  std::string which, refusal;
  const int64_t room = address_space_room(&which);
  bool small_ok = true, mapped_refused = false;
  try {
    check_memory(double(int64_t{512} << 20), int64_t{1} << 40, "loom attn", "--memory-limit");
  } catch (const InvalidArgument& e) {
    refusal = e.what();
  }
  try {
    check_memory(double(int64_t{1} << 20), -1, "x", "--memory-limit");
  } catch (const InvalidArgument&) {
    small_ok = false;
  }
  try {
    check_memory(double(int64_t{1} << 20), -1, "x", "--memory-limit",
                 2.0 * double(kOpenBlasBufferBytes));
  } catch (const InvalidArgument&) {
    mapped_refused = true;
  }
  const int64_t available = available_memory_bytes();
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &saved), 0);
  EXPECT_GT(room, int64_t{200} << 20);
  EXPECT_LE(room, int64_t{256} << 20);
  EXPECT_LE(available, room);
  EXPECT_NE(which.find("the address-space limit (ulimit -v)"), std::string::npos) << which;
  EXPECT_NE(refusal.find("loom attn needs about 512.0 MiB of address space"), std::string::npos)
      << refusal;
  EXPECT_NE(refusal.find("the address-space limit (ulimit -v) of "), std::string::npos) << refusal;
  EXPECT_EQ(refusal.find('\n'), std::string::npos) << refusal;
  EXPECT_TRUE(small_ok);
  EXPECT_TRUE(mapped_refused) << "OpenBLAS's buffers not counted against the limit";
}

TEST(Memory, ParseSizeTakesDecimalDigitsUpTo8EiB) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(parse_size("8388607T", "--memory-limit"), kMax - (int64_t{1} << 40) + 1);
  EXPECT_EQ(parse_size("8796093022207M", "--memory-limit"), (kMax >> 20) << 20);
  EXPECT_EQ(parse_size("9223372036854775807", "--memory-limit"), kMax);
  EXPECT_EQ(parse_size("9223372036854775807B", "--memory-limit"), kMax);
  EXPECT_EQ(parse_size("1", "--memory-limit"), 1);
  EXPECT_EQ(parse_size("007K", "--memory-limit"), 7 << 10);
  EXPECT_EQ(parse_size("3t", "--memory-limit"), int64_t{3} << 40);
  EXPECT_EQ(parse_size("5KB", "--max-bytes"), 5 << 10);
  EXPECT_EQ(parse_size("5mb", "--max-bytes"), 5 << 20);
  EXPECT_EQ(parse_size("5B", "--max-bytes"), 5);
  for (const char* bad : {"0x10", "1e3", "+5", " 5", "5 ", "1.5G", ".5G", "5.", "1,000", "5iB",
                          "5Bb", "5KiBB", "5k i", "-0", "0K", "00"}) {
    try {
      parse_size(bad, "--memory-limit");
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("--memory-limit"), std::string::npos) << e.what();
    }
  }
  // A fraction is named as one (it was "an unknown suffix '.5G'"): loom prints limits such as
  // "21.69 GiB", which a user may copy.
  for (const char* frac : {"1.5G", "21.69GiB", "5."}) {
    try {
      parse_size(frac, "--memory-limit");
      ADD_FAILURE() << "'" << frac << "' accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("is a fraction: give a whole number"), std::string::npos)
          << e.what();
    }
  }
  // 2^63 bytes and past: one error naming the limit, not an overflow.
  for (const char* big : {"8388608T", "9223372036854775808", "99999999999999999999999999",
                          "8796093022208M", "9007199254740992K", "8589934592G"}) {
    try {
      parse_size(big, "--memory-limit");
      ADD_FAILURE() << "'" << big << "' accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()), "--memory-limit must be a positive size below 8 EiB, got '" +
                                           std::string(big) + "'");
    }
  }
}

// An estimate whose byte counts overflowed (loom attn --seq 2^63 - 1 gave a negative one) passed
// every limit and the run allocated; now it is refused, whatever the limit.
TEST(Memory, OverflowedEstimatesAreRefusedWhateverTheLimit) {
  for (const double bad : {-1.0, -1e19, double(NAN), double(INFINITY), -double(INFINITY)}) {
    EXPECT_THROW(check_memory(bad, int64_t{1} << 30, "x", "--memory-limit"), InvalidArgument)
        << bad;
    EXPECT_THROW(check_memory(bad, std::numeric_limits<int64_t>::max(), "x", "--memory-limit"),
                 InvalidArgument)
        << bad;
    EXPECT_THROW(check_memory(bad, -1, "x", "--memory-limit"), InvalidArgument) << bad;
  }
  EXPECT_NO_THROW(check_memory(0.0, int64_t{1} << 30, "x", "--memory-limit"));
}

TEST(TensorTest, OverflowingShapesAndFailedAllocationsAreNamed) {
  EXPECT_THROW(Tensor<float>({int64_t{1} << 40, int64_t{1} << 40}), InvalidArgument);
  try {
    Tensor<double> t({int64_t{1} << 30, int64_t{1} << 30});  // 8 EiB
    ADD_FAILURE() << "allocated 8 EiB";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("[1073741824, 1073741824]"), std::string::npos)
        << e.what();
  }
}

// tensor.h's contract: at most 4 dimensions (a 5-d shape was taken), and size(i) outside the
// dimensions is a loom error naming it (it was std::out_of_range).
TEST(TensorTest, DimensionsAreCheckedAsTheHeaderSays) {
  EXPECT_NO_THROW(Tensor<float>({1, 2, 3, 4}));
  try {
    Tensor<float> t({1, 1, 1, 1, 1});
    ADD_FAILURE() << "a 5-d tensor was made";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("at most 4 dimensions, got [1, 1, 1, 1, 1]"),
              std::string::npos)
        << e.what();
  }
  const Tensor<float> t({2, 3});
  EXPECT_EQ(t.size(1), 3);
  for (int64_t bad : {int64_t{-1}, int64_t{2}, int64_t{5}}) {
    try {
      (void)t.size(bad);
      ADD_FAILURE() << "size(" << bad << ")";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("of a 2-d tensor [2, 3]"), std::string::npos)
          << e.what();
    }
  }
}

TEST(Median, OddEvenEmptyAndUnsorted) {
  EXPECT_EQ(median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(median({4.0, 1.0, 3.0, 2.0}), 2.5);  // the mean of the two middle values
  EXPECT_EQ(median({7.0}), 7.0);
  EXPECT_EQ(median({}), 0.0);
}

}  // namespace
}  // namespace loom
