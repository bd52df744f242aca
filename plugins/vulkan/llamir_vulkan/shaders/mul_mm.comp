#version 450
// Tiled matrix-matrix product, ggml's mul_mat (and mul_mat_id with MUL_MAT_ID) for batches of
// tokens: d[n, m] = sum_k a[m, k] * b[n, k] per batch, a's batch axes broadcast into b's.
// A workgroup computes a BM x BN tile of d: it loads BK-wide slices of BM rows of a (dequantized
// while loading) and of BN columns of b into shared memory (as vec4s of four rows / columns at
// one k), and each thread accumulates a TM x TN block of the tile in registers (rows
// tx * TM.., columns ty * TN..).
// mul_mat: one workgroup per (m tile, n tile, batch of d).
// mul_mat_id: one workgroup per (m tile, expert); it gathers the (token, slot) pairs whose id is
// its expert, BN at a time, as the columns of its tiles (d [T, k, M], b [T, n_b, K], ids [T, k]).
// b is in the weight's vec_dot_type (mul_b.glsl): as ggml's CPU, the products see b rounded to
// it, and a q4_1 / q5_1 weight's min m enters as m * s_b per block (A_SPLIT_MIN, with BK = QK:
// one block per k step), s_b the q8_1 block's stored d * sum(q).
// Defines: A_<TYPE>, A_UNIT, A_VEC4, A_SPLIT_MIN (dequant.glsl), B_<TYPE>, B_VEC4 (mul_b.glsl),
// BM, BN, BK, TM, TN (TM and TN multiples of 4), WG = (BM / TM) * (BN / TN), MUL_MAT_ID.
// mul_mat_id's expert_base: the first expert in a's binding (a large src0 is bound in pieces;
// pairs choosing an expert outside it are left to another dispatch).
#include "common.glsl"
#define A_BINDING 1
#include "dequant.glsl"
#define B_BINDING 2
#include "mul_b.glsl"
#if defined(A_SPLIT_MIN) && BK != QK
#error "mul_mm: A_SPLIT_MIN needs BK = QK (one block of a per k step)"
#endif

#ifdef MUL_MAT_ID
layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor b; Tensor ids; Tensor d; uint expert_base; } p;
layout(std430, binding = 3) readonly buffer Ids { int data_ids[]; };
layout(std430, binding = 4) writeonly buffer D { float data_d[]; };
#else
layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor b; Tensor d; } p;
layout(std430, binding = 3) writeonly buffer D { float data_d[]; };
#endif

const uint TX = BM / TM;  // threads along m

shared vec4 tile_a[BK * BM / 4];  // [k][m / 4]: four rows of a at one k
shared vec4 tile_b[BK * BN / 4];  // [k][n / 4]
shared uint col_b[BN];            // each column's start in b (its first element or block)
shared uint col_d[BN];            // and in d
#ifdef A_SPLIT_MIN
shared float tile_min[BM];        // the k step's block of each row of a: its min m
shared float tile_sum[BN];        // and of each column of b: its s
#endif

// d[m0 .. m0 + BM, columns 0 .. n_cols of col_b / col_d] for a's rows starting at a_base.
void mul_tile(uint a_base, uint m0, uint n_cols) {
    const uint tid = gl_LocalInvocationID.x;
    const uint tx = tid % TX, ty = tid / TX;
    const uint M = p.a.ne1, K = p.a.ne0;
    float acc[TM][TN];
    [[unroll]] for (uint i = 0; i < TM; i++) {
        [[unroll]] for (uint j = 0; j < TN; j++) {
            acc[i][j] = 0.0;
        }
    }
    for (uint k0 = 0; k0 < K; k0 += BK) {
        // a: BM rows x BK, four consecutive k per load, consecutive threads along k
        for (uint u = tid; u < BM * BK / 4; u += WG) {
            uint r = u / (BK / 4), kk = (u % (BK / 4)) * 4, k = k0 + kk;
            uint m = m0 + r;
            vec4 v = vec4(0.0);
            if (m < M && k + 4 <= K) {
                v = dequant4(a_base + m * p.a.nb1, k, p.a.nb0);
            }
#ifdef A_FLOAT
            else if (m < M) {  // a float row's tail
                [[unroll]] for (uint c = 0; c < 4; c++) {
                    v[c] = k + c < K ? dequant1(a_base + m * p.a.nb1, k + c, p.a.nb0) : 0.0;
                }
            }
#endif
            [[unroll]] for (uint c = 0; c < 4; c++) {
                tile_a[(kk + c) * (BM / 4) + r / 4][r % 4] = v[c];
            }
        }
        // b: BN columns x BK
        for (uint u = tid; u < BN * BK / 4; u += WG) {
            uint n = u / (BK / 4), kk = (u % (BK / 4)) * 4, k = k0 + kk;
            vec4 v = vec4(0.0);
            if (n < n_cols && k + 4 <= K) {
                v = b4(col_b[n], k, p.b.nb0);
            }
#ifdef B_FLOAT
            else if (n < n_cols) {  // a float column's tail
                [[unroll]] for (uint c = 0; c < 4; c++) {
                    v[c] = k + c < K ? b1(col_b[n], k + c, p.b.nb0) : 0.0;
                }
            }
#endif
            [[unroll]] for (uint c = 0; c < 4; c++) {
                tile_b[(kk + c) * (BN / 4) + n / 4][n % 4] = v[c];
            }
        }
#ifdef A_SPLIT_MIN
        for (uint u = tid; u < BM + BN; u += WG) {
            if (u < BM) {
                tile_min[u] = m0 + u < M ? a_min(a_base + (m0 + u) * p.a.nb1, k0) : 0.0;
            } else {
                tile_sum[u - BM] = u - BM < n_cols ? b_sum(col_b[u - BM], k0) : 0.0;
            }
        }
#endif
        barrier();
        [[unroll]] for (uint kk = 0; kk < BK; kk++) {
            vec4 va[TM / 4], vb[TN / 4];
            [[unroll]] for (uint i = 0; i < TM / 4; i++) {
                va[i] = tile_a[kk * (BM / 4) + tx * (TM / 4) + i];
            }
            [[unroll]] for (uint j = 0; j < TN / 4; j++) {
                vb[j] = tile_b[kk * (BN / 4) + ty * (TN / 4) + j];
            }
            [[unroll]] for (uint i = 0; i < TM; i++) {
                [[unroll]] for (uint j = 0; j < TN; j++) {
                    acc[i][j] = fma(va[i / 4][i % 4], vb[j / 4][j % 4], acc[i][j]);
                }
            }
        }
#ifdef A_SPLIT_MIN
        [[unroll]] for (uint i = 0; i < TM; i++) {
            [[unroll]] for (uint j = 0; j < TN; j++) {
                acc[i][j] = fma(tile_min[tx * TM + i], tile_sum[ty * TN + j], acc[i][j]);
            }
        }
#endif
        barrier();
    }
    [[unroll]] for (uint j = 0; j < TN; j++) {
        uint n = ty * TN + j;
        if (n < n_cols) {
            [[unroll]] for (uint i = 0; i < TM; i++) {
                uint m = m0 + tx * TM + i;
                if (m < M) {
                    data_d[col_d[n] + m * p.d.nb0] = acc[i][j];
                }
            }
        }
    }
}

#ifdef MUL_MAT_ID
shared uint pairs[BN + WG];  // flat (token, slot) indices t * k + slot whose id is this expert
shared uint n_pairs;

// Columns 0 .. n of the tile from the pair list.
void set_columns(uint n) {
    for (uint c = gl_LocalInvocationID.x; c < n; c += WG) {
        uint slot = pairs[c] % p.ids.ne0, t = pairs[c] / p.ids.ne0;
        col_b[c] = at(p.b, 0, slot % p.b.ne1, t, 0);
        col_d[c] = at(p.d, 0, slot, t, 0);
    }
    barrier();
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    uint tiles_m = (p.a.ne1 + BM - 1) / BM;
    uint g = group_id();
    uint m0 = (g % tiles_m) * BM, e = g / tiles_m;
    if (e >= p.a.ne2) {
        return;
    }
    uint a_base = at(p.a, 0, 0, e, 0);
    uint total = p.ids.ne0 * p.ids.ne1;
    if (tid == 0) {
        n_pairs = 0;
    }
    barrier();
    for (uint base = 0; base < total; base += WG) {
        uint i = base + tid;
        if (i < total && uint(data_ids[at(p.ids, i % p.ids.ne0, i / p.ids.ne0, 0, 0)]) - p.expert_base == e) {
            pairs[atomicAdd(n_pairs, 1u)] = i;
        }
        barrier();
        uint n = n_pairs;
        bool last = base + WG >= total;
        // a full tile's worth of columns (or the rest, at the end): multiply, keep what is left
        while (n >= BN || (last && n > 0)) {
            uint cols = min(n, BN);
            set_columns(cols);
            mul_tile(a_base, m0, cols);
            uint rest = n - cols;
            uint keep = tid < rest ? pairs[cols + tid] : 0;
            barrier();
            if (tid < rest) {
                pairs[tid] = keep;
            }
            barrier();
            n = rest;
        }
        if (tid == 0) {
            n_pairs = n;
        }
        barrier();
    }
}

#else
void main() {
    uint tiles_m = (p.a.ne1 + BM - 1) / BM, tiles_n = (p.b.ne1 + BN - 1) / BN;
    uint g = group_id();
    uint m0 = (g % tiles_m) * BM;
    g /= tiles_m;
    uint n0 = (g % tiles_n) * BN;
    g /= tiles_n;
    uint i2 = g % p.d.ne2, i3 = g / p.d.ne2;
    if (i3 >= p.d.ne3) {
        return;
    }
    for (uint c = gl_LocalInvocationID.x; c < BN; c += WG) {
        col_b[c] = at(p.b, 0, n0 + c, i2, i3);
        col_d[c] = at(p.d, 0, n0 + c, i2, i3);
    }
    barrier();
    uint a_base = at(p.a, 0, 0, i2 / (p.b.ne2 / p.a.ne2), i3 / (p.b.ne3 / p.a.ne3));
    mul_tile(a_base, m0, min(BN, p.b.ne1 - n0));
}
#endif
