// The decode step's own CPU kernels (torch.ops.rayrl.*, schemas in decode_kernels.py, which builds this
// file with -mavx2 -mfma only where the CPU has them; the step keeps torch's ops where it cannot build).
//
// decode_attention: attention for few query rows. Why: in a decode step every row has a handful of query vectors per KV head (the GQA group) against
// its own L cached keys. torch's SDPA CPU kernel spends most of that call in MKL's small-matrix GEMM
// path set up for two tiny matrices per (row, KV head); here each (row, KV head) is one task that reads
// its keys and values once, for all the group's queries, with AVX2 FMAs. Shapes: query [n, H, G, D], key and value [n, H, L, D] (any strides, the last dimension contiguous),
// mask broadcastable to [n, H, G, L] (float, added to the scaled scores: 0 or -inf) or none.
// Returns [n, H, G, D], contiguous. A query whose every column is masked gets zeros.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int kGroupBlock = 4;  // queries whose value sums are accumulated together (8 accumulators)

// e^x; x below -87 (a masked column's -inf) gives exactly 0, x above 88 gives e^88. Range reduction
// x = k ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial for e^r (relative error about 2e-7), scaled
// by 2^k through the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);  // also true for -inf, false for NaN
  x = _mm256_min_ps(_mm256_max_ps(x, lowest), _mm256_set1_ps(88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact k * hi
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The four sums of a, b, c, d in one vector (lane i: the sum of the i-th argument).
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b);
  const __m256 cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline float dot(const float* a, const float* b, int64_t dim) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  float sum = hsum(acc);
  for (; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

struct Strides {  // in elements
  int64_t query;   // between the group's queries
  int64_t column;  // between a key's (value's) columns
  int64_t mask_query;
  int64_t mask_column;
};

// out[g] <- norm[g] * sum_j p[g * len + j] * v[j] for GN queries; the accumulators stay in registers
// (GN is a compile-time count), 16 columns (one cache line of a value row) at a time.
template <int GN>
void weighted_values(const float* p, const float* v, const float* norm, float* out, int64_t len, int64_t dim,
                     int64_t column) {
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    __m256 lo[GN], hi[GN];
    for (int g = 0; g < GN; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const float* vj = v + j * column + d;
      const __m256 x0 = _mm256_loadu_ps(vj), x1 = _mm256_loadu_ps(vj + 8);
      for (int g = 0; g < GN; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + g * len + j);
        lo[g] = _mm256_fmadd_ps(w, x0, lo[g]);
        hi[g] = _mm256_fmadd_ps(w, x1, hi[g]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      const __m256 s = _mm256_set1_ps(norm[g]);
      _mm256_storeu_ps(out + g * dim + d, _mm256_mul_ps(lo[g], s));
      _mm256_storeu_ps(out + g * dim + d + 8, _mm256_mul_ps(hi[g], s));
    }
  }
  for (; d < dim; ++d) {
    for (int g = 0; g < GN; ++g) {
      float sum = 0.0f;
      for (int64_t j = 0; j < len; ++j) sum += p[g * len + j] * v[j * column + d];
      out[g * dim + d] = sum * norm[g];
    }
  }
}

// One (row, KV head): scores[g * len + l] <- softmax weights (unnormalised), out[g] <- the weighted sum
// of values, normalised. ``mask`` is null or this (row, head)'s first element.
void attend_one(const float* q, const float* k, const float* v, const float* mask, float* out, float* scores,
                int64_t group, int64_t len, int64_t dim, float scale, const Strides& st) {
  // scores: four keys at a time for every query, so a block of keys is read from memory once
  int64_t l = 0;
  const int64_t vec_dim = dim - dim % 8;
  for (; l + 4 <= len; l += 4) {
    const float* k0 = k + l * st.column;
    const float* k1 = k0 + st.column;
    const float* k2 = k1 + st.column;
    const float* k3 = k2 + st.column;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * st.query;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t d = 0; d < vec_dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(qg + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + d), a3);
      }
      alignas(16) float s[4];
      _mm_store_ps(s, hsum4(a0, a1, a2, a3));
      for (int64_t d = vec_dim; d < dim; ++d) {
        s[0] += qg[d] * k0[d];
        s[1] += qg[d] * k1[d];
        s[2] += qg[d] * k2[d];
        s[3] += qg[d] * k3[d];
      }
      for (int j = 0; j < 4; ++j) scores[g * len + l + j] = s[j] * scale;
    }
  }
  for (; l < len; ++l) {
    for (int64_t g = 0; g < group; ++g) scores[g * len + l] = dot(q + g * st.query, k + l * st.column, dim) * scale;
  }
  // softmax over each query's columns, the mask added first; 1 / sum applied to the output
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    const float* m = mask == nullptr ? nullptr : mask + g * st.mask_query;
    __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
      __m256 x = _mm256_loadu_ps(s + j);
      if (m != nullptr) {
        x = _mm256_add_ps(x, st.mask_column == 1 ? _mm256_loadu_ps(m + j)
                                                 : _mm256_set_ps(m[(j + 7) * st.mask_column], m[(j + 6) * st.mask_column],
                                                                 m[(j + 5) * st.mask_column], m[(j + 4) * st.mask_column],
                                                                 m[(j + 3) * st.mask_column], m[(j + 2) * st.mask_column],
                                                                 m[(j + 1) * st.mask_column], m[j * st.mask_column]));
        _mm256_storeu_ps(s + j, x);
      }
      top8 = _mm256_max_ps(top8, x);
    }
    alignas(32) float tops[8];
    _mm256_store_ps(tops, top8);
    float top = *std::max_element(tops, tops + 8);
    for (; j < len; ++j) {
      if (m != nullptr) s[j] += m[j * st.mask_column];
      top = std::max(top, s[j]);
    }
    if (top == -std::numeric_limits<float>::infinity()) {  // nothing to attend: zeros
      std::fill(s, s + len, 0.0f);
      inv_sum[g] = 0.0f;
      continue;
    }
    top8 = _mm256_set1_ps(top);
    __m256 acc = _mm256_setzero_ps();
    for (j = 0; j + 8 <= len; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), top8));
      _mm256_storeu_ps(s + j, e);
      acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    for (; j < len; ++j) {
      s[j] = std::exp(s[j] - top);
      sum += s[j];
    }
    inv_sum[g] = 1.0f / sum;
  }
  // values: 16 columns (a cache line) of up to four queries at a time, each value row read once per block
  for (int64_t g0 = 0; g0 < group; g0 += kGroupBlock) {
    const int64_t gn = std::min<int64_t>(kGroupBlock, group - g0);
    const float* p = scores + g0 * len;
    float* o = out + g0 * dim;
    const float* norm = inv_sum.data() + g0;
    switch (gn) {
      case 1: weighted_values<1>(p, v, norm, o, len, dim, st.column); break;
      case 2: weighted_values<2>(p, v, norm, o, len, dim, st.column); break;
      case 3: weighted_values<3>(p, v, norm, o, len, dim, st.column); break;
      default: weighted_values<4>(p, v, norm, o, len, dim, st.column); break;
    }
  }
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "decode_attention: 4-d query, key, value");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat, "decode_attention: float32 only");
  const int64_t n = query.size(0), heads = query.size(1), group = query.size(2), dim = query.size(3);
  const int64_t len = key.size(2);
  TORCH_CHECK(key.size(0) == n && key.size(1) == heads && key.size(3) == dim && value.sizes() == key.sizes(),
              "decode_attention: key/value [n, heads, len, dim] to match query [n, heads, group, dim]");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "decode_attention: the last dimension must be contiguous");
  TORCH_CHECK(key.stride(2) == value.stride(2), "decode_attention: key and value with the same column stride");
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kFloat, "decode_attention: an additive float32 mask");
    m = mask->expand({n, heads, group, len});
  }
  at::Tensor out = at::empty({n, heads, group, dim}, query.options());
  const float* qp = query.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const float* mp = m.defined() ? m.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const Strides st{query.stride(2), key.stride(2), m.defined() ? m.stride(2) : 0, m.defined() ? m.stride(3) : 0};
  const float s = static_cast<float>(scale);
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * len);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / heads, h = t % heads;
      const float* mt = mp == nullptr ? nullptr : mp + b * m.stride(0) + h * m.stride(1);
      attend_one(qp + b * query.stride(0) + h * query.stride(1), kp + b * key.stride(0) + h * key.stride(1),
                 vp + b * value.stride(0) + h * value.stride(1), mt, op + t * group * dim, scores.data(), group,
                 len, dim, s, st);
    }
  });
  return out;
}

// rope_cache: RoPE on a step's query and key heads, and the key/value column written to the cache, in one
// pass. Why: in torch ops this is a multiply, a roll, an addcmul and a strided copy per layer, a few
// microseconds each, over a few kilobytes. qkv [n, heads + 2 * kv_heads, dim] (the fused projection's
// output; its last two dimensions contiguous): the query heads are rotated in place; the rotated keys and
// the values go to new_col [2, n, kv_heads, dim] (any strides, the last dimension contiguous), not back to
// qkv. cos, sin [n, dim] contiguous, sin sign-folded: x' = x * cos + roll(x, dim / 2) * sin.
inline void rotate(const float* x, float* out, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t d = 0;
  for (; d + 8 <= half; d += 8) {
    const __m256 a = _mm256_loadu_ps(x + d), b = _mm256_loadu_ps(x + d + half);
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(b, _mm256_loadu_ps(sin + d), _mm256_mul_ps(a, _mm256_loadu_ps(cos + d))));
    _mm256_storeu_ps(out + d + half, _mm256_fmadd_ps(a, _mm256_loadu_ps(sin + d + half),
                                                     _mm256_mul_ps(b, _mm256_loadu_ps(cos + d + half))));
  }
  for (; d < half; ++d) {
    const float a = x[d], b = x[d + half];
    out[d] = a * cos[d] + b * sin[d];
    out[d + half] = b * cos[d + half] + a * sin[d + half];
  }
}

void rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& new_col,
                int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2), "rope_cache: qkv [n, heads, dim]");
  const int64_t n = qkv.size(0), dim = qkv.size(2), kv_heads = (qkv.size(1) - heads) / 2;
  TORCH_CHECK(dim % 2 == 0 && heads + 2 * kv_heads == qkv.size(1), "rope_cache: heads + 2 kv_heads heads of even size");
  TORCH_CHECK(new_col.dim() == 4 && new_col.size(0) == 2 && new_col.size(1) == n && new_col.size(2) == kv_heads &&
                  new_col.size(3) == dim && new_col.stride(3) == 1, "rope_cache: new_col [2, n, kv_heads, dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * dim && sin.numel() == n * dim,
              "rope_cache: cos, sin [n, dim] contiguous");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && new_col.scalar_type() == at::kFloat &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rope_cache: float32 only");
  float* x = qkv.data_ptr<float>();
  float* col = new_col.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  for (int64_t b = 0; b < n; ++b) {
    float* row = x + b * qkv.stride(0);
    const float* cb = c + b * dim;
    const float* sb = s + b * dim;
    for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, row + h * dim, cb, sb, dim);
    for (int64_t h = 0; h < kv_heads; ++h) {
      float* key = col + b * new_col.stride(1) + h * new_col.stride(2);
      rotate(row + (heads + h) * dim, key, cb, sb, dim);
      std::copy_n(row + (heads + kv_heads + h) * dim, dim, key + new_col.stride(0));
    }
  }
}

// silu_mul: silu(gate) * up from the fused gate/up projection's output gate_up [n, 2 * inter] (rows
// contiguous), as a new [n, inter]: one pass instead of silu, a multiply and two narrowed views.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0 &&
                  gate_up.scalar_type() == at::kFloat, "silu_mul: float32 gate_up [n, 2 * inter], rows contiguous");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({n, inter}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t b = 0; b < n; ++b) {
    const float* g = in + b * gate_up.stride(0);
    const float* u = g + inter;
    float* ob = o + b * inter;
    int64_t d = 0;
    for (; d + 8 <= inter; d += 8) {
      const __m256 x = _mm256_loadu_ps(g + d);
      const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
      _mm256_storeu_ps(ob + d, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + d)));
    }
    for (; d < inter; ++d) ob[d] = g[d] / (1.0f + std::exp(-g[d])) * u[d];
  }
  return out;
}

// add_rms_norm: x += y in place, then returns rms_norm(x) * weight as a new tensor: the residual add and
// the next norm in one pass over the row. x, y [n, hidden] with rows contiguous; weight [hidden].
at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == y.sizes() && x.stride(1) == 1 && y.stride(1) == 1 &&
                  weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: x, y [n, hidden], weight [hidden]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "add_rms_norm: float32 only");
  const int64_t n = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty({n, hidden}, x.options());
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < n; ++b) {
    float* xb = xp + b * x.stride(0);
    const float* yb = yp + b * y.stride(0);
    float* ob = o + b * hidden;
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= hidden; d += 8) {
      const __m256 v = _mm256_add_ps(_mm256_loadu_ps(xb + d), _mm256_loadu_ps(yb + d));
      _mm256_storeu_ps(xb + d, v);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum(acc);
    for (; d < hidden; ++d) {
      xb[d] += yb[d];
      sum += xb[d] * xb[d];
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (d = 0; d + 8 <= hidden; d += 8) {
      _mm256_storeu_ps(ob + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + d), inv8), _mm256_loadu_ps(w + d)));
    }
    for (; d < hidden; ++d) ob[d] = xb[d] * inv * w[d];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rayrl, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rope_cache", &rope_cache);
  m.impl("silu_mul", &silu_mul);
  m.impl("add_rms_norm", &add_rms_norm);
}
