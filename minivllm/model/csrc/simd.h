/* The GEMMs' vector primitives, one section per target (DESIGN.md, "Kernels per ISA"): each GEMM
 * (gemm.c, quant_gemm.c) is written once over these, so a target is this header's section and nothing
 * else. kernels.py compiles the library for one target (-march=native, or MINIVLLM_CPU_ARCH's value)
 * and the first section the target satisfies is the one built:
 *   avx512  AVX512F/BW/VNNI/BF16 (Sapphire Rapids, Zen 4): vpdpbusd and vdpbf16ps on 512-bit vectors
 *   avx2    AVX2 + FMA + F16C (x86-64-v3): 256-bit vectors; vpdpbusd where the target has AVX-VNNI
 *           (Alder Lake on) or AVX512-VNNI (Ice Lake), else vpmaddubsw + vpmaddwd, kept exact
 *   neon    AArch64 with the dot-product extension (armv8.2-a+dotprod): 128-bit vectors; usdot where
 *           the target has i8mm, else sdot on bytes made signed, kept exact
 * A target with none of these builds no GEMM: kernels.py then reports them as torch's.
 *
 * `vec` is one native vector of LANES float32, `ivec` one of the same width seen as bytes or as LANES
 * int32. Every primitive computes the same numbers on every target (integer ops exactly, float ops one
 * IEEE rounding each); only how many lanes one instruction covers differs, so a kernel's arithmetic per
 * output is the same sequence of roundings on every target, and the results differ across targets only
 * where a kernel chooses a different instruction (AVX-512's vdpbf16ps for 1 or 2 rows; see gemm.c).
 */
#ifndef MINIVLLM_SIMD_H
#define MINIVLLM_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define SIMD_NEON 1
#endif

#if defined(SIMD_AVX512) || defined(SIMD_AVX2)
#include <immintrin.h>
#define SIMD 1

/* bf16 sums as vdpbf16ps computes them (gemm.c): input denormals read as 0, output denormals flushed. */
static inline unsigned denormals_off(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | _MM_FLUSH_ZERO_ON | _MM_DENORMALS_ZERO_ON);
    return csr;
}
static inline void denormals_restore(unsigned csr) { _mm_setcsr(csr); }

/* a / b, rounded once: -ffast-math would make it a * (1 / b), rounded twice, and a product that the
 * twin (quant.quantize_activations) puts at 43.499996 could land on 43.5 and round the other way. */
static inline float exact_div(float a, float b) { return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b))); }
#endif

#if defined(SIMD_AVX512)
#define SIMD_NAME "avx512"
#define LANES 16
typedef __m512 vec;
typedef __m512i ivec;

static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vec_set1(float x) { return _mm512_set1_ps(x); }
static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vec_sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vec_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vec_fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vec_abs(vec a) { return _mm512_abs_ps(a); }
static inline vec vec_max(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline float vec_reduce_max(vec a) { return _mm512_reduce_max_ps(a); }
static inline vec vec_bits(ivec a) { return _mm512_castsi512_ps(a); }
static inline vec vec_from_ivec(ivec a) { return _mm512_cvtepi32_ps(a); }
/* `a` as it is: an empty asm the compiler cannot see through, so -ffast-math cannot reassociate the
 * products that made it with the ones that use it (quant_gemm.c's scales: d * dx is not sc * (d0 * dx)). */
static inline vec vec_fence(vec a) {
    __asm__("" : "+v"(a));
    return a;
}
static inline vec vec_from_bf16(const uint16_t *p) {
    return vec_bits(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vec vec_from_half(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __mmask16 lanes_mask(int n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }
static inline vec vec_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps(lanes_mask(n), p); }
/* A masked store only for a partial vector: a full one stores plainly (Zen 4 takes longer over masked ones). */
static inline void vec_store_n(float *p, vec v, int n) {
    if (n >= LANES) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, lanes_mask(n), v);
}
static inline void vec_store_bf16_n(uint16_t *p, vec v, int n) {
    const __m256i packed = (__m256i)_mm512_cvtneps_pbh(v);
    if (n >= LANES) _mm256_storeu_si256((__m256i *)p, packed);
    else _mm256_mask_storeu_epi16(p, lanes_mask(n), packed);
}

static inline ivec ivec_load(const void *p) { return _mm512_loadu_si512(p); }
static inline void ivec_store(void *p, ivec v) { _mm512_storeu_si512(p, v); }
static inline ivec ivec_zero(void) { return _mm512_setzero_si512(); }
static inline ivec ivec_set1_32(int32_t x) { return _mm512_set1_epi32(x); }
static inline ivec ivec_or(ivec a, ivec b) { return _mm512_or_si512(a, b); }
static inline ivec ivec_and8(ivec a, uint8_t c) { return _mm512_and_si512(a, _mm512_set1_epi8((char)c)); }
static inline ivec ivec_shr16(ivec a, int n) { return _mm512_srli_epi16(a, n); }
static inline ivec ivec_shl16(ivec a, int n) { return _mm512_slli_epi16(a, n); }
/* w + add in each byte where v has `bit`: a byte mask, off the shift port. */
static inline ivec ivec_add8_where(ivec w, ivec v, uint8_t bit, uint8_t add) {
    const __mmask64 where = _mm512_test_epi8_mask(v, _mm512_set1_epi8((char)bit));
    return _mm512_mask_add_epi8(w, where, w, _mm512_set1_epi8((char)add));
}
/* Each byte (< 16) replaced by table[byte]. */
static inline ivec ivec_lut8(const uint8_t *table, ivec v) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table)), v);
}
/* A part's lane c += the dot product of u's 4 bytes c (unsigned) with x4's 4 bytes (signed); `wide`: u
 * may reach 255 (Q8_0, the IQ4 tables), else u < 128. ivec_part_sum turns a part into int32 sums, once
 * per part_groups(bits, wide) groups of 4 k: int32 lanes already on every target but AVX2 without VNNI. */
static inline ivec ivec_dot4(ivec part, ivec u, int32_t x4, int wide) {
    (void)wide;
    return _mm512_dpbusd_epi32(part, u, _mm512_set1_epi32(x4));
}
static inline ivec ivec_add32(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
static inline ivec ivec_and32(ivec a, uint32_t c) { return _mm512_and_si512(a, _mm512_set1_epi32((int)c)); }
static inline ivec ivec_shl32(ivec a, int n) { return _mm512_slli_epi32(a, n); }
static inline ivec ivec_shr32(ivec a, int n) { return _mm512_srli_epi32(a, n); }
static inline ivec ivec_from_i8(const void *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline ivec ivec_from_u8(const void *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline ivec ivec_round(vec a) { return _mm512_cvtps_epi32(a); }  /* to nearest even (MXCSR's default) */
static inline int32_t ivec_reduce_add32(ivec a) { return _mm512_reduce_add_epi32(a); }
static inline void ivec_store_i8(int8_t *p, ivec a) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a)); }

#elif defined(SIMD_AVX2)
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define SIMD_NAME "avx2+vnni"
#else
#define SIMD_NAME "avx2"
#endif
#define LANES 8
typedef __m256 vec;
typedef __m256i ivec;

static inline vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vec_set1(float x) { return _mm256_set1_ps(x); }
static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vec_sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vec_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vec_fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vec_abs(vec a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
static inline vec vec_max(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline float vec_reduce_max(vec a) {  /* exact in any order */
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline vec vec_bits(ivec a) { return _mm256_castsi256_ps(a); }
static inline vec vec_from_ivec(ivec a) { return _mm256_cvtepi32_ps(a); }
static inline vec vec_fence(vec a) {  /* the AVX-512 section's */
    __asm__("" : "+x"(a));
    return a;
}
static inline vec vec_from_bf16(const uint16_t *p) {
    return vec_bits(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vec vec_from_half(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
/* Partial vectors (a matrix's last columns) through a buffer: AVX2's masked moves are dword-only. */
static inline vec vec_load_n(const float *p, int n) {
    float buf[LANES] = {0};
    memcpy(buf, p, sizeof(float) * (size_t)(n < LANES ? n : LANES));
    return vec_load(buf);
}
static inline void vec_store_n(float *p, vec v, int n) {
    if (n >= LANES) {
        vec_store(p, v);
        return;
    }
    float buf[LANES];
    vec_store(buf, v);
    memcpy(p, buf, sizeof(float) * (size_t)n);
}
static inline void vec_store_bf16_n(uint16_t *p, vec v, int n) {  /* round to nearest even: bf16.h's rule */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    if (n >= LANES) {
        _mm_storeu_si128((__m128i *)p, packed);
        return;
    }
    uint16_t buf[LANES];
    _mm_storeu_si128((__m128i *)buf, packed);
    memcpy(p, buf, sizeof(uint16_t) * (size_t)n);
}

static inline ivec ivec_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void ivec_store(void *p, ivec v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline ivec ivec_zero(void) { return _mm256_setzero_si256(); }
static inline ivec ivec_set1_32(int32_t x) { return _mm256_set1_epi32(x); }
static inline ivec ivec_or(ivec a, ivec b) { return _mm256_or_si256(a, b); }
static inline ivec ivec_and8(ivec a, uint8_t c) { return _mm256_and_si256(a, _mm256_set1_epi8((char)c)); }
static inline ivec ivec_shr16(ivec a, int n) { return _mm256_srli_epi16(a, n); }
static inline ivec ivec_shl16(ivec a, int n) { return _mm256_slli_epi16(a, n); }
static inline ivec ivec_add8_where(ivec w, ivec v, uint8_t bit, uint8_t add) {
    const __m256i b = _mm256_set1_epi8((char)bit);
    const __m256i where = _mm256_cmpeq_epi8(_mm256_and_si256(v, b), b);
    return _mm256_add_epi8(w, _mm256_and_si256(where, _mm256_set1_epi8((char)add)));
}
static inline ivec ivec_lut8(const uint8_t *table, ivec v) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table)), v);
}
/* The AVX-512 section's ivec_dot4 says what a part is. */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
static inline ivec ivec_dot4(ivec part, ivec u, int32_t x4, int wide) {
    (void)wide;
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(part, u, _mm256_set1_epi32(x4));
#else
    return _mm256_dpbusd_epi32(part, u, _mm256_set1_epi32(x4));
#endif
}
#else
#define SIMD_INT16_PARTS 1
/* Without VNNI, vpmaddubsw sums pairs of u * x into int16, saturating. Below 128, a part is int16 lanes:
 * each group adds at most 2 * umax * 127 to a lane, so part_groups of them (8 for 4 bits, 4 for 5, 2
 * for 6) stay within 32,767, and vpmaddwd widens the part to int32 sums once. `wide` formats' u reach
 * 255 (pairs up to 64,770): their top bit's products (128 * x, pairs within 32,512) go apart, and
 * vpmaddwd widens both at once into an int32 part. The sums stay exact, as vpdpbusd's are. */
static inline ivec ivec_dot4(ivec part, ivec u, int32_t x4, int wide) {
    const __m256i x = _mm256_set1_epi32(x4);
    if (!wide) return _mm256_add_epi16(part, _mm256_maddubs_epi16(u, x));
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i top = _mm256_and_si256(u, _mm256_set1_epi8((char)0x80));
    const __m256i low = _mm256_and_si256(u, _mm256_set1_epi8(0x7F));
    part = _mm256_add_epi32(part, _mm256_madd_epi16(_mm256_maddubs_epi16(low, x), ones));
    return _mm256_add_epi32(part, _mm256_madd_epi16(_mm256_maddubs_epi16(top, x), ones));
}
static inline ivec ivec_part_sum(ivec part, int wide) {
    return wide ? part : _mm256_madd_epi16(part, _mm256_set1_epi16(1));
}
static inline int part_groups(int bits, int wide) {
    return wide || bits <= 4 ? 8 : bits == 5 ? 4 : 2;
}
static inline int part_is_sum(int wide) { return wide; }  /* a wide part is int32 sums */
#endif
static inline ivec ivec_add32(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
static inline ivec ivec_and32(ivec a, uint32_t c) { return _mm256_and_si256(a, _mm256_set1_epi32((int)c)); }
static inline ivec ivec_shl32(ivec a, int n) { return _mm256_slli_epi32(a, n); }
static inline ivec ivec_shr32(ivec a, int n) { return _mm256_srli_epi32(a, n); }
static inline ivec ivec_from_i8(const void *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline ivec ivec_from_u8(const void *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline ivec ivec_round(vec a) { return _mm256_cvtps_epi32(a); }  /* to nearest even (MXCSR's default) */
static inline int32_t ivec_reduce_add32(ivec a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
static inline void ivec_store_i8(int8_t *p, ivec a) {  /* values within int8: the packs saturate nothing */
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}
#elif defined(SIMD_NEON)
#include <arm_neon.h>
#define SIMD 1
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define SIMD_NAME "neon+i8mm"
#else
#define SIMD_NAME "neon"
#endif
#define LANES 4
typedef float32x4_t vec;
typedef uint8x16_t ivec;

/* FPCR.FZ: denormal inputs and outputs flushed, as MXCSR's DAZ and FTZ do on x86. */
static inline unsigned denormals_off(void) {
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr | (1u << 24)));
    return (unsigned)fpcr;
}
static inline void denormals_restore(unsigned fpcr) { __asm__ volatile("msr fpcr, %0" : : "r"((uint64_t)fpcr)); }

/* a / b rounded once, in an instruction -ffast-math cannot turn into a * (1 / b) (see the x86 one). */
static inline float exact_div(float a, float b) {
    float r;
    __asm__("fdiv %s0, %s1, %s2" : "=w"(r) : "w"(a), "w"(b));
    return r;
}

static inline vec vec_load(const float *p) { return vld1q_f32(p); }
static inline void vec_store(float *p, vec v) { vst1q_f32(p, v); }
static inline vec vec_set1(float x) { return vdupq_n_f32(x); }
static inline vec vec_zero(void) { return vdupq_n_f32(0.f); }
static inline vec vec_add(vec a, vec b) { return vaddq_f32(a, b); }
static inline vec vec_sub(vec a, vec b) { return vsubq_f32(a, b); }
static inline vec vec_mul(vec a, vec b) { return vmulq_f32(a, b); }
static inline vec vec_fmadd(vec a, vec b, vec c) { return vfmaq_f32(c, a, b); }  /* fused, as x86's FMA */
static inline vec vec_abs(vec a) { return vabsq_f32(a); }
static inline vec vec_max(vec a, vec b) { return vmaxq_f32(a, b); }
static inline float vec_reduce_max(vec a) { return vmaxvq_f32(a); }
static inline vec vec_bits(ivec a) { return vreinterpretq_f32_u8(a); }
static inline vec vec_from_ivec(ivec a) { return vcvtq_f32_s32(vreinterpretq_s32_u8(a)); }
static inline vec vec_fence(vec a) {  /* the AVX-512 section's */
    __asm__("" : "+w"(a));
    return a;
}
static inline vec vec_from_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
static inline vec vec_from_half(const void *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)));
}
static inline vec vec_load_n(const float *p, int n) {
    float buf[LANES] = {0};
    memcpy(buf, p, sizeof(float) * (size_t)(n < LANES ? n : LANES));
    return vec_load(buf);
}
static inline void vec_store_n(float *p, vec v, int n) {
    float buf[LANES];
    vec_store(buf, v);
    memcpy(p, buf, sizeof(float) * (size_t)(n < LANES ? n : LANES));
}
static inline void vec_store_bf16_n(uint16_t *p, vec v, int n) {  /* round to nearest even: bf16.h's rule */
    const uint32x4_t bits = vreinterpretq_u32_f32(v);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    uint16_t buf[LANES];
    vst1_u16(buf, vshrn_n_u32(vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7FFF), odd)), 16));
    memcpy(p, buf, sizeof(uint16_t) * (size_t)(n < LANES ? n : LANES));
}

static inline ivec ivec_load(const void *p) { return vld1q_u8((const uint8_t *)p); }
static inline void ivec_store(void *p, ivec v) { vst1q_u8((uint8_t *)p, v); }
static inline ivec ivec_zero(void) { return vdupq_n_u8(0); }
static inline ivec ivec_set1_32(int32_t x) { return vreinterpretq_u8_s32(vdupq_n_s32(x)); }
static inline ivec ivec_or(ivec a, ivec b) { return vorrq_u8(a, b); }
static inline ivec ivec_and8(ivec a, uint8_t c) { return vandq_u8(a, vdupq_n_u8(c)); }
/* Shifts by a register (a negative count shifts right): the counts need not be literals. */
static inline ivec ivec_shr16(ivec a, int n) {
    return vreinterpretq_u8_u16(vshlq_u16(vreinterpretq_u16_u8(a), vdupq_n_s16((int16_t)-n)));
}
static inline ivec ivec_shl16(ivec a, int n) {
    return vreinterpretq_u8_u16(vshlq_u16(vreinterpretq_u16_u8(a), vdupq_n_s16((int16_t)n)));
}
static inline ivec ivec_add8_where(ivec w, ivec v, uint8_t bit, uint8_t add) {
    return vaddq_u8(w, vandq_u8(vtstq_u8(v, vdupq_n_u8(bit)), vdupq_n_u8(add)));
}
static inline ivec ivec_lut8(const uint8_t *table, ivec v) { return vqtbl1q_u8(vld1q_u8(table), v); }
/* The AVX-512 section's ivec_dot4 says what a part is. usdot (i8mm) is vpdpbusd's unsigned-by-signed
 * product. Without it, sdot multiplies signed bytes: u below 128 are the same bytes signed; `wide`
 * formats' u (up to 255) go in as u - 128, and 128 times the activations' sum is added back. Exact
 * either way. */
static inline ivec ivec_dot4(ivec part, ivec u, int32_t x4, int wide) {
    const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
    const int32x4_t a = vreinterpretq_s32_u8(part);
#if defined(__ARM_FEATURE_MATMUL_INT8)
    (void)wide;
    return vreinterpretq_u8_s32(vusdotq_s32(a, u, x));
#else
    if (!wide) return vreinterpretq_u8_s32(vdotq_s32(a, vreinterpretq_s8_u8(u), x));
    const int32_t sum = (int8_t)x4 + (int8_t)(x4 >> 8) + (int8_t)(x4 >> 16) + (int8_t)(x4 >> 24);
    const int32x4_t shifted = vdotq_s32(a, vreinterpretq_s8_u8(veorq_u8(u, vdupq_n_u8(0x80))), x);
    return vreinterpretq_u8_s32(vaddq_s32(shifted, vdupq_n_s32(128 * sum)));
#endif
}
static inline ivec ivec_add32(ivec a, ivec b) {
    return vreinterpretq_u8_s32(vaddq_s32(vreinterpretq_s32_u8(a), vreinterpretq_s32_u8(b)));
}
static inline ivec ivec_and32(ivec a, uint32_t c) {
    return vreinterpretq_u8_u32(vandq_u32(vreinterpretq_u32_u8(a), vdupq_n_u32(c)));
}
static inline ivec ivec_shl32(ivec a, int n) {
    return vreinterpretq_u8_u32(vshlq_u32(vreinterpretq_u32_u8(a), vdupq_n_s32(n)));
}
static inline ivec ivec_shr32(ivec a, int n) {
    return vreinterpretq_u8_u32(vshlq_u32(vreinterpretq_u32_u8(a), vdupq_n_s32(-n)));
}
static inline int32x4_t widen4_s8(const void *p) {  /* 4 bytes exactly: a row's last read ends at its end */
    int32_t v;
    memcpy(&v, p, 4);
    return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(v)))));
}
static inline ivec ivec_from_i8(const void *p) { return vreinterpretq_u8_s32(widen4_s8(p)); }
static inline ivec ivec_from_u8(const void *p) { return ivec_and32(ivec_from_i8(p), 0xFF); }
static inline ivec ivec_round(vec a) { return vreinterpretq_u8_s32(vcvtnq_s32_f32(a)); }  /* to nearest even */
static inline int32_t ivec_reduce_add32(ivec a) { return vaddvq_s32(vreinterpretq_s32_u8(a)); }
static inline void ivec_store_i8(int8_t *p, ivec a) {  /* values within int8 */
    const int16x4_t h = vmovn_s32(vreinterpretq_s32_u8(a));
    const int32_t v = vget_lane_s32(vreinterpret_s32_s8(vmovn_s16(vcombine_s16(h, h))), 0);
    memcpy(p, &v, 4);
}
#endif

#if defined(SIMD) && !defined(SIMD_INT16_PARTS)
/* Parts are the int32 sums themselves: one per block of 8 groups. */
static inline ivec ivec_part_sum(ivec part, int wide) {
    (void)wide;
    return part;
}
static inline int part_groups(int bits, int wide) {
    (void)bits, (void)wide;
    return 8;
}
/* Whether a part is int32 sums already (ivec_part_sum gives it back): a block's integers can then start at
 * its zero point in the part itself, with no sum beside it to add the part into. */
static inline int part_is_sum(int wide) {
    (void)wide;
    return 1;
}
#endif

#endif
