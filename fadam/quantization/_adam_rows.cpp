// The quantized Adam step on the CPU, one pass over memory per block: decode a block's codes, update its moments and
// param, find the block's new absmax and encode the moments for it. Built on first use by fadam/quantization/_native.py
// (torch.utils.cpp_extension, this file only) and called through ctypes with the pointers of contiguous tensors.
//
// The arithmetic is the chain's, operation by operation and in float32, so that results equal the eager kernels in
// _fused.py bit for bit: ATen's vectorized CPU lerp, addcmul and add-with-alpha are each one fused multiply-add
// (where the CPU has FMA), the square root is torch's own, and everything else rounds once per operation (built with
// -ffp-contract=off). The loops are written for the compiler's vectorizer (noinline, noclone: a clone with a
// constant argument lost it): selections are bit masks, not branches, the absmax is an integer maximum over bit
// patterns and the encoder an integer comparison with them (non-negative floats order as their bits do); all keep
// IEEE results.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// A map's encoder for |y| in [0, 1] (fadam/quantization/_native.py: _encoder): one entry per bfloat16 bit pattern
// of |y| (the top 16 bits of its float32) from `base` up to that of 1.0. An entry holds the number of the map's
// positive midpoints below the pattern's smallest float (bits 17 and up) and the distance in bits from that float to
// the next midpoint if the pattern holds one, else 0x10000 (no pattern holds two). Non-negative floats order as their
// bits do, so one table read and one integer comparison give the nearest code.
struct Grid {
  const int32_t* buckets;
  int32_t base;  // bucket 0: every pattern at or below it, and one with no midpoint
  int32_t zero;  // code of 0 (signed maps) or of the smallest value
};

struct Args {
  void* p;  // params, gradients and updates: float32 or bfloat16 (param_dtype)
  const void* g;
  void* out;  // null: the new param goes into p; else the update goes into out and p is only read
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* v_codes;
  float* v_absmax;
  const float* m_map;  // the 256 values of the map each moment was stored with
  const float* v_map;
  Grid m_grid;  // the maps the moments are written with: signed for m, non-negative for v (v >= 0)
  Grid v_grid;
  int64_t rows;
  int64_t block;
  int32_t bits;
  int32_t param_dtype;  // 0: float32, 1: bfloat16
  int32_t maximize;
  int32_t coupled_decay;    // weight decay added to the gradient (Adam)
  int32_t decoupled_decay;  // weight decay applied to the param (AdamW)
  float b1_weight;  // 1 - b1, lerp's weight
  float b2;
  float one_minus_b2;
  float eps;
  float weight_decay;
  float lr;
  float bc1;
  float bc2_sqrt;
  float factor;  // decoupled decay factor 1 - lr * weight_decay
};

// torch's CPU sqrt: MKL's vsSqrt where torch was built with MKL (its last bit differs from the IEEE square root for
// about 1% of inputs), else the IEEE one. A weak reference: null where libtorch_cpu does not export it.
extern "C" void vsSqrt(int n, const float* a, float* r) __attribute__((weak));

void square_roots(const float* __restrict v, float* __restrict root, int64_t n) {
  if (vsSqrt != nullptr) {
    vsSqrt(static_cast<int>(n), v, root);
    return;
  }
  for (int64_t i = 0; i < n; ++i) root[i] = std::sqrt(v[i]);
}

inline float from_bits(int32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// A param dtype: how its values load as float32 and how a float32 result rounds to it (ATen computes reduced-precision
// ops in float32 and rounds each result).
struct Float32 {
  using Storage = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
  static float round(float x) { return x; }
};

struct BFloat16 {
  using Storage = uint16_t;
  static float load(uint16_t x) { return from_bits(static_cast<int32_t>(static_cast<uint32_t>(x) << 16)); }
  static uint16_t store(float x) {  // round to nearest even, as c10::BFloat16; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return x != x ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
  }
  static float round(float x) { return load(store(x)); }
};

inline float select(bool condition, float a, float b) {
  uint32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  const uint32_t mask = -static_cast<uint32_t>(condition);
  const uint32_t bits = (ia & mask) | (ib & ~mask);
  float result;
  std::memcpy(&result, &bits, 4);
  return result;
}

// ATen's vectorized fused multiply-add: one rounding where the CPU has FMA, two otherwise.
inline float multiply_add(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// torch.add(g, p, alpha) in p's dtype: with FMA, ATen's vectorized kernel rounds g + alpha * p once (then to p's
// dtype); without (ATEN_CPU_CAPABILITY=default), its scalar kernel also rounds alpha * p to p's dtype first.
template <typename P>
inline float add_scaled(float g, float p, float alpha) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return P::round(multiply_add(p, alpha, g));
#else
  return P::round(g + P::round(p * alpha));
#endif
}

inline int32_t finite_magnitude_bits(float x) {
  const float magnitude = std::fabs(x);
  const float kept = select(magnitude < INFINITY, magnitude, 0.0f);  // NaN compares false
  int32_t bits;
  std::memcpy(&bits, &kept, 4);
  return bits;
}

// y / scale as the codec computes it: NaN to 0, then clamped to [-1, 1].
inline float unit(float x, float scale) {
  float y = x / scale;
  y = select(y < -1.0f, -1.0f, y);
  y = select(y > 1.0f, 1.0f, y);
  return select(y != y, 0.0f, y);
}

template <bool kSigned>
inline int32_t encode(float y, const Grid& grid) {
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  const int32_t magnitude = bits & 0x7FFFFFFF;
  const int32_t negative = bits >> 31;  // 0 or -1
  int32_t bucket = (magnitude >> 16) - grid.base;
  bucket = bucket < 0 ? 0 : bucket;
  const int32_t entry = grid.buckets[bucket];
  const int32_t mid = (magnitude & 0x7FFF0000) + (entry & 0x1FFFF);
  const int32_t below = entry >> 17;
  if (!kSigned) return (below + static_cast<int32_t>(magnitude > mid)) & ~negative;  // no midpoint below 0
  // y < 0 counts the negative midpoints below y: the mirror image of the positive ones at or above |y|
  const int32_t offset = below + static_cast<int32_t>(magnitude - negative > mid);
  return grid.zero + ((offset ^ negative) - negative);
}

// New moments of one block into m_out, v_out, and the bit patterns of their absmax into m_max, v_max.
template <typename P, bool kMaximize, bool kCoupled>
__attribute__((noinline, noclone)) void moments_row(const Args& a, const typename P::Storage* __restrict p,
                                                    const typename P::Storage* __restrict g,
                                                    const int32_t* __restrict m_codes,
                                                    const int32_t* __restrict v_codes, float m_scale, float v_scale,
                                                    float* __restrict m_out, float* __restrict v_out, int32_t* m_max,
                                                    int32_t* v_max) {
  const float* __restrict m_map = a.m_map;
  const float* __restrict v_map = a.v_map;
  const float b2 = a.b2, one_minus_b2 = a.one_minus_b2, decay = P::round(a.weight_decay);  // alpha in p's dtype
  // ATen's lerp: start + w * (end - start) for |w| < 0.5, else end + (w - 1) * (end - start), one rounding each
  const bool small_weight = std::fabs(a.b1_weight) < 0.5f;
  const float coefficient = small_weight ? a.b1_weight : a.b1_weight - 1.0f;
  int32_t m_top = 0, v_top = 0;
  const int64_t n = a.block;
  for (int64_t i = 0; i < n; ++i) {
    const float m = m_map[m_codes[i]] * m_scale;
    const float v = v_map[v_codes[i]] * v_scale;
    float grad = kMaximize ? -P::load(g[i]) : P::load(g[i]);
    if (kCoupled) grad = add_scaled<P>(grad, P::load(p[i]), decay);  // torch.add(g, p, alpha=decay)
    const float m_new = multiply_add(coefficient, grad - m, select(small_weight, m, grad));
    const float v_new = multiply_add(one_minus_b2 * grad, grad, v * b2);  // addcmul(v * b2, g, g, value)
    m_out[i] = m_new;
    v_out[i] = v_new;
    const int32_t mb = finite_magnitude_bits(m_new), vb = finite_magnitude_bits(v_new);
    m_top = mb > m_top ? mb : m_top;
    v_top = vb > v_top ? vb : v_top;
  }
  *m_max = m_top;
  *v_max = v_top;
}

// The param (or update) of one block and the codes of its new moments for their new absmax.
template <typename P, bool kDecoupled, bool kToOut>
__attribute__((noinline, noclone)) void finish_row(const Args& a, typename P::Storage* __restrict p,
                                                   typename P::Storage* __restrict out,
                                                   const float* __restrict m, const float* __restrict v,
                                                   const float* __restrict root, float m_scale, float v_scale,
                                                   uint8_t* __restrict m_codes, uint8_t* __restrict v_codes) {
  const Grid m_grid = a.m_grid, v_grid = a.v_grid;
  const float bc1 = a.bc1, bc2_sqrt = a.bc2_sqrt, eps = a.eps, negative_lr = -a.lr, factor = P::round(a.factor);
  const int64_t n = a.block;  // a local: the code stores (uint8_t) may alias any field of `a`
  for (int64_t i = 0; i < n; ++i) {
    const float m_new = m[i], v_new = v[i];
    // _fused._update: ((m / bc1) / (sqrt(v) / bc2_sqrt + eps)).to(p.dtype) * -lr, minus (p - p * factor)
    float u = P::round(P::round((m_new / bc1) / (root[i] / bc2_sqrt + eps)) * negative_lr);
    const float param = P::load(p[i]);
    if (kDecoupled) u = P::round(u - P::round(param - P::round(param * factor)));
    if (kToOut) {
      out[i] = P::store(u);
    } else {
      p[i] = P::store(param + u);
    }
    m_codes[i] = static_cast<uint8_t>(encode<true>(unit(m_new, m_scale), m_grid));
    v_codes[i] = static_cast<uint8_t>(encode<false>(unit(v_new, v_scale), v_grid));
  }
}

// Codes widened to int32 before they index a map: gcc reads a table at uint8 indices with one scalar load per
// element, at int32 indices with a vector gather (16.8M params, two threads: 5 ms less a step). 4-bit codes: element
// 2i is the low nibble of byte i. Separate functions so that the pointers are restrict: uint8_t stores may alias
// anything, which keeps the loops scalar otherwise.
void widen(const uint8_t* __restrict codes, int32_t* __restrict wide, int64_t n) {
  for (int64_t i = 0; i < n; ++i) wide[i] = codes[i];
}

void unpack_nibbles(const uint8_t* __restrict packed, int32_t* __restrict codes, int64_t bytes) {
  for (int64_t i = 0; i < bytes; ++i) {
    codes[2 * i] = packed[i] & 15;
    codes[2 * i + 1] = packed[i] >> 4;
  }
}

void pack_nibbles(const uint8_t* __restrict codes, uint8_t* __restrict packed, int64_t bytes) {
  for (int64_t i = 0; i < bytes; ++i) packed[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
}

// Rows whose square roots are taken in one call (about 4096 elements): the call costs more than a row's work.
constexpr int64_t kGroupElements = 4096;

template <typename P>
using MomentsRow = void (*)(const Args&, const typename P::Storage*, const typename P::Storage*, const int32_t*,
                            const int32_t*, float, float, float*, float*, int32_t*, int32_t*);
template <typename P>
using FinishRow = void (*)(const Args&, typename P::Storage*, typename P::Storage*, const float*, const float*,
                           const float*, float, float, uint8_t*, uint8_t*);

// The row functions come chosen for the flags (templates each, for the vectorizer); the driver is one per dtype.
template <typename P>
void run(const Args& a, MomentsRow<P> moments_row, FinishRow<P> finish_row) {
  using Storage = typename P::Storage;
  Storage* params = static_cast<Storage*>(a.p);
  const Storage* grads = static_cast<const Storage*>(a.g);
  Storage* updates = static_cast<Storage*>(a.out);
  const int64_t block = a.block, code_width = a.bits == 8 ? block : block / 2;
  const int64_t group = std::max<int64_t>(1, kGroupElements / block);
  at::parallel_for(0, a.rows, group, [&](int64_t begin, int64_t end) {
    const int64_t size = group * block;
    std::vector<float> m(size), v(size), root(size), m_absmax(group), v_absmax(group);
    std::vector<int32_t> m_index(block), v_index(block);
    std::vector<uint8_t> m_codes(a.bits == 8 ? 0 : size), v_codes(a.bits == 8 ? 0 : size);
    for (int64_t first = begin; first < end; first += group) {
      const int64_t count = std::min(group, end - first);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t r = first + j;
        const uint8_t* m_in = a.m_codes + r * code_width;
        const uint8_t* v_in = a.v_codes + r * code_width;
        if (a.bits == 4) {
          unpack_nibbles(m_in, m_index.data(), code_width);
          unpack_nibbles(v_in, v_index.data(), code_width);
        } else {
          widen(m_in, m_index.data(), block);
          widen(v_in, v_index.data(), block);
        }
        int32_t m_max, v_max;
        moments_row(a, params + r * block, grads + r * block, m_index.data(), v_index.data(), a.m_absmax[r],
                    a.v_absmax[r], m.data() + j * block, v.data() + j * block, &m_max, &v_max);
        m_absmax[j] = from_bits(m_max);
        v_absmax[j] = from_bits(v_max);
      }
      square_roots(v.data(), root.data(), count * block);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t r = first + j;
        uint8_t* m_out = a.bits == 8 ? a.m_codes + r * code_width : m_codes.data() + j * block;
        uint8_t* v_out = a.bits == 8 ? a.v_codes + r * code_width : v_codes.data() + j * block;
        const float m_scale = m_absmax[j] > 0.0f ? m_absmax[j] : 1.0f;
        const float v_scale = v_absmax[j] > 0.0f ? v_absmax[j] : 1.0f;
        finish_row(a, params + r * block, updates == nullptr ? nullptr : updates + r * block, m.data() + j * block,
                   v.data() + j * block, root.data() + j * block, m_scale, v_scale, m_out, v_out);
        if (a.bits == 4) {
          pack_nibbles(m_out, a.m_codes + r * code_width, code_width);
          pack_nibbles(v_out, a.v_codes + r * code_width, code_width);
        }
        a.m_absmax[r] = m_absmax[j];
        a.v_absmax[r] = v_absmax[j];
      }
    }
  });
}

// Calls f with std::true_type or std::false_type: a runtime flag as a template argument.
template <typename F>
void with_flag(bool flag, F&& f) {
  flag ? f(std::true_type{}) : f(std::false_type{});
}

template <typename P>
void dispatch(const Args& a) {
  MomentsRow<P> moments = nullptr;
  FinishRow<P> finish = nullptr;
  with_flag(a.maximize, [&](auto maximize) {
    with_flag(a.coupled_decay, [&](auto coupled) {
      moments = &moments_row<P, decltype(maximize)::value, decltype(coupled)::value>;
    });
  });
  with_flag(a.decoupled_decay, [&](auto decoupled) {
    with_flag(a.out != nullptr, [&](auto to_out) {
      finish = &finish_row<P, decltype(decoupled)::value, decltype(to_out)::value>;
    });
  });
  run<P>(a, moments, finish);
}

}  // namespace

extern "C" int fadam_quantized_adam_rows(const Args* args) {
  if (args->bits != 8 && (args->bits != 4 || args->block % 2 != 0)) return 1;
  if (args->param_dtype == 0) {
    dispatch<Float32>(*args);
  } else if (args->param_dtype == 1) {
    dispatch<BFloat16>(*args);
  } else {
    return 2;
  }
  return 0;
}

// The kernel's encoder alone, for y / 1 (clamped to [-1, 1], NaN to 0): what the tests and
// benchmarks/check_encoder_exhaustive.py compare with the chain's codec.
extern "C" void fadam_quantized_encode(const float* y, int64_t n, const Grid* grid, int32_t is_signed,
                                       int32_t* codes) {
  for (int64_t i = 0; i < n; ++i) {
    codes[i] = is_signed ? encode<true>(unit(y[i], 1.0f), *grid) : encode<false>(unit(y[i], 1.0f), *grid);
  }
}
