/* actcomp's native CPU kernels: the hot loops of the eager codecs, one pass each.
 *
 * Built at first use by actcomp/kernels/native_cpu.py (the system C compiler, -O3, OpenMP) and
 * called through ctypes on contiguous CPU tensors. Every kernel gives the bytes its eager
 * reference gives, bit for bit (tests/kernels/test_native_cpu.py): the same float32 operations in the
 * same order, each rounded (built with -ffp-contract=off, so no multiply-add is fused), and
 * the same counter-based noise as actcomp/kernels/noise.py.
 *
 * dtype codes: 0 = float32, 1 = bfloat16 (the bits held in uint16).
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__) || defined(__BMI2__)
#include <immintrin.h>
#endif
/* Two hand-vectorized paths: AVX-512 (x86-64-v4, Zen 4, Intel since Skylake-X) and AVX2 with
 * FMA (x86-64-v3, Zen 1-3, Intel since Haswell). Without either, the portable loops run. The
 * AVX2 path exists because GCC does not vectorize the portable loops there: their 64-byte
 * vector types are split and spilled to the stack lane by lane, which made the AVX2 int8
 * encode 8x slower than the AVX-512 one and 2x slower than the eager reference. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ACTCOMP_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ACTCOMP_AVX2 1
#endif
#include <stdlib.h>
#include <string.h>

/* The vector width, in bits, of the hand-vectorized path this build compiled: 512 (AVX-512),
 * 256 (AVX2), or 0 (the portable loops, vectorized as the compiler can). */
int actcomp_vector_bits(void) {
#if defined(ACTCOMP_AVX512)
    return 512;
#elif defined(ACTCOMP_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* Groups per parallel task: eight groups hold a whole number of bytes of codes at any width,
 * so no two threads write the same byte. */
#define TASK_GROUPS 8
/* Elements per parallel task when selecting candidates. */
#define SELECT_BLOCK 65536
#define PERIOD_BITS 16
#define ROTATION_KEY 0x1E3779B9u
#define MAX_FINITE_BF16_BITS 0x7F7Fu

static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* noise.py's noise_at: the seeded hash of the element's place in its period's rotation. */
static inline float noise_at(uint32_t seed, int64_t index) {
    uint32_t rotation = lowbias32((uint32_t)(index >> PERIOD_BITS) ^ ROTATION_KEY) & 0xFFFFu;
    uint32_t place = ((uint32_t)(index & 0xFFFF) + rotation) & 0xFFFFu;
    return (float)(lowbias32(place ^ seed) >> 8) * 0x1p-24f;
}

static inline float bits_to_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline uint32_t float_to_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return bits;
}

static inline __attribute__((always_inline)) float load(const void *x, int64_t i, const int dtype) {
    if (dtype == 0) return ((const float *)x)[i];
    return bits_to_float((uint32_t)((const uint16_t *)x)[i] << 16);
}

/* Round to nearest even, as torch's float -> bfloat16 cast does for finite values. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits = float_to_bits(value);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* quantize.py's round_up_to_bf16, for a non-negative float32. */
static inline float round_up_to_bf16(float value) {
    uint32_t upper = (float_to_bits(value) + 0xFFFFu) >> 16;
    if (upper > MAX_FINITE_BF16_BITS) upper = MAX_FINITE_BF16_BITS;
    return bits_to_float(upper << 16);
}

/* Eight codes of bits bits <-> eight bytes: one bit-field extract or deposit per eight codes
 * where the CPU has AVX-512 (and so a fast PEXT/PDEP), shifts and masks elsewhere: Zen 1 and
 * Zen 2 have BMI2 but run PEXT/PDEP in microcode, 18 to 300 cycles each. */
static inline uint64_t byte_fields(int bits) {
    return bits == 4 ? 0x0F0F0F0F0F0F0F0Full : 0x0303030303030303ull;
}

static inline uint64_t pack_eight(uint64_t bytes, const int bits) {
#if defined(ACTCOMP_AVX512)
    return _pext_u64(bytes, byte_fields(bits));
#else
    /* Each step halves the number of fields and joins neighbours: 8 bytes -> 4 -> 2 -> 1. */
    if (bits == 4) {
        bytes = (bytes | bytes >> 4) & 0x00FF00FF00FF00FFull;
        bytes = (bytes | bytes >> 8) & 0x0000FFFF0000FFFFull;
        return (bytes | bytes >> 16) & 0xFFFFFFFFull;
    }
    bytes = (bytes | bytes >> 6) & 0x000F000F000F000Full;
    bytes = (bytes | bytes >> 12) & 0x000000FF000000FFull;
    return (bytes | bytes >> 24) & 0xFFFFull;
#endif
}

static inline uint64_t unpack_eight(uint64_t packed, const int bits) {
#if defined(ACTCOMP_AVX512)
    return _pdep_u64(packed, byte_fields(bits));
#else
    uint64_t bytes = 0;
    for (int k = 0; k < 8; k++) bytes |= ((packed >> (k * bits)) & ((1u << bits) - 1u)) << (8 * k);
    return bytes;
#endif
}

/* Codes of a group are made a tile at a time into a buffer in cache, then packed. */
#define TILE 256
/* Lanes of the min/max pass: sixteen running minima and maxima make it a vector loop. They are
 * GCC/Clang vector types, so they stay in registers (as a float array they were spilled and
 * reloaded every iteration, a store-to-load chain that took a third of the encode). Per lane
 * the comparisons are the scalar ones, `value < low ? value : low`, so signed zeros resolve
 * as before. */
#define LANES 16
typedef float lanes_f32 __attribute__((vector_size(4 * LANES)));
typedef int32_t lanes_i32 __attribute__((vector_size(4 * LANES)));
typedef uint32_t lanes_u32 __attribute__((vector_size(4 * LANES)));
typedef uint16_t lanes_u16 __attribute__((vector_size(2 * LANES)));

static inline lanes_f32 lanes_load(const void *x, int64_t i, const int dtype) {
    lanes_f32 value;
    if (dtype == 0) {
        memcpy(&value, (const float *)x + i, sizeof value);
    } else {
        lanes_u16 raw;
        memcpy(&raw, (const uint16_t *)x + i, sizeof raw);
        const lanes_u32 wide = __builtin_convertvector(raw, lanes_u32) << 16;
        memcpy(&value, &wide, sizeof value);
    }
    return value;
}

/* Per lane: when ? a : b (C has no vector ?:, so a bit select). */
static inline lanes_f32 lanes_pick(lanes_i32 when, lanes_f32 a, lanes_f32 b) {
    lanes_i32 ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const lanes_i32 bits = (ai & when) | (bi & ~when);
    lanes_f32 picked;
    memcpy(&picked, &bits, sizeof picked);
    return picked;
}

#if defined(ACTCOMP_AVX512)
static inline __attribute__((always_inline)) __m512 load_sixteen(const void *x, int64_t i, const int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)x + i);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
}

/* lowbias32, per lane. */
static inline __m512i lowbias32_lanes(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int32_t)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* The noise at places place + 0..15 (mod 2**16), hashed in registers. (A table of the period,
 * built per call and read per value, was slower: its allocation and build cost more than the
 * hashing it saves.) */
static inline __attribute__((always_inline)) __m512 noise_sixteen(uint32_t place, uint32_t seed) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i places = _mm512_and_si512(_mm512_add_epi32(_mm512_set1_epi32((int32_t)place), lane),
                                            _mm512_set1_epi32(0xFFFF));
    const __m512i hashed = lowbias32_lanes(_mm512_xor_si512(places, _mm512_set1_epi32((int32_t)seed)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(hashed, 8)), _mm512_set1_ps(0x1p-24f));
}

/* code_of for the sixteen elements from at, as int32: 0 to levels, or INT32_MIN for a NaN
 * (MAXPS/MINPS with the value second keep a NaN, as code_of's clamps do, and the truncating
 * conversion makes it INT32_MIN, which code_of's (uint8_t)(int32_t) makes 0). */
static inline __attribute__((always_inline)) __m512i codes_sixteen(const void *x, int64_t at, __m512 noise, float low,
                                                                   float inverse, float levels, const int dtype) {
    __m512 code = _mm512_add_ps(
        _mm512_mul_ps(_mm512_sub_ps(load_sixteen(x, at, dtype), _mm512_set1_ps(low)), _mm512_set1_ps(inverse)), noise);
    code = _mm512_min_ps(_mm512_set1_ps(levels), _mm512_max_ps(_mm512_setzero_ps(), code));
    return _mm512_cvttps_epi32(code);
}

/* Sixty-four such codes as bytes, in order. Saturating packs give the truncation's bytes for
 * every value codes_sixteen returns (0 to 255, and INT32_MIN -> 0), and cost far less than a
 * narrowing store (VPMOVDB to memory is microcoded on Zen 4). */
static inline void store_sixty_four(uint8_t *to, __m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i bytes = _mm512_packus_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d));
    /* Each 128-bit lane holds four codes of a, b, c, d in turn: gather a's, then b's, ... */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_si512((void *)to, _mm512_permutexvar_epi32(order, bytes));
}
#elif defined(ACTCOMP_AVX2)
/* The same steps eight lanes wide: each instruction below is its AVX-512 twin's lower half, so
 * the codes are the same bits (MAXPS/MINPS/CVTTPS2DQ behave alike at both widths). */
static inline __attribute__((always_inline)) __m256 load_eight(const void *x, int64_t i, const int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)x + i);
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
}

static inline __m256i lowbias32_eight(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int32_t)0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

static inline __attribute__((always_inline)) __m256 noise_eight(uint32_t place, uint32_t seed) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i places = _mm256_and_si256(_mm256_add_epi32(_mm256_set1_epi32((int32_t)place), lane),
                                            _mm256_set1_epi32(0xFFFF));
    const __m256i hashed = lowbias32_eight(_mm256_xor_si256(places, _mm256_set1_epi32((int32_t)seed)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hashed, 8)), _mm256_set1_ps(0x1p-24f));
}

static inline __attribute__((always_inline)) __m256i codes_eight(const void *x, int64_t at, __m256 noise, float low,
                                                                 float inverse, float levels, const int dtype) {
    __m256 code = _mm256_add_ps(
        _mm256_mul_ps(_mm256_sub_ps(load_eight(x, at, dtype), _mm256_set1_ps(low)), _mm256_set1_ps(inverse)), noise);
    code = _mm256_min_ps(_mm256_set1_ps(levels), _mm256_max_ps(_mm256_setzero_ps(), code));
    return _mm256_cvttps_epi32(code);
}

/* Thirty-two codes (int32 lanes of 0 to 255 or INT32_MIN) as bytes, in order: the packs work
 * within 128-bit halves, leaving a's, b's, c's, d's first four codes in the lower half and their
 * last four in the upper; one permutation of 32-bit words puts them back in order. */
static inline void store_thirty_two(uint8_t *to, __m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)to, _mm256_permutevar8x32_epi32(bytes, order));
}
#endif

static inline __attribute__((always_inline)) void group_range(const void *x, int64_t start, int64_t stop,
                                                              float *low_out, float *high_out, const int dtype) {
    lanes_f32 low, high;
    for (int lane = 0; lane < LANES; lane++) {
        low[lane] = INFINITY;
        high[lane] = -INFINITY;
    }
    int64_t i = start;
#if defined(ACTCOMP_AVX512)
    /* MINPS/MAXPS are exactly `value < low ? value : low` and `value > high ? value : high`. */
    __m512 low_lanes = _mm512_set1_ps(INFINITY), high_lanes = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + LANES <= stop; i += LANES) {
        const __m512 value = load_sixteen(x, i, dtype);
        low_lanes = _mm512_min_ps(value, low_lanes);
        high_lanes = _mm512_max_ps(value, high_lanes);
        unordered |= _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    }
    low = (lanes_f32)low_lanes;
    high = (lanes_f32)high_lanes;
    int nan = unordered != 0;
#elif defined(ACTCOMP_AVX2)
    /* Lanes 0-7 and 8-15 in two registers each: the same sixteen running minima and maxima as
     * the other paths, so signed zeros resolve as there. */
    __m256 low_first = _mm256_set1_ps(INFINITY), low_second = low_first;
    __m256 high_first = _mm256_set1_ps(-INFINITY), high_second = high_first;
    __m256 unordered = _mm256_setzero_ps();
    for (; i + LANES <= stop; i += LANES) {
        const __m256 first = load_eight(x, i, dtype), second = load_eight(x, i + 8, dtype);
        low_first = _mm256_min_ps(first, low_first);
        low_second = _mm256_min_ps(second, low_second);
        high_first = _mm256_max_ps(first, high_first);
        high_second = _mm256_max_ps(second, high_second);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(first, second, _CMP_UNORD_Q));
    }
    float spill[LANES];
    _mm256_storeu_ps(spill, low_first);
    _mm256_storeu_ps(spill + 8, low_second);
    memcpy(&low, spill, sizeof low);
    _mm256_storeu_ps(spill, high_first);
    _mm256_storeu_ps(spill + 8, high_second);
    memcpy(&high, spill, sizeof high);
    int nan = _mm256_movemask_ps(unordered) != 0;
#else
    lanes_i32 unordered = {0};
    for (; i + LANES <= stop; i += LANES) {
        const lanes_f32 value = lanes_load(x, i, dtype);
        low = lanes_pick(value < low, value, low);
        high = lanes_pick(value > high, value, high);
        unordered |= value != value;
    }
    int nan = 0;
    for (int lane = 0; lane < LANES; lane++) nan |= unordered[lane] != 0;
#endif
    float low0 = low[0], high0 = high[0];
    for (; i < stop; i++) {
        const float value = load(x, i, dtype);
        low0 = value < low0 ? value : low0;
        high0 = value > high0 ? value : high0;
        nan |= value != value;
    }
    for (int lane = 1; lane < LANES; lane++) {
        low0 = low[lane] < low0 ? low[lane] : low0;
        high0 = high[lane] > high0 ? high[lane] : high0;
    }
    /* torch's amin/amax: a NaN anywhere makes both NaN (the comparisons above pass it over). It
     * reaches here only when non-finite values were not set aside. */
    *low_out = nan ? NAN : low0;
    *high_out = nan ? NAN : high0;
}

/* floor((value - low) * inverse + noise), clamped to [0, levels]: quantize.py's arithmetic, each
 * operation rounded as there. */
static inline uint8_t code_of(float value, float low, float inverse, float noise, float levels) {
    float code = (value - low) * inverse + noise;
    code = code < 0.0f ? 0.0f : code;
    code = code > levels ? levels : code;
    return (uint8_t)(int32_t)code; /* truncation: floor of a non-negative */
}

/* GCC outlines an OpenMP region before it inlines, so a constant argument of an always_inline
 * function does not reach the code inside its parallel loop: bits and dtype stayed run-time
 * values there (a memcpy call of `bits` bytes, a division by 8 / bits, per eight codes). The
 * parallel loops therefore call the task bodies through this switch, whose literal constants
 * make one specialized copy per case. */
#define SPECIALIZED(bits, dtype, CALL)                                                         \
    if ((dtype) == 0) {                                                                        \
        switch (bits) { case 8: CALL(8, 0); break; case 4: CALL(4, 0); break; default: CALL(2, 0); } \
    } else {                                                                                   \
        switch (bits) { case 8: CALL(8, 1); break; case 4: CALL(4, 1); break; default: CALL(2, 1); } \
    }

/* Groups first to last of quantize(); returns whether every value there is finite (a group's
 * minimum and maximum are, which is what the chain's finite flag asks of the whole tensor). */
static inline __attribute__((always_inline)) int quantize_groups(
    const void *x, int64_t count, int64_t group, int64_t first, int64_t last, uint32_t seed, int64_t base,
    uint8_t *codes, void *offset, uint16_t *scale, const int dtype, const int bits) {
    int finite = 1;
    const float levels = (float)((1 << bits) - 1);
    const int per_byte = 8 / bits;
    if (bits < 8) {
        const int64_t begin = first * group * bits / 8;
        const int64_t stop = last * group < count ? last * group : count;
        memset(codes + begin, 0, (size_t)((stop * bits + 7) / 8 - begin));
    }
    uint8_t tile[TILE];
    for (int64_t g = first; g < last; g++) {
        const int64_t start = g * group;
        const int64_t stop = start + group < count ? start + group : count;
        float low, high;
        group_range(x, start, stop, &low, &high, dtype);
        finite &= isfinite(low) && isfinite(high);
        /* max/levels - min/levels cannot overflow where (max - min) could. */
        const float step = round_up_to_bf16(high / levels - low / levels);
        const float inverse = 1.0f / (step > 0.0f ? step : 1.0f);
        if (dtype == 0) ((float *)offset)[g] = low;
        else ((uint16_t *)offset)[g] = (uint16_t)(float_to_bits(low) >> 16); /* exact: low is a bf16 */
        scale[g] = (uint16_t)(float_to_bits(step) >> 16); /* exact: rounded to a bf16 above */
        for (int64_t at = start; at < stop; at += TILE) {
            const int length = stop - at < TILE ? (int)(stop - at) : TILE;
            /* The noise of element at is that of element base + at of the whole tensor. */
            const int64_t place0 = base + at;
            if ((place0 >> PERIOD_BITS) == ((place0 + length - 1) >> PERIOD_BITS)) {
                /* The tile within one period of the noise: its rotation hashed once, not per
                 * element (half the hashing, which is most of the arithmetic). */
                const uint32_t rotation = lowbias32((uint32_t)(place0 >> PERIOD_BITS) ^ ROTATION_KEY) & 0xFFFFu;
                int k = 0;
#if defined(ACTCOMP_AVX512)
#define CODES_SIXTEEN(K)                                                                                    \
    codes_sixteen(x, at + (K), noise_sixteen(((uint32_t)((place0 + (K)) & 0xFFFF) + rotation) & 0xFFFFu, seed), \
                  low, inverse, levels, dtype)
                for (; k + 4 * LANES <= length; k += 4 * LANES)
                    store_sixty_four(tile + k, CODES_SIXTEEN(k), CODES_SIXTEEN(k + 16), CODES_SIXTEEN(k + 32),
                                     CODES_SIXTEEN(k + 48));
#undef CODES_SIXTEEN
#elif defined(ACTCOMP_AVX2)
#define CODES_EIGHT(K)                                                                                    \
    codes_eight(x, at + (K), noise_eight(((uint32_t)((place0 + (K)) & 0xFFFF) + rotation) & 0xFFFFu, seed), \
                low, inverse, levels, dtype)
                for (; k + 4 * 8 <= length; k += 4 * 8)
                    store_thirty_two(tile + k, CODES_EIGHT(k), CODES_EIGHT(k + 8), CODES_EIGHT(k + 16),
                                     CODES_EIGHT(k + 24));
#undef CODES_EIGHT
#endif
                for (; k < length; k++) {
                    const uint32_t place = ((uint32_t)((place0 + k) & 0xFFFF) + rotation) & 0xFFFFu;
                    const float noise = (float)(lowbias32(place ^ seed) >> 8) * 0x1p-24f;
                    tile[k] = code_of(load(x, at + k, dtype), low, inverse, noise, levels);
                }
            } else {
                for (int k = 0; k < length; k++)
                    tile[k] = code_of(load(x, at + k, dtype), low, inverse, noise_at(seed, place0 + k), levels);
            }
            if (bits == 8) {
                memcpy(codes + at, tile, (size_t)length);
            } else if (at % 8 == 0) {
                /* Eight codes fill bits whole bytes; a last run of fewer is or-ed in. */
                const int whole = length / 8 * 8;
                for (int k = 0; k < whole; k += 8) {
                    uint64_t bytes;
                    memcpy(&bytes, tile + k, 8);
                    const uint64_t packed = pack_eight(bytes, bits);
                    memcpy(codes + (at + k) / per_byte, &packed, (size_t)bits);
                }
                for (int k = whole; k < length; k++)
                    codes[(at + k) / per_byte] |= (uint8_t)(tile[k] << (((at + k) % per_byte) * bits));
            } else {
                for (int k = 0; k < length; k++)
                    codes[(at + k) / per_byte] |= (uint8_t)(tile[k] << (((at + k) % per_byte) * bits));
            }
        }
    }
    return finite;
}

/* finite: where not NULL, set to whether every value of x is finite (the chain's finite flag,
 * from the groups' ranges this pass computes anyway: no second read of x). */
static void quantize(const void *x, int64_t count, int64_t group, uint32_t seed, int64_t base, uint8_t *codes,
                     void *offset, uint16_t *scale, int threads, int dtype, int bits, uint8_t *finite) {
    const int64_t groups = (count + group - 1) / group;
    const int64_t tasks = (groups + TASK_GROUPS - 1) / TASK_GROUPS;
    int all_finite = 1;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(&& : all_finite)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t first = task * TASK_GROUPS;
        const int64_t last = first + TASK_GROUPS < groups ? first + TASK_GROUPS : groups;
        int task_finite = 1;
#define QUANTIZE_GROUPS(B, D) \
    task_finite = quantize_groups(x, count, group, first, last, seed, base, codes, offset, scale, D, B)
        SPECIALIZED(bits, dtype, QUANTIZE_GROUPS)
        all_finite = all_finite && task_finite;
    }
    if (finite != NULL) *finite = (uint8_t)all_finite;
}

/* One dequantized value: fmaf, as ATen's addcmul is on CPU (an 8-bit code times a bf16 scale is
 * exact in float32 unless it overflows, and there only the fused form agrees), saturated to
 * the dtype's range (the rounded-up scale can step past its largest value). */
static inline __attribute__((always_inline)) void decode_one(uint8_t code, float step, float low, float limit,
                                                             void *out, int64_t at, const int dtype) {
    float value = fmaf((float)code, step, low);
    value = value < -limit ? -limit : value;
    value = value > limit ? limit : value;
    if (dtype == 0) ((float *)out)[at] = value;
    else ((uint16_t *)out)[at] = float_to_bf16(value);
}

/* Sixteen codes (one per byte of bytes) decoded into out[at:at + 16], in registers where the
 * CPU has AVX-512: a byte buffer written eight bytes at a time and read back sixteen wide
 * cannot be forwarded from the store queue, which stalled int4/int2 at 3x the time of int8. */
static inline __attribute__((always_inline)) void decode_sixteen(const uint64_t bytes[2], float step, float low,
                                                                 float limit, void *out, int64_t at, const int dtype) {
#if defined(ACTCOMP_AVX512)
    const __m128i codes = _mm_set_epi64x((long long)bytes[1], (long long)bytes[0]);
    __m512 value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), _mm512_set1_ps(step),
                                   _mm512_set1_ps(low));
    /* The value as the second operand: max/min return it when it is NaN, as the clamps above do
     * (a NaN reaches here only when non-finite values were not set aside). */
    value = _mm512_min_ps(_mm512_set1_ps(limit), _mm512_max_ps(_mm512_set1_ps(-limit), value));
    if (dtype == 0) {
        _mm512_storeu_ps((float *)out + at, value);
    } else {
        __m512i wide = _mm512_castps_si512(value); /* float_to_bf16, per lane */
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(wide, 16), _mm512_set1_epi32(1));
        wide = _mm512_add_epi32(wide, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(_mm512_srli_epi32(wide, 16)));
    }
#else
    for (int k = 0; k < 16; k++)
        decode_one((uint8_t)(bytes[k / 8] >> (8 * (k % 8))), step, low, limit, out, at + k, dtype);
#endif
}

#if defined(ACTCOMP_AVX2)
/* Codes at to at + 7 (at a multiple of 8) as int32 lanes: bytes widened, or the bits * 8 bits
 * of packed codes broadcast and each lane shifted to its own field (no PDEP, which Zen 1 and 2
 * run in microcode, and no byte buffer read back wider than it was written). */
static inline __attribute__((always_inline)) __m256i unpack_codes_eight(const uint8_t *codes, int64_t at,
                                                                        const int bits) {
    if (bits == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + at)));
    uint32_t packed = 0;
    memcpy(&packed, codes + at / (8 / bits), (size_t)bits);
    const __m256i fields = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int32_t)packed), fields),
                            _mm256_set1_epi32((1 << bits) - 1));
}

/* decode_one for eight codes, as decode_sixteen does sixteen. */
static inline __attribute__((always_inline)) void decode_eight(__m256i codes, float step, float low, float limit,
                                                               void *out, int64_t at, const int dtype) {
    __m256 value = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(step), _mm256_set1_ps(low));
    value = _mm256_min_ps(_mm256_set1_ps(limit), _mm256_max_ps(_mm256_set1_ps(-limit), value));
    if (dtype == 0) {
        _mm256_storeu_ps((float *)out + at, value);
    } else {
        __m256i wide = _mm256_castps_si256(value); /* float_to_bf16, per lane */
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(wide, 16), _mm256_set1_epi32(1));
        wide = _mm256_srli_epi32(_mm256_add_epi32(wide, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
        /* Lanes hold 0 to 0xFFFF, which the unsigned-saturating pack keeps as they are. */
        _mm_storeu_si128((__m128i *)((uint16_t *)out + at),
                         _mm_packus_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1)));
    }
}
#endif

/* Groups first to last of dequantize(). */
static inline __attribute__((always_inline)) void dequantize_groups(
    const uint8_t *codes, const void *offset, const uint16_t *scale, int64_t count, int64_t group, int64_t first,
    int64_t last, const int bits, void *out, const int dtype) {
    const int per_byte = 8 / bits;
    const uint8_t mask = (uint8_t)((1 << bits) - 1);
    /* The rounded-up scale can step past the dtype's largest value; saturate. */
    const float limit = dtype == 0 ? 3.4028234663852886e38f : 3.3895313892515355e38f;
    for (int64_t g = first; g < last; g++) {
        const int64_t start = g * group;
        const int64_t stop = start + group < count ? start + group : count;
        const float low = load(offset, g, dtype);
        const float step = bits_to_float((uint32_t)scale[g] << 16);
        int64_t at = start;
        if (start % 8 == 0) {
#if defined(ACTCOMP_AVX2)
            for (; at + 8 <= stop; at += 8) decode_eight(unpack_codes_eight(codes, at, bits), step, low, limit, out,
                                                         at, dtype);
#endif
            for (; at + LANES <= stop; at += LANES) {
                uint64_t bytes[2];
                if (bits == 8) {
                    memcpy(bytes, codes + at, sizeof bytes);
                } else {
                    uint64_t packed[2] = {0, 0};
                    memcpy(&packed[0], codes + at / per_byte, (size_t)bits);
                    memcpy(&packed[1], codes + (at + 8) / per_byte, (size_t)bits);
                    bytes[0] = unpack_eight(packed[0], bits);
                    bytes[1] = unpack_eight(packed[1], bits);
                }
                decode_sixteen(bytes, step, low, limit, out, at, dtype);
            }
        }
        for (; at < stop; at++)
            decode_one((uint8_t)((codes[at / per_byte] >> ((at % per_byte) * bits)) & mask), step, low, limit,
                       out, at, dtype);
    }
}

static void dequantize(const uint8_t *codes, const void *offset, const uint16_t *scale, int64_t count,
                       int64_t group, int bits, void *out, int threads, int dtype) {
    const int64_t groups = (count + group - 1) / group;
    const int64_t tasks = (groups + TASK_GROUPS - 1) / TASK_GROUPS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t first = task * TASK_GROUPS;
        const int64_t last = first + TASK_GROUPS < groups ? first + TASK_GROUPS : groups;
#define DEQUANTIZE_GROUPS(B, D) dequantize_groups(codes, offset, scale, count, group, first, last, B, out, D)
        SPECIALIZED(bits, dtype, DEQUANTIZE_GROUPS)
    }
}

/* noise.py's noise_seed of contiguous x (count elements of width bytes, 4 or 2): the signed bit
 * patterns of every step-th element summed exactly (int64), xor-folded to 32 bits, mixed with
 * mix (torch's seed and the size, from Python) and hashed, into *seed: one call where the
 * tensor ops took a slice, a view, a sum and a dozen scalar ops (about 45 us on a Zen 4). */
void actcomp_noise_seed(const void *x, int64_t count, int width, int64_t step, uint32_t mix, int64_t *seed) {
    int64_t sum = 0;
    for (int64_t i = 0; i < count; i += step)
        sum += width == 4 ? (int64_t)((const int32_t *)x)[i] : (int64_t)((const int16_t *)x)[i];
    /* noise.py's _fold32: (value ^ (value >> 32)) & 0xFFFFFFFF, the shift arithmetic. */
    const uint32_t folded = (uint32_t)((uint64_t)(sum ^ (sum >> 32)) & 0xFFFFFFFFu);
    *seed = (int64_t)lowbias32(folded ^ mix);
}

/* actcomp_noise_seed's seed computed here, then the quantize below on all of x (base 0): one
 * call instead of two for a tensor quantized whole, the common case (a call's fixed cost is a
 * few microseconds, as large as the work on a small tensor's samples). */
static uint32_t seed_of(const void *x, int64_t count, int width, int64_t step, uint32_t mix) {
    int64_t seed;
    actcomp_noise_seed(x, count, width, step, mix, &seed);
    return (uint32_t)seed;
}

void actcomp_quantize_seeded_f32(const float *x, int64_t count, int64_t group, int bits, int64_t step, uint32_t mix,
                                 uint8_t *codes, float *offset, uint16_t *scale, int threads, uint8_t *finite) {
    quantize(x, count, group, seed_of(x, count, 4, step, mix), 0, codes, offset, scale, threads, 0, bits, finite);
}

void actcomp_quantize_seeded_bf16(const uint16_t *x, int64_t count, int64_t group, int bits, int64_t step,
                                  uint32_t mix, uint8_t *codes, uint16_t *offset, uint16_t *scale, int threads,
                                  uint8_t *finite) {
    quantize(x, count, group, seed_of(x, count, 2, step, mix), 0, codes, offset, scale, threads, 1, bits, finite);
}

/* seed: noise.py's noise_seed, an int64 scalar tensor's data holding 32 bits; read here, so
 * that no value goes back to Python. base: the index of x[0] in the whole tensor whose noise
 * this is (a chunk quantized alone rounds as the whole tensor would). */
void actcomp_quantize_f32(const float *x, int64_t count, int64_t group, int bits, const int64_t *seed,
                          int64_t base, uint8_t *codes, float *offset, uint16_t *scale, int threads,
                          uint8_t *finite) {
    quantize(x, count, group, (uint32_t)*seed, base, codes, offset, scale, threads, 0, bits, finite);
}

void actcomp_quantize_bf16(const uint16_t *x, int64_t count, int64_t group, int bits, const int64_t *seed,
                           int64_t base, uint8_t *codes, uint16_t *offset, uint16_t *scale, int threads,
                           uint8_t *finite) {
    quantize(x, count, group, (uint32_t)*seed, base, codes, offset, scale, threads, 1, bits, finite);
}

void actcomp_dequantize_f32(const uint8_t *codes, const float *offset, const uint16_t *scale, int64_t count,
                            int64_t group, int bits, float *out, int threads) {
    dequantize(codes, offset, scale, count, group, bits, out, threads, 0);
}

void actcomp_dequantize_bf16(const uint8_t *codes, const uint16_t *offset, const uint16_t *scale, int64_t count,
                             int64_t group, int bits, uint16_t *out, int threads) {
    dequantize(codes, offset, scale, count, group, bits, out, threads, 1);
}

#ifdef ACTCOMP_AVX512
/* Sixteen lanes at a time: the chosen lanes compressed into a register, then a masked store
 * (a compressing store straight to memory is microcoded, and slow, on some CPUs). */
static inline __m512i keys_of(const int32_t *x, int64_t i) {
    return _mm512_and_si512(_mm512_loadu_si512(x + i), _mm512_set1_epi32(0x7FFFFFFF));
}
static inline __m512i keys16_of(const int16_t *x, int64_t i) {
    return _mm512_and_si512(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))),
                            _mm512_set1_epi32(0x7FFF));
}
static inline void store_keys(int32_t *keys, int64_t at, __mmask16 room, __m512i chosen) {
    _mm512_mask_storeu_epi32(keys + at, room, chosen);
}
static inline void store_keys16(int16_t *keys, int64_t at, __mmask16 room, __m512i chosen) {
    _mm256_mask_storeu_epi16(keys + at, room, _mm512_cvtepi32_epi16(chosen));
}
#define VECTOR_CANDIDATES(LOAD, STORE)                                                            \
    {                                                                                             \
        const __m512i low = _mm512_set1_epi32((int32_t)floor);                                    \
        __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i),                          \
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));             \
        for (; i + 16 <= stop; i += 16) {                                                         \
            const __m512i key = LOAD(x, i);                                                       \
            const __mmask16 take = _mm512_cmpge_epi32_mask(key, low);                             \
            if (take) {                                                                           \
                const int n = __builtin_popcount(take);                                           \
                const __mmask16 room = (__mmask16)((1u << n) - 1u);                               \
                _mm512_mask_storeu_epi32(positions + at, room, _mm512_maskz_compress_epi32(take, index)); \
                STORE(keys, at, room, _mm512_maskz_compress_epi32(take, key));                    \
                at += n;                                                                          \
            }                                                                                     \
            index = _mm512_add_epi32(index, _mm512_set1_epi32(16));                               \
        }                                                                                         \
    }
#elif defined(ACTCOMP_AVX2)
/* AVX2 has no compress: for each 8-bit mask of chosen lanes, the permutation that moves them to
 * the front, filled in once when the library is loaded. The chosen lanes are then stored eight
 * wide while eight more fit in the block's own part of the outputs (a store past it would race
 * with the next block's thread); the last few go one at a time. */
static int32_t chosen_first[256][8];
__attribute__((constructor)) static void fill_chosen_first(void) {
    for (int mask = 0; mask < 256; mask++) {
        int n = 0;
        for (int lane = 0; lane < 8; lane++)
            if (mask >> lane & 1) chosen_first[mask][n++] = lane;
        while (n < 8) chosen_first[mask][n++] = 0;
    }
}
static inline __m256i keys_of(const int32_t *x, int64_t i) {
    return _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), _mm256_set1_epi32(0x7FFFFFFF));
}
static inline __m256i keys16_of(const int16_t *x, int64_t i) {
    return _mm256_and_si256(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(x + i))),
                            _mm256_set1_epi32(0x7FFF));
}
static inline void store_keys(int32_t *keys, int64_t at, __m256i chosen) {
    _mm256_storeu_si256((__m256i *)(keys + at), chosen);
}
static inline void store_keys16(int16_t *keys, int64_t at, __m256i chosen) {
    /* Keys below 2**15: the signed-saturating pack keeps them. */
    _mm_storeu_si128((__m128i *)(keys + at),
                     _mm_packs_epi32(_mm256_castsi256_si128(chosen), _mm256_extracti128_si256(chosen, 1)));
}
#define VECTOR_CANDIDATES(LOAD, STORE)                                                            \
    {                                                                                             \
        const int64_t end = found[b + 1];                                                         \
        /* key >= floor as key > floor - 1 (AVX2 compares only for greater), in int32 range */    \
        const int64_t below_floor = floor - 1;                                                    \
        const __m256i below = _mm256_set1_epi32(below_floor > INT32_MAX ? INT32_MAX              \
                                                : below_floor < INT32_MIN ? INT32_MIN : (int32_t)below_floor); \
        __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int32_t)i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); \
        for (; i + 8 <= stop && at + 8 <= end; i += 8) {                                          \
            const __m256i key = LOAD(x, i);                                                       \
            const int take = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, below))); \
            if (take) {                                                                           \
                const __m256i order = _mm256_loadu_si256((const __m256i *)chosen_first[take]);    \
                _mm256_storeu_si256((__m256i *)(positions + at), _mm256_permutevar8x32_epi32(index, order)); \
                STORE(keys, at, _mm256_permutevar8x32_epi32(key, order));                         \
                at += __builtin_popcount(take);                                                   \
            }                                                                                     \
            index = _mm256_add_epi32(index, _mm256_set1_epi32(8));                                \
        }                                                                                         \
    }
#else
#define VECTOR_CANDIDATES(LOAD, STORE)
#endif

/* Magnitude keys (the bits without the sign) at least floor: their positions (int32, ascending)
 * and keys, written when there are at most capacity of them. Returns how many there are
 * (more than capacity: nothing written, call again with room), or -1 if out of memory. */
#define CANDIDATES(NAME, KEY, SIGN_MASK, LOAD, STORE)                                                 \
    int64_t NAME(const KEY *x, int64_t count, int64_t floor, int32_t *positions, KEY *keys,         \
                 int64_t capacity, int threads) {                                                   \
        const int64_t blocks = (count + SELECT_BLOCK - 1) / SELECT_BLOCK;                           \
        int64_t *found = malloc((size_t)(blocks + 1) * sizeof(int64_t));                            \
        if (!found) return -1;                                                                      \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                           \
        for (int64_t b = 0; b < blocks; b++) {                                                      \
            const int64_t stop = (b + 1) * SELECT_BLOCK < count ? (b + 1) * SELECT_BLOCK : count;   \
            int64_t n = 0;                                                                          \
            for (int64_t i = b * SELECT_BLOCK; i < stop; i++) n += (x[i] & SIGN_MASK) >= floor;     \
            found[b + 1] = n;                                                                       \
        }                                                                                           \
        found[0] = 0;                                                                               \
        for (int64_t b = 0; b < blocks; b++) found[b + 1] += found[b];                              \
        const int64_t total = found[blocks];                                                        \
        if (total <= capacity) {                                                                    \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
            for (int64_t b = 0; b < blocks; b++) {                                                  \
                const int64_t stop = (b + 1) * SELECT_BLOCK < count ? (b + 1) * SELECT_BLOCK : count; \
                int64_t at = found[b];                                                              \
                int64_t i = b * SELECT_BLOCK;                                                       \
                VECTOR_CANDIDATES(LOAD, STORE)                                                      \
                for (; i < stop; i++) {                                                             \
                    const KEY key = (KEY)(x[i] & SIGN_MASK);                                        \
                    if (key >= floor) {                                                             \
                        positions[at] = (int32_t)i;                                                 \
                        keys[at++] = key;                                                           \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        free(found);                                                                                \
        return total;                                                                               \
    }

CANDIDATES(actcomp_candidates_32, int32_t, 0x7FFFFFFF, keys_of, store_keys)
CANDIDATES(actcomp_candidates_16, int16_t, 0x7FFF, keys16_of, store_keys16)

/* eager_select.py's _with_ties: the positions of the candidates whose key is above key, and of
 * the first ties ones equal to it, moved to the front of positions in order (never past where
 * they are read). Returns how many. */
#define COMPACT(NAME, KEY)                                                                           \
    int64_t NAME(int32_t *positions, const KEY *keys, int64_t count, int64_t key, int64_t ties) {   \
        int64_t at = 0;                                                                              \
        for (int64_t i = 0; i < count; i++) {                                                        \
            const int above = keys[i] > key;                                                         \
            const int tie = keys[i] == key && ties > 0;                                              \
            ties -= tie;                                                                             \
            positions[at] = positions[i];                                                            \
            at += above | tie;                                                                       \
        }                                                                                            \
        return at;                                                                                   \
    }

COMPACT(actcomp_compact_32, int32_t)
COMPACT(actcomp_compact_16, int16_t)

/* Elias-Fano positions (positions.py's EliasFano): slot j's position p sets bit (p >> low_bits) + j
 * of the high stream, and its low low_bits bits are code j of the low stream (little-endian,
 * code j at bit j * low_bits). Both streams are zeroed by the caller. One pass over the slots:
 * they are a tenth of the elements or fewer. */
void actcomp_ef_encode(const int32_t *positions, int64_t capacity, int low_bits, uint8_t *high, uint8_t *low) {
    const uint32_t mask = (1u << low_bits) - 1u;
    for (int64_t j = 0; j < capacity; j++) {
        const int64_t position = positions[j];
        const int64_t bit = (position >> low_bits) + j;
        high[bit >> 3] |= (uint8_t)(1u << (bit & 7));
        if (low_bits) {
            const uint32_t code = (uint32_t)position & mask;
            const int64_t at = j * low_bits;
            const int shift = (int)(at & 7);
            low[at >> 3] |= (uint8_t)(code << shift);
            if (shift + low_bits > 8) low[(at >> 3) + 1] |= (uint8_t)(code >> (8 - shift));
        }
    }
}

/* Bytes of the high stream per parallel task when scattering. */
#define SCATTER_BYTES 8192

static inline uint32_t read_code(const uint8_t *low, int64_t low_bytes, int64_t slot, int low_bits) {
    const int64_t at = slot * low_bits;
    const int64_t byte = at >> 3;
    uint32_t pair = low[byte];
    if (byte + 1 < low_bytes) pair |= (uint32_t)low[byte + 1] << 8;
    return (pair >> (at & 7)) & ((1u << low_bits) - 1u);
}

/* EliasFano.scatter: a tensor of count zeros with each slot's value (its bits, 2 or 4 bytes wide)
 * put at its position; slots whose position is count (left empty) put nothing. Tasks of the
 * high stream run in parallel, each starting at the slot its bits' popcount before it says. */
#define EF_SCATTER(NAME, WORD)                                                                        \
    int64_t NAME(const WORD *values, int64_t capacity, const uint8_t *high, int64_t high_bytes,       \
                 const uint8_t *low, int64_t low_bytes, int low_bits, int64_t count, WORD *out,        \
                 int threads) {                                                                       \
        const int64_t tasks = (high_bytes + SCATTER_BYTES - 1) / SCATTER_BYTES;                       \
        int64_t *first_slot = malloc((size_t)(tasks + 1) * sizeof(int64_t));                          \
        if (!first_slot) return -1;                                                                   \
        _Pragma("omp parallel num_threads(threads)")                                                   \
        {                                                                                             \
            _Pragma("omp for schedule(static)")                                                        \
            for (int64_t i = 0; i < count; i++) out[i] = 0;                                           \
            _Pragma("omp for schedule(static)")                                                        \
            for (int64_t task = 0; task < tasks; task++) {                                            \
                const int64_t stop = (task + 1) * SCATTER_BYTES < high_bytes ? (task + 1) * SCATTER_BYTES \
                                                                                : high_bytes;          \
                int64_t ones = 0;                                                                     \
                for (int64_t b = task * SCATTER_BYTES; b < stop; b++) ones += __builtin_popcount(high[b]); \
                first_slot[task + 1] = ones;                                                          \
            }                                                                                         \
            _Pragma("omp single")                                                                      \
            {                                                                                         \
                first_slot[0] = 0;                                                                    \
                for (int64_t task = 0; task < tasks; task++) first_slot[task + 1] += first_slot[task]; \
            }                                                                                         \
            _Pragma("omp for schedule(static)")                                                        \
            for (int64_t task = 0; task < tasks; task++) {                                            \
                const int64_t stop = (task + 1) * SCATTER_BYTES < high_bytes ? (task + 1) * SCATTER_BYTES \
                                                                                : high_bytes;          \
                int64_t slot = first_slot[task];                                                      \
                /* Eight bytes at a time (a word's set bits visited by count-trailing-zeros): one  \
                 * unpredictable loop exit per word, not per byte. */                              \
                for (int64_t b = task * SCATTER_BYTES; b < stop; b += 8) {                            \
                    uint64_t word = 0;                                                                \
                    memcpy(&word, high + b, (size_t)(stop - b < 8 ? stop - b : 8));                   \
                    while (word) {                                                                    \
                        const int64_t bit = b * 8 + __builtin_ctzll(word);                            \
                        word &= word - 1;                                                             \
                        const int64_t position = ((bit - slot) << low_bits)                           \
                            | (low_bits ? read_code(low, low_bytes, slot, low_bits) : 0);             \
                        if (position < count && slot < capacity) out[position] = values[slot];        \
                        slot++;                                                                       \
                    }                                                                                 \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        free(first_slot);                                                                             \
        return 0;                                                                                     \
    }

EF_SCATTER(actcomp_ef_scatter_16, uint16_t)
EF_SCATTER(actcomp_ef_scatter_32, uint32_t)

/* The radix selects below for a few keys (up to SMALL_SELECT of them): digits of at most 11
 * bits, each counted into one histogram of 2048 bins on the stack (three passes over 31-bit keys,
 * the later two counting only the keys that share the digits found so far). The 16-bit digits
 * below allocate and zero 256 KiB and scan up to 98,304 bins per call, about 18 us whatever the
 * count: most of a min-k encode of a small layer's input. The answer is unique, so both give it
 * bit for bit. */
#define SMALL_SELECT 32768
#define SMALL_SELECT_OVER(NAME, WORD)                                                                \
    static int64_t NAME(const WORD *x, int64_t count, int64_t kept, int key_bits, uint32_t mask,    \
                        int64_t *ties) {                                                             \
        uint32_t histogram[2048];                                                                    \
        const int digits = (key_bits + 10) / 11;                                                     \
        int shift = key_bits;                                                                        \
        int64_t prefix = 0, wanted = kept;                                                           \
        for (int d = 0; d < digits; d++) {                                                           \
            const int width = (shift + digits - d - 1) / (digits - d);                               \
            const uint32_t bins_mask = (1u << width) - 1;                                            \
            shift -= width;                                                                          \
            memset(histogram, 0, sizeof(uint32_t) << width);                                         \
            if (d == 0) {                                                                            \
                for (int64_t i = 0; i < count; i++) histogram[((uint32_t)x[i] & mask) >> shift]++;   \
            } else {                                                                                 \
                const int high = shift + width;                                                      \
                for (int64_t i = 0; i < count; i++) {                                                \
                    const uint32_t key = (uint32_t)x[i] & mask;                                      \
                    if ((int64_t)(key >> high) == prefix) histogram[(key >> shift) & bins_mask]++;   \
                }                                                                                    \
            }                                                                                        \
            int64_t above = 0, digit = bins_mask;                                                    \
            for (; digit > 0 && above + histogram[digit] < wanted; digit--) above += histogram[digit]; \
            wanted -= above;                                                                         \
            prefix = (prefix << width) | digit;                                                      \
        }                                                                                            \
        *ties = wanted;                                                                              \
        return prefix;                                                                               \
    }

SMALL_SELECT_OVER(small_select_32, uint32_t)
SMALL_SELECT_OVER(small_select_16, uint16_t)

/* thresholds.py's select_threshold over keys (non-negative, of key_bits bits): the kept-th
 * largest key, returned, and in *ties how many keys equal to it are kept (kept less those
 * above it). Radix select: a histogram of the top digit, then one of the rest among the keys
 * sharing it. The answer is unique, so it is the ATen path's bit for bit. Returns -1 if out
 * of memory. */
#define SELECT(NAME, KEY, SMALL, UNSIGNED)                                                           \
    int64_t NAME(const KEY *keys, int64_t count, int64_t kept, int key_bits, int64_t *ties) {        \
        if (count <= SMALL_SELECT)                                                                    \
            return SMALL((const UNSIGNED *)keys, count, kept, key_bits, 0xFFFFFFFFu, ties);           \
        const int low_bits = key_bits > 16 ? 16 : 0;                                                  \
        const int64_t top_bins = (int64_t)1 << (key_bits - low_bits);                                 \
        uint32_t *histogram = calloc((size_t)(top_bins > 65536 ? top_bins : 65536), sizeof(uint32_t)); \
        if (!histogram) return -1;                                                                    \
        for (int64_t i = 0; i < count; i++) histogram[keys[i] >> low_bits]++;                         \
        int64_t above = 0, digit = top_bins - 1;                                                      \
        for (; digit > 0 && above + histogram[digit] < kept; digit--) above += histogram[digit];      \
        int64_t wanted = kept - above, key = digit;                                                   \
        if (low_bits) {                                                                               \
            memset(histogram, 0, 65536 * sizeof(uint32_t));                                           \
            for (int64_t i = 0; i < count; i++)                                                       \
                if ((keys[i] >> low_bits) == digit) histogram[keys[i] & 0xFFFF]++;                    \
            int64_t below_top = 0, rest = 65535;                                                      \
            for (; rest > 0 && below_top + histogram[rest] < wanted; rest--) below_top += histogram[rest]; \
            wanted -= below_top;                                                                      \
            key = (digit << low_bits) | rest;                                                         \
        }                                                                                             \
        free(histogram);                                                                              \
        *ties = wanted;                                                                               \
        return key;                                                                                   \
    }

SELECT(actcomp_select_32, int32_t, small_select_32, uint32_t)
SELECT(actcomp_select_16, int16_t, small_select_16, uint16_t)

/* select_threshold over the magnitude keys of the data itself (x[i] with the sign bit cleared):
 * the SELECT above without the keys materialized, each thread counting its share of the
 * elements into a histogram of its own. Min-k keeping more than about 15% of the elements
 * (Bitmask positions) starts here: its candidates would weigh more than the input. */
#define SELECT_DATA(NAME, WORD, SIGN_MASK, SMALL)                                                    \
    int64_t NAME(const WORD *x, int64_t count, int64_t kept, int key_bits, int threads, int64_t *ties) { \
        if (count <= SMALL_SELECT) return SMALL(x, count, kept, key_bits, SIGN_MASK, ties);           \
        const int low_bits = key_bits > 16 ? 16 : 0;                                                  \
        const int64_t top_bins = (int64_t)1 << (key_bits - low_bits);                                 \
        const int64_t bins = top_bins > 65536 ? top_bins : 65536;                                     \
        uint32_t *histograms = calloc((size_t)(bins * threads), sizeof(uint32_t));                    \
        if (!histograms) return -1;                                                                   \
        uint32_t *histogram = histograms;                                                             \
        /* A share of the elements per thread (no OpenMP call: the build may lack its header). */   \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
        for (int t = 0; t < threads; t++) {                                                           \
            uint32_t *own = histograms + bins * t;                                                    \
            const int64_t stop = count * (t + 1) / threads;                                           \
            for (int64_t i = count * t / threads; i < stop; i++) own[(x[i] & SIGN_MASK) >> low_bits]++; \
        }                                                                                             \
        for (int t = 1; t < threads; t++)                                                             \
            for (int64_t b = 0; b < top_bins; b++) histogram[b] += histograms[bins * t + b];           \
        int64_t above = 0, digit = top_bins - 1;                                                      \
        for (; digit > 0 && above + histogram[digit] < kept; digit--) above += histogram[digit];      \
        int64_t wanted = kept - above, key = digit;                                                   \
        if (low_bits) {                                                                               \
            memset(histograms, 0, (size_t)(bins * threads) * sizeof(uint32_t));                        \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                         \
            for (int t = 0; t < threads; t++) {                                                       \
                uint32_t *own = histograms + bins * t;                                                \
                const int64_t stop = count * (t + 1) / threads;                                       \
                for (int64_t i = count * t / threads; i < stop; i++) {                                \
                    const uint32_t key_i = x[i] & SIGN_MASK;                                          \
                    if ((key_i >> low_bits) == (uint32_t)digit) own[key_i & 0xFFFF]++;                \
                }                                                                                     \
            }                                                                                         \
            for (int t = 1; t < threads; t++)                                                         \
                for (int64_t b = 0; b < 65536; b++) histogram[b] += histograms[bins * t + b];          \
            int64_t below_top = 0, rest = 65535;                                                      \
            for (; rest > 0 && below_top + histogram[rest] < wanted; rest--) below_top += histogram[rest]; \
            wanted -= below_top;                                                                      \
            key = (digit << low_bits) | rest;                                                         \
        }                                                                                             \
        free(histograms);                                                                             \
        *ties = wanted;                                                                               \
        return key;                                                                                   \
    }

SELECT_DATA(actcomp_select_data_32, uint32_t, 0x7FFFFFFFu, small_select_32)
SELECT_DATA(actcomp_select_data_16, uint16_t, 0x7FFFu, small_select_16)

/* Min-k under an exact threshold, per block of SELECT_BLOCK elements (a multiple of 8: a bitmask's
 * blocks write whole bytes): into slot[b] the block's first slot, into tied[b] how many of its keys
 * equal to key it keeps (the first ties ones in position order over the whole tensor). Returns how
 * many are kept. BITMASK_KEEP and KEPT_POSITIONS then write each block from its own slot. */
#define KEPT_BLOCKS(NAME, WORD, SIGN_MASK)                                                           \
    static int64_t NAME(const WORD *x, int64_t count, int64_t key, int64_t ties, int64_t *slot,      \
                        int64_t *tied, int threads) {                                                \
        const int64_t blocks = (count + SELECT_BLOCK - 1) / SELECT_BLOCK;                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                           \
        for (int64_t b = 0; b < blocks; b++) {                                                      \
            const int64_t stop = (b + 1) * SELECT_BLOCK < count ? (b + 1) * SELECT_BLOCK : count;   \
            int64_t over = 0, same = 0;                                                             \
            for (int64_t i = b * SELECT_BLOCK; i < stop; i++) {                                     \
                const int64_t key_i = x[i] & SIGN_MASK;                                             \
                over += key_i > key;                                                                \
                same += key_i == key;                                                               \
            }                                                                                       \
            slot[b] = over;                                                                         \
            tied[b] = same;                                                                         \
        }                                                                                           \
        int64_t kept = 0, left = ties;                                                              \
        for (int64_t b = 0; b < blocks; b++) {                                                      \
            const int64_t keeps_tied = tied[b] < left ? tied[b] : left;                             \
            const int64_t keeps = slot[b] + keeps_tied;                                             \
            slot[b] = kept;                                                                         \
            tied[b] = keeps_tied;                                                                   \
            kept += keeps;                                                                          \
            left -= keeps_tied;                                                                     \
        }                                                                                           \
        return kept;                                                                                \
    }

KEPT_BLOCKS(kept_blocks_32, uint32_t, 0x7FFFFFFFu)
KEPT_BLOCKS(kept_blocks_16, uint16_t, 0x7FFFu)

/* positions.py's encode_kept with Bitmask positions under an exact threshold: the elements whose
 * key is above key, and the first ties equal to it in position order, set in bits (a bit per
 * element, little-end first, zeroed by the caller) and their values written to values in
 * position order. Blocks of SELECT_BLOCK elements (a multiple of 8: each writes whole bytes)
 * count their kept first, so each thread writes from its own slot. Returns how many were kept,
 * or -1 if out of memory. */
#define BITMASK_KEEP(NAME, BLOCKS, WORD, SIGN_MASK)                                                  \
    int64_t NAME(const WORD *x, int64_t count, int64_t key, int64_t ties, uint8_t *bits, WORD *values, \
                 int threads) {                                                                      \
        const int64_t blocks = (count + SELECT_BLOCK - 1) / SELECT_BLOCK;                           \
        int64_t *above = malloc((size_t)(2 * blocks + 2) * sizeof(int64_t));                        \
        if (!above) return -1;                                                                      \
        int64_t *tied_in = above + blocks + 1;                                                      \
        const int64_t slot = BLOCKS(x, count, key, ties, above, tied_in, threads);                  \
        /* The bits first (a compare per element; a running tie count only in the blocks that   \
         * keep ties, and only until they are kept), then the kept values copied  \
         * by visiting the set bits a word at a time. */                                         \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                           \
        for (int64_t b = 0; b < blocks; b++) {                                                      \
            const int64_t begin = b * SELECT_BLOCK;                                                 \
            const int64_t stop = begin + SELECT_BLOCK < count ? begin + SELECT_BLOCK : count;       \
            int64_t may_tie = tied_in[b];                                                           \
            for (int64_t start = begin; start < stop; start += 8) {                                 \
                const int64_t end = start + 8 < stop ? start + 8 : stop;                            \
                uint32_t byte = 0;                                                                  \
                if (may_tie > 0) {                                                                  \
                    for (int64_t i = start; i < end; i++) {                                         \
                        const int64_t key_i = x[i] & SIGN_MASK;                                     \
                        const int tie = (key_i == key) & (may_tie > 0);                             \
                        may_tie -= tie;                                                             \
                        byte |= (uint32_t)((key_i > key) | tie) << (i - start);                     \
                    }                                                                               \
                } else {                                                                            \
                    for (int64_t i = start; i < end; i++)                                           \
                        byte |= (uint32_t)((int64_t)(x[i] & SIGN_MASK) > key) << (i - start);       \
                }                                                                                   \
                bits[start >> 3] = (uint8_t)byte;                                                   \
            }                                                                                       \
            int64_t at = above[b];                                                                  \
            for (int64_t byte = begin / 8; byte < (stop + 7) / 8; byte += 8) {                      \
                uint64_t word = 0;                                                                  \
                const int64_t bytes = (stop + 7) / 8 - byte;                                        \
                memcpy(&word, bits + byte, (size_t)(bytes < 8 ? bytes : 8));                        \
                while (word) {                                                                      \
                    values[at++] = x[byte * 8 + __builtin_ctzll(word)];                             \
                    word &= word - 1;                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        free(above);                                                                                \
        return slot;                                                                                \
    }

BITMASK_KEEP(actcomp_bitmask_keep_32, kept_blocks_32, uint32_t, 0x7FFFFFFFu)
BITMASK_KEEP(actcomp_bitmask_keep_16, kept_blocks_16, uint16_t, 0x7FFFu)

/* The ascending int32 positions of the elements BITMASK_KEEP keeps (key above key, the first ties
 * equal to it), for the forms that store positions (Elias-Fano): min-k between what candidates
 * hold and what a bitmask stores better. Returns how many, or -1 if out of memory. */
#define KEPT_POSITIONS(NAME, BLOCKS, WORD, SIGN_MASK)                                                \
    int64_t NAME(const WORD *x, int64_t count, int64_t key, int64_t ties, int32_t *positions,        \
                 int threads) {                                                                      \
        const int64_t blocks = (count + SELECT_BLOCK - 1) / SELECT_BLOCK;                           \
        if (blocks <= 1) {                                                                          \
            /* One block starts at slot 0: no counting pass (a small layer's input). */             \
            int64_t at = 0, may_tie = ties;                                                         \
            for (int64_t i = 0; i < count; i++) {                                                   \
                const int64_t key_i = x[i] & SIGN_MASK;                                             \
                const int tie = (key_i == key) & (may_tie > 0);                                     \
                may_tie -= tie;                                                                     \
                if ((key_i > key) | tie) positions[at++] = (int32_t)i;                              \
            }                                                                                       \
            return at;                                                                              \
        }                                                                                           \
        int64_t *above = malloc((size_t)(2 * blocks + 2) * sizeof(int64_t));                        \
        if (!above) return -1;                                                                      \
        int64_t *equal = above + blocks + 1;                                                        \
        const int64_t slot = BLOCKS(x, count, key, ties, above, equal, threads);                    \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                           \
        for (int64_t b = 0; b < blocks; b++) {                                                      \
            const int64_t stop = (b + 1) * SELECT_BLOCK < count ? (b + 1) * SELECT_BLOCK : count;   \
            int64_t at = above[b], may_tie = equal[b];                                              \
            for (int64_t i = b * SELECT_BLOCK; i < stop; i++) {                                     \
                const int64_t key_i = x[i] & SIGN_MASK;                                             \
                const int tie = (key_i == key) & (may_tie > 0);                                     \
                may_tie -= tie;                                                                     \
                if ((key_i > key) | tie) positions[at++] = (int32_t)i;                              \
            }                                                                                       \
        }                                                                                           \
        free(above);                                                                                \
        return slot;                                                                                \
    }

KEPT_POSITIONS(actcomp_kept_positions_32, kept_blocks_32, uint32_t, 0x7FFFFFFFu)
KEPT_POSITIONS(actcomp_kept_positions_16, kept_blocks_16, uint16_t, 0x7FFFu)

/* Bitmask.scatter: count zeros (all bits clear), and value slot j at the j-th set bit of bits.
 * Returns -1 if out of memory. */
#define BITMASK_EXPAND(NAME, WORD)                                                                   \
    int64_t NAME(const uint8_t *bits, const WORD *values, int64_t slots, int64_t count, WORD *out,   \
                 int threads) {                                                                      \
        const int64_t blocks = (count + SELECT_BLOCK - 1) / SELECT_BLOCK;                           \
        int64_t *first = malloc((size_t)(blocks + 1) * sizeof(int64_t));                            \
        if (!first) return -1;                                                                      \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                           \
        for (int64_t b = 0; b < blocks; b++) {                                                      \
            const int64_t stop = (b + 1) * SELECT_BLOCK < count ? (b + 1) * SELECT_BLOCK : count;   \
            int64_t ones = 0;                                                                       \
            for (int64_t byte = b * (SELECT_BLOCK / 8); byte < (stop + 7) / 8; byte++)              \
                ones += __builtin_popcount(bits[byte]);                                             \
            first[b + 1] = ones;                                                                    \
        }                                                                                           \
        first[0] = 0;                                                                               \
        for (int64_t b = 0; b < blocks; b++) first[b + 1] += first[b];                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                           \
        for (int64_t b = 0; b < blocks; b++) {                                                      \
            const int64_t stop = (b + 1) * SELECT_BLOCK < count ? (b + 1) * SELECT_BLOCK : count;   \
            int64_t slot = first[b];                                                                \
            /* Zeros, then the set bits visited a word at a time by count-trailing-zeros. */      \
            memset(out + b * SELECT_BLOCK, 0, (size_t)(stop - b * SELECT_BLOCK) * sizeof(WORD));   \
            for (int64_t byte = b * (SELECT_BLOCK / 8); byte < (stop + 7) / 8; byte += 8) {         \
                uint64_t word = 0;                                                                  \
                const int64_t bytes = (stop + 7) / 8 - byte;                                        \
                memcpy(&word, bits + byte, (size_t)(bytes < 8 ? bytes : 8));                        \
                while (word) {                                                                      \
                    /* Never past the block or the slots, whatever bits a caller hands in. */      \
                    const int64_t position = byte * 8 + __builtin_ctzll(word);                      \
                    if (position < stop && slot < slots) out[position] = values[slot];              \
                    slot++;                                                                         \
                    word &= word - 1;                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        free(first);                                                                                \
        return 0;                                                                                   \
    }

BITMASK_EXPAND(actcomp_bitmask_expand_16, uint16_t)
BITMASK_EXPAND(actcomp_bitmask_expand_32, uint32_t)

/* positions.py's encode_positions: the values at the slots' positions, +0 (all bits clear) for
 * an empty slot (position count). */
#define GATHER(NAME, WORD)                                                                            \
    void NAME(const WORD *flat, int64_t count, const int32_t *positions, int64_t slots, WORD *out,    \
              int threads) {                                                                          \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
        for (int64_t j = 0; j < slots; j++) out[j] = positions[j] < count ? flat[positions[j]] : 0;   \
    }

GATHER(actcomp_gather_16, uint16_t)
GATHER(actcomp_gather_32, uint32_t)

/* fp8 e4m3fn, as torch converts: round to nearest even, subnormals included (through a float
 * addition that aligns their bits); the encoder clamps to +-448 first, so no NaN is made. */
static inline uint8_t float_to_e4m3fn(float value) {
    uint32_t bits = float_to_bits(value);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t result;
    if (bits >= (1087u << 20)) {
        result = 0x7F;
    } else if (bits < (121u << 23)) {
        const uint32_t denormal = 141u << 23;
        result = (uint8_t)(float_to_bits(bits_to_float(bits) + bits_to_float(denormal)) - denormal);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
        result = (uint8_t)(bits >> 20);
    }
    return result | (uint8_t)(sign >> 24);
}

static inline float e4m3fn_to_float(uint8_t code) {
    const uint32_t sign = (uint32_t)(code & 0x80) << 24, exponent = (code >> 3) & 0xF, mantissa = code & 7;
    if (exponent == 0xF && mantissa == 7) return NAN;
    if (exponent == 0) return bits_to_float(sign) + (sign ? -1.0f : 1.0f) * (float)mantissa * 0x1p-9f;
    return bits_to_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

/* casts.py's Fp8: *amax = max(-min, max) of x (its dtype's values, exact in float). */
static inline __attribute__((always_inline)) void fp8_range(const void *x, int64_t count, float *amax,
                                                            int threads, const int dtype) {
    float low = INFINITY, high = -INFINITY;
#pragma omp parallel num_threads(threads)
    {
        float my_low = INFINITY, my_high = -INFINITY;
#pragma omp for schedule(static) nowait
        for (int64_t start = 0; start < count; start += TILE * 64) {
            const int64_t stop = start + TILE * 64 < count ? start + TILE * 64 : count;
            float part_low, part_high;
            group_range(x, start, stop, &part_low, &part_high, dtype);
            /* A NaN part (see group_range) stays NaN. */
            my_low = part_low < my_low || part_low != part_low ? part_low : my_low;
            my_high = part_high > my_high || part_high != part_high ? part_high : my_high;
        }
#pragma omp critical
        {
            low = my_low < low || my_low != my_low ? my_low : low;
            high = my_high > high || my_high != my_high ? my_high : high;
        }
    }
    *amax = !count ? 0.0f : low != low ? NAN : (-low > high ? -low : high);
}

#if defined(ACTCOMP_AVX2)
/* float_to_e4m3fn for eight values, its three cases computed for every lane and blended (GCC
 * vectorizes the branchy scalar form with AVX-512's masks, not with AVX2). */
static inline __m256i e4m3fn_eight(__m256 value) {
    const __m256i all = _mm256_castps_si256(value);
    const __m256i sign = _mm256_and_si256(all, _mm256_set1_epi32((int32_t)0x80000000u));
    const __m256i bits = _mm256_xor_si256(all, sign); /* below 2**31: signed comparisons are unsigned ones */
    const __m256i saturated = _mm256_cmpgt_epi32(bits, _mm256_set1_epi32((1087 << 20) - 1));
    const __m256i subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), bits);
    const __m256i denormal = _mm256_set1_epi32(141 << 23);
    const __m256i subnormal_code = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(denormal))), denormal);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
    const __m256i normal_code = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32((int32_t)((uint32_t)(7 - 127) << 23) + 0x7FFFF))),
        20);
    __m256i code = _mm256_blendv_epi8(normal_code, subnormal_code, subnormal);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), saturated);
    /* The scalar form's (uint8_t) keeps the low byte. */
    return _mm256_or_si256(_mm256_and_si256(code, _mm256_set1_epi32(0xFF)), _mm256_srli_epi32(sign, 24));
}

/* (x / step) clamped to +-448 as fp8_encode's scalar steps do: MAXPS/MINPS with the value second
 * keep a NaN, as those comparisons do. */
static inline __attribute__((always_inline)) __m256i fp8_codes_eight(const void *x, int64_t at, __m256 step,
                                                                     const int dtype) {
    const __m256 value = _mm256_div_ps(load_eight(x, at, dtype), step);
    return e4m3fn_eight(_mm256_min_ps(_mm256_set1_ps(448.0f), _mm256_max_ps(_mm256_set1_ps(-448.0f), value)));
}
#endif

static inline __attribute__((always_inline)) void fp8_encode(const void *x, int64_t count, const float *scale,
                                                             uint8_t *codes, int threads, const int dtype) {
    const float step = *scale;
#if defined(ACTCOMP_AVX2)
    const int64_t vectored = count / 32 * 32;
    const __m256 steps = _mm256_set1_ps(step);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < vectored; i += 32)
        store_thirty_two(codes + i, fp8_codes_eight(x, i, steps, dtype), fp8_codes_eight(x, i + 8, steps, dtype),
                         fp8_codes_eight(x, i + 16, steps, dtype), fp8_codes_eight(x, i + 24, steps, dtype));
#else
#define vectored 0 /* a literal: a variable would be captured by the OpenMP region and change its code */
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = vectored; i < count; i++) {
        float value = load(x, i, dtype) / step;
        value = value < -448.0f ? -448.0f : value;
        value = value > 448.0f ? 448.0f : value;
        codes[i] = float_to_e4m3fn(value);
    }
#undef vectored
}

static inline __attribute__((always_inline)) void fp8_decode(const uint8_t *codes, int64_t count, const float *scale,
                                                             void *out, int threads, const int dtype) {
    const float step = *scale;
    const float limit = dtype == 0 ? 3.4028234663852886e38f : 3.3895313892515355e38f;
    float table[256]; /* every code's value: a load from L1 instead of a branchy conversion */
    for (int code = 0; code < 256; code++) table[code] = e4m3fn_to_float((uint8_t)code);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < count; i++) {
        float value = table[codes[i]] * step;
        value = value < -limit ? -limit : value;
        value = value > limit ? limit : value;
        if (dtype == 0) ((float *)out)[i] = value;
        else ((uint16_t *)out)[i] = float_to_bf16(value);
    }
}

void actcomp_fp8_range_f32(const float *x, int64_t count, float *amax, int threads) {
    fp8_range(x, count, amax, threads, 0);
}
void actcomp_fp8_range_bf16(const uint16_t *x, int64_t count, float *amax, int threads) {
    fp8_range(x, count, amax, threads, 1);
}
void actcomp_fp8_encode_f32(const float *x, int64_t count, const float *scale, uint8_t *codes, int threads) {
    fp8_encode(x, count, scale, codes, threads, 0);
}
void actcomp_fp8_encode_bf16(const uint16_t *x, int64_t count, const float *scale, uint8_t *codes, int threads) {
    fp8_encode(x, count, scale, codes, threads, 1);
}
void actcomp_fp8_decode_f32(const uint8_t *codes, int64_t count, const float *scale, float *out, int threads) {
    fp8_decode(codes, count, scale, out, threads, 0);
}
void actcomp_fp8_decode_bf16(const uint8_t *codes, int64_t count, const float *scale, uint16_t *out, int threads) {
    fp8_decode(codes, count, scale, out, threads, 1);
}

/* exact_codecs.py's one-bit masks. Encode: bit i (of byte i / 8, little end first) set where
 * the predicate holds, mode 0 ReLU's not (x <= 0) (NaN holds), mode 1 x > 0; a last partial
 * byte's spare bits clear. Decode: each element the word inside where its bit is set, outside
 * where not (the values' bits, 2 or 4 bytes wide). */
static inline int mask_holds(float value, int mode) {
    return mode == 0 ? !(value <= 0.0f) : value > 0.0f;
}

static inline __attribute__((always_inline)) void mask_pack(const void *x, int64_t count, int mode,
                                                            uint8_t *bits, int threads, const int dtype) {
    const int64_t bytes = (count + 7) / 8;
    const int64_t whole = count / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < (whole + 1) / 2; block++) {
        const int64_t first = block * 16;
#ifdef ACTCOMP_AVX512
        if (first + 16 <= count) {
            __m512 values = dtype == 0 ? _mm512_loadu_ps((const float *)x + first)
                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                      _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + first))), 16));
            const __mmask16 held = mode == 0 ? _mm512_cmp_ps_mask(values, _mm512_setzero_ps(), _CMP_NLE_UQ)
                                             : _mm512_cmp_ps_mask(values, _mm512_setzero_ps(), _CMP_GT_OQ);
            memcpy(bits + block * 2, &held, 2);
            continue;
        }
#elif defined(ACTCOMP_AVX2)
        if (first + 16 <= count) {
            const __m256 low = load_eight(x, first, dtype), high = load_eight(x, first + 8, dtype);
            const __m256 zero = _mm256_setzero_ps();
            const int held = mode == 0
                ? _mm256_movemask_ps(_mm256_cmp_ps(low, zero, _CMP_NLE_UQ))
                    | _mm256_movemask_ps(_mm256_cmp_ps(high, zero, _CMP_NLE_UQ)) << 8
                : _mm256_movemask_ps(_mm256_cmp_ps(low, zero, _CMP_GT_OQ))
                    | _mm256_movemask_ps(_mm256_cmp_ps(high, zero, _CMP_GT_OQ)) << 8;
            const uint16_t packed = (uint16_t)held;
            memcpy(bits + block * 2, &packed, 2);
            continue;
        }
#endif
        for (int64_t byte = block * 2; byte < block * 2 + 2 && byte < whole; byte++) {
            uint8_t packed = 0;
            for (int k = 0; k < 8; k++) packed |= (uint8_t)(mask_holds(load(x, byte * 8 + k, dtype), mode) << k);
            bits[byte] = packed;
        }
    }
    if (bytes > whole) {
        uint8_t packed = 0;
        for (int64_t i = whole * 8; i < count; i++) packed |= (uint8_t)(mask_holds(load(x, i, dtype), mode) << (i - whole * 8));
        bits[whole] = packed;
    }
}

void actcomp_mask_pack_f32(const float *x, int64_t count, int mode, uint8_t *bits, int threads) {
    mask_pack(x, count, mode, bits, threads, 0);
}
void actcomp_mask_pack_bf16(const uint16_t *x, int64_t count, int mode, uint8_t *bits, int threads) {
    mask_pack(x, count, mode, bits, threads, 1);
}

#ifdef ACTCOMP_AVX512
/* Sixteen elements from two bytes of bits: one masked blend of the two stand-ins. */
#define MASK_UNPACK_16_LANES(WORD)                                                                    \
    if (sizeof(WORD) == 4) {                                                                          \
        const __m512i outside_lanes = _mm512_set1_epi32((int32_t)outside);                            \
        const __m512i inside_lanes = _mm512_set1_epi32((int32_t)inside);                              \
        for (; byte + 2 <= stop_byte && (byte + 2) * 8 <= count; byte += 2) {                         \
            uint16_t held;                                                                            \
            memcpy(&held, bits + byte, 2);                                                            \
            _mm512_storeu_si512((void *)(out + byte * 8), _mm512_mask_blend_epi32(held, outside_lanes, inside_lanes)); \
        }                                                                                             \
    } else {                                                                                          \
        const __m256i outside_lanes = _mm256_set1_epi16((int16_t)outside);                            \
        const __m256i inside_lanes = _mm256_set1_epi16((int16_t)inside);                              \
        for (; byte + 2 <= stop_byte && (byte + 2) * 8 <= count; byte += 2) {                         \
            uint16_t held;                                                                            \
            memcpy(&held, bits + byte, 2);                                                            \
            _mm256_storeu_si256((__m256i *)(out + byte * 8), _mm256_mask_blend_epi16(held, outside_lanes, inside_lanes)); \
        }                                                                                             \
    }
#elif defined(ACTCOMP_AVX2)
/* Eight 4-byte or sixteen 2-byte elements at a time: each lane tests its own bit of the
 * broadcast byte(s) and picks its stand-in. */
#define MASK_UNPACK_16_LANES(WORD)                                                                    \
    if (sizeof(WORD) == 4) {                                                                          \
        const __m256i outside_lanes = _mm256_set1_epi32((int32_t)outside);                            \
        const __m256i inside_lanes = _mm256_set1_epi32((int32_t)inside);                              \
        const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);                      \
        for (; byte + 1 <= stop_byte && (byte + 1) * 8 <= count; byte++) {                           \
            const __m256i held = _mm256_cmpeq_epi32(                                                  \
                _mm256_and_si256(_mm256_set1_epi32(bits[byte]), lane_bit), lane_bit);                 \
            _mm256_storeu_si256((__m256i *)(out + byte * 8), _mm256_blendv_epi8(outside_lanes, inside_lanes, held)); \
        }                                                                                             \
    } else {                                                                                          \
        const __m256i outside_lanes = _mm256_set1_epi16((int16_t)outside);                            \
        const __m256i inside_lanes = _mm256_set1_epi16((int16_t)inside);                              \
        const __m256i lane_bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, \
                                                   8192, 16384, (int16_t)0x8000);                     \
        for (; byte + 2 <= stop_byte && (byte + 2) * 8 <= count; byte += 2) {                         \
            uint16_t two;                                                                             \
            memcpy(&two, bits + byte, 2);                                                             \
            const __m256i held = _mm256_cmpeq_epi16(                                                  \
                _mm256_and_si256(_mm256_set1_epi16((int16_t)two), lane_bit), lane_bit);               \
            _mm256_storeu_si256((__m256i *)(out + byte * 8), _mm256_blendv_epi8(outside_lanes, inside_lanes, held)); \
        }                                                                                             \
    }
#else
#define MASK_UNPACK_16_LANES(WORD)
#endif

/* Bytes of bits per parallel task when unpacking. */
#define UNPACK_BYTES 4096

#define MASK_UNPACK(NAME, WORD)                                                                       \
    void NAME(const uint8_t *bits, int64_t count, const WORD *standins, WORD *out, int threads) {    \
        const WORD outside = standins[0], inside = standins[1];                                      \
        const int64_t bytes = (count + 7) / 8;                                                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
        for (int64_t task = 0; task < (bytes + UNPACK_BYTES - 1) / UNPACK_BYTES; task++) {            \
            int64_t byte = task * UNPACK_BYTES;                                                       \
            const int64_t stop_byte = byte + UNPACK_BYTES < bytes ? byte + UNPACK_BYTES : bytes;      \
            MASK_UNPACK_16_LANES(WORD)                                                                \
            for (; byte < stop_byte; byte++) {                                                        \
                const uint8_t packed = bits[byte];                                                    \
                const int64_t stop = byte * 8 + 8 < count ? byte * 8 + 8 : count;                    \
                for (int64_t i = byte * 8; i < stop; i++) out[i] = (packed >> (i - byte * 8)) & 1 ? inside : outside; \
            }                                                                                         \
        }                                                                                             \
    }

MASK_UNPACK(actcomp_mask_unpack_16, uint16_t)
MASK_UNPACK(actcomp_mask_unpack_32, uint32_t)

/* derivative_codes.py's interval codes (the Few-bit GELU/SiLU codes). Encode: each value's code
 * is the number of ``edges`` strictly below it (NaN: none, code 0, as the reference's
 * comparisons give), ``bits`` (1 to 8) to an element in one little-endian bit stream (code i in
 * bits [i * bits, (i + 1) * bits): bitpack.py's runs of eight codes, a field within a byte where
 * ``bits`` divides 8), a last partial byte's spare bits clear. The edges come as float32 (a
 * bfloat16 input's are bfloat16 values, exact in float32, so the comparisons are the
 * reference's). A block of 64
 * values is compared edge by edge, a loop the compiler vectorizes. Decode: each element the
 * ``table`` entry its code names (the values' bits, 2 or 4 bytes wide). */
#define INTERVAL_BLOCK 64
static inline __attribute__((always_inline)) void interval_pack(const void *x, int64_t count, const float *edges,
                                                                int edge_count, int bits, uint8_t *packed,
                                                                int threads, const int dtype) {
    const int64_t blocks = (count + INTERVAL_BLOCK - 1) / INTERVAL_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t first = block * INTERVAL_BLOCK;
        const int n = (int)(count - first < INTERVAL_BLOCK ? count - first : INTERVAL_BLOCK);
        float value[INTERVAL_BLOCK];
        uint8_t codes[INTERVAL_BLOCK];
        for (int k = 0; k < n; k++) value[k] = load(x, first + k, dtype);
        for (int k = n; k < INTERVAL_BLOCK; k++) value[k] = -INFINITY;  /* code 0: spare fields clear */
        for (int k = 0; k < INTERVAL_BLOCK; k++) codes[k] = 0;
        for (int e = 0; e < edge_count; e++) {
            const float edge = edges[e];
            for (int k = 0; k < INTERVAL_BLOCK; k++) codes[k] += value[k] > edge;
        }
        /* A block starts on a byte: 64 codes are 8 * bits bytes. */
        uint8_t *to = packed + first / 8 * bits;
        uint64_t word = 0;
        int filled = 0, out = 0;
        for (int k = 0; k < n; k++) {
            word |= (uint64_t)codes[k] << filled;
            filled += bits;
            while (filled >= 8) {
                to[out++] = (uint8_t)word;
                word >>= 8;
                filled -= 8;
            }
        }
        if (filled > 0) to[out] = (uint8_t)word;
    }
}

void actcomp_interval_pack_f32(const float *x, int64_t count, const float *edges, int edge_count, int bits,
                               uint8_t *packed, int threads) {
    interval_pack(x, count, edges, edge_count, bits, packed, threads, 0);
}
void actcomp_interval_pack_bf16(const uint16_t *x, int64_t count, const float *edges, int edge_count, int bits,
                                uint8_t *packed, int threads) {
    interval_pack(x, count, edges, edge_count, bits, packed, threads, 1);
}

#define INTERVAL_UNPACK(name, word_t)                                                                      \
    void name(const uint8_t *packed, int64_t count, int bits, const word_t *table, word_t *out, int threads) { \
        const unsigned mask = (1u << bits) - 1;                                                             \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                   \
        for (int64_t i = 0; i < count; i++) {                                                               \
            const int64_t at = i * bits;                                                                    \
            const int shift = (int)(at & 7);                                                                \
            unsigned code = packed[at >> 3] >> shift;                                                       \
            /* A field that runs into the next byte: that byte holds its end, so it exists. */              \
            if (shift + bits > 8) code |= (unsigned)packed[(at >> 3) + 1] << (8 - shift);                   \
            out[i] = table[code & mask];                                                                    \
        }                                                                                                   \
    }
INTERVAL_UNPACK(actcomp_interval_unpack_16, uint16_t)
INTERVAL_UNPACK(actcomp_interval_unpack_32, uint32_t)

/* casts.py's saturating float32 -> bfloat16 cast, one pass where the reference makes four:
 * finite values beyond bfloat16's largest are clamped to it, infinities stay, the rest round
 * to nearest even as torch casts; NaN becomes nan_bits (torch's NaN on this CPU, which the
 * caller reads from torch: ATen's vectorized cast writes 0xFFFF, its scalar one 0x7FC0). */
void actcomp_saturate_bf16(const float *x, int64_t count, int nan_bits, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < count; i++) {
        const uint32_t bits = float_to_bits(x[i]);
        const uint32_t magnitude = bits & 0x7FFFFFFFu;
        /* 0x7F7F0000 is bfloat16's largest finite value; above it and below infinity, clamp. */
        const uint32_t clamped = magnitude > 0x7F7F0000u && magnitude < 0x7F800000u
            ? (bits & 0x80000000u) | 0x7F7F0000u : bits;
        const uint16_t rounded = (uint16_t)((clamped + 0x7FFFu + ((clamped >> 16) & 1u)) >> 16);
        out[i] = magnitude > 0x7F800000u ? (uint16_t)nan_bits : rounded;
    }
}

/* Python's floor division and modulo on int64 (torch.div(..., rounding_mode="floor"), %). */
static inline int64_t floor_div(int64_t a, int64_t b) {
    const int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline int64_t floor_mod(int64_t a, int64_t b) {
    const int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

/* exact_codecs.py's PoolOffsets. geometry: kernel columns, stride (2), padding (2), dilation
 * (2), the input plane's width, the output plane's rows and columns. Encode: each argmax
 * position's offset inside its window, as the reference computes it for any int64 (floor
 * division, the uint8 cast wrapping), packed bits wide little end first as
 * bitpack.pack_codes packs (1 bit: set where the code is non-zero; else fields summed in a
 * byte). Decode: the positions back, from a table of each code's place in the window. */
static inline uint8_t pool_offset(int64_t index, int64_t origin_row, int64_t origin_col, const int64_t *g) {
    const int64_t width = g[7];
    int64_t row, col;
    if (index >= 0 && index <= 0xFFFFFFFFll && width <= 0xFFFFFFFFll) {  /* 32-bit division: several times faster */
        row = (int64_t)((uint32_t)index / (uint32_t)width);
        col = index - row * width;
    } else {
        row = floor_div(index, width);
        col = floor_mod(index, width);
    }
    const int64_t in_row = floor_div(row - origin_row, g[5]), in_col = floor_div(col - origin_col, g[6]);
    return (uint8_t)(in_row * g[0] + in_col);
}

/* Bytes of codes per parallel task in the pool-offsets encode. */
#define POOL_TASK_BYTES 4096

void actcomp_pool_encode(const int64_t *indices, int64_t count, const int64_t *geometry, int bits, uint8_t *packed,
                         int threads) {
    const int64_t out_cols = geometry[9], plane = geometry[8] * out_cols;
    if (plane <= 0) return;
    const int per_byte = 8 / bits;
    const int64_t bytes = (count + per_byte - 1) / per_byte;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < (bytes + POOL_TASK_BYTES - 1) / POOL_TASK_BYTES; task++) {
        const int64_t first = task * POOL_TASK_BYTES, stop = first + POOL_TASK_BYTES < bytes ? first + POOL_TASK_BYTES : bytes;
        /* The output row and column of the task's first element, then stepped along. */
        const int64_t place = (first * per_byte) % plane;
        int64_t r = place / out_cols, c = place % out_cols;
        for (int64_t byte = first; byte < stop; byte++) {
            uint8_t sum = 0;
            for (int k = 0; k < per_byte; k++) {
                const int64_t i = byte * per_byte + k;
                if (i >= count) break;
                const uint8_t code = pool_offset(indices[i], r * geometry[1] - geometry[3],
                                                 c * geometry[2] - geometry[4], geometry);
                sum = bits == 1 ? (uint8_t)(sum | ((code != 0) << k)) : (uint8_t)(sum + (uint8_t)(code << (k * bits)));
                if (++c == out_cols) {
                    c = 0;
                    if (++r == geometry[8]) r = 0;
                }
            }
            packed[byte] = sum;
        }
    }
}

void actcomp_pool_decode(const uint8_t *packed, int64_t count, const int64_t *geometry, int bits, int64_t *indices,
                         int threads) {
    const int64_t out_rows = geometry[8], out_cols = geometry[9], plane = out_rows * out_cols;
    if (plane <= 0) return;
    const int64_t width = geometry[7];
    int64_t place_of[256];
    for (int code = 0; code < 256; code++)
        place_of[code] = (code / geometry[0]) * geometry[5] * width + (code % geometry[0]) * geometry[6];
    const int per_byte = 8 / bits;
    const int field = (1 << bits) - 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < (count + plane - 1) / plane; p++) {
        for (int64_t r = 0; r < out_rows; r++) {
            const int64_t origin = (r * geometry[1] - geometry[3]) * width - geometry[4];
            for (int64_t c = 0; c < out_cols; c++) {
                const int64_t i = p * plane + r * out_cols + c;
                if (i >= count) break;
                const int code = (packed[i / per_byte] >> ((i % per_byte) * bits)) & field;
                indices[i] = origin + c * geometry[2] + place_of[code];
            }
        }
    }
}
