// CPU paged attention that reads K/V where the block tables say they are: no gather, no copy of
// the context. Registered as torch.ops.pagedserve_cpu.paged_attention (kernels/cpu_ops.py builds
// it on first use). Semantics are kernels/reference.py's paged_attention.
//
// One work item is (sequence, query tile, kv head): the tile's query positions times the G query
// heads that share the kv head are its rows, so each key/value row read from the cache serves all
// of them. Keys are visited block by block through the table, with an online softmax (running
// max m, running sum l, unnormalised accumulator acc per row: flash-decoding), so nothing the size
// of the context is ever materialised. Every product is accumulated in float32 whatever the cache
// dtype. The causal limit of a row is a prefix of each block, so no mask is built.
//
// Only portable flags are assumed (kernels/cpu_ops.py adds -march=native where the compiler has
// it): the inner loops are written on W-float vector-extension types (W = 16 with AVX-512, else 8)
// that gcc and clang lower to AVX-512, AVX2, SSE or NEON. Threads are ATen's (at::parallel_for over work items), so
// torch.set_num_threads governs them and no second OpenMP runtime is linked.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// W floats in GCC/Clang vector-extension types; the compiler lowers them to whatever -march allows,
// so no intrinsics tie us to one ISA. W is one register's width where AVX-512 has 16 floats, and 8
// elsewhere (one AVX2 register, two NEON ones): 16-float types on AVX2 made score_keys' W
// accumulators 32 registers of 16, and their spills made decode 2.3-3.5x slower (0.85 vs 2.9 ms,
// 64 sequences x 192 keys, 4/2 heads, one thread).
#if defined(__AVX512F__)
#define W_IS_16 1
constexpr int64_t W = 16;
#else
#define W_IS_16 0
constexpr int64_t W = 8;
#endif
typedef float vfloat __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(W * sizeof(int32_t))));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
// For constants only (folded at compile time): a runtime scalar is broadcast by writing it as an
// operand, `x * v`, since `vfloat{} + x` is a scalar add (0 + -0 is +0) before the broadcast.
inline vfloat splat(float x) { return vfloat{} + x; }

// Sum of the W lanes: the 4-lane quarters added together, then a short tree.
inline float hsum(vfloat v) {
  v4 a;
  std::memcpy(&a, &v, sizeof(a));
  for (int64_t i = 1; i < W / 4; ++i) {
    v4 b;
    std::memcpy(&b, reinterpret_cast<const char*>(&v) + i * sizeof(b), sizeof(b));
    a += b;
  }
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// Largest of the W lanes, the same way.
inline float hmax(vfloat v) {
  v4 a;
  std::memcpy(&a, &v, sizeof(a));
  for (int64_t i = 1; i < W / 4; ++i) {
    v4 b;
    std::memcpy(&b, reinterpret_cast<const char*>(&v) + i * sizeof(b), sizeof(b));
    a = a > b ? a : b;
  }
  return std::max(std::max(a[0], a[2]), std::max(a[1], a[3]));
}

// exp(x) for x <= 0 (a score minus its running max), lane-wise: Cephes' single-precision
// polynomial, ~1 ulp. Below -87 the result is ~1e-38 rather than 0, which vanishes next to the
// row's sum (>= 1).
inline vfloat exp_nonpositive(vfloat x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  // n = round(x / ln2): truncation rounds a negative number toward zero, hence the -0.5
  const vint ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vint);
  const vfloat n = __builtin_convertvector(ni, vfloat);
  vfloat r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint bits = (ni + 127) << 23;  // 2^n
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Geometry {
  int64_t num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, group;
  int64_t q_s0, q_s1, out_s0, out_s1;       // [T, Hq, D] strides (D stride is 1)
  int64_t c_s0, c_s1, c_s2;                 // cache [N, B, Hkv, D] strides, shared by K and V
  int64_t table_s0;
  float scale;
};

// Query positions per work item: rows = TILE * G stay few enough that their accumulators
// ([rows, D] floats) live in L1 next to one block of K and V.
constexpr int64_t kQueryTile = 16;
// From this many rows on, a block's keys are transposed ([D, B]) so that scores come out W keys
// to a vector (one FMA per dimension, no horizontal sum); the transpose costs B * D moves per
// block, which pays for itself only over many rows. Decode (rows = G) takes dot products instead.
constexpr int64_t kTransposeRows = 16;
// Rows scored together against one transposed block: 8, padded with zero queries. Their scores
// are kept in 8 vector accumulators, 4 rows x 2 vectors of keys where a block has two (or more)
// vectors of keys, else 8 rows x 1: each accumulator takes one FMA per dimension, and with fewer
// than ~8 of them the loop waits on FMA latency rather than issuing (4 x 1 ran at half the rate).
constexpr int64_t kRowBlock = 8;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Scratch of one thread, reused across its work items.
struct Scratch {
  std::vector<float> data;
  float* take(size_t floats) {
    if (data.size() < floats) data.resize(floats);
    return data.data();
  }
};

// Scores of rows [r0, r0 + R) against keys [0, BW) of a transposed block kt [D, BW], NV vectors of
// keys at a time (BW a multiple of NV * W): score [rows, BW]. Rows past `rows` have zero queries
// (qf is padded), so they cost but do no harm.
template <int64_t D, int64_t R, int64_t NV>
inline void score_transposed(const float* qf, const float* kt, int64_t r0, int64_t n, int64_t BW,
                             float* score) {
  for (int64_t t0 = 0; t0 < n; t0 += NV * W) {
    vfloat s[R][NV] = {};
    for (int64_t d = 0; d < D; ++d) {
      vfloat k[NV];
      for (int64_t v = 0; v < NV; ++v) k[v] = load(kt + d * BW + t0 + v * W);
      for (int64_t j = 0; j < R; ++j) {
        const float qd = qf[(r0 + j) * D + d];
        for (int64_t v = 0; v < NV; ++v) s[j][v] += qd * k[v];
      }
    }
    for (int64_t j = 0; j < R; ++j)
      for (int64_t v = 0; v < NV; ++v) store(score + (r0 + j) * BW + t0 + v * W, s[j][v]);
  }
}

// Score of row r against keys [0, nr) of block kb (row stride ks), by dot products.
template <int64_t D>
inline void score_dot(const float* qr, const float* kb, int64_t ks, int64_t nr, float* score) {
  constexpr int64_t C = D / W;
  vfloat qv[C];
  for (int64_t c = 0; c < C; ++c) qv[c] = load(qr + c * W);
  for (int64_t t = 0; t < nr; ++t) {
    const float* kr = kb + t * ks;
    vfloat s0 = qv[0] * load(kr), s1 = vfloat{};  // two chains: FMA latency, not throughput
    for (int64_t c = 1; c < C; ++c) {
      if (c % 2) s1 += qv[c] * load(kr + c * W);
      else s0 += qv[c] * load(kr + c * W);
    }
    score[t] = hsum(s0 + s1);
  }
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
// Lane j of the result is the sum of the W lanes of v[j]: a transpose-reduce tree of W - 1
// shuffle pairs and adds, where W horizontal sums take ~log2(W) + 3 dependent operations each.
// Each level halves the lanes per key: for W = 16, after level 1 a vector holds two keys' partials
// (8 lanes each), after level 4 sixteen keys (1 lane each), in order.
#if W_IS_16
inline vfloat hsum_lanes(const vfloat* v) {
  vfloat a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
// W = 8: the same tree, three levels.
inline vfloat hsum_lanes(const vfloat* v) {
  vfloat a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

#if !W_IS_16
// dst[i * ld_dst + t] = src[t * ld_src + i] for an 8 x 8 tile (W = 8, floats): the rows loaded
// once and transposed in registers by three levels of shuffles. Copying element by element read a
// key per float and wrote a column, 13 % of a prefill over a cached prefix (AVX2).
inline void transpose_tile(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  vfloat r[8], t[8], u[8];
  for (int j = 0; j < 8; ++j) r[j] = load(src + j * ld_src);
  for (int k = 0; k < 4; ++k) {   // pairs of rows interleaved, one float at a time
    t[2 * k] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * k + 1] = __builtin_shufflevector(r[2 * k], r[2 * k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int b = 0; b < 8; b += 4) {   // then two floats at a time
    u[b] = __builtin_shufflevector(t[b], t[b + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[b + 1] = __builtin_shufflevector(t[b], t[b + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[b + 2] = __builtin_shufflevector(t[b + 1], t[b + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[b + 3] = __builtin_shufflevector(t[b + 1], t[b + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int k = 0; k < 4; ++k) {   // then four
    store(dst + k * ld_dst, __builtin_shufflevector(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11));
    store(dst + (k + 4) * ld_dst, __builtin_shufflevector(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15));
  }
}
#define HAVE_TRANSPOSE_TILE 1
#endif

// score_dot with the W keys of a vector summed together (hsum_lanes): decode's few rows per block
// spent as much on horizontal sums as on the products themselves.
template <int64_t D>
inline void score_keys(const float* qr, const float* kb, int64_t ks, int64_t nr, float* score) {
  constexpr int64_t C = D / W;
  vfloat qv[C];
  for (int64_t c = 0; c < C; ++c) qv[c] = load(qr + c * W);
  for (int64_t t0 = 0; t0 < nr; t0 += W) {
    const int64_t m = std::min(W, nr - t0);
    vfloat acc[W];
    for (int64_t j = 0; j < W; ++j) {
      if (j >= m) {
        acc[j] = vfloat{};
        continue;
      }
      const float* kr = kb + (t0 + j) * ks;
      vfloat s = qv[0] * load(kr);
      for (int64_t c = 1; c < C; ++c) s += qv[c] * load(kr + c * W);
      acc[j] = s;
    }
    store(score + t0, hsum_lanes(acc));
  }
}
#else
template <int64_t D>
inline void score_keys(const float* qr, const float* kb, int64_t ks, int64_t nr, float* score) {
  score_dot<D>(qr, kb, ks, nr, score);
}
#endif

// One (sequence, query tile, kv head): rows = num_q query positions x G heads. D is a template
// parameter so that a row's query and accumulator (D / W vectors each) stay in registers.
template <typename T, int64_t D>
void attend_item(const Geometry& g, const T* q, const T* k_cache, const T* v_cache,
                 const int32_t* table, int64_t seq, int64_t kv_head, int64_t q_first,
                 int64_t num_q, int64_t pos_first, T* out, Scratch& scratch) {
  constexpr int64_t C = D / W;  // vectors per head row
  const int64_t B = g.block_size, G = g.group;
  const int64_t BW = round_up(B, W);
  const int64_t rows = num_q * G;  // row r: query (q_first + r / G), head (kv_head * G + r % G)
  const bool transpose = rows >= kTransposeRows;
  const int64_t rows_padded = round_up(rows, kRowBlock);
  float* qf = scratch.take(static_cast<size_t>(2 * rows_padded * D + 2 * rows_padded +
                                               rows_padded * BW + 2 * BW * D));
  float* acc = qf + rows_padded * D;     // [rows, D] unnormalised output
  float* m = acc + rows_padded * D;      // [rows] running max
  float* l = m + rows_padded;            // [rows] running sum of exp
  float* score = l + rows_padded;        // [rows, BW] this block's scores, then probabilities
  float* kbuf = score + rows_padded * BW;  // [B, D] K in float (non-float caches) or [D, BW] K^T
  float* vbuf = kbuf + BW * D;           // [B, D] V in float (non-float caches)

  for (int64_t r = 0; r < rows_padded; ++r) {
    if (r < rows) {
      const T* src = q + (q_first + r / G) * g.q_s0 + (kv_head * G + r % G) * g.q_s1;
      for (int64_t i = 0; i < D; ++i) qf[r * D + i] = to_float(src[i]) * g.scale;
    } else {
      std::fill(qf + r * D, qf + (r + 1) * D, 0.0f);
    }
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }

  const int64_t kv_end = pos_first + num_q;  // the last row sees keys [0, kv_end)
  const int64_t num_blocks = (kv_end + B - 1) / B;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t base = b * B;
    const int64_t n = std::min(B, kv_end - base);
    const int64_t off = static_cast<int64_t>(table[seq * g.table_s0 + b]) * g.c_s0 + kv_head * g.c_s2;
    if (b + 1 < num_blocks) {
      // The next block is anywhere in the pool: no hardware prefetcher guesses the jump, so ask
      // for its rows now and let them arrive while this block is computed.
      const int64_t next = static_cast<int64_t>(table[seq * g.table_s0 + b + 1]) * g.c_s0 + kv_head * g.c_s2;
      const int64_t next_n = std::min(B, kv_end - base - B);
      for (int64_t t = 0; t < next_n; ++t) {
        for (int64_t i = 0; i < D; i += 64 / static_cast<int64_t>(sizeof(T))) {
          __builtin_prefetch(k_cache + next + t * g.c_s1 + i);
          __builtin_prefetch(v_cache + next + t * g.c_s1 + i);
        }
      }
    }
    // Keys and values of this block as float rows (in place for a float cache).
    const float* kb;
    const float* vb;
    int64_t kv_stride;
    if constexpr (std::is_same_v<T, float>) {
      kb = k_cache + off;
      vb = v_cache + off;
      kv_stride = g.c_s1;
    } else {
      for (int64_t t = 0; t < n; ++t) {
        const T* vs = v_cache + off + t * g.c_s1;
        for (int64_t i = 0; i < D; ++i) vbuf[t * D + i] = to_float(vs[i]);
      }
      vb = vbuf;
      kv_stride = D;
      kb = kbuf;
    }
    if (transpose) {
      // kbuf becomes K^T [D, BW], keys past n zero; every row's scores for the block at once.
      const T* ks = k_cache + off;
      bool tiled = false;
#ifdef HAVE_TRANSPOSE_TILE
      if constexpr (std::is_same_v<T, float>) {
        if (n % W == 0) {
          for (int64_t t = 0; t < n; t += W)
            for (int64_t i = 0; i < D; i += W) transpose_tile(ks + t * g.c_s1 + i, g.c_s1, kbuf + i * BW + t, BW);
          tiled = true;
        }
      }
#endif
      if (!tiled)
        for (int64_t t = 0; t < n; ++t)   // each key's row read in order, its column written
          for (int64_t i = 0; i < D; ++i) kbuf[i * BW + t] = to_float(ks[t * g.c_s1 + i]);
      for (int64_t i = 0; i < D; ++i) std::fill(kbuf + i * BW + n, kbuf + (i + 1) * BW, 0.0f);
      if (BW % (2 * W) == 0) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) score_transposed<D, 4, 2>(qf, kbuf, r0, n, BW, score);
      } else {
        for (int64_t r0 = 0; r0 < rows; r0 += 8) score_transposed<D, 8, 1>(qf, kbuf, r0, n, BW, score);
      }
    } else if constexpr (!std::is_same_v<T, float>) {
      for (int64_t t = 0; t < n; ++t) {
        const T* ks = k_cache + off + t * g.c_s1;
        for (int64_t i = 0; i < D; ++i) kbuf[t * D + i] = to_float(ks[i]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      // Row r's query sits at pos_first + r / G and sees keys up to and including it.
      const int64_t nr = std::min(n, pos_first + r / G + 1 - base);
      if (nr <= 0) continue;
      float* sr = score + r * BW;
      if (!transpose) score_keys<D>(qf + r * D, kb, kv_stride, nr, sr);
      // Lanes past nr take part in whole-vector max and exp: -inf there changes no max, and its
      // exp is ~1e-38, nothing.
      for (int64_t t = nr; t < round_up(nr, W); ++t) sr[t] = -std::numeric_limits<float>::infinity();
      vfloat vmax = load(sr);
      for (int64_t t0 = W; t0 < nr; t0 += W) {
        const vfloat x = load(sr + t0);
        vmax = x > vmax ? x : vmax;
      }
      const float m_new = std::max(m[r], hmax(vmax));
      vfloat sum = vfloat{};
      for (int64_t t0 = 0; t0 < nr; t0 += W) {
        const vfloat p = exp_nonpositive(load(sr + t0) - m_new);
        store(sr + t0, p);
        sum += p;
      }
      float* ar = acc + r * D;
      vfloat a[C];
      for (int64_t c = 0; c < C; ++c) a[c] = load(ar + c * W);
      if (m_new > m[r]) {
        const float alpha = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
        l[r] *= alpha;
        for (int64_t c = 0; c < C; ++c) a[c] *= alpha;
        m[r] = m_new;
      }
      l[r] += hsum(sum);
      for (int64_t t = 0; t < nr; ++t) {
        const float* vr = vb + t * kv_stride;
        const float p = sr[t];
        for (int64_t c = 0; c < C; ++c) a[c] += p * load(vr + c * W);
      }
      for (int64_t c = 0; c < C; ++c) store(ar + c * W, a[c]);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (q_first + r / G) * g.out_s0 + (kv_head * G + r % G) * g.out_s1;
    const float inv = 1.0f / l[r];
    for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[r * D + i] * inv);
  }
}

// q [T, Hq, D]; k_cache, v_cache [N, B, Hkv, D] (any stride(0), unit stride on D, same strides);
// block_tables [S, max_blocks] int32; seq_lens [S] int32; query_start_loc [S+1] int32, or empty
// for decode (one query per sequence, T == S). Returns [T, Hq, D] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [T, Hq, D], caches [N, B, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must share shape and strides");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1, "unit stride on the head dimension");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt, "block tables and lengths are int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "contiguous tables and lengths");
  Geometry g{};
  g.num_seqs = seq_lens.size(0);
  g.num_q_heads = q.size(1);
  g.num_kv_heads = k_cache.size(2);
  g.head_dim = q.size(2);
  g.block_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == g.head_dim, "q and cache head dims differ");
  TORCH_CHECK(g.num_q_heads % g.num_kv_heads == 0, "query heads must be a multiple of kv heads");
  g.group = g.num_q_heads / g.num_kv_heads;
  const bool decode = query_start_loc.numel() == 0;
  TORCH_CHECK(decode ? q.size(0) == g.num_seqs : query_start_loc.numel() == g.num_seqs + 1,
              "query_start_loc must have one entry per sequence plus one (or be empty for decode)");
  at::Tensor out = at::empty(q.sizes(), q.options());
  g.q_s0 = q.stride(0);
  g.q_s1 = q.stride(1);
  g.out_s0 = out.stride(0);
  g.out_s1 = out.stride(1);
  g.c_s0 = k_cache.stride(0);
  g.c_s1 = k_cache.stride(1);
  g.c_s2 = k_cache.stride(2);
  g.table_s0 = block_tables.stride(0);
  g.scale = static_cast<float>(scale);
  if (q.size(0) == 0) return out;

  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = decode ? nullptr : query_start_loc.data_ptr<int32_t>();
  // Work items: (sequence, query tile) pairs, each run for every kv head.
  std::vector<int64_t> item_seq, item_tile;
  for (int64_t s = 0; s < g.num_seqs; ++s) {
    // A decode row of length 0 is padding (a CUDA graph bucket's spare row, services/worker/
    // cuda_graphs.py): it reads nothing and its output is zeros.
    const int64_t q_len = decode ? (lens[s] > 0 ? 1 : 0) : qsl[s + 1] - qsl[s];
    if (decode && q_len == 0) out.select(0, s).zero_();
    TORCH_CHECK(q_len >= 0 && q_len <= lens[s], "sequence ", s, " has ", q_len, " queries for ", lens[s], " keys");
    // Every block the kernel will read must be in the pool: a bad table is an error, not a read
    // of some other memory.
    const int64_t used = (lens[s] + g.block_size - 1) / g.block_size;
    TORCH_CHECK(used <= block_tables.size(1), "sequence ", s, " needs ", used, " blocks; its table has ",
                block_tables.size(1));
    const int32_t* row = block_tables.data_ptr<int32_t>() + s * g.table_s0;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < k_cache.size(0), "sequence ", s, " block ", b, " is ", row[b],
                  ", outside the pool of ", k_cache.size(0));
    for (int64_t t = 0; t * kQueryTile < q_len; ++t) {
      item_seq.push_back(s);
      item_tile.push_back(t);
    }
  }
  const int64_t num_items = static_cast<int64_t>(item_seq.size()) * g.num_kv_heads;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int32_t* tp = block_tables.data_ptr<int32_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    auto attend = &attend_item<scalar_t, 64>;
    switch (g.head_dim) {
      case 16: attend = &attend_item<scalar_t, 16>; break;
      case 32: attend = &attend_item<scalar_t, 32>; break;
      case 64: break;
      case 128: attend = &attend_item<scalar_t, 128>; break;
      case 256: attend = &attend_item<scalar_t, 256>; break;
      default: TORCH_CHECK(false, "head_dim must be 16, 32, 64, 128 or 256, got ", g.head_dim);
    }
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      Scratch buf;
      for (int64_t it = begin; it < end; ++it) {
        const int64_t pair = it / g.num_kv_heads, kv_head = it % g.num_kv_heads;
        const int64_t s = item_seq[pair], tile = item_tile[pair];
        const int64_t start = decode ? s : qsl[s];
        const int64_t q_len = decode ? 1 : qsl[s + 1] - qsl[s];
        const int64_t first = tile * kQueryTile;
        const int64_t num_q = std::min(kQueryTile, q_len - first);
        const int64_t pos_first = lens[s] - q_len + first;
        attend(g, qp, kp, vp, tp, s, kv_head, start + first, num_q, pos_first, op, buf);
      }
    });
  });
  return out;
}

}  // namespace

namespace {

// key, value [T, Hkv, D] -> their slots in k_cache, v_cache [N, B, Hkv, D] (same dtype, unit stride
// on D); slot_mapping [T] int64, a negative slot is padding and skipped. One op with no decision
// taken on the host, so a recorded decode step (services/worker/cuda_graphs.py) replays it whatever
// the slots; and a row copy per head instead of the reference's masked index_put.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4, "key, value [T, Hkv, D]");
  TORCH_CHECK(key.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(), "key, value and the caches must share a dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must share shape and strides");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "key's heads and dims are the cache's");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1, "unit stride on the head dimension");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0), "slot_mapping [T] int64, contiguous");
  const int64_t T = key.size(0), H = key.size(1), B = k_cache.size(1);
  const int64_t slots_total = k_cache.size(0) * B;
  const int64_t bytes = key.size(2) * key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  const int64_t es = key.element_size();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots_total, "token ", t, " has slot ", slot, ", outside the pool of ", slots_total);
    const int64_t dst = (slot / B) * k_cache.stride(0) + (slot % B) * k_cache.stride(1);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = (dst + h * k_cache.stride(2)) * es;
      std::memcpy(kc + off, kp + (t * key.stride(0) + h * key.stride(1)) * es, bytes);
      std::memcpy(vc + off, vp + (t * value.stride(0) + h * value.stride(1)) * es, bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, &write_kv_cache);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
