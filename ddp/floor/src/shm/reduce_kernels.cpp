// The reduction kernels (reduce_kernels.h). One generic loop, instantiated per format and
// operation: for a block of elements, widen the first source into a small accumulator array,
// combine every further source into it in rank order, finish (AVG divides), then narrow into
// `dst`. The accumulator stays in L1; each inner loop is a plain element-wise loop the compiler
// vectorizes; and because all sources of a block are read before `dst` is written, `dst` may be
// one of the sources.
//
// The 16-bit formats convert a block at a time, which lets x86 CPUs with F16C/AVX2 (every x86
// made since about 2013) use their conversion instructions and 8-wide vectors, chosen once at run
// time; elsewhere the portable conversions of reduce_kernels.h run, with identical results.
// copy_bytes() lives here too, for the same reason (explicit vectors, chosen at run time).
#include "ddp/floor/src/shm/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define DDP_SHM_X86_DISPATCH 1
#endif

namespace ddp::detail::shm {
namespace {

constexpr std::size_t kBlock = 1024;  // elements per block: 4 KiB of float accumulators

#ifdef DDP_SHM_X86_DISPATCH
// What this CPU can do, looked up once, before main().
struct CpuFeatures {
  bool avx, avx2, f16c;
};
CpuFeatures detect_cpu() {
  __builtin_cpu_init();  // we may run before the compiler runtime's own initializer
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  // F16C is CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c"); it
  // uses the AVX registers, whose support by the OS __builtin_cpu_supports("avx") checks.
  const bool f16c_bit = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
  const bool avx = __builtin_cpu_supports("avx");
  return {avx, avx && __builtin_cpu_supports("avx2"), avx && f16c_bit};
}
const CpuFeatures kCpu = detect_cpu();
#endif

// --- Block conversions of the 16-bit formats -------------------------------------------------

void widen_bf16_portable(const std::uint16_t* in, float* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
}
void narrow_bf16_portable(const float* in, std::uint16_t* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}
void widen_half_portable(const std::uint16_t* in, float* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = half_to_float(in[i]);
}
void narrow_half_portable(const float* in, std::uint16_t* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = float_to_half(in[i]);
}

#ifdef DDP_SHM_X86_DISPATCH
// The same loop as narrow_bf16_portable, vectorized 8-wide.
__attribute__((target("avx2"))) void narrow_bf16_avx2(const float* in, std::uint16_t* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}
// vcvtph2ps is exact; vcvtps2ph with rounding control 0 rounds to nearest even, overflows to
// infinity and quiets NaN keeping the payload's top bits: the portable functions' results.
__attribute__((target("avx,f16c"))) void widen_half_f16c(const std::uint16_t* in, float* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = half_to_float(in[i]);
}
__attribute__((target("avx,f16c"))) void narrow_half_f16c(const float* in, std::uint16_t* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = float_to_half(in[i]);
}
#endif

// --- Copies ----------------------------------------------------------------------------------

#ifdef DDP_SHM_X86_DISPATCH
// Explicit vector moves: the compiler would turn a plain copy loop back into a memcpy call.
// kStream: stored past the cache - the destination's lines are not read first (a plain store
// fetches each line before it writes it); a head of up to one vector is copied plainly so that
// the streamed stores are aligned, as they must be, and they are fenced before returning, so they
// are visible before anything this thread does next.
template <bool kStream>
void move_sse2(unsigned char* dst, const unsigned char* src, std::size_t bytes) {
  std::size_t i = kStream ? std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16) : 0;
  std::memcpy(dst, src, i);
  for (; i + 64 <= bytes; i += 64) {
    __m128i v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16 * k));
    for (int k = 0; k < 4; ++k) {
      auto* out = reinterpret_cast<__m128i*>(dst + i + 16 * k);
      if constexpr (kStream) {
        _mm_stream_si128(out, v[k]);
      } else {
        _mm_storeu_si128(out, v[k]);
      }
    }
  }
  std::memcpy(dst + i, src + i, bytes - i);
  if constexpr (kStream) _mm_sfence();
}
template <bool kStream>
__attribute__((target("avx"))) void move_avx(unsigned char* dst, const unsigned char* src, std::size_t bytes) {
  std::size_t i = kStream ? std::min(bytes, (32 - reinterpret_cast<std::uintptr_t>(dst) % 32) % 32) : 0;
  std::memcpy(dst, src, i);
  for (; i + 64 <= bytes; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    }
  }
  std::memcpy(dst + i, src + i, bytes - i);
  if constexpr (kStream) _mm_sfence();
}
#endif

// A storage format: how a block of stored elements becomes accumulators (widen) and back (narrow).
template <typename T>
struct Native {  // float, double, integers: accumulate in the type itself
  using Stored = T;
  using Acc = T;
  static void widen(const T* in, T* out, std::size_t n) { std::copy(in, in + n, out); }
  static void narrow(const T* in, T* out, std::size_t n) { std::copy(in, in + n, out); }
};

struct BFloat16 {
  using Stored = std::uint16_t;
  using Acc = float;
  static void widen(const Stored* in, float* out, std::size_t n) { widen_bf16_portable(in, out, n); }  // a shift: vectorizes anywhere
  static void narrow(const float* in, Stored* out, std::size_t n) {
#ifdef DDP_SHM_X86_DISPATCH
    if (kCpu.avx2) return narrow_bf16_avx2(in, out, n);
#endif
    narrow_bf16_portable(in, out, n);
  }
};

struct Float16 {
  using Stored = std::uint16_t;
  using Acc = float;
  static void widen(const Stored* in, float* out, std::size_t n) {
#ifdef DDP_SHM_X86_DISPATCH
    if (kCpu.f16c) return widen_half_f16c(in, out, n);
#endif
    widen_half_portable(in, out, n);
  }
  static void narrow(const float* in, Stored* out, std::size_t n) {
#ifdef DDP_SHM_X86_DISPATCH
    if (kCpu.f16c) return narrow_half_f16c(in, out, n);
#endif
    narrow_half_portable(in, out, n);
  }
};

// --- The loop ----------------------------------------------------------------------------------

// dst[i] = narrow(finish(combine(...combine(widen(srcs[0][i]), widen(srcs[1][i]))..., widen(srcs[n-1][i]))))
template <typename Format, typename Combine, typename Finish>
void reduce_blocks(typename Format::Stored* dst, const typename Format::Stored* const* srcs, int nsrc, std::size_t count,
                   Combine combine, Finish finish) {
  using Acc = typename Format::Acc;
  constexpr bool kWidens = !std::is_same_v<typename Format::Stored, Acc>;
  Acc acc[kBlock];
  Acc wide[kWidens ? kBlock : 1];  // a widened source block, for the 16-bit formats
  for (std::size_t begin = 0; begin < count; begin += kBlock) {
    const std::size_t n = std::min(kBlock, count - begin);
    if constexpr (!kWidens) {
      // The same operations, fused: the first two sources straight into the accumulators, the
      // finish straight into dst (a copy in and a pass over the block fewer: DDP's scaled sum of
      // two ranks ran at half the speed of a plain sum without this).
      const Acc* first = srcs[0] + begin;
      Acc* out = dst + begin;
      if (nsrc <= 2) {  // element by element: dst, one of the sources at most, is read before written
        const Acc* second = srcs[nsrc - 1] + begin;
        if (nsrc == 1) {
          for (std::size_t i = 0; i < n; ++i) out[i] = finish(first[i]);
        } else {
          for (std::size_t i = 0; i < n; ++i) out[i] = finish(combine(first[i], second[i]));
        }
        continue;
      }
      const Acc* second = srcs[1] + begin;
      for (std::size_t i = 0; i < n; ++i) acc[i] = combine(first[i], second[i]);
      for (int s = 2; s < nsrc; ++s) {
        const Acc* src = srcs[s] + begin;
        for (std::size_t i = 0; i < n; ++i) acc[i] = combine(acc[i], src[i]);
      }
      for (std::size_t i = 0; i < n; ++i) out[i] = finish(acc[i]);
      continue;
    }
    Format::widen(srcs[0] + begin, acc, n);
    for (int s = 1; s < nsrc; ++s) {
      const Acc* src;
      if constexpr (kWidens) {
        Format::widen(srcs[s] + begin, wide, n);
        src = wide;
      } else {
        src = srcs[s] + begin;  // combine straight from the source
      }
      for (std::size_t i = 0; i < n; ++i) acc[i] = combine(acc[i], src[i]);
    }
    for (std::size_t i = 0; i < n; ++i) acc[i] = finish(acc[i]);
    Format::narrow(acc, dst + begin, n);
  }
}

struct Same {
  template <typename T>
  T operator()(T x) const { return x; }
};

// Floating formats. MAX/MIN: NaN wins (a != a only for NaN), otherwise the larger/smaller; written
// as selects, which vectorize.
template <typename Format>
void reduce_floating(void* dst, const void* const* srcs, int nsrc, std::size_t count, Op op, double scale) {
  using Acc = typename Format::Acc;
  auto* out = static_cast<typename Format::Stored*>(dst);
  const auto* in = reinterpret_cast<const typename Format::Stored* const*>(srcs);
  const auto sum = [](Acc a, Acc b) { return a + b; };
  switch (op) {
    case Op::kSum: {
      if (scale == 1.0) return reduce_blocks<Format>(out, in, nsrc, count, sum, Same{});
      const Acc factor = static_cast<Acc>(scale);
      return reduce_blocks<Format>(out, in, nsrc, count, sum, [factor](Acc a) { return a * factor; });
    }
    case Op::kAvg: {
      const Acc n = static_cast<Acc>(nsrc);
      return reduce_blocks<Format>(out, in, nsrc, count, sum, [n](Acc a) { return a / n; });
    }
    case Op::kMax: return reduce_blocks<Format>(out, in, nsrc, count, [](Acc a, Acc b) { return (a > b || a != a) ? a : b; }, Same{});
    case Op::kMin: return reduce_blocks<Format>(out, in, nsrc, count, [](Acc a, Acc b) { return (a < b || a != a) ? a : b; }, Same{});
    case Op::kProduct: return reduce_blocks<Format>(out, in, nsrc, count, [](Acc a, Acc b) { return a * b; }, Same{});
  }
}

// Integers: SUM and PRODUCT in the unsigned type of the same width, which wraps by definition
// (signed overflow would be undefined behaviour). No AVG (reduce_into rejects it).
template <typename T, typename U>
void reduce_integer(void* dst, const void* const* srcs, int nsrc, std::size_t count, Op op) {
  auto* out = static_cast<T*>(dst);
  const auto* in = reinterpret_cast<const T* const*>(srcs);
  switch (op) {
    case Op::kSum:
      return reduce_blocks<Native<T>>(out, in, nsrc, count, [](T a, T b) { return static_cast<T>(static_cast<U>(a) + static_cast<U>(b)); },
                                      Same{});
    case Op::kProduct:
      return reduce_blocks<Native<T>>(out, in, nsrc, count, [](T a, T b) { return static_cast<T>(static_cast<U>(a) * static_cast<U>(b)); },
                                      Same{});
    case Op::kMax: return reduce_blocks<Native<T>>(out, in, nsrc, count, [](T a, T b) { return a > b ? a : b; }, Same{});
    case Op::kMin: return reduce_blocks<Native<T>>(out, in, nsrc, count, [](T a, T b) { return a < b ? a : b; }, Same{});
    case Op::kAvg: break;
  }
}

}  // namespace

namespace {
// The copy for this CPU, plain or streamed.
template <bool kStream>
void move_bytes(void* dst, const void* src, std::size_t bytes) {
#ifdef DDP_SHM_X86_DISPATCH
  auto* out = static_cast<unsigned char*>(dst);
  const auto* in = static_cast<const unsigned char*>(src);
  if (kCpu.avx) return move_avx<kStream>(out, in, bytes);
  return move_sse2<kStream>(out, in, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}
}  // namespace

void copy_bytes(void* dst, const void* src, std::size_t bytes) { move_bytes<false>(dst, src, bytes); }
void stream_bytes(void* dst, const void* src, std::size_t bytes) { move_bytes<true>(dst, src, bytes); }

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  throw std::invalid_argument("unknown dtype " + std::to_string(static_cast<unsigned>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown dtype";
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kSum: return "SUM";
    case Op::kAvg: return "AVG";
    case Op::kMax: return "MAX";
    case Op::kMin: return "MIN";
    case Op::kProduct: return "PRODUCT";
  }
  return "unknown op";
}

bool supported(DType dtype, Op op) {
  const bool known_dtype = static_cast<std::uint32_t>(dtype) <= static_cast<std::uint32_t>(DType::kUInt8);
  const bool known_op = static_cast<std::uint32_t>(op) <= static_cast<std::uint32_t>(Op::kProduct);
  const bool integer = dtype == DType::kInt32 || dtype == DType::kInt64 || dtype == DType::kUInt8;
  return known_dtype && known_op && !(integer && op == Op::kAvg);
}

bool scales(DType dtype, Op op) {
  return op == Op::kSum && supported(dtype, Op::kAvg);  // the floating types
}

void reduce_into(void* dst, const void* const* srcs, int nsrc, std::size_t count, DType dtype, Op op, double scale) {
  if (!supported(dtype, op)) {
    throw std::invalid_argument(std::string("reduce_into: ") + op_name(op) + " of " + dtype_name(dtype) + " is not supported");
  }
  if (scale != 1.0 && !scales(dtype, op)) {
    throw std::invalid_argument(std::string("reduce_into: ") + op_name(op) + " of " + dtype_name(dtype) + " cannot be scaled");
  }
  if (nsrc < 1) throw std::invalid_argument("reduce_into: needs at least one source");
  if (count == 0) return;
  switch (dtype) {
    case DType::kFloat32: return reduce_floating<Native<float>>(dst, srcs, nsrc, count, op, scale);
    case DType::kFloat64: return reduce_floating<Native<double>>(dst, srcs, nsrc, count, op, scale);
    case DType::kBFloat16: return reduce_floating<BFloat16>(dst, srcs, nsrc, count, op, scale);
    case DType::kFloat16: return reduce_floating<Float16>(dst, srcs, nsrc, count, op, scale);
    case DType::kInt32: return reduce_integer<std::int32_t, std::uint32_t>(dst, srcs, nsrc, count, op);
    case DType::kInt64: return reduce_integer<std::int64_t, std::uint64_t>(dst, srcs, nsrc, count, op);
    case DType::kUInt8: return reduce_integer<std::uint8_t, unsigned>(dst, srcs, nsrc, count, op);
  }
}

}  // namespace ddp::detail::shm
