// The store's shared index math (store_index.h, also compiled into the CUDA
// kernel) and the CPU kernel (store.h), against a plain byte-by-byte scatter
// written from the layout definitions.
#include "radixkv/store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "radixkv/store_index.h"

namespace radixkv {
namespace {

// ---- the index math ----------------------------------------------------------

TEST(StoreIndexTest, RowOffsetUnpagedAndPaged) {
  const RowLayout flat{1, 320, 320, 80};
  for (int64_t r = 0; r < 100; ++r) EXPECT_EQ(RowOffset(flat, r), r * 320);
  const RowLayout paged{16, 15360, 320, 80};  // 3 layers interleaved per page
  for (int64_t r = 0; r < 100; ++r) {
    EXPECT_EQ(RowOffset(paged, r), (r / 16) * 15360 + (r % 16) * 320) << r;
  }
}

TEST(StoreIndexTest, LoadSlotWidensBothIndexTypes) {
  const int32_t i32[3] = {7, -1, 2147483647};
  const int64_t i64[3] = {7, -1, int64_t{1} << 40};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(LoadSlot(i32, IndexType::kInt32, i), i32[i]);
    EXPECT_EQ(LoadSlot(i64, IndexType::kInt64, i), i64[i]);
  }
}

TEST(StoreIndexTest, SlotInRange) {
  EXPECT_TRUE(SlotInRange(0, 1));
  EXPECT_TRUE(SlotInRange(9, 10));
  EXPECT_FALSE(SlotInRange(10, 10));
  EXPECT_FALSE(SlotInRange(-1, 10));
  EXPECT_FALSE(SlotInRange(0, 0));
}

StoreParams DenseParams(int64_t heads, int64_t head_bytes, int64_t page_size) {
  StoreParams p{};
  p.num_sides = 2;
  const int64_t row = heads * head_bytes;
  for (int s = 0; s < 2; ++s) {
    p.side[s].src_layout = RowLayout{1, row, row, head_bytes};
    p.side[s].dst_layout = RowLayout{page_size, page_size * row, row, head_bytes};
    p.side[s].heads = heads;
    p.side[s].head_bytes = head_bytes;
  }
  return p;
}

TEST(StoreIndexTest, SimplifyMergesDenseHeadsAndPages) {
  StoreParams p = DenseParams(8, 256, 16);
  SimplifyStore(&p);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(p.side[s].heads, 1);
    EXPECT_EQ(p.side[s].head_bytes, 2048);
    EXPECT_EQ(p.side[s].dst_layout.page_size, 1);
    EXPECT_EQ(p.side[s].dst_layout.page_stride, 2048);
    EXPECT_EQ(p.side[s].dst_layout.row_stride, 2048);
    EXPECT_EQ(p.side[s].src_layout.page_stride, 2048);
  }
}

TEST(StoreIndexTest, SimplifyKeepsWhatIsNotDense) {
  StoreParams p = DenseParams(4, 160, 16);
  p.side[1].src_layout.head_stride = 480;           // v's heads are strided: a fused kv slice
  p.side[0].dst_layout.page_stride = 3 * 16 * 640;  // PageFirst with 3 layers
  p.side[1].dst_layout.page_stride = 3 * 16 * 640;
  SimplifyStore(&p);
  EXPECT_EQ(p.side[1].heads, 4);
  EXPECT_EQ(p.side[1].head_bytes, 160);
  EXPECT_EQ(p.side[0].heads, 1);  // k's heads are dense: one run, sides are independent
  EXPECT_EQ(p.side[0].head_bytes, 640);
  EXPECT_EQ(p.side[0].dst_layout.page_size, 16);
  EXPECT_EQ(p.side[0].dst_layout.row_stride, 640);
  EXPECT_EQ(p.side[1].src_layout.head_stride, 480);
}

TEST(StoreIndexTest, SimplifyMergesConvertingHeadsBySourceBytes) {
  StoreParams p = DenseParams(4, 64, 1);  // 64 float8 bytes a head in the cache
  p.side[0].source = SourceFloat::kBFloat16;
  p.side[0].src_layout = RowLayout{1, 512, 512, 128};  // 64 bfloat16 a head
  p.side[1].source = SourceFloat::kFloat32;
  p.side[1].src_layout = RowLayout{1, 1024, 1024, 128};  // heads overlap: not dense
  SimplifyStore(&p);
  EXPECT_EQ(p.side[0].heads, 1);
  EXPECT_EQ(p.side[0].head_bytes, 256);
  EXPECT_EQ(p.side[0].src_layout.head_stride, 512);
  EXPECT_EQ(p.side[1].heads, 4);
  EXPECT_EQ(RowBytes(p), 512);
}

TEST(StoreIndexTest, VectorBytesFollowsEveryPointerAndStride) {
  alignas(64) static char buf[4096];
  StoreParams p = DenseParams(1, 256, 1);
  for (int s = 0; s < 2; ++s) {
    p.side[s].src = buf;
    p.side[s].dst = buf + 1024;
  }
  EXPECT_EQ(VectorBytes(p, 16), 16);
  EXPECT_EQ(VectorBytes(p, 8), 8);
  p.side[1].head_bytes = 200;  // head_dim 100 in fp16
  EXPECT_EQ(VectorBytes(p, 16), 8);
  p.side[1].head_bytes = 256;
  p.side[1].src = buf + 6;  // a misaligned slice
  EXPECT_EQ(VectorBytes(p, 16), 2);
  p.side[1].source = SourceFloat::kFloat16;  // converting sides go element by element
  EXPECT_EQ(VectorBytes(p, 16), 16);
  p.side[1].source = SourceFloat::kNone;
  p.side[1].src = buf;
  p.side[0].src_layout.page_stride = 256 + 4;
  EXPECT_EQ(VectorBytes(p, 16), 4);
  p.side[0].src_layout.page_stride = 256;
  p.side[0].heads = 2;
  p.side[0].dst_layout.head_stride = 1;  // only counts when there are several heads
  EXPECT_EQ(VectorBytes(p, 16), 1);
  p.side[0].heads = 1;
  EXPECT_EQ(VectorBytes(p, 16), 16);
  // MLA: 1024 and 128 bytes at columns 0 and 1024 of 1152-byte rows.
  p.side[0].head_bytes = 1024;
  p.side[1].head_bytes = 128;
  p.side[1].dst = buf + 1024 + 1024;
  for (int s = 0; s < 2; ++s) p.side[s].dst_layout = RowLayout{1, 1152, 1152, 1152};
  EXPECT_EQ(VectorBytes(p, 16), 16);
  EXPECT_EQ(MaxRunUnits(p, 16), 64);
  p.side[1].source = SourceFloat::kBFloat16;
  EXPECT_EQ(MaxRunUnits(p, 16), 128);  // elements of the converting side
}

// ---- float8 conversion ------------------------------------------------------------

// The float8 values of a format, decoded from their definition (sign,
// exponent, mantissa; subnormals at exponent 0), as doubles.
double DecodeFloat8(uint8_t code, Float8Format f) {
  const bool e4m3 = f == Float8Format::kE4M3Fn;
  const int man_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int exp = (code & 0x7F) >> man_bits, man = code & ((1 << man_bits) - 1);
  const double mag = exp == 0 ? std::ldexp(man, 1 - bias - man_bits)
                              : std::ldexp((1 << man_bits) + man, exp - bias - man_bits);
  return (code & 0x80) ? -mag : mag;
}

// The reference conversion, from the rounding rule rather than from bits:
// the nearest of the finite values (ties to the even code); a magnitude at or
// past the midpoint between the largest finite value and the next power step
// (480 for e4m3fn, 61440 for e5m2; the tie goes to the even code) overflows:
// to 448 in e4m3fn (torch saturates), to infinity (0x7C) in e5m2.
uint8_t ReferenceFloat8(float x, Float8Format f) {
  const bool e4m3 = f == Float8Format::kE4M3Fn;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(static_cast<double>(x));
  const int max_code = e4m3 ? 0x7E : 0x7B;
  // The value after the largest finite one, had the format one more code.
  const double beyond = e4m3 ? 480.0 : 65536.0;
  int lo = 0;  // the largest code whose value is <= a
  while (lo < max_code && DecodeFloat8(static_cast<uint8_t>(lo + 1), f) <= a) ++lo;
  const double lo_v = DecodeFloat8(static_cast<uint8_t>(lo), f);
  if (lo_v == a) return sign | static_cast<uint8_t>(lo);
  const double hi_v = lo == max_code ? beyond : DecodeFloat8(static_cast<uint8_t>(lo + 1), f);
  const double mid = (lo_v + hi_v) / 2;  // exact: a few significant bits
  int code = a < mid ? lo : a > mid ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  if (code > max_code) return sign | (e4m3 ? 0x7E : 0x7C);
  return sign | static_cast<uint8_t>(code);
}

// Floats around every value and every midpoint of the format (one ulp
// either side and exact), zero, the smallest floats, and infinities.
std::vector<float> InterestingFloats(Float8Format f) {
  std::vector<double> points;
  for (int c = 0; c <= 0x7F; ++c) {
    const double v = DecodeFloat8(static_cast<uint8_t>(c), f);
    if (std::isnan(v)) continue;
    points.push_back(v);
    const double next = c < 0x7E ? DecodeFloat8(static_cast<uint8_t>(c + 1), f) : 2 * v;
    points.push_back((v + next) / 2);
  }
  points.push_back(480);
  points.push_back(464);
  points.push_back(61440);
  points.push_back(65536);
  std::vector<float> out;
  for (double p : points) {
    const float v = static_cast<float>(p);
    for (float x : {std::nextafter(v, 0.0f), v, std::nextafter(v, INFINITY)}) {
      out.push_back(x);
      out.push_back(-x);
    }
  }
  for (float x : {0.0f, 1e-45f, 1.17549435e-38f, 3.4028235e38f, INFINITY, NAN}) {
    out.push_back(x);
    out.push_back(-x);
  }
  return out;
}

TEST(Float8Test, MatchesTheRoundingRuleAroundEveryValueAndMidpoint) {
  for (Float8Format f : {Float8Format::kE4M3Fn, Float8Format::kE5M2}) {
    for (float x : InterestingFloats(f)) {
      ASSERT_EQ(Float8FromFloat(x, f), ReferenceFloat8(x, f))
          << "x=" << x << " format " << static_cast<int>(f);
    }
  }
}

TEST(Float8Test, MatchesTheRoundingRuleOverFloatBitPatterns) {
  // Every 4099th float bit pattern (a prime stride reaches every low-bit
  // residue), both signs, subnormals, infinities and NaNs included.
  for (Float8Format f : {Float8Format::kE4M3Fn, Float8Format::kE5M2}) {
    int64_t checked = 0;
    for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 4099) {
      const float x = BitsFloat(static_cast<uint32_t>(b));
      ASSERT_EQ(Float8FromFloat(x, f), ReferenceFloat8(x, f))
          << "bits 0x" << std::hex << b << " format " << static_cast<int>(f);
      ++checked;
    }
    EXPECT_GT(checked, 1000000);
  }
}

TEST(Float8Test, KnownValues) {
  const Float8Format e4 = Float8Format::kE4M3Fn, e5 = Float8Format::kE5M2;
  EXPECT_EQ(Float8FromFloat(1.0f, e4), 0x38);
  EXPECT_EQ(Float8FromFloat(-2.0f, e4), 0xC0);
  EXPECT_EQ(Float8FromFloat(448.0f, e4), 0x7E);
  EXPECT_EQ(Float8FromFloat(464.0f, e4), 0x7E);  // a tie: to the even code
  EXPECT_EQ(Float8FromFloat(1e9f, e4), 0x7E);    // saturates
  EXPECT_EQ(Float8FromFloat(-INFINITY, e4), 0xFE);
  EXPECT_EQ(Float8FromFloat(NAN, e4), 0x7F);
  EXPECT_EQ(Float8FromFloat(std::ldexp(1.0f, -9), e4), 0x01);   // the smallest subnormal
  EXPECT_EQ(Float8FromFloat(std::ldexp(1.0f, -10), e4), 0x00);  // a tie with zero
  EXPECT_EQ(Float8FromFloat(-0.0f, e4), 0x80);
  EXPECT_EQ(Float8FromFloat(1.0f, e5), 0x3C);
  EXPECT_EQ(Float8FromFloat(57344.0f, e5), 0x7B);
  EXPECT_EQ(Float8FromFloat(61440.0f, e5), 0x7C);  // a tie: to the even code, infinity
  EXPECT_EQ(Float8FromFloat(-INFINITY, e5), 0xFC);
  EXPECT_EQ(Float8FromFloat(std::ldexp(1.0f, -16), e5), 0x01);
}

TEST(Float8Test, HalfAndBFloat16DecodeExactly) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    const double mag = exp == 0    ? std::ldexp(man, -24)
                       : exp == 31 ? (man ? NAN : INFINITY)
                                   : std::ldexp(1024 + man, exp - 25);
    const float want = static_cast<float>((h & 0x8000) ? -mag : mag);
    const float got = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
      EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0);
    } else {
      ASSERT_EQ(FloatBits(got), FloatBits(want)) << "half 0x" << std::hex << h;
    }
    ASSERT_EQ(FloatBits(BFloat16ToFloat(static_cast<uint16_t>(h))), h << 16);
  }
}

TEST(Float8Test, ScaledKeepsTheSignOfNaN) {
  EXPECT_EQ(ScaledFloat8(-NAN, 2.0f, Float8Format::kE4M3Fn), 0xFF);
  EXPECT_EQ(ScaledFloat8(NAN, 2.0f, Float8Format::kE5M2), 0x7F);
  EXPECT_EQ(ScaledFloat8(3.0f, 0.5f, Float8Format::kE4M3Fn),
            Float8FromFloat(6.0f, Float8Format::kE4M3Fn));
  EXPECT_EQ(ScaledFloat8(1.0f, 3.0f, Float8Format::kE4M3Fn),
            Float8FromFloat(1.0f / 3.0f, Float8Format::kE4M3Fn));
}

// ---- a reference scatter and random layouts ------------------------------------

// One side of a store problem in owned buffers: strided source, padded and
// paged cache, every base offset free, so alignment goes from 1 byte to 16.
struct SideProblem {
  int64_t heads = 1, head_bytes = 1;  // cache bytes per run
  int64_t src_stride = 0, src_head_stride = 0, src_offset = 0;
  int64_t dst_page_stride = 0, dst_row_stride = 0, dst_head_stride = 0, dst_offset = 0;
  SourceFloat source = SourceFloat::kNone;
  Float8Format format = Float8Format::kE4M3Fn;
  float scale = 1.0f;
  std::vector<uint8_t> src, dst;
};

struct Problem {
  int64_t n = 0, page_size = 1, num_pages = 1;
  std::vector<SideProblem> sides;
  std::vector<int32_t> idx32;
  std::vector<int64_t> idx64;
  IndexType index_type = IndexType::kInt32;

  int64_t num_slots() const { return page_size * num_pages; }

  StoreParams Params() {
    StoreParams p{};
    p.num_sides = static_cast<int32_t>(sides.size());
    for (size_t s = 0; s < sides.size(); ++s) {
      SideProblem& d = sides[s];
      StoreSide& o = p.side[s];
      o.src = d.src.data() + d.src_offset;
      o.dst = d.dst.data() + d.dst_offset;
      o.src_layout = RowLayout{1, d.src_stride, d.src_stride, d.src_head_stride};
      o.dst_layout = RowLayout{page_size, d.dst_page_stride, d.dst_row_stride, d.dst_head_stride};
      o.heads = d.heads;
      o.head_bytes = d.head_bytes;
      o.source = d.source;
      o.format = d.format;
      o.scale = d.scale;
    }
    p.indices = index_type == IndexType::kInt32 ? static_cast<const void*>(idx32.data())
                                                : static_cast<const void*>(idx64.data());
    p.index_type = index_type;
    p.num_tokens = n;
    p.num_slots = num_slots();
    return p;
  }

  int64_t Slot(int64_t i) const { return index_type == IndexType::kInt32 ? idx32[i] : idx64[i]; }

  // The expected caches, written element by element from the definitions
  // (a converting side through ScaledFloat8, checked on its own above).
  std::vector<std::vector<uint8_t>> Expected() const {
    std::vector<std::vector<uint8_t>> out;
    for (const SideProblem& d : sides) {
      out.push_back(d.dst);
      const int64_t width = SourceBytes(d.source);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = Slot(i);
        if (slot < 0 || slot >= num_slots()) continue;
        for (int64_t h = 0; h < d.heads; ++h) {
          const int64_t from = d.src_offset + i * d.src_stride + h * d.src_head_stride;
          const int64_t to = d.dst_offset + (slot / page_size) * d.dst_page_stride +
                             (slot % page_size) * d.dst_row_stride + h * d.dst_head_stride;
          for (int64_t b = 0; b < d.head_bytes; ++b) {
            if (d.source == SourceFloat::kNone) {
              out.back()[to + b] = d.src[from + b];
              continue;
            }
            const uint8_t* e = d.src.data() + from + b * width;
            float x;
            if (d.source == SourceFloat::kFloat32) {
              std::memcpy(&x, e, 4);
            } else {
              uint16_t u;
              std::memcpy(&u, e, 2);
              x = d.source == SourceFloat::kFloat16 ? HalfToFloat(u) : BFloat16ToFloat(u);
            }
            out.back()[to + b] = ScaledFloat8(x, d.scale, d.format);
          }
        }
      }
    }
    return out;
  }
};

// Sides of their own widths; with `convert`, some sides convert floats to
// float8 (their source elements are random bit patterns: NaNs, infinities
// and subnormals included).
Problem RandomProblem(std::mt19937_64& rng, int64_t n, bool dense, int num_sides = 2,
                      bool convert = false) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Problem pr;
  pr.n = n;
  pr.page_size = pick(0, 1) ? 1 : pick(2, 16);
  pr.num_pages = (n + pr.page_size - 1) / pr.page_size + pick(1, 4);
  const int64_t pad = dense ? 0 : 1;
  const int64_t layers = dense ? 1 : pick(1, 3);  // PageFirst interleaves layers in a page
  for (int s = 0; s < num_sides; ++s) {
    SideProblem d;
    if (convert && pick(0, 1)) {
      d.source = static_cast<SourceFloat>(pick(1, 3));
      d.format = pick(0, 1) ? Float8Format::kE4M3Fn : Float8Format::kE5M2;
      d.scale =
          std::ldexp(static_cast<float>(pick(1, 1000)) / 97.0f, static_cast<int>(pick(-8, 8)));
    }
    const int64_t elem = d.source != SourceFloat::kNone ? 1 : int64_t{1} << pick(0, 2);
    const int64_t src_elem = d.source != SourceFloat::kNone ? SourceBytes(d.source) : elem;
    d.heads = pick(1, 4);
    d.head_bytes = elem * (dense ? 8 * pick(1, 16) : pick(1, 100));
    const int64_t src_run = d.head_bytes / elem * src_elem;
    d.src_head_stride = src_run + pad * src_elem * pick(0, 3);
    d.src_stride = d.heads * d.src_head_stride + pad * src_elem * pick(0, 5);
    d.src_offset =
        pad * src_elem * pick(0, 17) + (d.source == SourceFloat::kNone ? pad * pick(0, 3) : 0);
    d.dst_offset = pad * pick(0, 17);
    d.dst_head_stride = d.head_bytes + pad * elem * pick(0, 3);
    d.dst_row_stride = d.heads * d.dst_head_stride + pad * elem * pick(0, 3);
    d.dst_page_stride = layers * pr.page_size * d.dst_row_stride;
    d.src.resize(d.src_offset + std::max<int64_t>(n, 1) * d.src_stride);
    d.dst.resize(d.dst_offset + pr.num_pages * d.dst_page_stride);
    for (auto& b : d.src) b = static_cast<uint8_t>(rng());
    for (auto& b : d.dst) b = static_cast<uint8_t>(rng());
    pr.sides.push_back(std::move(d));
  }
  std::vector<int64_t> slots(pr.num_slots());
  for (int64_t i = 0; i < pr.num_slots(); ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  pr.index_type = pick(0, 1) ? IndexType::kInt32 : IndexType::kInt64;
  for (int64_t i = 0; i < n; ++i) {
    pr.idx32.push_back(static_cast<int32_t>(slots[i]));
    pr.idx64.push_back(slots[i]);
  }
  return pr;
}

std::vector<std::vector<uint8_t>> Caches(const Problem& pr) {
  std::vector<std::vector<uint8_t>> out;
  for (const SideProblem& d : pr.sides) out.push_back(d.dst);
  return out;
}

// ---- the device code path, run on the host ----------------------------------------

struct alignas(16) Bytes16 {
  uint32_t w[4];
};
struct alignas(8) Bytes8 {
  uint32_t w[2];
};

// Runs StoreTokenPart the way the CUDA kernel does: groups of `lanes` workers,
// each worker its share of a token, after SimplifyStore.
template <typename Vec>
void EmulateKernel(StoreParams p, int64_t lanes) {
  SimplifyStore(&p);
  ASSERT_LE(static_cast<int64_t>(sizeof(Vec)), VectorBytes(p, 16));
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    for (int64_t lane = 0; lane < lanes; ++lane) StoreTokenPart<Vec>(p, i, lane, lanes);
  }
}

void EmulateWidest(StoreParams p, int64_t lanes) {
  StoreParams q = p;
  SimplifyStore(&q);
  switch (VectorBytes(q, 16)) {
    case 16:
      return EmulateKernel<Bytes16>(p, lanes);
    case 8:
      return EmulateKernel<Bytes8>(p, lanes);
    case 4:
      return EmulateKernel<uint32_t>(p, lanes);
    case 2:
      return EmulateKernel<uint16_t>(p, lanes);
    default:
      return EmulateKernel<uint8_t>(p, lanes);
  }
}

TEST(StoreTokenPartTest, MatchesReferenceForEveryLaneCount) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 400; ++trial) {
    const bool dense = trial % 3 == 0;
    const int sides = 1 + trial % kMaxStoreSides;
    Problem pr = RandomProblem(rng, 1 + trial % 37, dense, sides, trial % 2 == 1);
    const auto expected = pr.Expected();
    for (int64_t lanes : {1, 4, 32}) {
      Problem run = pr;
      EmulateWidest(run.Params(), lanes);
      for (int s = 0; s < sides; ++s) {
        ASSERT_EQ(run.sides[s].dst, expected[s])
            << "trial " << trial << " side " << s << " lanes " << lanes << " head_bytes "
            << pr.sides[s].head_bytes << " source " << static_cast<int>(pr.sides[s].source);
      }
    }
  }
}

TEST(StoreTokenPartTest, SkipsOutOfRangeSlots) {
  std::mt19937_64 rng(2);
  Problem pr = RandomProblem(rng, 8, true, 3, true);
  pr.idx32[3] = pr.idx64[3] = -1;
  pr.idx32[5] = static_cast<int32_t>(pr.num_slots());
  pr.idx64[5] = pr.num_slots();
  const auto expected = pr.Expected();  // skips them too
  StoreParams p = pr.Params();
  SimplifyStore(&p);
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    EXPECT_EQ(StoreTokenPart<uint8_t>(p, i, 0, 1), i != 3 && i != 5) << i;
  }
  EXPECT_EQ(Caches(pr), expected);
}

// ---- the CPU kernel ------------------------------------------------------------------

TEST(StoreRowsTest, MatchesReferenceOnRandomLayouts) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 400; ++trial) {
    Problem pr =
        RandomProblem(rng, trial % 50, trial % 2 == 0, 1 + trial % kMaxStoreSides, trial % 4 >= 2);
    const auto expected = pr.Expected();
    ASSERT_EQ(StoreRows(pr.Params()).kind, StoreCheck::kOk);
    ASSERT_EQ(Caches(pr), expected) << "trial " << trial;
  }
}

// The CPU kernel converts long runs several elements at a time (AVX2 where
// the CPU has it): the same bytes as ScaledFloat8, element by element, over
// float bit patterns (every 4099th), every half and every bfloat16, with
// scales that make results overflow, round and go subnormal.
TEST(StoreRowsTest, ConvertingRunsMatchTheScalarConversion) {
  std::vector<uint32_t> f32;
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 4099) f32.push_back(static_cast<uint32_t>(b));
  std::vector<uint16_t> f16(65536);
  for (uint32_t h = 0; h < 65536; ++h) f16[h] = static_cast<uint16_t>(h);
  for (SourceFloat source :
       {SourceFloat::kFloat32, SourceFloat::kFloat16, SourceFloat::kBFloat16}) {
    const void* data = source == SourceFloat::kFloat32 ? static_cast<const void*>(f32.data())
                                                       : static_cast<const void*>(f16.data());
    const int64_t count =
        source == SourceFloat::kFloat32 ? static_cast<int64_t>(f32.size()) : 65536;
    for (Float8Format format : {Float8Format::kE4M3Fn, Float8Format::kE5M2}) {
      for (float scale : {1.0f, 0.37f, 3.0e-5f, 700.0f}) {
        // One token of `count - 3` elements (an odd tail), starting 3 in.
        const int64_t n = count - 3;
        std::vector<uint8_t> cache(n + 5, 0xAB);
        const int32_t slot = 0;
        StoreParams p{};
        p.num_sides = 1;
        StoreSide& d = p.side[0];
        d.src = static_cast<const char*>(data) + 3 * SourceBytes(source);
        d.dst = cache.data() + 1;
        d.src_layout = RowLayout{1, n * SourceBytes(source), n * SourceBytes(source), 0};
        d.dst_layout = RowLayout{1, n, n, n};
        d.heads = 1;
        d.head_bytes = n;
        d.source = source;
        d.format = format;
        d.scale = scale;
        p.indices = &slot;
        p.index_type = IndexType::kInt32;
        p.num_tokens = 1;
        p.num_slots = 1;
        ASSERT_EQ(StoreRows(p).kind, StoreCheck::kOk);
        ASSERT_EQ(cache[0], 0xAB);
        ASSERT_EQ(cache[n + 1], 0xAB);
        const char* src = static_cast<const char*>(d.src);
        for (int64_t e = 0; e < n; ++e) {
          const uint8_t want = ScaledFloat8(LoadSourceFloat(src, source, e), scale, format);
          ASSERT_EQ(cache[1 + e], want)
              << "element " << e << " source " << static_cast<int>(source) << " format "
              << static_cast<int>(format) << " scale " << scale;
        }
      }
    }
  }
}

// MLA: two sides of different widths writing two column ranges of one row
// buffer (paged, interleaved with other layers), sources strided slices of one
// fused projection; and the same converted to float8 from bfloat16.
TEST(StoreRowsTest, SidesOfTheirOwnWidthsShareOneRowBuffer) {
  std::mt19937_64 rng(10);
  for (bool convert : {false, true}) {
    for (int64_t lanes : {0, 1, 8, 32}) {  // 0: StoreRows, else the device path
      const int64_t lora = 512, rope = 64, row = lora + rope, n = 45, page = 16, pages = 5;
      const int64_t src_elem = 2, cache_elem = convert ? 1 : 2;
      const int64_t layers = 3, layer = 1;      // PageFirst: a page holds all layers
      const int64_t fused = lora + 128 + rope;  // [k_nope | other | k_rope] per token
      std::vector<uint8_t> src(n * fused * src_elem);
      std::vector<uint8_t> cache(pages * layers * page * row * cache_elem);
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      for (auto& b : cache) b = static_cast<uint8_t>(rng());
      std::vector<int32_t> slots(pages * page);
      for (int64_t i = 0; i < pages * page; ++i) slots[i] = static_cast<int32_t>(i);
      std::shuffle(slots.begin(), slots.end(), rng);
      StoreParams p{};
      p.num_sides = 2;
      const int64_t row_bytes = row * cache_elem;
      const RowLayout dst{page, layers * page * row_bytes, row_bytes, row_bytes};
      char* base = reinterpret_cast<char*>(cache.data()) + layer * page * row_bytes;
      const int64_t cols[2] = {0, lora}, widths[2] = {lora, rope}, src_cols[2] = {0, lora + 128};
      for (int s = 0; s < 2; ++s) {
        StoreSide& d = p.side[s];
        d.src = src.data() + src_cols[s] * src_elem;
        d.dst = base + cols[s] * cache_elem;
        d.src_layout = RowLayout{1, fused * src_elem, fused * src_elem, widths[s] * src_elem};
        d.dst_layout = dst;
        d.heads = 1;
        d.head_bytes = widths[s] * cache_elem;
        if (convert) {
          d.source = SourceFloat::kBFloat16;
          d.format = Float8Format::kE4M3Fn;
          d.scale = 0.37f;
        }
      }
      p.indices = slots.data();
      p.index_type = IndexType::kInt32;
      p.num_tokens = n;
      p.num_slots = pages * page;
      std::vector<uint8_t> expected = cache;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t s = slots[i];
        const int64_t at =
            ((s / page) * layers + layer) * page * row_bytes + (s % page) * row_bytes;
        for (int side = 0; side < 2; ++side) {
          for (int64_t c = 0; c < widths[side]; ++c) {
            const uint8_t* from = src.data() + (i * fused + src_cols[side] + c) * src_elem;
            uint8_t* to = expected.data() + at + (cols[side] + c) * cache_elem;
            if (!convert) {
              std::memcpy(to, from, 2);
            } else {
              uint16_t u;
              std::memcpy(&u, from, 2);
              *to = ScaledFloat8(BFloat16ToFloat(u), 0.37f, Float8Format::kE4M3Fn);
            }
          }
        }
      }
      if (lanes == 0) {
        ASSERT_EQ(StoreRows(p).kind, StoreCheck::kOk);
      } else {
        EmulateWidest(p, lanes);
      }
      ASSERT_TRUE(cache == expected) << "convert " << convert << " lanes " << lanes;
    }
  }
}

// Batches past the streaming threshold: caches of whole 64-byte lines take the
// cache-bypassing copy, the others are split over threads; converting sides
// never stream.
TEST(StoreRowsTest, LargeBatchesMatchReference) {
  std::mt19937_64 rng(4);
  for (int64_t head_bytes : {4096, 4000, 256, 192, 200, 33}) {
    for (int variant = 0; variant < 3; ++variant) {  // line-aligned, not, converting
      const bool line_aligned = variant != 1;
      Problem pr;
      pr.n = (int64_t{6} << 20) / (2 * head_bytes) + 1;  // 6 MiB written
      pr.page_size = 1;
      pr.num_pages = pr.n + 100;
      for (int s = 0; s < 2; ++s) {
        SideProblem d;
        if (variant == 2 && s == 1) {
          d.source = SourceFloat::kFloat16;
          d.format = Float8Format::kE5M2;
          d.scale = 3.0f;
        }
        const int64_t src_run = head_bytes * SourceBytes(d.source);
        d.heads = 1;
        d.head_bytes = head_bytes;
        d.src_stride = d.src_head_stride = src_run;
        d.src_offset = line_aligned ? 0 : 3 + s;
        d.src.resize(d.src_offset + pr.n * src_run);
        d.dst.assign(64 + pr.num_pages * head_bytes, 0xAB);
        const auto addr = reinterpret_cast<uintptr_t>(d.dst.data());
        d.dst_offset = static_cast<int64_t>((64 - addr % 64) % 64) + (line_aligned ? 0 : 16);
        for (auto& b : d.src) b = static_cast<uint8_t>(rng());
        d.dst_page_stride = d.dst_row_stride = d.dst_head_stride = head_bytes;
        pr.sides.push_back(std::move(d));
      }
      std::vector<int64_t> slots(pr.num_pages);
      for (int64_t i = 0; i < pr.num_pages; ++i) slots[i] = i;
      std::shuffle(slots.begin(), slots.end(), rng);
      for (int64_t i = 0; i < pr.n; ++i) pr.idx64.push_back(slots[i]);
      pr.index_type = IndexType::kInt64;
      const auto expected = pr.Expected();
      const auto before = Caches(pr);
      for (int threads : {1, 2, 3}) {
        for (int s = 0; s < 2; ++s) pr.sides[s].dst = before[s];
        ASSERT_EQ(StoreRows(pr.Params(), threads).kind, StoreCheck::kOk);
        ASSERT_TRUE(Caches(pr) == expected)
            << "head_bytes " << head_bytes << " variant " << variant << " threads " << threads;
      }
    }
  }
}

TEST(StoreRowsTest, OutOfRangeSlotWritesNothing) {
  std::mt19937_64 rng(5);
  for (int64_t bad_at : {0, 7, 1023, 1024, 2999}) {
    for (int64_t bad : {int64_t{-1}, int64_t{-2147483648LL}, int64_t{0}}) {
      for (IndexType type : {IndexType::kInt32, IndexType::kInt64}) {
        Problem pr = RandomProblem(rng, 3000, true, 3, true);
        pr.index_type = type;
        const int64_t value = bad == 0 ? pr.num_slots() : bad;  // 0 stands for num_slots
        pr.idx32[bad_at] = static_cast<int32_t>(value);
        pr.idx64[bad_at] = value;
        const auto before = Caches(pr);
        const StoreCheck check = StoreRows(pr.Params());
        EXPECT_EQ(check.kind, StoreCheck::kOutOfRange);
        EXPECT_EQ(check.position, bad_at);
        EXPECT_EQ(check.slot, value);
        EXPECT_EQ(Caches(pr), before);
      }
    }
  }
}

TEST(StoreRowsTest, Int64SlotsBeyondInt32AreOutOfRange) {
  std::mt19937_64 rng(6);
  Problem pr = RandomProblem(rng, 10, true);
  pr.index_type = IndexType::kInt64;
  pr.idx64[9] = (int64_t{1} << 32) + 1;  // would wrap to slot 1 if truncated
  EXPECT_EQ(StoreRows(pr.Params()).position, 9);
}

TEST(StoreRowsTest, RepeatedSlotWritesNothing) {
  std::mt19937_64 rng(8);
  for (IndexType type : {IndexType::kInt32, IndexType::kInt64}) {
    for (int64_t n : {2, 100, 5000}) {
      Problem pr = RandomProblem(rng, n, true, 2, true);
      pr.index_type = type;
      pr.idx32[n - 1] = pr.idx32[n / 2 - 1];
      pr.idx64[n - 1] = pr.idx64[n / 2 - 1];
      const auto before = Caches(pr);
      const StoreCheck check = StoreRows(pr.Params());
      EXPECT_EQ(check.kind, StoreCheck::kRepeated);
      EXPECT_EQ(check.position, n - 1);
      EXPECT_EQ(check.slot, pr.idx64[n - 1]);
      EXPECT_EQ(Caches(pr), before);
    }
  }
}

// The indices live inside the cache they are stored into: storing token 0
// rewrites token 1's index. Each index is read once, before anything is
// written, so token 1 goes where its index said at the start, never out of
// bounds.
TEST(StoreRowsTest, IndicesAliasingTheCacheAreReadOnce) {
  for (IndexType type : {IndexType::kInt32, IndexType::kInt64}) {
    const int64_t width = type == IndexType::kInt32 ? 4 : 8;
    const int64_t row = 16, num_slots = 8;
    std::vector<uint8_t> kc(num_slots * row, 0), vc(num_slots * row, 0);
    // Slot 0's row holds the two indices; token 0's k row is all 0xFF, which
    // written into slot 0 turns index 1 into -1 (int32) or -1 (int64).
    void* indices = kc.data();
    if (type == IndexType::kInt32) {
      const int32_t idx[2] = {0, 5};
      std::memcpy(indices, idx, sizeof(idx));
    } else {
      const int64_t idx[2] = {0, 5};
      std::memcpy(indices, idx, sizeof(idx));
    }
    std::vector<uint8_t> k(2 * row, 0xFF), v(2 * row, 0x11);
    StoreParams p{};
    p.num_sides = 2;
    p.side[0].src = k.data();
    p.side[1].src = v.data();
    p.side[0].dst = kc.data();
    p.side[1].dst = vc.data();
    for (int s = 0; s < 2; ++s) {
      p.side[s].src_layout = RowLayout{1, row, row, row};
      p.side[s].dst_layout = RowLayout{1, row, row, row};
      p.side[s].heads = 1;
      p.side[s].head_bytes = row;
    }
    p.indices = indices;
    p.index_type = type;
    p.num_tokens = 2;
    p.num_slots = num_slots;
    ASSERT_EQ(StoreRows(p).kind, StoreCheck::kOk) << width;
    for (int64_t b = 0; b < row; ++b) {
      EXPECT_EQ(kc[5 * row + b], 0xFF) << "token 1 went to slot 5, as read at the start";
      EXPECT_EQ(vc[5 * row + b], 0x11);
    }
  }
}

TEST(StoreRowsTest, EmptyBatchIsANoOp) {
  StoreParams p{};
  p.num_sides = 2;
  for (int s = 0; s < 2; ++s) {
    p.side[s].heads = 1;
    p.side[s].head_bytes = 16;
  }
  p.num_tokens = 0;
  p.num_slots = 0;
  p.index_type = IndexType::kInt32;
  EXPECT_EQ(StoreRows(p).kind, StoreCheck::kOk);
}

TEST(FindSlotOutOfRangeTest, FirstBadPosition) {
  std::vector<int32_t> idx(5000, 3);
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 5000, 4), -1);
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 5000, 3), 0);
  idx[4097] = 4;
  idx[4500] = -1;
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 5000, 4), 4097);
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 4097, 4), -1);
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 0, 0), -1);
}

}  // namespace
}  // namespace radixkv
