// AMX tiles on Linux x86-64: whether this process may use them, and the tile configuration.
// Only the AVX-512 build has AMX code (enabled per function with target pragmas); the others
// report AMX unavailable.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__)
#define RADIX_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace radixengine::cpu {

#if RADIX_HAVE_AMX

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// AVX512-BF16 in CPUID (leaf 7, sub-leaf 1: EAX bit 5).
inline bool cpuid_avx512_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 5) & 1u);
}

// AMX-BF16, AMX-TILE and AVX512-BF16 (its conversions) in CPUID, and the kernel's permission to
// use the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM). Checked once per process.
inline bool amx_tiles_available() {
  static const bool available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = (edx >> 22) & 1u;
    const bool amx_tile = (edx >> 24) & 1u;
    const bool avx512_bf16 = cpuid_avx512_bf16();
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return amx_bf16 && amx_tile && avx512_bf16 &&
           syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return available;
}

// Eight tiles of 64 bytes a row (palette 1): tiles 0, 1 and 4 of `rows_a` rows, 2, 3 and 5 of
// `rows_b`, 6 and 7 of 16 (the two row groups of a C += A B product: C tiles 0, 1 with A tile 4
// and C tiles 2, 3 with A tile 5, all against the B tiles 6, 7).
inline void load_tile_config(int rows_a = 16, int rows_b = 16) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    const bool group_b = t == 2 || t == 3 || t == 5;
    cfg.rows[t] = static_cast<uint8_t>(t >= 6 ? 16 : group_b ? rows_b : rows_a);
    cfg.colsb[t] = 64;
  }
  // The intrinsic's asm names only the first 8 bytes of the config, so the compiler may drop the
  // stores to the rest; this operand is the whole struct.
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

inline void load_full_tile_config() { load_tile_config(); }

#else

inline bool amx_tiles_available() { return false; }

#endif

}  // namespace radixengine::cpu
