// Decode rows of ragged paged attention for XLA:CPU, as an XLA FFI custom call.
//
// XLA:CPU cannot fuse a gather into a dot: the jnp reference copies every K/V chunk out of
// the paged cache (at copy speed, ~4-8 GB/s here) before two small batched dots read it
// again. This kernel reads each sequence's K/V rows in place, once, with an online softmax,
// so a decode step's attention costs about one pass over the cached bytes.
//
// Semantics are the reference's decode path (reference.py `_decode`): a sequence s < num_seqs
// whose query_start_loc[s + 1] - query_start_loc[s] == 1 has one query row, at position
// kv_lens[s] - 1, attending to every cached key at or before it (within sliding_window when
// it is > 0; scores soft-capped when soft_cap > 0). Every other output row is zero.
//
// Shapes (f32): q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
// i32: kv_lens [S], block_tables [S, max_blocks], query_start_loc [S + 1], num_seqs [1].
// Output [T, Hq, D]. Work is split over sequences (over (sequence, KV head) pairs when there
// are fewer sequences than threads) and run on up to JAXSERVE_CPU_ATTENTION_THREADS threads
// (default: the CPUs this process may run on).

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Geometry {
  int64_t num_blocks, block_size, num_kv_heads, head_dim, group, max_blocks;
};

int NumThreads() {
  static const int n = [] {
    if (const char* env = std::getenv("JAXSERVE_CPU_ATTENTION_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return v;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

// exp(x) for x <= 0 (-inf included: ~1e-38, which multiplies sums still zero), to ~1e-7
// relative (Cephes' expf polynomial); unlike std::exp the compiler vectorizes it.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// One query row's heads of KV heads [h0, h1) (G query heads each) over the sequence's first
// kv_len keys. Each block's K/V token rows are read front to back, every KV head of the range
// in one pass (a row of all heads is contiguous in the cache), and each K/V head row once for
// its G query heads. q, out: [(h1 - h0) * G, D], contiguous in the caller's [Hq, D] rows;
// scratch: R * (2 + D + BS) floats, R = (h1 - h0) * G.
template <int kD>
void AttendRows(const float* q, const float* k_cache, const float* v_cache,
                const int32_t* blocks, int64_t kv_len, int64_t window, const Geometry& g,
                int64_t h0, int64_t h1, float scale, float cap, float* out, float* scratch) {
  const int64_t D = kD > 0 ? kD : g.head_dim;
  const int64_t G = g.group, BS = g.block_size, stride = g.num_kv_heads * D;
  const int64_t R = (h1 - h0) * G;
  float* m = scratch;
  float* l = m + R;
  float* acc = l + R;
  float* s = acc + R * D;
  for (int64_t r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * R * D);
  kv_len = std::min(kv_len, g.max_blocks * BS);
  const int64_t start = window > 0 ? std::max<int64_t>(0, kv_len - window) : 0;
  for (int64_t b = start / BS; b * BS < kv_len; ++b) {
    const int64_t block = blocks[b];
    if (block < 0 || block >= g.num_blocks) continue;  // never for a valid table
    const float* kb = k_cache + block * BS * stride + h0 * D;
    const float* vb = v_cache + block * BS * stride + h0 * D;
    const int64_t t0 = std::max<int64_t>(start - b * BS, 0);
    const int64_t t1 = std::min<int64_t>(BS, kv_len - b * BS);
    for (int64_t t = t0; t < t1; ++t) {  // scores
      for (int64_t h = 0; h < h1 - h0; ++h) {
        const float* kr = kb + t * stride + h * D;
        for (int64_t r = h * G; r < (h + 1) * G; ++r) {
          const float* qr = q + r * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
          dot *= scale;
          if (cap > 0.f) dot = cap * std::tanh(dot / cap);
          s[r * BS + t] = dot;
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {  // online softmax over this block's keys
      float* sr = s + r * BS;
      float block_max = sr[t0];
#pragma omp simd reduction(max : block_max)
      for (int64_t t = t0 + 1; t < t1; ++t) block_max = std::max(block_max, sr[t]);
      const float m_new = std::max(m[r], block_max);
      const float alpha = ExpNonPositive(m[r] - m_new);  // ~0 on the first block (m = -inf)
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = t0; t < t1; ++t) {
        sr[t] = ExpNonPositive(sr[t] - m_new);
        sum += sr[t];
      }
      l[r] = alpha * l[r] + sum;
      m[r] = m_new;
      float* ar = acc + r * D;
      for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
    }
    for (int64_t t = t0; t < t1; ++t) {  // values
      for (int64_t h = 0; h < h1 - h0; ++h) {
        const float* vr = vb + t * stride + h * D;
        for (int64_t r = h * G; r < (h + 1) * G; ++r) {
          const float p = s[r * BS + t];
          float* ar = acc + r * D;
          for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv;
  }
}

using RowFn = decltype(&AttendRows<0>);

RowFn PickRowFn(int64_t head_dim) {
  switch (head_dim) {  // fixed widths let the compiler unroll and vectorize the D loops
    case 64: return &AttendRows<64>;
    case 128: return &AttendRows<128>;
    case 256: return &AttendRows<256>;
    default: return &AttendRows<0>;
  }
}

ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                           ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> query_start_loc,
                           ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                           float sm_scale, int64_t sliding_window, float soft_cap) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2) {
    return ffi::Error::InvalidArgument("paged decode: q must be 3-D, caches 4-D, tables 2-D");
  }
  const int64_t num_tokens = qd[0], num_q_heads = qd[1], head_dim = qd[2];
  const Geometry g{kd[0], kd[1], kd[2], kd[3], 0, bd[1]};
  if (g.head_dim != head_dim || g.num_kv_heads <= 0 || num_q_heads % g.num_kv_heads) {
    return ffi::Error::InvalidArgument("paged decode: q heads/width do not fit the cache");
  }
  Geometry geo = g;
  geo.group = num_q_heads / g.num_kv_heads;
  const int64_t max_seqs = bd[0];
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* tables = block_tables.typed_data();
  const int32_t* starts = query_start_loc.typed_data();
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], max_seqs);
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * num_tokens * num_q_heads * head_dim);

  // Work items: the single-token sequences in use, all their KV heads in one pass (rows of
  // all heads are contiguous), or one KV head each when there are fewer sequences than
  // threads to give work to.
  std::vector<int64_t> seqs;
  int64_t total_keys = 0;
  for (int64_t s = 0; s < n; ++s) {
    if (starts[s + 1] - starts[s] == 1 && starts[s] >= 0 && starts[s] < num_tokens) {
      seqs.push_back(s);
      total_keys += lens[s];
    }
  }
  if (seqs.empty()) return ffi::Error::Success();
  // Threads only pay off past a few thousand keys (starting one costs ~20-50 us).
  const int64_t want = std::min<int64_t>(NumThreads(), std::max<int64_t>(1, total_keys / 2048));
  const int64_t heads_per_item =
      static_cast<int64_t>(seqs.size()) >= want ? g.num_kv_heads : 1;
  const int64_t splits = g.num_kv_heads / heads_per_item;
  const int64_t items = static_cast<int64_t>(seqs.size()) * splits;
  const RowFn row_fn = PickRowFn(head_dim);
  const float* qp = q.typed_data();
  const float* kp = k_cache.typed_data();
  const float* vp = v_cache.typed_data();
  auto run = [&](int64_t first, int64_t step) {
    std::vector<float> scratch(heads_per_item * geo.group * (2 + head_dim + geo.block_size));
    for (int64_t i = first; i < items; i += step) {
      const int64_t s = seqs[i / splits], h0 = (i % splits) * heads_per_item;
      const int64_t offset = (starts[s] * num_q_heads + h0 * geo.group) * head_dim;
      row_fn(qp + offset, kp, vp, tables + s * g.max_blocks, lens[s], sliding_window, geo, h0,
             h0 + heads_per_item, sm_scale, soft_cap, o + offset, scratch.data());
    }
  };
  const int64_t threads = std::min<int64_t>(want, items);
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, t, threads);
  run(0, threads);
  for (auto& t : pool) t.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
