/* The checksum a spill file's bytes are checked against when read back:
 * a spill file can be changed behind the tier's back (the same user can
 * write it through /proc/<pid>/fd; a faulty disk or filesystem), and a
 * changed span must fail its read, never give wrong gradients.
 *
 * CRC32C with the SSE4.2 instruction where the CPU has it (x86-64): three
 * independent lanes over the buffer's thirds, so the instruction's
 * latency overlaps (about 3 bytes a cycle); elsewhere a four-lane
 * multiply-rotate hash in plain C. The value only has to match the one
 * this process computed at the write (it is never stored or compared
 * across machines), so the two need not agree with each other or with a
 * standard CRC. Cost on the spill path: benchmarks/RESULTS.md. */
#include "spill_internal.h"

#include <string.h>

#define MIX1 0x9E3779B185EBCA87ull
#define MIX2 0xC2B2AE3D27D4EB4Full

static uint64_t
rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static uint64_t
lane_step(uint64_t acc, uint64_t in)
{
    return rotl(acc + in * MIX2, 31) * MIX1;
}

static uint64_t
load64(const unsigned char *p)
{
    uint64_t value;
    memcpy(&value, p, sizeof value);
    return value;
}

/* Four lanes of 8 bytes, then the tail byte by byte; the length is mixed
 * in (a file cut short differs). */
uint64_t
spill_checksum_portable(const void *buffer, uint64_t bytes)
{
    const unsigned char *p = buffer;
    uint64_t v[4] = {MIX1 + MIX2, MIX2, 0, (uint64_t)0 - MIX1};
    uint64_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        for (int k = 0; k < 4; k++)
            v[k] = lane_step(v[k], load64(p + i + 8 * (uint64_t)k));
    }
    uint64_t h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18) + bytes;
    for (; i < bytes; i++)
        h = lane_step(h, p[i]);
    return h;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define HAVE_CRC32C_CANDIDATE 1

/* clang (as make dist's zig cc) counts crc32 apart from sse4.2 */
__attribute__((target("sse4.2,crc32"))) static uint64_t
sum_crc32c(const unsigned char *p, uint64_t bytes)
{
    uint64_t third = bytes / 24 * 8, a = ~0u, b = ~0u, c = ~0u;
    for (uint64_t i = 0; i < third; i += 8) {
        a = _mm_crc32_u64(a, load64(p + i));
        b = _mm_crc32_u64(b, load64(p + third + i));
        c = _mm_crc32_u64(c, load64(p + 2 * third + i));
    }
    for (uint64_t i = 3 * third; i < bytes; i++)
        a = _mm_crc32_u8((uint32_t)a, p[i]);
    return (a ^ (b << 21) ^ (c << 42)) + bytes * MIX1;
}
#endif

uint64_t
spill_checksum(const void *buffer, uint64_t bytes)
{
#ifdef HAVE_CRC32C_CANDIDATE
    /* the CPU is asked every call: cheap next to any spilled buffer */
    if (__builtin_cpu_supports("sse4.2"))
        return sum_crc32c(buffer, bytes);
#endif
    return spill_checksum_portable(buffer, bytes);
}
