// The decoder stack for one decode step on CPU in f32, in one call: per layer two
// RMSNorms, RoPE, the KV-cache write, grouped-query attention over the cache, SwiGLU and
// the residual adds are plain loops here; the four matrix products go to libtorch's
// oneDNN prepacked linear. A decode step at batch 16 is otherwise ~2,000 small tch
// operations whose dispatch costs more than their arithmetic.
//
// Hot loops are compiled for AVX-512, AVX2 and baseline x86-64 (GCC target_clones picks
// one at load time); threads come from libtorch's OpenMP pool (at::parallel_for), so
// nothing is oversubscribed. Errors are returned as messages, never thrown across FFI.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "shim.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define YATT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define YATT_CLONES
#endif

namespace {

using yatt::set_err;

// exp for the softmax and SiLU, in a form compilers vectorize (Cephes' expf: Cody-Waite
// reduction and a degree-5 polynomial; relative error < 2e-7 on [-87, 88]). Rounding to
// the nearest integer adds and subtracts 1.5·2^23 (no floorf call); clamps are ternaries
// (std::fmin/fmax are library calls that block vectorization).
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  int32_t ni;
  std::memcpy(&ni, &shifted, sizeof ni);
  ni -= 0x4B400000;  // the bits of 1.5·2^23: what remains is n as an integer
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// x += y (when y is given), then out = x * rsqrt(mean(x²) + eps) * w, row by row.
YATT_CLONES void add_rms_rows(float* x, const float* y, const float* w, float* out,
                              int64_t r0, int64_t r1, int64_t h, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    float* xr = x + r * h;
    if (y) {
      const float* yr = y + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) xr[i] += yr[i];
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    float* o = out + r * h;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) o[i] = xr[i] * inv * w[i];
  }
}

// The cache is paged: blocks of KB positions, keys transposed within a block
// [block, kv, hd, KB], values [block, kv, KB, hd]; row r's position p lives in block
// table[r * tb + p / KB] (see KvCache in kv_cache.rs).
constexpr int64_t KB = 16;

// RoPE on the q and k heads of each row of the fused qkv output (in place), and the new
// k (rotated) and v written into the caches at the row's position. With qn/kn (Qwen3),
// each q and k head is first RMS-normed over its hd values.
YATT_CLONES void rope_store_rows(float* qkv, int64_t stride, const int64_t* pos,
                                 const int64_t* table, int64_t tb, const float* cos_t,
                                 const float* sin_t, float* kb, float* vc, int64_t r0,
                                 int64_t r1, int64_t nh, int64_t nkv, int64_t hd,
                                 const float* qn, const float* kn, float eps) {
  const int64_t half = hd / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t p = pos[r];
    const float* c = cos_t + p * half;
    const float* s = sin_t + p * half;
    float* row = qkv + r * stride;
    for (int64_t h = 0; h < nh + nkv; ++h) {
      float* x = row + h * hd;
      const float* nw = h < nh ? qn : kn;
      if (nw) {
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < hd; ++i) ss += x[i] * x[i];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hd) + eps);
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) x[i] = x[i] * inv * nw[i];
      }
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
    const int64_t blk = table[r * tb + p / KB];
    for (int64_t g = 0; g < nkv; ++g) {
      const float* k = row + (nh + g) * hd;
      const float* v = row + (nh + nkv + g) * hd;
      float* kcol = kb + ((blk * nkv + g) * hd) * KB + p % KB;
      for (int64_t d = 0; d < hd; ++d) kcol[d * KB] = k[d];
      std::memcpy(vc + ((blk * nkv + g) * KB + p % KB) * hd, v, hd * sizeof(float));
    }
  }
}

// Softmax over s[0..n) in place; returns 1 / sum (the caller folds it into the weights).
// Always inlined, so it is compiled for the calling clone's instruction set.
inline __attribute__((always_inline)) float softmax_unnormalized(float* s, int64_t n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp_approx(s[j] - m);
    sum += s[j];
  }
  return 1.0f / sum;
}

// Attention of the `REP` query heads q [REP, HD] sharing kv head g over positions 0..n,
// read through the row's block table `tr`: key block b at kb + (tr[b]·nkv + g)·HD·KB
// (transposed, see KB), its values at vc + (tr[b]·nkv + g)·KB·HD. Rows sharing a prompt
// hold the same blocks, so they read one copy of it (it stays in cache between them).
// With the sizes known at compile time the accumulators stay in registers and each key
// block and value row is read once for all REP heads. `sc` holds REP × span floats.
// Positions below `lo` are outside a sliding window: never scored nor summed.
template <int REP, int HD>
inline __attribute__((always_inline)) void attend_group(const float* q, const float* kb,
                                                         const float* vc, const int64_t* tr,
                                                         int64_t nkv, int64_t g, int64_t lo,
                                                         int64_t n, float scale, float* sc,
                                                         int64_t span, float* out) {
  const int64_t nb = (n + KB - 1) / KB;
  for (int64_t b = lo / KB; b < nb; ++b) {
    const float* Kb = kb + (tr[b] * nkv + g) * HD * KB;
    float acc[REP][KB] = {};
    for (int d = 0; d < HD; ++d) {
      for (int h = 0; h < REP; ++h) {
        const float qd = q[h * HD + d];
#pragma omp simd
        for (int l = 0; l < KB; ++l) acc[h][l] += qd * Kb[d * KB + l];
      }
    }
    for (int h = 0; h < REP; ++h) {
#pragma omp simd
      for (int l = 0; l < KB; ++l) sc[h * span + b * KB + l] = acc[h][l] * scale;
    }
  }
  float inv[REP];
  for (int h = 0; h < REP; ++h) inv[h] = softmax_unnormalized(sc + h * span + lo, n - lo);
  float o[REP][HD] = {};
  for (int64_t j = lo; j < n; ++j) {
    const float* vj = vc + ((tr[j / KB] * nkv + g) * KB + j % KB) * HD;
    for (int h = 0; h < REP; ++h) {
      const float pj = sc[h * span + j];
#pragma omp simd
      for (int d = 0; d < HD; ++d) o[h][d] += pj * vj[d];
    }
  }
  for (int h = 0; h < REP; ++h) {
#pragma omp simd
    for (int d = 0; d < HD; ++d) out[h * HD + d] = o[h][d] * inv[h];
  }
}

// The same for any head layout, accumulating in memory.
inline void attend_group_any(const float* q, const float* kb, const float* vc,
                             const int64_t* tr, int64_t nkv, int64_t g, int64_t lo, int64_t n,
                             int64_t rep, int64_t hd, float scale, float* sc, int64_t span,
                             float* out) {
  const int64_t nb = (n + KB - 1) / KB;
  for (int64_t h = 0; h < rep; ++h) {
    const float* qv = q + h * hd;
    float* s = sc + h * span;
    for (int64_t b = lo / KB; b < nb; ++b) {
      const float* Kb = kb + (tr[b] * nkv + g) * hd * KB;
      float acc[KB] = {};
      for (int64_t d = 0; d < hd; ++d) {
        const float qd = qv[d];
#pragma omp simd
        for (int64_t l = 0; l < KB; ++l) acc[l] += qd * Kb[d * KB + l];
      }
#pragma omp simd
      for (int64_t l = 0; l < KB; ++l) s[b * KB + l] = acc[l] * scale;
    }
    const float inv = softmax_unnormalized(s + lo, n - lo);
    float* o = out + h * hd;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
    for (int64_t j = lo; j < n; ++j) {
      const float pj = s[j] * inv;
      const float* vj = vc + ((tr[j / KB] * nkv + g) * KB + j % KB) * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) o[d] += pj * vj[d];
    }
  }
}

// Attention of one new token per row over cache positions 0..=pos[row] (the last
// `window` of them when window > 0), through the rows' block tables [B, tb]. Task t is
// (row t / nkv, kv head t % nkv) with its `rep` query heads. `sc` holds rep × (tb·KB)
// floats.
YATT_CLONES void attend_tasks(const float* qkv, int64_t stride, const int64_t* pos,
                              const int64_t* table, int64_t tb, const float* kb,
                              const float* vc, float* out, int64_t t0, int64_t t1, int64_t nh,
                              int64_t nkv, int64_t hd, int64_t window, float* sc) {
  const int64_t rep = nh / nkv;
  const int64_t span = tb * KB;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r = t / nkv, g = t % nkv;
    const int64_t n = pos[r] + 1;
    const int64_t lo = window > 0 && n > window ? n - window : 0;
    const int64_t* tr = table + r * tb;
    const float* q = qkv + r * stride + g * rep * hd;
    float* o = out + r * nh * hd + g * rep * hd;
#define YATT_GROUP(R, H)                                                     \
  if (rep == R && hd == H) {                                                 \
    attend_group<R, H>(q, kb, vc, tr, nkv, g, lo, n, scale, sc, span, o);   \
    continue;                                                                \
  }
    YATT_GROUP(1, 64) YATT_GROUP(2, 64) YATT_GROUP(3, 64) YATT_GROUP(4, 64)
    YATT_GROUP(6, 64) YATT_GROUP(7, 64) YATT_GROUP(8, 64)
    YATT_GROUP(1, 128) YATT_GROUP(2, 128) YATT_GROUP(3, 128) YATT_GROUP(4, 128)
    YATT_GROUP(6, 128) YATT_GROUP(7, 128) YATT_GROUP(8, 128)
#undef YATT_GROUP
    attend_group_any(q, kb, vc, tr, nkv, g, lo, n, rep, hd, scale, sc, span, o);
  }
}

// out = silu(gate) * up for rows of the fused gate/up output [rows, 2·f].
YATT_CLONES void swiglu_rows(const float* gu, float* out, int64_t r0, int64_t r1,
                             int64_t f) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * f;
    const float* u = g + f;
    float* o = out + r * f;
#pragma omp simd
    for (int64_t i = 0; i < f; ++i) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
  }
}

// One row of sampling: the scaled logits x = logits / T go through the row twice, first
// for their maximum and the k largest (a min-heap; chunks of 16 below its threshold are
// skipped after one vector compare), then for sum(exp(x - max)). The draw happens over the
// k candidates, sorted: top-p filter, then inverse CDF with the row's uniform.
YATT_CLONES void sample_row(const float* logits, int64_t V, float temp, int64_t k, float top_p,
                            float u, float* x, std::pair<float, int64_t>* heap,
                            int64_t* tok_out, float* lp_out) {
  const bool greedy = temp <= 0.f;
  const float T = greedy ? 1.0f : temp;
  if (greedy) k = 1;
  k = k < 1 ? 1 : (k > V ? V : k);
  // Min-heap on value (ties: the larger index is "smaller", so lower indices win, like a
  // stable sort).
  auto less = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  int64_t filled = 0;
  float thr = -INFINITY;
  float mx = -INFINITY;
  constexpr int64_t C = 16;
  for (int64_t i0 = 0; i0 < V; i0 += C) {
    const int64_t m = V - i0 < C ? V - i0 : C;
    float cm = -INFINITY;
#pragma omp simd reduction(max : cm)
    for (int64_t j = 0; j < m; ++j) {
      const float v = logits[i0 + j] / T;
      x[i0 + j] = v;
      cm = v > cm ? v : cm;
    }
    mx = cm > mx ? cm : mx;
    if (filled == k && !(cm > thr)) continue;
    for (int64_t j = 0; j < m; ++j) {
      const float v = x[i0 + j];
      if (filled < k) {
        heap[filled++] = {v, i0 + j};
        std::push_heap(heap, heap + filled, less);
        if (filled == k) thr = heap[0].first;
      } else if (v > thr) {
        std::pop_heap(heap, heap + k, less);
        heap[k - 1] = {v, i0 + j};
        std::push_heap(heap, heap + k, less);
        thr = heap[0].first;
      }
    }
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < V; ++i) sum += exp_approx(x[i] - mx);
  const float lse = mx + std::log(sum);
  std::sort_heap(heap, heap + k, less);  // descending by value
  int64_t choice = 0;
  if (!greedy && k > 1) {
    // Probabilities over the candidates (top-p removes those whose preceding mass already
    // exceeds p), then the first candidate whose cumulative mass reaches u · total.
    double total = 0.0;
    int64_t kept = k;
    std::vector<double> p(k);
    double before = 0.0, all = 0.0;
    for (int64_t i = 0; i < k; ++i) all += std::exp(static_cast<double>(heap[i].first - heap[0].first));
    for (int64_t i = 0; i < k; ++i) {
      p[i] = std::exp(static_cast<double>(heap[i].first - heap[0].first)) / all;
      if (top_p < 1.0f && before > top_p) {
        kept = i;
        break;
      }
      before += p[i];
    }
    for (int64_t i = 0; i < kept; ++i) total += p[i];
    const double target = static_cast<double>(u) * total;
    double cum = 0.0;
    choice = kept - 1;
    for (int64_t i = 0; i < kept; ++i) {
      cum += p[i];
      if (!(cum < target)) {
        choice = i;
        break;
      }
    }
  }
  *tok_out = heap[choice].second;
  *lp_out = heap[choice].first - lse;
}

const at::Tensor& T(void* p) { return *static_cast<at::Tensor*>(p); }

// Up to this many rows, the norms and RoPE run on one thread: they take a few
// microseconds, less than waking the other threads.
constexpr int64_t kSerialRows = 128;

void check_f32(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous(),
              what, " must be a contiguous f32 CPU tensor");
}

}  // namespace

extern "C" {

// Runs the decoder layers for one new token per row 0..B.
//   x      [B, hidden] embeddings (read, not modified)
//   pos    [B] int64 positions (the position the new token is written to)
//   table  [B, tb] int64 block tables: row r's position p lives in block
//     table[r][p / KB]; the block of the written position must be the row's own
//   cos/sin [max_pos, hd/2] RoPE tables
//   per layer i: ln1[i], wqkv[i] (packed), bqkv[i] (may be null), wo[i] (packed),
//     ln2[i], wgu[i] (packed), wdown[i] (packed), kb[i] [blocks, kv, hd, 16]
//     (keys, transposed), vc[i] [blocks, kv, 16, hd], qn[i]/kn[i] [hd] per-head q/k RMSNorm
//     weights (both null: none), window[i] the sliding window (0: none)
// Returns the residual stream after the last layer, [B, hidden] (before the final norm).
void* yatt_decode_layers(void* x_in, void* pos_in, void* table_in, void* cos_in, void* sin_in, int64_t n_layers,
                         void** ln1, void** wqkv, void** bqkv, void** wo, void** ln2,
                         void** wgu, void** wdown, void** kb, void** vc, void** qn,
                         void** kn, const int64_t* window, int64_t nh,
                         int64_t nkv, int64_t hd, double eps, char* err, size_t errlen) {
  try {
    const at::Tensor& x0 = T(x_in);
    const at::Tensor& pos = T(pos_in);
    const at::Tensor& cos_t = T(cos_in);
    const at::Tensor& sin_t = T(sin_in);
    check_f32(x0, "x");
    check_f32(cos_t, "cos");
    check_f32(sin_t, "sin");
    TORCH_CHECK(x0.dim() == 2, "x must be [B, hidden]");
    TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() &&
                    pos.numel() == x0.size(0),
                "pos must be B contiguous int64");
    TORCH_CHECK(nkv > 0 && nh % nkv == 0 && hd % 2 == 0, "bad head layout");
    const int64_t B = x0.size(0), H = x0.size(1);
    const int64_t qkv_w = (nh + 2 * nkv) * hd;
    const int64_t* p = pos.data_ptr<int64_t>();
    const at::Tensor& tab = T(table_in);
    TORCH_CHECK(tab.scalar_type() == at::kLong && tab.is_contiguous() && tab.dim() == 2 &&
                    tab.size(0) == B && tab.device().is_cpu(),
                "table must be [B, blocks] contiguous int64 on the CPU");
    const int64_t tb = tab.size(1);
    const int64_t* table = tab.data_ptr<int64_t>();
    const int64_t max_pos = cos_t.size(0);
    for (int64_t r = 0; r < B; ++r) {
      TORCH_CHECK(p[r] >= 0 && p[r] < max_pos, "position ", p[r], " outside the RoPE table");
      TORCH_CHECK(p[r] / KB < tb, "position ", p[r], " beyond row ", r, "'s block table");
    }
    at::Tensor x = x0.clone();
    at::Tensor hn = at::empty({B, H}, x0.options());
    at::Tensor att = at::empty({B, nh * hd}, x0.options());
    float* xp = x.data_ptr<float>();
    float* hp = hn.data_ptr<float>();
    const float eps_f = static_cast<float>(eps);
    const at::Tensor* pending = nullptr;  // residual to add before the next norm
    at::Tensor last;
    auto norm = [&](const at::Tensor& w, const float* y) {
      check_f32(w, "norm weight");
      const float* wp = w.data_ptr<float>();
      at::parallel_for(0, B, kSerialRows, [&](int64_t a, int64_t b) {
        add_rms_rows(xp, y, wp, hp, a, b, H, eps_f);
      });
    };
    for (int64_t li = 0; li < n_layers; ++li) {
      const at::Tensor& kbi = T(kb[li]);
      const at::Tensor& vci = T(vc[li]);
      check_f32(kbi, "K cache");
      check_f32(vci, "V cache");
      TORCH_CHECK(kbi.dim() == 4 && kbi.size(1) == nkv && kbi.size(2) == hd &&
                      kbi.size(3) == KB && vci.dim() == 4 && vci.size(0) == kbi.size(0) &&
                      vci.size(1) == nkv && vci.size(2) == KB && vci.size(3) == hd,
                  "cache shapes do not match the model");
      if (li == 0) {
        const int64_t blocks = kbi.size(0);
        for (int64_t r = 0; r < B; ++r) {
          for (int64_t b = 0; b <= p[r] / KB; ++b) {
            const int64_t id = table[r * tb + b];
            TORCH_CHECK(id >= 0 && id < blocks, "block ", id, " of row ", r,
                        " is outside the cache (", blocks, " blocks)");
          }
        }
      }
      norm(T(ln1[li]), pending ? last.data_ptr<float>() : nullptr);
      at::Tensor qkv = yatt::packed_linear(hn, T(wqkv[li]), bqkv[li] ? &T(bqkv[li]) : nullptr);
      TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == qkv_w, "qkv projection shape");
      float* qp = qkv.data_ptr<float>();
      float* kbp = kbi.data_ptr<float>();
      float* vcp = vci.data_ptr<float>();
      const float* cp = cos_t.data_ptr<float>();
      const float* sp = sin_t.data_ptr<float>();
      const float* qnp = nullptr;
      const float* knp = nullptr;
      if (qn[li]) {
        check_f32(T(qn[li]), "q norm");
        check_f32(T(kn[li]), "k norm");
        TORCH_CHECK(T(qn[li]).numel() == hd && T(kn[li]).numel() == hd, "q/k norm width");
        qnp = T(qn[li]).data_ptr<float>();
        knp = T(kn[li]).data_ptr<float>();
      }
      at::parallel_for(0, B, kSerialRows, [&](int64_t a, int64_t b) {
        rope_store_rows(qp, qkv_w, p, table, tb, cp, sp, kbp, vcp, a, b, nh, nkv, hd, qnp, knp,
                        eps_f);
      });
      float* ap = att.data_ptr<float>();
      at::parallel_for(0, B * nkv, 1, [&](int64_t a, int64_t b) {
        std::vector<float> sc((nh / nkv) * tb * KB);
        attend_tasks(qp, qkv_w, p, table, tb, kbp, vcp, ap, a, b, nh, nkv, hd, window[li],
                     sc.data());
      });
      at::Tensor o = yatt::packed_linear(att, T(wo[li]), nullptr);
      norm(T(ln2[li]), o.data_ptr<float>());
      at::Tensor gu = yatt::packed_linear(hn, T(wgu[li]), nullptr);
      const int64_t f = gu.size(1) / 2;
      at::Tensor act = at::empty({B, f}, x0.options());
      const float* gp = gu.data_ptr<float>();
      float* actp = act.data_ptr<float>();
      at::parallel_for(0, B, 32, [&](int64_t a, int64_t b) { swiglu_rows(gp, actp, a, b, f); });
      last = yatt::packed_linear(act, T(wdown[li]), nullptr);
      pending = &last;
    }
    if (pending) x.add_(last);
    return new at::Tensor(std::move(x));
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
    return nullptr;
  }
}

// Samples one token per row of logits [n, V] (f32, contiguous): per-row temperature
// (<= 0: greedy), top-k (1..V), top-p and uniform. Writes the tokens and their log-probs
// under log_softmax(logits / T). Returns 0, or -1 with a message.
int yatt_sample_topk(void* logits_in, const float* temp, const int64_t* top_k,
                     const float* top_p, const float* uniform, int64_t* tok_out, float* lp_out,
                     char* err, size_t errlen) {
  try {
    const at::Tensor& logits = T(logits_in);
    check_f32(logits, "logits");
    TORCH_CHECK(logits.dim() == 2, "logits must be [n, vocab]");
    const int64_t n = logits.size(0), V = logits.size(1);
    const float* lp = logits.data_ptr<float>();
    int64_t kmax = 1;
    for (int64_t r = 0; r < n; ++r) kmax = std::max(kmax, std::min(top_k[r], V));
    at::parallel_for(0, n, 1, [&](int64_t a, int64_t b) {
      std::vector<float> x(V);
      std::vector<std::pair<float, int64_t>> heap(kmax);
      for (int64_t r = a; r < b; ++r) {
        sample_row(lp + r * V, V, temp[r], top_k[r], top_p[r], uniform[r], x.data(),
                   heap.data(), tok_out + r, lp_out + r);
      }
    });
    return 0;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
    return -1;
  }
}
}
