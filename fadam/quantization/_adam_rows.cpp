// The quantized Adam step on the CPU, one pass over memory per block: decode a block's codes, update its moments and
// param, find the block's new absmax and encode the moments for it. Built on first use by fadam/quantization/_native.py
// (torch.utils.cpp_extension, this file only) and called through ctypes with the pointers of contiguous tensors.
//
// Each thread runs its rows as a pipeline over groups of rows (run): the new moments of the next group are computed
// in the same loops as the params and codes of the current one (fused_row; 3-10% faster than one half after the
// other on 16.8M params, see benchmarks/README.md), which skip the encoder's clamps where a row's moments are all
// finite (nearly always).
// Moments are encoded as the codec does, times the reciprocal of their block's absmax; a block holding an infinity,
// found only in that rare row's own loop (row_scale_bits), stores its scale negated and keeps its infinities (see
// fadam/quantization/_codec.py). The same call runs the step's leaves whose moments stay in full precision (float32;
// run_full): the same arithmetic without codes.
//
// The arithmetic is the chain's, operation by operation and in float32, so that results equal the eager kernels in
// _fused.py bit for bit: ATen's vectorized CPU lerp, addcmul and add-with-alpha are each one fused multiply-add
// (where the CPU has FMA), the square root is torch's own, and everything else rounds once per operation (built with
// -ffp-contract=off). The loops are written for the compiler's vectorizer (noinline, noclone: a clone with a
// constant argument lost it): selections are bit masks, not branches, the absmax is an integer maximum over bit
// patterns and the encoder an integer comparison with them (non-negative floats order as their bits do), and the
// divisions by the bias corrections are multiplications by their reciprocals with an exact correction (quotient)
// where that gives the quotient's rounding; all keep IEEE results.
//
// A donated step whose leaves all take this kernel is read here as well (fadam_read_leaves): the metadata of its
// tensors, through torch's C shim, checked as _fused._plan and _native.Leaves check them from Python, where reading
// them cost about 13 us a leaf more (200 leaves of 83712 elements).

#include <Python.h>  // first, as Python asks

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// A map's encoder (fadam/quantization/_native.py: _encoder): one 32-bit entry per bfloat16 bit pattern of y (the top
// 16 bits of its float32, sign included, |y| <= 1), at index pattern - base; patterns below base, which hold no
// midpoint, read entry 0. The low byte of an entry is a code and its top 16 bits the low 16 bits of the map's midpoint
// inside the pattern (no pattern holds two), 0xFFFF for none. For y >= 0 the code is that of the pattern's smallest
// float plus one if y's low 16 bits exceed the midpoint's: one table read and one unsigned comparison of
// (y's bits << 16) with the entry. A negative y compares its low bits mirrored (0xFFFF - bits) with a mirrored
// midpoint, so that the same comparison steps its code down the signed map's negative half.
struct Grid {
  const uint32_t* entries;
  int32_t base;
  float finite_top;  // the map's largest value below 1: what a block holding an infinity scales its finite moments by
};

// Where a map's values for a block holding an infinity start among its values (fadam/quantization/_maps.py: INFINITE).
constexpr int64_t kInfinite = 256;

struct Args {
  void* p;  // params, gradients and updates: float32 or bfloat16 (param_dtype)
  const void* g;
  void* out;  // null: the new param goes into p; else the update goes into out and p is only read
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* v_codes;
  float* v_absmax;
  const float* m_map;  // the 512 values of the map each moment was stored with: for a finite block, then (from
  const float* v_map;  // kInfinite on) for a block holding an infinity
  float* m;  // a full-precision leaf's float32 moments, updated in place (its codes, absmax and maps are null);
  float* v;  // null for a quantized leaf
  Grid m_grid;  // the maps the moments are written with: signed for m, non-negative for v (v >= 0)
  Grid v_grid;
  int64_t rows;
  int64_t block;
  int64_t last;  // the last row's length: block, or less for a leaf's ragged last block
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
  float factor;  // what float32 params multiply by for the decoupled decay: 1 - lr * weight_decay
  float bf16_factor;  // what bfloat16 params multiply by: the same, or rounded to bfloat16 (see _fused._update)
};

// torch's CPU sqrt: MKL's vsSqrt where torch was built with MKL (its last bit differs from the IEEE square root for
// about 1% of inputs), else the IEEE one. A weak reference: null where libtorch_cpu does not export it.
extern "C" void vsSqrt(int n, const float* a, float* r) __attribute__((weak));
// Called from inside at::parallel_for's OpenMP region, vsSqrt opens a nested one of its own on every call (about 0.4
// us: as long as its work on 1024 elements) unless the calling thread limits MKL to itself.
extern "C" int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));

// MKL's thread count for the calling thread set to one while it lives, then restored.
class MklOnThisThread {
 public:
  MklOnThisThread() : previous_(MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~MklOnThisThread() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous_);
  }
  MklOnThisThread(const MklOnThisThread&) = delete;
  MklOnThisThread& operator=(const MklOnThisThread&) = delete;

 private:
  int previous_;  // 0: the global setting
};

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
  static float decay_factor(const Args& a) { return a.factor; }
  static float load(float x) { return x; }
  static float store(float x) { return x; }
  static float round(float x) { return x; }
};

struct BFloat16 {
  using Storage = uint16_t;
  static float decay_factor(const Args& a) { return a.bf16_factor; }
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

// x / b from b's reciprocal r = 1 / b (correctly rounded), as Markstein's division ends: the FMA gives the remainder
// x - q * b of q = x * r exactly, and q + remainder * r rounds to the IEEE quotient. That holds where no step under-
// or overflows: for b in [2^-20, 1] (Adam's bias corrections) and x = 0 or |x| in [2^-100, 2^100] (QuotientRange);
// benchmarks/check_quotient_exhaustive.py compares every such x with division. The sign is x's, as division's: the
// sum q + 0 would turn x = -0 into +0. A vector division costs several FMAs' time: dividing by the two bias
// corrections this way saves 4-5% of the kernel (benchmarks/README.md).
inline float quotient(float x, float b, float r) {
  const float q = x * r;
  return std::copysign(std::fma(std::fma(-q, b, x), r, q), x);
}

// Where quotient() equals division: the divisors and the magnitudes (as bits) of the dividends.
struct QuotientRange {
  static constexpr float kLeastDivisor = 0x1p-20f;
  static constexpr int32_t kLeastBits = 0x0D800000;  // 2^-100
  static constexpr int32_t kMostBits = 0x71800000;   // 2^100
  // quotient() needs the FMA instruction: without it std::fma is a call into libm, slower than the division.
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  static constexpr bool kAvailable = true;
#else
  static constexpr bool kAvailable = false;
#endif
  static bool divisor(float b) { return kAvailable && b >= kLeastDivisor && b <= 1.0f; }
};

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

inline int32_t magnitude_bits(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits & 0x7FFFFFFF;
}

constexpr int32_t kInfinityBits = 0x7F800000;

constexpr int32_t kLeastNormalBits = 0x00800000;  // 2^-126: the least scale of a block holding an infinity

// The scale of x[0, n), as bits, for the rare block whose moments hold an inf or NaN (the codec's row_absmax): the
// largest finite magnitude or, where an infinity is among them, the same raised to at least 2^-126 and negated.
int32_t row_scale_bits(const float* x, int64_t n) {
  int32_t top = 0;
  bool infinite = false;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t bits = magnitude_bits(x[i]);
    top = bits < kInfinityBits && bits > top ? bits : top;
    infinite |= bits == kInfinityBits;
  }
  return infinite ? static_cast<int32_t>(static_cast<uint32_t>(std::max(top, kLeastNormalBits)) | 0x80000000u) : top;
}

// What a block's moments are multiplied by before they are encoded: the reciprocal of its scale's magnitude (of 1 for
// a zero scale) and, for a block holding an infinity (a negative scale), its map's finite top, so that its finite
// moments stay below the codes of +-1, which stand for +-inf there.
inline float encoding_inverse(float scale, float finite_top) {
  const float magnitude = std::fabs(scale);
  const float inverse = 1.0f / (magnitude > 0.0f ? magnitude : 1.0f);
  return scale < 0.0f ? inverse * finite_top : inverse;
}

// How a row's stored moments decode: code c is values[c] * magnitude of their scale, with the map's values for a
// block holding an infinity where the scale is negative.
struct Stored {
  const float* m_values;
  const float* v_values;
  float m_scale, v_scale;
};

inline Stored stored_row(const Args& a, int64_t r) {
  const float m = a.m_absmax[r], v = a.v_absmax[r];
  return {m < 0.0f ? a.m_map + kInfinite : a.m_map, v < 0.0f ? a.v_map + kInfinite : a.v_map, std::fabs(m),
          std::fabs(v)};
}

// x / absmax as the codec computes it: x times the absmax's reciprocal `inverse`, NaN to 0, clamped to [-1, 1].
inline float unit(float x, float inverse) {
  float y = x * inverse;
  y = select(y < -1.0f, -1.0f, y);
  y = select(y > 1.0f, 1.0f, y);
  return select(y != y, 0.0f, y);
}

inline uint32_t encode(float y, const Grid& grid) {
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  const int32_t pattern = static_cast<int32_t>(bits >> 16);  // with the sign bit
  int32_t index = pattern - grid.base;  // int32: gcc gathers with 32-bit indices, with 64-bit ones for uint32
  index = index < 0 ? 0 : index;
  const uint32_t entry = grid.entries[index];
  const uint32_t negative = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31);
  const uint32_t key = (bits << 16) ^ (negative & 0xFFFF0000u);
  return entry + static_cast<uint32_t>(key > entry);  // the low byte is the code
}

// The moment update's constants, hoisted out of the loops.
template <typename P>
struct MomentRule {
  uint32_t gradient_sign;  // 0x80000000 to maximize: torch.neg flips the sign bit, NaN's included
  float b2, one_minus_b2, decay;
  bool small_weight;  // ATen's lerp: start + w * (end - start) for |w| < 0.5, else end + (w - 1) * (end - start)
  float coefficient;
  explicit MomentRule(const Args& a)
      : gradient_sign(a.maximize ? 0x80000000u : 0u),
        b2(a.b2),
        one_minus_b2(a.one_minus_b2),
        decay(P::round(a.weight_decay)),  // alpha in p's dtype
        small_weight(std::fabs(a.b1_weight) < 0.5f),
        coefficient(small_weight ? a.b1_weight : a.b1_weight - 1.0f) {}
};

// New m and v of one element from its decoded moments, gradient and param into m_new, v_new; their magnitude bits
// into the row's running maxima m_top, v_top, and m's minus one into the running minimum m_floor (a zero wraps round
// to the most, so that m_floor + 1 is the least nonzero magnitude).
template <typename P, bool kCoupled>
inline void next_moments(const MomentRule<P>& rule, float m, float v, float gradient, float param, float& m_new,
                         float& v_new, int32_t& m_top, int32_t& v_top, uint32_t& m_floor) {
  uint32_t bits;
  std::memcpy(&bits, &gradient, 4);
  float grad = from_bits(static_cast<int32_t>(bits ^ rule.gradient_sign));
  if (kCoupled) grad = add_scaled<P>(grad, param, rule.decay);  // torch.add(g, p, alpha=decay)
  m_new = multiply_add(rule.coefficient, grad - m, select(rule.small_weight, m, grad));
  v_new = multiply_add(rule.one_minus_b2 * grad, grad, v * rule.b2);  // addcmul(v * b2, g, g, value)
  m_top = std::max(m_top, magnitude_bits(m_new));
  v_top = std::max(v_top, magnitude_bits(v_new));
  m_floor = std::min(m_floor, static_cast<uint32_t>(magnitude_bits(m_new)) - 1u);
}

// The param update's constants.
template <typename P>
struct UpdateRule {
  float bc1, bc2_sqrt, eps, negative_lr, factor, bc1_reciprocal, bc2_sqrt_reciprocal;
  explicit UpdateRule(const Args& a)
      : bc1(a.bc1),
        bc2_sqrt(a.bc2_sqrt),
        eps(a.eps),
        negative_lr(-a.lr),
        factor(P::decay_factor(a)),
        bc1_reciprocal(1.0f / a.bc1),
        bc2_sqrt_reciprocal(1.0f / a.bc2_sqrt) {}
};

// _fused._update: ((m / bc1) / (sqrt(v) / bc2_sqrt + eps)).to(p.dtype) * -lr, minus (p - p * factor) (AdamW).
// kByReciprocal: the divisions by bc1 and bc2_sqrt by quotient(), for m_new and root in QuotientRange.
template <typename P, bool kDecoupled, bool kByReciprocal>
inline float update_of(const UpdateRule<P>& rule, float m_new, float root, float param) {
  const float m_hat = kByReciprocal ? quotient(m_new, rule.bc1, rule.bc1_reciprocal) : m_new / rule.bc1;
  const float root_hat =
      kByReciprocal ? quotient(root, rule.bc2_sqrt, rule.bc2_sqrt_reciprocal) : root / rule.bc2_sqrt;
  float u = P::round(P::round(m_hat / (root_hat + rule.eps)) * rule.negative_lr);
  if (kDecoupled) u = P::round(u - P::round(param - P::round(param * rule.factor)));
  return u;
}

// What a row's loop writes: the new param p + u into p or, kToOut, the update u itself into out; in p's dtype.
template <typename P, bool kDecoupled, bool kToOut, bool kByReciprocal = false>
inline typename P::Storage result_of(const UpdateRule<P>& rule, float m_new, float root, float param) {
  const float u = update_of<P, kDecoupled, kByReciprocal>(rule, m_new, root, param);
  return P::store(kToOut ? u : param + u);
}

// What a row's moment loop finds: its scales (absmax) as bit patterns, and whether its new m all lie in QuotientRange.
struct RowSummary {
  int32_t m_max, v_max;
  bool m_in_quotient_range;
};

// A row's summary from the running maxima and minimum of its moments' magnitude bits (next_moments): the maxima
// hold an inf or NaN only in the rare row where a moment is not finite, which then takes its scale in a loop of its
// own (row_scale_bits). True if finite.
inline bool summarize(int32_t m_top, int32_t v_top, uint32_t m_floor, const float* m, const float* v, int64_t n,
                      RowSummary* summary) {
  summary->m_max = m_top < kInfinityBits ? m_top : row_scale_bits(m, n);
  summary->v_max = v_top < kInfinityBits ? v_top : row_scale_bits(v, n);
  summary->m_in_quotient_range =
      m_top <= QuotientRange::kMostBits && m_floor >= static_cast<uint32_t>(QuotientRange::kLeastBits) - 1u;
  return m_top < kInfinityBits && v_top < kInfinityBits;
}

// One row's moments (from codes widened to int32: see widen, stored as `stored` says) into m_out, v_out, what they
// hold into summary; true if they are all finite.
template <typename P, bool kCoupled>
__attribute__((noinline, noclone)) bool moments_row(const Args& a, const typename P::Storage* __restrict p,
                                                    const typename P::Storage* __restrict g,
                                                    const int32_t* __restrict m_codes,
                                                    const int32_t* __restrict v_codes, const Stored& stored,
                                                    float* __restrict m_out, float* __restrict v_out,
                                                    RowSummary* summary) {
  const float* __restrict m_map = stored.m_values;
  const float* __restrict v_map = stored.v_values;
  const float m_scale = stored.m_scale, v_scale = stored.v_scale;
  const MomentRule<P> rule(a);
  int32_t m_top = 0, v_top = 0;
  uint32_t m_floor = UINT32_MAX;
  const int64_t n = a.block;
  for (int64_t i = 0; i < n; ++i) {
    next_moments<P, kCoupled>(rule, m_map[m_codes[i]] * m_scale, v_map[v_codes[i]] * v_scale, P::load(g[i]),
                              kCoupled ? P::load(p[i]) : 0.0f, m_out[i], v_out[i], m_top, v_top, m_floor);
  }
  return summarize(m_top, v_top, m_floor, m_out, v_out, n, summary);
}

// One row's param (or update, into out) and the codes of its new moments m, v for the reciprocals of their absmax.
template <typename P, bool kDecoupled, bool kToOut>
__attribute__((noinline, noclone)) void finish_row(const Args& a, typename P::Storage* __restrict p,
                                                   typename P::Storage* __restrict out,
                                                   const float* __restrict m, const float* __restrict v,
                                                   const float* __restrict root, float m_inverse, float v_inverse,
                                                   uint8_t* __restrict m_codes, uint8_t* __restrict v_codes) {
  const Grid m_grid = a.m_grid, v_grid = a.v_grid;
  const UpdateRule<P> rule(a);
  const int64_t n = a.block;  // a local: the code stores (uint8_t) may alias any field of `a`
  for (int64_t i = 0; i < n; ++i) {
    (kToOut ? out : p)[i] = result_of<P, kDecoupled, kToOut>(rule, m[i], root[i], P::load(p[i]));
    m_codes[i] = static_cast<uint8_t>(encode(unit(m[i], m_inverse), m_grid));
    v_codes[i] = static_cast<uint8_t>(encode(unit(v[i], v_inverse), v_grid));
  }
}

// finish_row of one row and moments_row of another, in one loop, so that the first's divisions and the second's
// table reads and memory streams overlap. The row's moments are all finite and the reciprocals of their absmax too,
// so they need none of the encoder's clamps: |x| <= absmax, so x * (1 / absmax) lies in [-1, 1] (the product of
// absmax and its rounded reciprocal rounds to at most 1). kByReciprocal: the row's m lie in QuotientRange.
template <typename P, bool kCoupled, bool kDecoupled, bool kToOut, bool kByReciprocal>
__attribute__((noinline, noclone)) bool fused_row(
    const Args& a, typename P::Storage* __restrict p, typename P::Storage* __restrict out, const float* __restrict m,
    const float* __restrict v, const float* __restrict root, float m_inverse, float v_inverse,
    uint8_t* __restrict m_codes, uint8_t* __restrict v_codes, const typename P::Storage* __restrict next_p,
    const typename P::Storage* __restrict next_g, const int32_t* __restrict next_m_codes,
    const int32_t* __restrict next_v_codes, const Stored& next_stored, float* __restrict next_m,
    float* __restrict next_v, RowSummary* summary) {
  const float* __restrict m_map = next_stored.m_values;
  const float* __restrict v_map = next_stored.v_values;
  const float next_m_scale = next_stored.m_scale, next_v_scale = next_stored.v_scale;
  const Grid m_grid = a.m_grid, v_grid = a.v_grid;
  const MomentRule<P> moment_rule(a);
  const UpdateRule<P> update_rule(a);
  int32_t m_top = 0, v_top = 0;
  uint32_t m_floor = UINT32_MAX;
  const int64_t n = a.block;
  for (int64_t i = 0; i < n; ++i) {
    (kToOut ? out : p)[i] =
        result_of<P, kDecoupled, kToOut, kByReciprocal>(update_rule, m[i], root[i], P::load(p[i]));
    m_codes[i] = static_cast<uint8_t>(encode(m[i] * m_inverse, m_grid));  // unit() without its clamps
    v_codes[i] = static_cast<uint8_t>(encode(v[i] * v_inverse, v_grid));
    next_moments<P, kCoupled>(moment_rule, m_map[next_m_codes[i]] * next_m_scale,
                              v_map[next_v_codes[i]] * next_v_scale, P::load(next_g[i]),
                              kCoupled ? P::load(next_p[i]) : 0.0f, next_m[i], next_v[i], m_top, v_top, m_floor);
  }
  return summarize(m_top, v_top, m_floor, next_m, next_v, n, summary);
}

// A full-precision leaf's elements [0, n): its float32 moments m and v updated in place, with the quantized rows'
// arithmetic and no codes.
template <typename P, bool kCoupled>
__attribute__((noinline, noclone)) void full_moments(const Args& a, const typename P::Storage* __restrict p,
                                                     const typename P::Storage* __restrict g, float* __restrict m,
                                                     float* __restrict v, int64_t n) {
  const MomentRule<P> rule(a);
  int32_t m_top = 0, v_top = 0;  // no absmax, no quotient range: unread
  uint32_t m_floor = 0;
  for (int64_t i = 0; i < n; ++i) {
    next_moments<P, kCoupled>(rule, m[i], v[i], P::load(g[i]), kCoupled ? P::load(p[i]) : 0.0f, m[i], v[i], m_top,
                              v_top, m_floor);
  }
}

// A full-precision leaf's params (or updates, into out) [0, n) from its new m and the square roots of its new v.
template <typename P, bool kDecoupled, bool kToOut>
__attribute__((noinline, noclone)) void full_finish(const Args& a, typename P::Storage* __restrict p,
                                                    typename P::Storage* __restrict out, const float* __restrict m,
                                                    const float* __restrict root, int64_t n) {
  const UpdateRule<P> rule(a);
  for (int64_t i = 0; i < n; ++i) {
    (kToOut ? out : p)[i] = result_of<P, kDecoupled, kToOut>(rule, m[i], root[i], P::load(p[i]));
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

// Elements per group: its square roots are taken in one call (the call costs more than a row's work).
constexpr int64_t kGroupElements = 4096;

template <typename P>
struct Kernels {
  bool (*moments)(const Args&, const typename P::Storage*, const typename P::Storage*, const int32_t*,
                  const int32_t*, const Stored&, float*, float*, RowSummary*);
  void (*finish)(const Args&, typename P::Storage*, typename P::Storage*, const float*, const float*, const float*,
                 float, float, uint8_t*, uint8_t*);
  using Fused = bool (*)(const Args&, typename P::Storage*, typename P::Storage*, const float*, const float*,
                         const float*, float, float, uint8_t*, uint8_t*, const typename P::Storage*,
                         const typename P::Storage*, const int32_t*, const int32_t*, const Stored&, float*, float*,
                         RowSummary*);
  Fused fused;
  Fused fused_by_reciprocals;  // for rows whose m lie in QuotientRange
  void (*full_moments)(const Args&, const typename P::Storage*, const typename P::Storage*, float*, float*, int64_t);
  void (*full_finish)(const Args&, typename P::Storage*, typename P::Storage*, const float*, const float*, int64_t);
};

// Rows per group for a row length: its square roots are taken in one call, as are the next group's.
int64_t group_rows(int64_t block) { return std::max<int64_t>(1, kGroupElements / block); }

// A group's new moments, their square roots and absmax, between the two halves of its step.
struct Group {
  std::vector<float> m, v, root, m_absmax, v_absmax;
  std::vector<char> finite, m_in_quotient_range;
  int64_t first = 0, count = 0;
  Group(int64_t elements, int64_t rows)
      : m(elements),
        v(elements),
        root(elements),
        m_absmax(rows),
        v_absmax(rows),
        finite(rows),
        m_in_quotient_range(rows) {}
  void record(int64_t j, const RowSummary& summary) {
    m_absmax[j] = from_bits(summary.m_max);
    v_absmax[j] = from_bits(summary.v_max);
    m_in_quotient_range[j] = summary.m_in_quotient_range;
  }
};

// One thread's buffers, sized for the longest group and row of a call's Args and reused across them.
struct Scratch {
  Group current, next;
  std::vector<int32_t> m_index, v_index;  // a row's codes widened to int32
  std::vector<uint8_t> m_codes, v_codes;  // a 4-bit row's codes before they are packed
  Scratch(int64_t elements, int64_t rows, int64_t block)
      : current(elements, rows), next(elements, rows), m_index(block), v_index(block), m_codes(block), v_codes(block) {}
};

// Rows [begin, end) of `a` run as a pipeline over groups: the moments of group k + 1 are computed in the same loops
// as the params and codes of group k (fused_row), after group k's square roots.
template <typename P>
void run(const Args& a, const Kernels<P>& kernels, int64_t begin, int64_t end, Scratch& scratch) {
  using Storage = typename P::Storage;
  Storage* params = static_cast<Storage*>(a.p);
  const Storage* grads = static_cast<const Storage*>(a.g);
  Storage* updates = static_cast<Storage*>(a.out);
  const int64_t block = a.block, code_width = a.bits == 8 ? block : block / 2;
  const int64_t rows_per_group = group_rows(block);
  // a ragged last row: a's fields with its length as the block, which is what the row kernels read
  const int64_t short_row = a.last == block ? -1 : a.rows - 1;
  Args short_args = a;
  short_args.block = a.last;
  const auto row_args = [&](int64_t r) -> const Args& { return r == short_row ? short_args : a; };
  const auto length = [&](int64_t r) { return r == short_row ? a.last : block; };
  Group* current = &scratch.current;
  Group* next = &scratch.next;
  // the roots (0 or sqrt of a finite v: in [2^-75, 2^64]) always lie in QuotientRange; the m of a row only mostly
  const bool divisors_in_quotient_range = QuotientRange::divisor(a.bc1) && QuotientRange::divisor(a.bc2_sqrt);
  int32_t* m_index = scratch.m_index.data();
  int32_t* v_index = scratch.v_index.data();
  // the widened codes of row r, into m_index, v_index
  const auto load_codes = [&](int64_t r) {
    const uint8_t* m_in = a.m_codes + r * code_width;
    const uint8_t* v_in = a.v_codes + r * code_width;
    if (a.bits == 4) {
      unpack_nibbles(m_in, m_index, length(r) / 2);
      unpack_nibbles(v_in, v_index, length(r) / 2);
    } else {
      widen(m_in, m_index, length(r));
      widen(v_in, v_index, length(r));
    }
  };
  // row j of group `to`: its moments alone
  const auto moments = [&](Group& to, int64_t j) {
    const int64_t r = to.first + j;
    load_codes(r);
    RowSummary summary;
    to.finite[j] = kernels.moments(row_args(r), params + r * block, grads + r * block, m_index, v_index,
                                   stored_row(a, r), to.m.data() + j * block, to.v.data() + j * block, &summary);
    to.record(j, summary);
  };
  const auto codes_out = [&](uint8_t* codes, uint8_t* unpacked, int64_t r) {
    return a.bits == 8 ? codes + r * code_width : unpacked;
  };
  // row j of group `from`: its param and codes, with row j of group `to`'s moments where `to` has that row
  const auto finish = [&](Group& from, int64_t j, Group& to) {
    const int64_t r = from.first + j;
    Storage* out = updates == nullptr ? nullptr : updates + r * block;
    uint8_t* m_out = codes_out(a.m_codes, scratch.m_codes.data(), r);
    uint8_t* v_out = codes_out(a.v_codes, scratch.v_codes.data(), r);
    const float m_inverse = encoding_inverse(from.m_absmax[j], a.m_grid.finite_top);
    const float v_inverse = encoding_inverse(from.v_absmax[j], a.v_grid.finite_top);
    const float* m = from.m.data() + j * block;
    const float* v = from.v.data() + j * block;
    const float* root = from.root.data() + j * block;
    // an absmax below about 3e-39 has no finite reciprocal: x * inverse leaves [-1, 1] there (finish_row clamps);
    // the ragged row is shorter than the row it would be fused with
    const int64_t s = to.first + j;
    if (j < to.count && from.finite[j] && m_inverse < INFINITY && v_inverse < INFINITY && s != short_row) {
      load_codes(s);
      RowSummary summary;
      const auto fused = divisors_in_quotient_range && from.m_in_quotient_range[j] ? kernels.fused_by_reciprocals
                                                                                   : kernels.fused;
      to.finite[j] = fused(a, params + r * block, out, m, v, root, m_inverse, v_inverse, m_out, v_out,
                           params + s * block, grads + s * block, m_index, v_index, stored_row(a, s),
                           to.m.data() + j * block, to.v.data() + j * block, &summary);
      to.record(j, summary);
    } else {
      // a row with an inf or NaN moment, the last group of a thread's rows of this leaf, or its ragged row
      kernels.finish(row_args(r), params + r * block, out, m, v, root, m_inverse, v_inverse, m_out, v_out);
      if (j < to.count) moments(to, j);
    }
    if (a.bits == 4) {
      pack_nibbles(m_out, a.m_codes + r * code_width, length(r) / 2);
      pack_nibbles(v_out, a.v_codes + r * code_width, length(r) / 2);
    }
    a.m_absmax[r] = from.m_absmax[j];
    a.v_absmax[r] = from.v_absmax[j];
  };
  // a group's square roots: its rows' moments lie at multiples of block, a ragged row only in the last one
  const auto roots = [&](Group& group) {
    const int64_t elements = (group.count - 1) * block + length(group.first + group.count - 1);
    square_roots(group.v.data(), group.root.data(), elements);
  };
  current->first = begin;
  current->count = std::min(rows_per_group, end - begin);
  for (int64_t j = 0; j < current->count; ++j) moments(*current, j);
  roots(*current);
  while (current->count > 0) {
    next->first = current->first + current->count;
    next->count = std::min(rows_per_group, end - next->first);
    for (int64_t j = 0; j < current->count; ++j) finish(*current, j, *next);
    if (next->count > 0) roots(*next);
    std::swap(current, next);
  }
}

// A full-precision leaf's rows [begin, end), in chunks of a scratch group's size: the new moments, their square
// roots in one call, then the params.
template <typename P>
void run_full(const Args& a, const Kernels<P>& kernels, int64_t begin, int64_t end, Scratch& scratch) {
  using Storage = typename P::Storage;
  Storage* params = static_cast<Storage*>(a.p);
  const Storage* grads = static_cast<const Storage*>(a.g);
  Storage* updates = static_cast<Storage*>(a.out);
  float* root = scratch.current.root.data();
  const int64_t chunk = static_cast<int64_t>(scratch.current.root.size());
  const int64_t stop = end * a.block - (end == a.rows ? a.block - a.last : 0);
  for (int64_t start = begin * a.block; start < stop; start += chunk) {
    const int64_t n = std::min(chunk, stop - start);
    kernels.full_moments(a, params + start, grads + start, a.m + start, a.v + start, n);
    square_roots(a.v + start, root, n);
    kernels.full_finish(a, params + start, updates == nullptr ? nullptr : updates + start, a.m + start, root, n);
  }
}

// Calls f with std::true_type or std::false_type: a runtime flag as a template argument.
template <typename F>
void with_flag(bool flag, F&& f) {
  flag ? f(std::true_type{}) : f(std::false_type{});
}

template <typename P>
void dispatch(const Args& a, int64_t begin, int64_t end, Scratch& scratch) {
  Kernels<P> kernels{};
  with_flag(a.coupled_decay, [&](auto coupled) {
    constexpr bool kCoupled = decltype(coupled)::value;
    kernels.moments = &moments_row<P, kCoupled>;
    kernels.full_moments = &full_moments<P, kCoupled>;
    with_flag(a.decoupled_decay, [&](auto decoupled) {
      with_flag(a.out != nullptr, [&](auto to_out) {
        constexpr bool kDecoupled = decltype(decoupled)::value, kToOut = decltype(to_out)::value;
        kernels.finish = &finish_row<P, kDecoupled, kToOut>;
        kernels.fused = &fused_row<P, kCoupled, kDecoupled, kToOut, false>;
        kernels.fused_by_reciprocals = &fused_row<P, kCoupled, kDecoupled, kToOut, true>;
        kernels.full_finish = &full_finish<P, kDecoupled, kToOut>;
      });
    });
  });
  if (a.m != nullptr) {
    run_full<P>(a, kernels, begin, end, scratch);
  } else {
    run<P>(a, kernels, begin, end, scratch);
  }
}

// A leaf's fields as fadam/quantization/_native.py lays them out (_LEAF_FIELDS): the addresses of p, g, out (0 for
// none), m_codes, m_absmax, v_codes, v_absmax, m_map, v_map, m and v (0 for the ones a leaf has not), then rows,
// block, last and param_dtype.
constexpr int64_t kLeafFields = 15;

template <typename T>
T* address(int64_t field) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(field));
}

// `shared` (the step's hyperparameters and scalars) with one leaf's fields.
Args leaf_args(const Args& shared, const int64_t* f) {
  Args a = shared;
  a.p = address<void>(f[0]);
  a.g = address<const void>(f[1]);
  a.out = address<void>(f[2]);
  a.m_codes = address<uint8_t>(f[3]);
  a.m_absmax = address<float>(f[4]);
  a.v_codes = address<uint8_t>(f[5]);
  a.v_absmax = address<float>(f[6]);
  a.m_map = address<const float>(f[7]);
  a.v_map = address<const float>(f[8]);
  a.m = address<float>(f[9]);
  a.v = address<float>(f[10]);
  a.rows = f[11];
  a.block = f[12];
  a.last = f[13];
  a.param_dtype = static_cast<int32_t>(f[14]);
  return a;
}

}  // namespace

// Runs the rows of `count` leaves (kLeafFields each in `fields`), each leaf's ragged last block as its last, shorter
// row. The threads split all the rows in one parallel region, each running its share leaf by leaf (a region per leaf
// cost more than a small leaf's work, which then ran on one thread). Returns 0, or i + 1 for the first leaf the
// kernel cannot run, having run none.
extern "C" int64_t fadam_quantized_adam_leaves(const Args* shared, const int64_t* fields, int64_t count) {
  std::vector<Args> args(count);
  std::vector<int64_t> first_row(count + 1, 0);
  int64_t elements = 0, rows = 0, block = 0;  // the largest group and row: each thread's scratch
  for (int64_t i = 0; i < count; ++i) {
    const Args& a = args[i] = leaf_args(*shared, fields + i * kLeafFields);
    const bool full = a.m != nullptr;  // full-precision moments: no codes to pack
    const bool bits_ok = full || a.bits == 8 || (a.bits == 4 && a.block % 2 == 0 && a.last % 2 == 0);
    const bool sizes_ok = a.block >= 1 && a.rows >= 0 && a.last >= 1 && a.last <= a.block;
    if (!bits_ok || !sizes_ok || full != (a.v != nullptr) || (a.param_dtype != 0 && a.param_dtype != 1)) return i + 1;
    first_row[i + 1] = first_row[i] + a.rows;
    elements = std::max(elements, group_rows(a.block) * a.block);
    rows = std::max(rows, group_rows(a.block));
    block = std::max(block, a.block);
  }
  // grain: a group of 256-element rows
  at::parallel_for(0, first_row[count], group_rows(256), [&](int64_t begin, int64_t end) {
    const MklOnThisThread mkl_on_this_thread;
    Scratch scratch(elements, rows, block);
    // the leaves whose rows overlap [begin, end), each with its part of them
    for (int64_t i = std::upper_bound(first_row.begin(), first_row.end(), begin) - first_row.begin() - 1;
         i < count && first_row[i] < end; ++i) {
      const int64_t from = std::max(begin, first_row[i]) - first_row[i];
      const int64_t to = std::min(end, first_row[i + 1]) - first_row[i];
      if (from >= to) continue;  // a leaf with no rows
      if (args[i].param_dtype == 0) {
        dispatch<Float32>(args[i], from, to, scratch);
      } else {
        dispatch<BFloat16>(args[i], from, to, scratch);
      }
    }
  });
  return 0;
}

// torch's C shim (torch/csrc/inductor/aoti_torch/c/shim.h, its stable ABI), declared here rather than included so
// that the references are weak: null where a torch lacks one, and then fadam_read_leaves declines every step.
struct AtenTensorOpaque;
using AtenTensorHandle = AtenTensorOpaque*;
extern "C" {
int32_t aoti_torch_get_data_ptr(AtenTensorHandle, void**) __attribute__((weak));
int32_t aoti_torch_get_sizes(AtenTensorHandle, int64_t**) __attribute__((weak));
int32_t aoti_torch_get_dim(AtenTensorHandle, int64_t*) __attribute__((weak));
int32_t aoti_torch_get_dtype(AtenTensorHandle, int32_t*) __attribute__((weak));
int32_t aoti_torch_get_device_type(AtenTensorHandle, int32_t*) __attribute__((weak));
int32_t aoti_torch_get_layout(AtenTensorHandle, int32_t*) __attribute__((weak));
int32_t aoti_torch_is_contiguous(AtenTensorHandle, bool*) __attribute__((weak));
int32_t aoti_torch_delete_tensor_object(AtenTensorHandle) __attribute__((weak));
int32_t aoti_torch_dtype_float32() __attribute__((weak));
int32_t aoti_torch_dtype_bfloat16() __attribute__((weak));
int32_t aoti_torch_dtype_uint8() __attribute__((weak));
int32_t aoti_torch_device_type_cpu() __attribute__((weak));
int32_t aoti_torch_layout_strided() __attribute__((weak));
}

namespace {

bool has_shim() {
  return aoti_torch_get_data_ptr && aoti_torch_get_sizes && aoti_torch_get_dim && aoti_torch_get_dtype &&
         aoti_torch_get_device_type && aoti_torch_get_layout && aoti_torch_is_contiguous &&
         aoti_torch_delete_tensor_object && aoti_torch_dtype_float32 && aoti_torch_dtype_bfloat16 &&
         aoti_torch_dtype_uint8 && aoti_torch_device_type_cpu && aoti_torch_layout_strided;
}

// What a leaf's checks read of one of its tensors; dtype -1 for one that is not a dense CPU tensor.
struct TensorFacts {
  int32_t dtype = -1;
  int64_t dim = 0;
  const int64_t* sizes = nullptr;
  bool contiguous = false;
  void* data = nullptr;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d = 0; d < dim; ++d) n *= sizes[d];
    return n;
  }
  bool same_shape(const TensorFacts& other) const {
    return dim == other.dim && std::equal(sizes, sizes + dim, other.sizes);
  }
  // contiguous, of dtype, one-dimensional of `length` (or zero-dimensional for -1)
  bool is(int32_t want, int64_t length) const {
    return dtype == want && contiguous && (length < 0 ? dim == 0 : dim == 1 && sizes[0] == length);
  }
  // a QuantizedArray's `like` for a tensor of `other`'s shape: of dtype, shaped (*other's shape, 0)
  bool is_shape_of(const TensorFacts& other, int32_t want) const {
    return dtype == want && dim == other.dim + 1 && std::equal(other.sizes, other.sizes + other.dim, sizes) &&
           sizes[other.dim] == 0;
  }
};

// The data pointer is read last: a tensor without storage (a torch.func wrapper, say) logs the shim's error there.
TensorFacts read_tensor(AtenTensorHandle handle) {
  TensorFacts t;
  int32_t device = -1, layout = -1, dtype = -1;
  if (aoti_torch_get_device_type(handle, &device) || device != aoti_torch_device_type_cpu() ||
      aoti_torch_get_layout(handle, &layout) || layout != aoti_torch_layout_strided() ||
      aoti_torch_get_dtype(handle, &dtype) || aoti_torch_get_dim(handle, &t.dim) ||
      aoti_torch_get_sizes(handle, const_cast<int64_t**>(&t.sizes)) ||
      aoti_torch_is_contiguous(handle, &t.contiguous) || aoti_torch_get_data_ptr(handle, &t.data)) {
    return TensorFacts{};
  }
  t.dtype = dtype;
  return t;
}

}  // namespace

// What fadam_read_leaves needs besides the tensors (_native._Reading).
struct Reading {
  int64_t bits;
  int64_t block;
  int64_t m_map_id;  // the maps the step writes m and v with; a leaf stored with others takes Python's path
  int64_t v_map_id;
  int64_t maps_at;  // the address of the (maps, 512) float32 map values, and a map's bytes
  int64_t map_bytes;
  int64_t coupled_decay;  // Adam's L2 decay: bfloat16 leaves take Python's path (_native.Leaves.add says why)
};

// One donated step's leaves, each of kinds[i] tensors among `handles` (a list of capsules of torch's tensor
// handles, torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors'): 10 for quantized moments (p, g, and the codes,
// absmax, map id and like of m, then of v), 4 for float32 ones (p, g, m, v). Checks each as _fused._plan,
// _native.Leaves.add and add_full do and writes the fields of those with rows into `fields` (kLeafFields each).
// Returns how many, or -1 where any leaf needs Python's path: a tensor not contiguous, not on the CPU, of another
// dtype or shape, moments made for another shape or stored with other maps, a ragged last block the kernel leaves to
// Python, or two leaves writing one tensor (tied weights). Deletes every handle, unless torch lacks the shim (_native
// asks fadam_reads_leaves first and then never calls this).
extern "C" int64_t fadam_read_leaves(PyObject* handles, const int64_t* kinds, int64_t count, const Reading* reading,
                                     int64_t* fields) {
  if (!has_shim()) return -1;
  const Py_ssize_t total = PyList_GET_SIZE(handles);
  std::vector<TensorFacts> tensors(total);
  for (Py_ssize_t i = 0; i < total; ++i) {
    auto* handle = static_cast<AtenTensorHandle>(PyCapsule_GetPointer(PyList_GET_ITEM(handles, i), nullptr));
    if (handle == nullptr) {  // not one of torch's capsules: its leaf takes Python's path
      PyErr_Clear();
      continue;
    }
    tensors[i] = read_tensor(handle);
    aoti_torch_delete_tensor_object(handle);
  }
  const int32_t float32 = aoti_torch_dtype_float32(), bfloat16 = aoti_torch_dtype_bfloat16();
  const int32_t uint8 = aoti_torch_dtype_uint8();
  const Reading& r = *reading;
  std::vector<int64_t> written;
  int64_t recorded = 0, at = 0;
  for (int64_t leaf = 0; leaf < count; ++leaf) {
    if (at + kinds[leaf] > total) return -1;
    const TensorFacts* t = tensors.data() + at;
    at += kinds[leaf];
    const TensorFacts &p = t[0], &g = t[1];
    const int64_t param_dtype = p.dtype == float32 ? 0 : p.dtype == bfloat16 ? 1 : -1;
    if (param_dtype < 0 || g.dtype != p.dtype || !p.contiguous || !g.contiguous || !g.same_shape(p)) return -1;
    if (param_dtype == 1 && r.coupled_decay) return -1;
    const int64_t n = p.numel(), rows = (n + r.block - 1) / r.block, tail = n % r.block;
    int64_t* f = fields + recorded * kLeafFields;
    const auto address = [](const TensorFacts& x) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(x.data)); };
    if (kinds[leaf] == 10) {
      const TensorFacts &m_codes = t[2], &m_absmax = t[3], &m_map = t[4], &m_like = t[5], &v_codes = t[6],
                   &v_absmax = t[7], &v_map = t[8], &v_like = t[9];
      const int64_t codes = r.bits == 8 ? n : (n + 1) / 2;
      if (!m_like.is_shape_of(p, uint8) || !v_like.is_shape_of(p, uint8) || !m_codes.is(uint8, codes) ||
          !v_codes.is(uint8, codes) || !m_absmax.is(float32, rows) || !v_absmax.is(float32, rows) ||
          !m_map.is(uint8, -1) || !v_map.is(uint8, -1) ||
          *static_cast<uint8_t*>(m_map.data) != r.m_map_id || *static_cast<uint8_t*>(v_map.data) != r.v_map_id ||
          (r.bits == 4 && tail % 2 != 0)) {
        return -1;
      }
      if (rows == 0) continue;
      const int64_t leaf_fields[kLeafFields] = {
          address(p), address(g), 0, address(m_codes), address(m_absmax), address(v_codes), address(v_absmax),
          r.maps_at + r.m_map_id * r.map_bytes, r.maps_at + r.v_map_id * r.map_bytes, 0, 0, rows, r.block,
          tail ? tail : r.block, param_dtype};
      std::copy(leaf_fields, leaf_fields + kLeafFields, f);
      written.insert(written.end(), {address(p), address(m_codes), address(m_absmax), address(v_codes),
                                     address(v_absmax)});
    } else if (kinds[leaf] == 4) {
      const TensorFacts &m = t[2], &v = t[3];
      if (m.dtype != float32 || v.dtype != float32 || !m.contiguous || !v.contiguous || !m.same_shape(p) ||
          !v.same_shape(p)) {
        return -1;
      }
      if (rows == 0) continue;
      const int64_t leaf_fields[kLeafFields] = {
          address(p), address(g), 0, 0, 0, 0, 0, 0, 0, address(m), address(v), rows, r.block,
          n - (rows - 1) * r.block, param_dtype};
      std::copy(leaf_fields, leaf_fields + kLeafFields, f);
      written.insert(written.end(), {address(p), address(m), address(v)});
    } else {
      return -1;
    }
    ++recorded;
  }
  std::sort(written.begin(), written.end());
  if (at != total || std::adjacent_find(written.begin(), written.end()) != written.end()) return -1;
  return recorded;
}

// The kernel's encoder alone, for y itself (clamped to [-1, 1], NaN to 0): what the tests and
// benchmarks/check_encoder_exhaustive.py compare with the chain's codec.
extern "C" void fadam_quantized_encode(const float* y, int64_t n, const Grid* grid, int32_t* codes) {
  for (int64_t i = 0; i < n; ++i) {
    codes[i] = static_cast<int32_t>(encode(unit(y[i], 1.0f), *grid) & 0xFFu);
  }
}

// The kernel's division by a bias correction b through its reciprocal (quotient), on x[0, n) into out, where b lies
// in QuotientRange; -1 where it does not (the kernel divides then), else 0: what the tests and
// benchmarks/check_quotient_exhaustive.py compare with division.
extern "C" int32_t fadam_quantized_quotient(const float* x, int64_t n, float b, float* out) {
  if (!QuotientRange::divisor(b)) return -1;
  const float r = 1.0f / b;
  for (int64_t i = 0; i < n; ++i) out[i] = quotient(x[i], b, r);
  return 0;
}

// Whether fadam_read_leaves can read tensors: torch exports the shim functions it calls.
extern "C" int32_t fadam_reads_leaves() { return has_shim(); }
