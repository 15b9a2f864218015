#pragma once
// Element-wise reductions of several equally long arrays into one, for the shared-memory
// collectives: dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], always in that order,
// so every rank that reduces the same inputs gets the same bits.
//
// Numerics: float32 and float64 accumulate in their own type; bfloat16 and float16 accumulate in
// float32 across all inputs and round once at the end (to nearest, ties to even). AVG is the sum
// divided by nsrc, for floating types only. Integer SUM and PRODUCT wrap around (two's complement),
// like PyTorch's. MAX and MIN of floating values propagate NaN (torch.maximum does too).
//
// Thread-safety: pure functions.
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ddp::detail::shm {

enum class DType : std::uint32_t { kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8 };
enum class Op : std::uint32_t { kSum, kAvg, kMax, kMin, kProduct };

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // "float32", ...
const char* op_name(Op op);           // "SUM", ...
// Whether reduce_into() handles the pair (all but AVG of integers).
bool supported(DType dtype, Op op);
// Whether reduce_into() takes a scale other than 1 for the pair: SUM of the floating types.
bool scales(DType dtype, Op op);

// Reduces `count` elements of each of the `nsrc` (>= 1) arrays `srcs` into `dst`. `dst` may be one
// of the sources exactly (the same pointer); otherwise no two arrays may overlap. Elements need
// their type's alignment. A `scale` other than 1 multiplies a floating SUM in the accumulating
// type before it is stored (DDP's 1/world: the average in the same pass, rounded once more).
// Throws std::invalid_argument for an unsupported pair, or a scale the pair does not take.
void reduce_into(void* dst, const void* const* srcs, int nsrc, std::size_t count, DType dtype, Op op, double scale = 1.0);

// memcpy(dst, src, bytes) for the collectives' copies into and out of shared memory (the two
// ranges must not overlap). glibc's memcpy copies such sizes with "rep movsb", which on AMD Zen
// runs about ten times slower than a plain vector loop when the source was just written by
// another core - the normal case here (seen with 256 KiB chunks between two ranks).
void copy_bytes(void* dst, const void* src, std::size_t bytes);
// The same copy with stores that bypass the cache, for a large destination written once and read
// later (an all-to-all's output): the plain stores of copy_bytes read each destination line before
// writing it, and evict what the caller will read next. About a quarter less time for a copy of
// many megabytes (measured on AMD Zen, both cores copying); slower for a destination its reader
// would have found in cache. The stores are visible to other threads when it returns.
void stream_bytes(void* dst, const void* src, std::size_t bytes);

// The 16-bit floating formats, by hand (no dependency on c10). Exact for every value; the
// narrowing conversions round to nearest, ties to even, overflow to infinity, and keep NaN a
// NaN (quiet, with the sign and the payload's top bits).
inline std::uint32_t float_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}
inline float bits_float(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
// condition ? a : b without a branch. The compiler will not turn `?:` over values computed with
// floating-point operations into vector selects (they might trap), so the conversions below, which
// compute every case and pick one, select with masks.
inline std::uint32_t select(bool condition, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(condition);
  return (a & mask) | (b & ~mask);
}

// bfloat16 is the top half of a float32.
inline float bf16_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

inline std::uint16_t float_to_bf16(float value) {
  const std::uint32_t bits = float_bits(value);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  // Adding 0x7fff plus the lowest kept bit rounds the dropped half to nearest, ties to even; a
  // carry runs into the exponent, which is right (up to the next binade, or to infinity).
  const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (bits >> 16) | 0x0040u;  // truncating could turn a NaN into infinity
  return static_cast<std::uint16_t>(select(nan, quiet_nan, rounded));
}

// float16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  const std::uint32_t normal = ((exponent + (127 - 15)) << 23) | (mantissa << 13);  // rebias 15 -> 127
  const std::uint32_t special = 0x7f800000u | (mantissa << 13);                       // infinity, NaN (payload kept)
  const std::uint32_t subnormal = float_bits(static_cast<float>(static_cast<std::int32_t>(mantissa)) * 0x1p-24f);  // mantissa * 2^-24, exact
  const std::uint32_t magnitude = select(exponent == 0, subnormal, select(exponent == 0x1f, special, normal));
  return bits_float(sign | magnitude);
}

inline std::uint16_t float_to_half(float value) {
  const std::uint32_t bits = float_bits(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t a = bits & 0x7fffffffu;  // |value|
  const std::uint32_t quiet_nan = 0x7e00u | ((a >> 13) & 0x3ffu);
  // |value| >= 2^-14: a normal half. Rebias the exponent (127 -> 15) and round 23 -> 10 mantissa
  // bits to nearest, ties to even; a carry into the exponent is right, as above.
  const std::uint32_t normal = (a - ((127u - 15u) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // |value| < 2^-14: a subnormal half counts units of 2^-24. Adding 0.5f, whose last mantissa bit
  // is worth 2^-24, makes the FPU round |value| to a multiple of 2^-24 (ties to even); the low
  // mantissa bits of the sum are then that multiple (1024, exactly 2^-14, is the smallest normal).
  const std::uint32_t subnormal = float_bits(bits_float(a) + 0.5f) - float_bits(0.5f);
  // 65520 (0x477ff000) is halfway between the largest half, 65504, and 65536: ties to even go up.
  const std::uint32_t infinity = 0x7c00u;
  const std::uint32_t magnitude =
      select(a > 0x7f800000u, quiet_nan, select(a >= 0x477ff000u, infinity, select(a >= 0x38800000u, normal, subnormal)));
  return static_cast<std::uint16_t>(sign | magnitude);
}

}  // namespace ddp::detail::shm
