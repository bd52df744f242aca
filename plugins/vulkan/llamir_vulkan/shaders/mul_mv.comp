#version 450
// Matrix-vector product for one or a few columns of b (token generation): ggml's mul_mat with
// ne11 <= NCOLS, and mul_mat_id (MUL_MAT_ID) per (token, slot). One workgroup per ROWS rows of a
// and batch of d (per ROWS rows and (token, slot) pair for mul_mat_id): its threads stride over
// k, each keeping a partial sum per row and column, then one thread per (row, column) adds the
// WG partials up from shared memory. With MV_WORDS (a quantized a, mul_mv_words.glsl) a thread
// takes CHUNK elements (a whole block, or a K-quant's sub-blocks) per step, read as 32-bit words,
// each b chunk serving the ROWS rows; else four consecutive elements at a time through
// dequant4 / b4 (consecutive threads read consecutive bytes either way).
// b is in the weight's vec_dot_type (mul_b.glsl): as ggml's CPU, the products see b rounded to
// it, and a q4_1 / q5_1 weight's min m enters as m * s_b per block (A_SPLIT_MIN; the thread
// whose elements start a block adds it), s_b the q8_1 block's stored d * sum(q).
// Defines: A_<TYPE>, A_UNIT, A_VEC4, A_SPLIT_MIN (dequant.glsl), B_<TYPE>, B_VEC4 (mul_b.glsl),
// MV_WORDS, NCOLS (the columns of b; 1 with MUL_MAT_ID), ROWS, WG, MUL_MAT_ID.
// mul_mat_id's expert_base: the first expert in a's binding (a large src0 is bound in pieces;
// pairs choosing an expert outside it are left to another dispatch).
#include "common.glsl"
#define A_BINDING 1
#include "dequant.glsl"
#define B_BINDING 2
#include "mul_b.glsl"
#ifdef MV_WORDS
#include "mul_mv_words.glsl"
#endif

#ifdef MUL_MAT_ID
layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor b; Tensor ids; Tensor d; uint expert_base; } p;
layout(std430, binding = 3) readonly buffer Ids { int data_ids[]; };
layout(std430, binding = 4) writeonly buffer D { float data_d[]; };
#else
layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor b; Tensor d; } p;
layout(std430, binding = 3) writeonly buffer D { float data_d[]; };
#endif

shared float partial[ROWS * NCOLS * (WG + 1)];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint M = p.a.ne1, K = p.a.ne0;
    uint row_groups = (M + ROWS - 1) / ROWS;
    uint g = group_id();
    uint m0 = (g % row_groups) * ROWS;
    g /= row_groups;
    uint a_rows[ROWS], cols_b[NCOLS], cols_d[NCOLS];
#ifdef MUL_MAT_ID
    uint slot = g % p.ids.ne0, t = g / p.ids.ne0;
    if (t >= p.ids.ne1) {
        return;
    }
    uint e = uint(data_ids[at(p.ids, slot, t, 0, 0)]) - p.expert_base;
    if (e >= p.a.ne2) {  // an expert another dispatch's binding holds
        return;
    }
    uint a_base = at(p.a, 0, 0, e, 0);
    cols_b[0] = at(p.b, 0, slot % p.b.ne1, t, 0);
    cols_d[0] = at(p.d, 0, slot, t, 0);
#else
    uint i2 = g % p.d.ne2, i3 = g / p.d.ne2;
    if (i3 >= p.d.ne3) {
        return;
    }
    uint a_base = at(p.a, 0, 0, i2 / (p.b.ne2 / p.a.ne2), i3 / (p.b.ne3 / p.a.ne3));
    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
        cols_b[c] = at(p.b, 0, c, i2, i3);
        cols_d[c] = at(p.d, 0, c, i2, i3);
    }
#endif
    [[unroll]] for (uint r = 0; r < ROWS; r++) {
        a_rows[r] = a_base + min(m0 + r, M - 1) * p.a.nb1;  // rows past M repeat the last, unwritten
    }
    float acc[ROWS][NCOLS];
    [[unroll]] for (uint r = 0; r < ROWS; r++) {
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            acc[r][c] = 0.0;
        }
    }
#ifdef MV_WORDS
    for (uint ci = tid; ci < K / CHUNK; ci += WG) {
        uint k0 = ci * CHUNK;
        vec4 vb[NCOLS][CHUNK / 4];
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            b_chunk(cols_b[c], k0, vb[c]);
        }
        [[unroll]] for (uint r = 0; r < ROWS; r++) {
            vec4 va[CHUNK / 4];
            a_chunk(a_rows[r] + (k0 / QK) * QUANT_BYTES, k0 % QK, va);
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                [[unroll]] for (uint i = 0; i < CHUNK / 4; i++) {
                    acc[r][c] += dot(va[i], vb[c][i]);
                }
            }
        }
#ifdef A_SPLIT_MIN
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            float s = b_sum(cols_b[c], k0);
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                acc[r][c] += a_min(a_rows[r], k0) * s;
            }
        }
#endif
    }
#else
    for (uint k = 4 * tid; k + 4 <= K; k += 4 * WG) {
        vec4 vb[NCOLS];
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            vb[c] = b4(cols_b[c], k, p.b.nb0);
        }
        [[unroll]] for (uint r = 0; r < ROWS; r++) {
            vec4 va = dequant4(a_rows[r], k, p.a.nb0);
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                acc[r][c] += dot(va, vb[c]);
            }
        }
#ifdef A_SPLIT_MIN
        if (k % QK == 0) {
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                float s = b_sum(cols_b[c], k);
                [[unroll]] for (uint r = 0; r < ROWS; r++) {
                    acc[r][c] += a_min(a_rows[r], k) * s;
                }
            }
        }
#endif
    }
#endif
#ifdef A_FLOAT
    for (uint k = K / 4 * 4 + tid; k < K; k += WG) {  // a float row's tail
        [[unroll]] for (uint r = 0; r < ROWS; r++) {
            float va = dequant1(a_rows[r], k, p.a.nb0);
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                acc[r][c] += va * b1(cols_b[c], k, p.b.nb0);
            }
        }
    }
#endif
    // One barrier: each (row, column) sum is then one thread's, over the WG partials (a row of
    // partial padded by one word, so that those threads read different banks).
    [[unroll]] for (uint r = 0; r < ROWS; r++) {
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            partial[(r * NCOLS + c) * (WG + 1) + tid] = acc[r][c];
        }
    }
    barrier();
    for (uint i = tid; i < ROWS * NCOLS; i += WG) {
        uint r = i / NCOLS, c = i % NCOLS;
        float sum = 0.0;
        [[unroll]] for (uint t = 0; t < WG; t++) {
            sum += partial[i * (WG + 1) + t];
        }
        if (m0 + r < M) {
            data_d[cols_d[c] + (m0 + r) * p.d.nb0] = sum;
        }
    }
}
