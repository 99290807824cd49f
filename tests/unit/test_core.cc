// core: bf16 rounding, Philox RNG shard invariance, .npy round trips and every malformed case,
// error macros.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "loom/bf16.h"
#include "loom/error.h"
#include "loom/npy.h"
#include "loom/rng.h"
#include "loom/tensor.h"

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
  void expect_io_error(const std::string& bytes, const std::string& needle) {
    const std::string p = path("bad.npy");
    write_raw(p, bytes);
    try {
      read_npy_f32(p);
      FAIL() << "no error for " << needle;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
    std::remove(p.c_str());
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
  expect_io_error(std::string("\x93NUMPY\x01\x00\xff\x00{", 11), "truncated npy header");
  expect_io_error(std::string("\x93NUMPY\x09\x00\x10\x00", 10), "version 9");
}

TEST_F(Npy, RoleShapeAndMissingFile) {
  Tensor<float> x({4, 2});
  const std::string p = path("q.npy");
  write_npy(p, x);
  try {
    read_npy_role(p, "q", 3);
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
