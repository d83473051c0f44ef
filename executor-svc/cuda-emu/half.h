// Ferry's CPU emulation of CUDA — TEST INFRASTRUCTURE, NOT A BACKEND.
//
// CUDA's half and bfloat16 as storage types with exact conversions (round to nearest, ties to
// even), shared by the kernels (kernel.h) and the emulated cuBLAS.
#pragma once

#include <string.h>

namespace ferry_emu {
inline unsigned int bits_of(float f) {
    unsigned int i;
    memcpy(&i, &f, 4);
    return i;
}
inline float float_of(unsigned int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
}  // namespace ferry_emu

struct __half {
    unsigned short x;
};
struct __nv_bfloat16 {
    unsigned short x;
};
typedef __half half;

inline float __half2float(__half h) {
    unsigned int sign = (h.x & 0x8000u) << 16, exp = (h.x >> 10) & 0x1f, man = h.x & 0x3ffu;
    unsigned int bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do {
            ++e;
            man <<= 1;
        } while (!(man & 0x400u));
        bits = sign | ((112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    return ::ferry_emu::float_of(bits);
}

inline __half __float2half_rn(float f) {
    unsigned int b = ::ferry_emu::bits_of(f);
    unsigned short sign = (b >> 16) & 0x8000u;
    unsigned int abs = b & 0x7fffffffu;
    if (abs >= 0x7f800000u) {  // inf or nan
        return __half{static_cast<unsigned short>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0))};
    }
    if (abs >= 0x477ff000u) return __half{static_cast<unsigned short>(sign | 0x7c00u)};  // overflow
    if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        if (abs < 0x33000000u) return __half{sign};
        // |f| / 2^-24 = man * 2^(e - 126), rounded to the nearest, ties to even.
        unsigned int e = abs >> 23, man = (abs & 0x7fffffu) | 0x800000u;
        unsigned int shift = 126 - e;  // 14 to 24
        unsigned int half_man = man >> shift;
        unsigned int rest = man & ((1u << shift) - 1);
        unsigned int halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (half_man & 1u))) ++half_man;
        return __half{static_cast<unsigned short>(sign | half_man)};
    }
    unsigned int h = ((abs >> 13) - (112u << 10));
    unsigned int rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return __half{static_cast<unsigned short>(sign | h)};
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __bfloat162float(__nv_bfloat16 h) { return ::ferry_emu::float_of(unsigned(h.x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned int b = ::ferry_emu::bits_of(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<unsigned short>((b >> 16) | 0x40u)};
    b += 0x7fffu + ((b >> 16) & 1u);
    return __nv_bfloat16{static_cast<unsigned short>(b >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
