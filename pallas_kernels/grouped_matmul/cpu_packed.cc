// Packed-weight (grouped) matmul for XLA:CPU, as an XLA FFI custom call.
//
// XLA:CPU decodes a packed weight (int4 nibbles, MXFP4 codes, fp8 e4m3) into a whole f32
// array before its dot: every call writes and reads back 4 bytes a weight where the packed
// weight is 0.5-1, and its fp8 conversion runs element by element. This kernel decodes each
// weight once per call into a small f32 panel that stays in L1 and multiplies every row of
// x by it there, so a call reads the packed bytes once.
//
// Semantics are packed.py's `dequantize` followed by a grouped matmul (jax.lax.ragged_dot):
//   x f32 [M, K]; kernel [E, Kp, N]: uint8 codes two a byte (Kp = K / 2; row 2r in the low
//   nibble) for format 0 (int4: unsigned integers) and 1 (MXFP4: e2m1), float8_e4m3fn (fmt 2)
//   or int8 (fmt 3, GGUF's kept blocks) with Kp = K; scale [E, K / group, N]: f32, or uint8
//   e8m0 exponents for MXFP4 (2 ** (s - 127)); offset [E, K / group, N] f32 (int4, gguf;
//   a [1] dummy otherwise); group_sizes i32 [E]: rows sum(group_sizes[:e]) .. of x times
//   expert e's weight (w = q * scale + offset, group by group of `group` rows of K); rows past
//   the groups are zero. Out f32 [M, N].
// Work is split over (expert, column tile) pairs on up to JAXSERVE_CPU_MATMUL_THREADS threads
// (default: the CPUs this process may run on).

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 64;   // columns of a tile: the panel's width
constexpr int64_t kDepth = 64;  // K rows decoded into the panel at a time (<= any group)
constexpr int64_t kRows = 4;    // rows of x a pass of the micro-kernel takes

int NumThreads() {
  static const int n = [] {
    if (const char* env = std::getenv("JAXSERVE_CPU_MATMUL_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return v;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

inline float Bits(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// An e2m1 code (sign in bit 3) -> f32, branch-free (so the decode loop vectorizes): magnitude
// codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6.
inline float E2M1(uint32_t code) {
  const uint32_t m = code & 7;
  const uint32_t normal = (((m >> 1) + 126) << 23) | ((m & 1) << 22);  // m >= 2
  const uint32_t bits = m >= 2 ? normal : (m == 1 ? (126u << 23) : 0u);
  return Bits(bits | ((code & 8) << 28));
}

// float8 e4m3fn bits -> f32, branch-free: sign, 4 exponent bits (bias 7), 3 mantissa bits;
// exponent 0 is subnormal (m / 8 * 2^-6); 0x7f / 0xff are NaN.
inline float E4M3(uint32_t b) {
  const uint32_t e = (b >> 3) & 0xF, m = b & 0x7;
  const float normal = Bits(((e + 120) << 23) | (m << 20));
  const float magnitude = e != 0 ? normal : static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  const float v = (b & 0x80) ? -magnitude : magnitude;
  return (b & 0x7F) == 0x7F ? __builtin_nanf("") : v;
}

// 2 ** (s - 127); s = 0 gives 0, as packed.py's bit shift does.
inline float E8M0(uint32_t s) { return Bits(s << 23); }

struct Operands {
  const float* x;
  const uint8_t* kernel;  // any of the formats, as bytes
  const float* scale_f;
  const uint8_t* scale_e8m0;
  const float* offset;
  int64_t k, n, kp, group, fmt;
};

// Expert e's K rows k0 .. k0 + depth - 1 of columns c0 .. c0 + cols - 1 decoded into panel
// [depth][kCols].
void Decode(const Operands& o, int64_t e, int64_t k0, int64_t depth, int64_t c0, int64_t cols,
            float* panel) {
  const int64_t groups = o.k / o.group;
  for (int64_t r = 0; r < depth; ++r) {
    const int64_t k = k0 + r, g = k / o.group;
    const int64_t srow = (e * groups + g) * o.n + c0;
    float* dst = panel + r * kCols;
    if (o.fmt == 0 || o.fmt == 1) {
      const uint8_t* src = o.kernel + (e * o.kp + k / 2) * o.n + c0;
      const int shift = (k & 1) * 4;
      if (o.fmt == 0) {
        const float* s = o.scale_f + srow;
        const float* f = o.offset + srow;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) {
          dst[c] = static_cast<float>((src[c] >> shift) & 0xF) * s[c] + f[c];
        }
      } else {
        const uint8_t* s = o.scale_e8m0 + srow;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) dst[c] = E2M1((src[c] >> shift) & 0xF) * E8M0(s[c]);
      }
    } else {
      const uint8_t* src = o.kernel + (e * o.kp + k) * o.n + c0;
      const float* s = o.scale_f + srow;
      if (o.fmt == 2) {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) dst[c] = E4M3(src[c]) * s[c];
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(src);
        const float* f = o.offset + srow;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<float>(q[c]) * s[c] + f[c];
      }
    }
  }
}

// out[rows, c0 .. c0 + kCols) += x[rows, k0 .. k0 + depth) @ panel, kRows rows at a time.
void Multiply(const float* x, int64_t k, int64_t k0, int64_t depth, const float* panel,
              int64_t rows, float* acc) {
  int64_t t = 0;
  for (; t + kRows <= rows; t += kRows) {
    float a[kRows][kCols];
    std::memcpy(a, acc + t * kCols, sizeof(a));
    for (int64_t r = 0; r < depth; ++r) {
      const float* w = panel + r * kCols;
      for (int64_t i = 0; i < kRows; ++i) {
        const float xv = x[(t + i) * k + k0 + r];
#pragma omp simd
        for (int64_t c = 0; c < kCols; ++c) a[i][c] += xv * w[c];
      }
    }
    std::memcpy(acc + t * kCols, a, sizeof(a));
  }
  for (; t < rows; ++t) {
    float* a = acc + t * kCols;
    for (int64_t r = 0; r < depth; ++r) {
      const float xv = x[t * k + k0 + r];
      const float* w = panel + r * kCols;
#pragma omp simd
      for (int64_t c = 0; c < kCols; ++c) a[c] += xv * w[c];
    }
  }
}

ffi::Error PackedMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer kernel,
                            ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> offset,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out,
                            int64_t fmt, int64_t group) {
  const auto xd = x.dimensions(), kd = kernel.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || kd.size() != 3 || od.size() != 2 || fmt < 0 || fmt > 3 || group < 1) {
    return ffi::Error::InvalidArgument("packed matmul: x [M, K], kernel [E, Kp, N], fmt 0-3");
  }
  const int64_t m = xd[0], k = xd[1], experts = kd[0], n = kd[2];
  const int64_t kp = fmt < 2 ? k / 2 : k;
  if (kd[1] != kp || od[0] != m || od[1] != n || k % group || group % 2) {
    return ffi::Error::InvalidArgument("packed matmul: shapes do not match");
  }
  Operands o{x.typed_data(),
             static_cast<const uint8_t*>(kernel.untyped_data()),
             fmt == 1 ? nullptr : static_cast<const float*>(scale.untyped_data()),
             fmt == 1 ? static_cast<const uint8_t*>(scale.untyped_data()) : nullptr,
             offset.typed_data(),
             k, n, kp, group, fmt};
  float* y = out->typed_data();
  std::memset(y, 0, sizeof(float) * m * n);
  std::vector<int64_t> start(experts + 1, 0);
  const int32_t* sizes = group_sizes.typed_data();
  for (int64_t e = 0; e < experts; ++e) start[e + 1] = start[e] + std::max(0, sizes[e]);
  if (start[experts] > m) return ffi::Error::InvalidArgument("group sizes exceed the rows");
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first column)
  for (int64_t e = 0; e < experts; ++e) {
    if (start[e + 1] == start[e]) continue;
    for (int64_t c = 0; c < n; c += kCols) items.emplace_back(e, c);
  }
  if (items.empty()) return ffi::Error::Success();
  const int64_t depth = std::min<int64_t>(kDepth, group);
  auto run = [&](int64_t first, int64_t step) {
    std::vector<float> panel(kDepth * kCols, 0.0f);
    std::vector<float> acc;
    for (size_t i = first; i < items.size(); i += step) {
      const auto [e, c0] = items[i];
      const int64_t cols = std::min<int64_t>(kCols, n - c0), rows = start[e + 1] - start[e];
      acc.assign(rows * kCols, 0.0f);
      const float* xe = o.x + start[e] * k;
      for (int64_t k0 = 0; k0 < k; k0 += depth) {
        const int64_t d = std::min<int64_t>(depth, k - k0);
        Decode(o, e, k0, d, c0, cols, panel.data());
        Multiply(xe, k, k0, d, panel.data(), rows, acc.data());
      }
      for (int64_t t = 0; t < rows; ++t) {
        std::memcpy(y + (start[e] + t) * n + c0, acc.data() + t * kCols, sizeof(float) * cols);
      }
    }
  };
  // A thread costs ~20-50 us to start: only calls with a few million multiply-adds split
  const int64_t work = (m + 4) * k * n;
  const int64_t threads = work < (4 << 20) ? 1 : std::min<int64_t>(NumThreads(), items.size());
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, t, threads);
  run(0, threads);
  for (auto& t : pool) t.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // kernel
                                  .Arg<ffi::AnyBuffer>()         // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offset
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group"));
