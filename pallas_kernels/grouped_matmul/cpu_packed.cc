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
//
// Blocking: a work item is (expert, block of kCols columns). Per item, kDepth rows of K at a
// time are decoded (scale and offset applied) into an f32 panel [kDepth][kCols] (16 KiB with
// AVX-512: L1-resident), then a register-blocked micro-kernel multiplies up to kMaxRows rows of
// x by it (kMaxRows x 4 vector accumulators, a panel row loaded once per kMaxRows rows), so a
// weight is decoded once per call whatever the batch and the decode cost is amortized over the
// expert's rows. With AVX-512 the decoding is vector code (fp8 through F16C's conversion,
// MXFP4 through a 16-entry permute); elsewhere loops the compiler vectorizes.
//
// Threads: items are claimed from an atomic counter by the calling thread and by tasks put on
// XLA's intra-op thread pool (the FFI's ThreadPool: no thread started per call, no threads
// beyond XLA's), up to JAXSERVE_CPU_MATMUL_THREADS workers (default: the CPUs this process may
// run on). The caller returns when every item is done; a task that starts late finds nothing
// left to claim and touches no buffer.

#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define JAXSERVE_PACKED_AVX512 1
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JAXSERVE_PAUSE() _mm_pause()
#else
#define JAXSERVE_PAUSE() std::this_thread::yield()
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int64_t kVec = 16;  // floats in a vector register
constexpr int kMaxRows = 6;   // 32 registers: 24 accumulators, 4 weights, broadcasts
#elif defined(__AVX__)
constexpr int64_t kVec = 8;
constexpr int kMaxRows = 3;  // 16 registers: 12 accumulators
#else
constexpr int64_t kVec = 4;
constexpr int kMaxRows = 4;
#endif
constexpr int64_t kCols = 4 * kVec;  // columns of an item: the panel's width
constexpr int64_t kDepth = 64;       // K rows decoded into the panel at a time (even)

typedef float Vec __attribute__((vector_size(kVec * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

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
  float* y;
  int64_t k, n, kp, group, fmt;
};

#ifdef JAXSERVE_PACKED_AVX512

inline __mmask16 Lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

// A format's decoding with AVX-512, 16 columns of a pair of K rows at a time (rows 2r and
// 2r + 1: one byte row of a 4-bit format, two rows of an 8-bit one; the group and K are even,
// so a pair is in one group). kRowsPerByteRow: K rows a row of the kernel's bytes holds;
// Load: a group's scale (and offset) for 16 columns; Raw: the codes at `src` (row 2r; row
// 2r + 1 is n bytes on for 8-bit codes) as floats q, lanes past `m` zero; Weight: q's weight
// (q * scale (+ offset)); Apply: acc + the weights' products given t = sum x * q and xs =
// sum x over the same rows of one group (the scale applied once for them all).
template <int F>
struct Codec;

template <>
struct Codec<0> {  // int4: unsigned nibbles, w = q * scale + offset
  static constexpr int64_t kRowsPerByteRow = 2;
  static constexpr bool kOffset = true;
  struct Scale {
    __m512 s, f;
  };
  static Scale Load(const Operands& o, int64_t srow, __mmask16 m) {
    return {_mm512_maskz_loadu_ps(m, o.scale_f + srow), _mm512_maskz_loadu_ps(m, o.offset + srow)};
  }
  static void Raw(const uint8_t* src, int64_t, __mmask16 m, __m512& lo, __m512& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, src));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  static __m512 Weight(const Scale& sc, __m512 q) { return _mm512_fmadd_ps(q, sc.s, sc.f); }
  static __m512 Apply(const Scale& sc, __m512 t, __m512 xs, __m512 acc) {
    return _mm512_fmadd_ps(sc.f, xs, _mm512_fmadd_ps(sc.s, t, acc));
  }
};

template <>
struct Codec<1> {  // MXFP4: e2m1 nibbles (a 16-entry permute) times 2 ** (e8m0 - 127)
  static constexpr int64_t kRowsPerByteRow = 2;
  static constexpr bool kOffset = false;
  struct Scale {
    __m512 s;
  };
  static Scale Load(const Operands& o, int64_t srow, __mmask16 m) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, o.scale_e8m0 + srow));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
  }
  static void Raw(const uint8_t* src, int64_t, __mmask16 m, __m512& lo, __m512& hi) {
    const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f,
                                        -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, src));
    lo = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)), table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
  static __m512 Weight(const Scale& sc, __m512 q) { return _mm512_mul_ps(q, sc.s); }
  static __m512 Apply(const Scale& sc, __m512 t, __m512, __m512 acc) {
    return _mm512_fmadd_ps(sc.s, t, acc);
  }
};

template <>
struct Codec<2> {  // fp8 e4m3 times scale
  static constexpr int64_t kRowsPerByteRow = 1;
  static constexpr bool kOffset = false;
  struct Scale {
    __m512 s;  // times 256: see One
  };
  static Scale Load(const Operands& o, int64_t srow, __mmask16 m) {
    return {_mm512_mul_ps(_mm512_maskz_loadu_ps(m, o.scale_f + srow), _mm512_set1_ps(256.0f))};
  }
  // e4m3 -> the f16 with the same sign, exponent and mantissa bits (the byte sign-extended to
  // 16 bits and shifted up 7, bit 14 cleared): the value / 256 exactly, subnormals included;
  // the scale carries the 256. The NaN codes (0x7f, 0xff) come out as +-480 / 256 (no
  // checkpoint holds them).
  static __m512 One(const uint8_t* src, __mmask16 m) {
    const __m256i h = _mm256_and_si256(
        _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, src)), 7),
        _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    return _mm512_cvtph_ps(h);
  }
  static void Raw(const uint8_t* src, int64_t n, __mmask16 m, __m512& lo, __m512& hi) {
    lo = One(src, m);
    hi = One(src + n, m);
  }
  static __m512 Weight(const Scale& sc, __m512 q) { return _mm512_mul_ps(q, sc.s); }
  static __m512 Apply(const Scale& sc, __m512 t, __m512, __m512 acc) {
    return _mm512_fmadd_ps(sc.s, t, acc);
  }
};

template <>
struct Codec<3> {  // GGUF's kept blocks: int8, w = q * d + m
  static constexpr int64_t kRowsPerByteRow = 1;
  static constexpr bool kOffset = true;
  using Scale = Codec<0>::Scale;
  static Scale Load(const Operands& o, int64_t srow, __mmask16 m) {
    return Codec<0>::Load(o, srow, m);
  }
  static void Raw(const uint8_t* src, int64_t n, __mmask16 m, __m512& lo, __m512& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, src)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, src + n)));
  }
  static __m512 Weight(const Scale& sc, __m512 q) { return Codec<0>::Weight(sc, q); }
  static __m512 Apply(const Scale& sc, __m512 t, __m512 xs, __m512 acc) {
    return Codec<0>::Apply(sc, t, xs, acc);
  }
};

// The pointer to K row k, columns c .. of expert e's codes.
template <int F>
inline const uint8_t* Codes(const Operands& o, int64_t e, int64_t k, int64_t c) {
  return o.kernel + (e * o.kp + k / Codec<F>::kRowsPerByteRow) * o.n + c;
}

// Expert e's K rows k0 .. k0 + depth - 1 (k0, depth even) of columns c0 .. c0 + kCols - 1
// decoded into panel [depth][kCols], scale and offset applied; columns past `cols` zero.
template <int F>
void DecodePanel(const Operands& o, int64_t e, int64_t k0, int64_t depth, int64_t c0,
                 int64_t cols, float* panel) {
  using C = Codec<F>;
  const int64_t groups = o.k / o.group, step = 2 / C::kRowsPerByteRow * o.n;
  const __mmask16 m[4] = {Lanes(cols), Lanes(cols - 16), Lanes(cols - 32), Lanes(cols - 48)};
  for (int64_t r = 0; r < depth;) {
    const int64_t g = (k0 + r) / o.group;
    const int64_t end = std::min(depth, (g + 1) * o.group - k0);  // this group's rows
    const int64_t srow = (e * groups + g) * o.n + c0;
    typename C::Scale sc[4];
    for (int j = 0; j < 4; ++j) sc[j] = C::Load(o, srow + 16 * j, m[j]);
    const uint8_t* src = Codes<F>(o, e, k0 + r, c0);
    for (; r < end; r += 2, src += step) {
      for (int j = 0; j < 4; ++j) {
        __m512 lo, hi;
        C::Raw(src + 16 * j, o.n, m[j], lo, hi);
        _mm512_storeu_ps(panel + r * kCols + 16 * j, C::Weight(sc[j], lo));
        _mm512_storeu_ps(panel + (r + 1) * kCols + 16 * j, C::Weight(sc[j], hi));
      }
    }
  }
}

constexpr int kStreamRows = 4;  // up to this many rows, codes are decoded into registers

// y[0 .. R, c0 .. c1) (row stride n) = x[0 .. R, :] (row stride k) @ expert e's columns
// c0 .. c1, for a few rows (the decode step): P pairs of K rows (in one group: 2P divides
// it) at a time, swept across the columns 16 at a time, the codes multiplied in registers
// and the group's scale (and offset) applied to their sum, into R accumulators read and
// written in y (L1). A sweep reads each row's codes c0 .. c1 in one run: column blocks 64
// codes wide, rows N bytes apart, ran at half the memory bandwidth (the hardware
// prefetchers follow runs within a page).
template <int F, int R, int P>
void Stream(const Operands& o, int64_t e, int64_t c0, int64_t c1, const float* x, float* y) {
  using C = Codec<F>;
  const int64_t groups = o.k / o.group, step = 2 / C::kRowsPerByteRow * o.n;
  const int64_t vecs = (c1 - c0 + 15) / 16;
  const __mmask16 last = Lanes(c1 - c0 - 16 * (vecs - 1));
  for (int64_t k = 0; k < o.k; k += 2 * P) {
    const int64_t srow = (e * groups + k / o.group) * o.n;
    const uint8_t* src = Codes<F>(o, e, k, 0);
    __m512 xb[R][2 * P], xs[R];
    for (int i = 0; i < R; ++i) {
      float sum = 0.0f;
      for (int p = 0; p < 2 * P; ++p) {
        xb[i][p] = _mm512_set1_ps(x[i * o.k + k + p]);
        sum += x[i * o.k + k + p];
      }
      xs[i] = _mm512_set1_ps(sum);
    }
    for (int64_t v = 0; v < vecs; ++v) {
      const int64_t c = c0 + 16 * v;
      const __mmask16 m = v + 1 < vecs ? static_cast<__mmask16>(0xFFFF) : last;
      __m512 t[R];
      for (int p = 0; p < P; ++p) {
        __m512 lo, hi;
        C::Raw(src + p * step + c, o.n, m, lo, hi);
        for (int i = 0; i < R; ++i) {
          t[i] = p == 0 ? _mm512_mul_ps(xb[i][0], lo) : _mm512_fmadd_ps(xb[i][2 * p], lo, t[i]);
          t[i] = _mm512_fmadd_ps(xb[i][2 * p + 1], hi, t[i]);
        }
      }
      const auto sc = C::Load(o, srow + c, m);
      for (int i = 0; i < R; ++i) {
        const __m512 acc = k == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, y + i * o.n + c);
        _mm512_mask_storeu_ps(y + i * o.n + c, m, C::Apply(sc, t[i], xs[i], acc));
      }
    }
  }
}

template <int F, int R>
void StreamRows(const Operands& o, int64_t e, int64_t c0, int64_t c1, const float* x, float* y) {
  if (o.group % 8 == 0) return Stream<F, R, 4>(o, e, c0, c1, x, y);
  Stream<F, R, 1>(o, e, c0, c1, x, y);
}

#else
constexpr int kStreamRows = 0;
#endif  // JAXSERVE_PACKED_AVX512

// Expert e's K rows k0 .. k0 + depth - 1 of columns c0 .. c0 + cols - 1 decoded into panel
// [depth][kCols], scale and offset applied; columns past `cols` zero.
// (Without AVX-512: loops the compiler vectorizes.)
[[maybe_unused]] void Decode(const Operands& o, int64_t e, int64_t k0, int64_t depth,
                             int64_t c0, int64_t cols, float* panel) {
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
    for (int64_t c = cols; c < kCols; ++c) dst[c] = 0.0f;
  }
}

// c[0 .. R, 0 .. kCols) (row stride ldc) = (first ? 0 : c) + x[0 .. R, 0 .. depth) @ panel:
// R x 4 vector accumulators in registers, each panel row loaded once for the R rows.
template <int R>
void Micro(const float* x, int64_t ldx, const float* panel, int64_t depth, float* c,
           int64_t ldc, bool first) {
  Vec acc[R][4];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = Vec{};
  }
  if (!first) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[i][j] = Load(c + i * ldc + j * kVec);
    }
  }
  for (int64_t r = 0; r < depth; ++r) {
    const float* w = panel + r * kCols;
    const Vec w0 = Load(w), w1 = Load(w + kVec), w2 = Load(w + 2 * kVec),
              w3 = Load(w + 3 * kVec);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float b = x[i * ldx + r];  // broadcast by the vector products
      acc[i][0] += b * w0;
      acc[i][1] += b * w1;
      acc[i][2] += b * w2;
      acc[i][3] += b * w3;
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) Store(c + i * ldc + j * kVec, acc[i][j]);
  }
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool);

template <int... R>
constexpr auto MicroTable(std::integer_sequence<int, R...>) {
  return std::array<MicroFn, sizeof...(R)>{&Micro<R + 1>...};
}
constexpr auto kMicro = MicroTable(std::make_integer_sequence<int, kMaxRows>{});

// rows of x (from x, stride k) times the panel into c (stride ldc), in blocks of at most
// kMaxRows rows of near-equal size (32 rows: 6, 6, 5, 5, 5, 5).
void MultiplyRows(const float* x, int64_t k, const float* panel, int64_t depth, int64_t rows,
                  float* c, int64_t ldc, bool first) {
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  int64_t t = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r = rows / blocks + (b < rows % blocks ? 1 : 0);
    kMicro[r - 1](x + t * k, k, panel, depth, c + t * ldc, ldc, first);
    t += r;
  }
}

struct Item {
  int64_t e, c0, c1;  // expert e's columns c0 .. c1
};

struct Job {
  Operands o;
  std::vector<int64_t> start;  // expert e's rows: start[e] .. start[e + 1]
  std::vector<Item> items;     // of the experts with rows
  std::atomic<int64_t> next{0}, done{0};
};

template <int F>
void RunItem(const Job& job, int64_t item) {
  thread_local std::vector<float> panel_buffer, tail_buffer;
  const Operands& o = job.o;
  const auto [e, c0, c1] = job.items[item];
  const int64_t cols = c1 - c0;
  const int64_t rows = job.start[e + 1] - job.start[e];
  const float* xe = o.x + job.start[e] * o.k;
#ifdef JAXSERVE_PACKED_AVX512
  float* ye = o.y + job.start[e] * o.n;
  static_assert(kStreamRows == 4);
  switch (rows) {
    case 1: return StreamRows<F, 1>(o, e, c0, c1, xe, ye);
    case 2: return StreamRows<F, 2>(o, e, c0, c1, xe, ye);
    case 3: return StreamRows<F, 3>(o, e, c0, c1, xe, ye);
    case 4: return StreamRows<F, 4>(o, e, c0, c1, xe, ye);
  }
#endif
  if (panel_buffer.size() < kDepth * kCols) panel_buffer.resize(kDepth * kCols);
  float* panel = panel_buffer.data();
  float* c = o.y + job.start[e] * o.n + c0;
  int64_t ldc = o.n;
  if (cols < kCols) {  // a last, narrower block: rows kCols wide here, copied out at the end
    if (tail_buffer.size() < static_cast<size_t>(rows * kCols)) tail_buffer.resize(rows * kCols);
    c = tail_buffer.data();
    ldc = kCols;
  }
  for (int64_t k0 = 0; k0 < o.k; k0 += kDepth) {
    const int64_t d = std::min<int64_t>(kDepth, o.k - k0);
#ifdef JAXSERVE_PACKED_AVX512
    DecodePanel<F>(o, e, k0, d, c0, cols, panel);
#else
    Decode(o, e, k0, d, c0, cols, panel);
#endif
    MultiplyRows(xe + k0, o.k, panel, d, rows, c, ldc, k0 == 0);
  }
  if (cols < kCols) {
    for (int64_t t = 0; t < rows; ++t) {
      std::memcpy(o.y + (job.start[e] + t) * o.n + c0, c + t * kCols, sizeof(float) * cols);
    }
  }
}

template <int F>
void WorkOn(Job& job) {
  const int64_t total = static_cast<int64_t>(job.items.size());
  for (;;) {
    const int64_t i = job.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= total) return;
    RunItem<F>(job, i);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

// Claims and runs items until none is left.
void Work(Job& job) {
  switch (job.o.fmt) {
    case 0: return WorkOn<0>(job);
    case 1: return WorkOn<1>(job);
    case 2: return WorkOn<2>(job);
    default: return WorkOn<3>(job);
  }
}

// The items: for an expert with more rows than kStreamRows, column blocks kCols wide; with
// fewer, column runs of ~512 columns (16 apart), a multiple of `workers` in number.
void Plan(Job& job, int64_t experts, int64_t workers) {
  const int64_t n = job.o.n, blocks = (n + kCols - 1) / kCols, vecs = (n + 15) / 16;
  const int64_t runs = std::min(vecs, ((n + 511) / 512 + workers - 1) / workers * workers);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = job.start[e + 1] - job.start[e];
    if (rows == 0) continue;
    if (rows <= kStreamRows) {
      for (int64_t i = 0; i < runs; ++i) {
        job.items.push_back({e, std::min(n, vecs * i / runs * 16),
                             std::min(n, vecs * (i + 1) / runs * 16)});
      }
    } else {
      for (int64_t b = 0; b < blocks; ++b) {
        job.items.push_back({e, b * kCols, std::min(n, (b + 1) * kCols)});
      }
    }
  }
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer kernel,
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
  auto job = std::make_shared<Job>();
  job->o = Operands{x.typed_data(),
                    static_cast<const uint8_t*>(kernel.untyped_data()),
                    fmt == 1 ? nullptr : static_cast<const float*>(scale.untyped_data()),
                    fmt == 1 ? static_cast<const uint8_t*>(scale.untyped_data()) : nullptr,
                    offset.typed_data(),
                    out->typed_data(),
                    k, n, kp, group, fmt};
  job->start.assign(experts + 1, 0);
  const int32_t* sizes = group_sizes.typed_data();
  for (int64_t e = 0; e < experts; ++e) {
    job->start[e + 1] = job->start[e] + std::max(0, sizes[e]);
  }
  const int64_t used = job->start[experts];
  if (used > m) return ffi::Error::InvalidArgument("group sizes exceed the rows");
  std::memset(job->o.y + used * n, 0, sizeof(float) * (m - used) * n);  // rows past the groups
  if (k == 0) {
    std::memset(job->o.y, 0, sizeof(float) * used * n);
    return ffi::Error::Success();
  }
  // Helpers from XLA's pool, for calls with more than a few microseconds of work.
  int64_t workers = 1;
  if ((used + 8) * k * n >= (1 << 18)) {
    workers += std::max<int64_t>(0, std::min<int64_t>(NumThreads() - 1, pool.num_threads()));
  }
  Plan(*job, experts, workers);
  const int64_t total = static_cast<int64_t>(job->items.size());
  if (total == 0) return ffi::Error::Success();
  const int64_t helpers = std::min(workers, total) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  for (int spins = 0; job->done.load(std::memory_order_acquire) < total; ++spins) {
    if (spins < 4096) {
      JAXSERVE_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // kernel
                                  .Arg<ffi::AnyBuffer>()         // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offset
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group"));
