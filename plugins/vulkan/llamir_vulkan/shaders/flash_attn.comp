#version 450
// ggml's flash_attn_ext, and llamir's soft_max_attn (the same attention with V stored transposed
// and the output not permuted): per query row, y = softmax(softcap(q k^T * scale) + slope_h*mask) v
// with an online softmax (running max M, sum S and V accumulator) over the KV cells, tile by tile.
//
// A workgroup takes BR query rows of one KV head and stream: row j is query t = j / G of head
// kvh*G + j % G (G = H / Hkv), so the heads sharing a KV head share its tiles too. Per tile of BC
// cells: K is loaded (dequantized) into shared memory, the BR x BC scores computed, one thread
// per row updates M and S and turns its scores into probabilities, then V is loaded into the same
// shared memory and accumulated; each thread keeps ACC_N of the BR x DV accumulators in registers.
// Sinks join each row's softmax after the cells; a row whose cells are all masked gives 0.
//
// Layouts (ggml order): q [dk, T, H, S], k [dk, n, Hkv, Skv], v [dv, n, Hkv, Skv] (SOFT_MAX_ATTN:
// [n, dv, Hkv, Skv]), mask [n, T', H', S'] repeated over heads and streams, sinks [H];
// y [dv, H, T, S] (flash_attn_ext's permuted output) or, with SOFT_MAX_ATTN, [dv, T, H, S].
// Stream s reads KV stream s / (S / Skv) (mul_mat's broadcast; flash_attn_ext has S == Skv).
// Defines: DK, DV (head sizes), BR, BC (the tile), ACC_N (ceil(BR*DV / WG)),
//   K_TYPE, K_FORMAT, V_TYPE, V_FORMAT (storage types and flash_attn_kv.glsl formats),
//   HAS_MASK (0 or 1) and M_TYPE, HAS_SINKS (0 or 1), SOFT_MAX_ATTN (0 or 1).
#include "common.glsl"
#include "soft_max_alibi.glsl"

layout(std430, binding = 0) readonly buffer Params {
    Tensor q;
    Tensor k;
    Tensor v;
#if HAS_MASK
    Tensor m;
#endif
#if HAS_SINKS
    Tensor sinks;
#endif
    Tensor y;
    float scale;      // scale / logit_softcap when softcapping
    float softcap;    // logit_softcap; 0: none
    float max_bias;
    float m0;
    float m1;
    uint n_head_log2;
} p;
layout(std430, binding = 1) readonly buffer Q { float data_q[]; };
layout(std430, binding = 2) readonly buffer K { K_TYPE data_k[]; };
layout(std430, binding = 3) readonly buffer V { V_TYPE data_v[]; };
#if HAS_MASK
layout(std430, binding = 4) readonly buffer M { M_TYPE data_m[]; };
#endif
#if HAS_SINKS
layout(std430, binding = 4 + HAS_MASK) readonly buffer Sinks { float data_sinks[]; };
#endif
layout(std430, binding = 4 + HAS_MASK + HAS_SINKS) writeonly buffer Y { float data_y[]; };

#define KV_AT k_at
#define KV_DATA data_k
#define KV_DESC p.k
#define KV_FORMAT K_FORMAT
#include "flash_attn_kv.glsl"

#define KV_AT v_at
#define KV_DATA data_v
#define KV_DESC p.v
#define KV_FORMAT V_FORMAT
#include "flash_attn_kv.glsl"

#define NEG_INF uintBitsToFloat(0xFF800000u)
const uint KV_ROW = DK > DV ? DK : DV;

shared float q_sh[BR * DK];       // the workgroup's query rows
shared float kv_sh[BC * KV_ROW];  // a tile of K rows [BC][DK], then of V rows [BC][DV]
shared float p_sh[BR * BC];       // the tile's scores, then its probabilities
shared float m_sh[BR];            // running max of each row
shared float s_sh[BR];            // running sum of each row
shared float ms_sh[BR];           // the tile's rescale factor of each row's sum and accumulator

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint G = p.q.ne2 / p.k.ne2;
    uint n_rows = p.q.ne1 * G;
    uint n_blocks = (n_rows + BR - 1) / BR;
    uint n_kv = p.k.ne1;
    uint gid = group_id();
    uint row0 = (gid % n_blocks) * BR;
    uint kvh = (gid / n_blocks) % p.k.ne2;
    uint s = gid / n_blocks / p.k.ne2;
    if (s >= p.q.ne3) {  // the grid's padding (uniform over the workgroup)
        return;
    }
    uint kvs = s / (p.q.ne3 / p.k.ne3);

    for (uint i = tid; i < BR * DK; i += WG) {
        uint j = row0 + i / DK;
        q_sh[i] = j < n_rows ? data_q[at(p.q, i % DK, j / G, kvh * G + j % G, s)] : 0.0;
    }
    if (tid < BR) {
        m_sh[tid] = NEG_INF;
        s_sh[tid] = 0.0;
    }
    float acc[ACC_N];
    [[unroll]] for (uint a = 0; a < ACC_N; a++) {
        acc[a] = 0.0;
    }
    barrier();

    for (uint c0 = 0; c0 < n_kv; c0 += BC) {
        uint nc = min(BC, n_kv - c0);
        for (uint i = tid; i < nc * DK; i += WG) {
            kv_sh[i] = k_at(i % DK, c0 + i / DK, kvh, kvs);
        }
        barrier();

        for (uint i = tid; i < BR * BC; i += WG) {
            uint r = i / BC, c = i % BC, j = row0 + r;
            float score = NEG_INF;
            if (j < n_rows && c < nc) {
                float dot = 0.0;
                for (uint d = 0; d < DK; d++) {
                    dot = fma(q_sh[r * DK + d], kv_sh[c * DK + d], dot);
                }
                float mv = 0.0;
#if HAS_MASK
                uint t = j / G, h = kvh * G + j % G;
                float slope = alibi_slope(h, p.max_bias, p.m0, p.m1, p.n_head_log2);
                mv = slope * float(data_m[at(p.m, c0 + c, t % p.m.ne1, h % p.m.ne2, s % p.m.ne3)]);
#endif
                if (p.softcap != 0.0) {
                    score = p.softcap * tanh(clamp(dot * p.scale, -15.0, 15.0)) + mv;
                } else {
                    score = fma(dot, p.scale, mv);
                }
            }
            p_sh[i] = score;
        }
        barrier();

        // the V tile replaces the K tile, while one thread per row updates the softmax
        for (uint i = tid; i < nc * DV; i += WG) {
#if SOFT_MAX_ATTN
            uint c = i % nc, d = i / nc;  // V is [n, dv]: read along the cells
            kv_sh[c * DV + d] = v_at(c0 + c, d, kvh, kvs);
#else
            kv_sh[i] = v_at(i % DV, c0 + i / DV, kvh, kvs);
#endif
        }
        if (tid < BR) {
            float m_old = m_sh[tid], m_new = m_old;
            for (uint c = 0; c < nc; c++) {
                m_new = max(m_new, p_sh[tid * BC + c]);
            }
            bool live = m_new != NEG_INF;  // some cell of the row so far is not masked
            float sum = 0.0;
            for (uint c = 0; c < nc; c++) {
                float e = live ? exp(p_sh[tid * BC + c] - m_new) : 0.0;
                p_sh[tid * BC + c] = e;
                sum += e;
            }
            float ms = live ? exp(m_old - m_new) : 1.0;
            s_sh[tid] = s_sh[tid] * ms + sum;
            m_sh[tid] = m_new;
            ms_sh[tid] = ms;
        }
        barrier();

        [[unroll]] for (uint a = 0; a < ACC_N; a++) {
            uint i = tid + a * WG;
            if (i < BR * DV) {
                uint r = i / DV, d = i % DV;
                float v = acc[a] * ms_sh[r];
                for (uint c = 0; c < nc; c++) {
                    v = fma(p_sh[r * BC + c], kv_sh[c * DV + d], v);
                }
                acc[a] = v;
            }
        }
        barrier();
    }

    [[unroll]] for (uint a = 0; a < ACC_N; a++) {
        uint i = tid + a * WG;
        uint r = i / DV, d = i % DV, j = row0 + r;
        if (i >= BR * DV || j >= n_rows) {
            continue;
        }
        uint t = j / G, h = kvh * G + j % G;
        float sum = s_sh[r], v = acc[a];
#if HAS_SINKS
        float M = m_sh[r], sink = data_sinks[at(p.sinks, h, 0, 0, 0)];
        if (sink > M) {
            float ms = exp(M - sink);
            v *= ms;
            sum = sum * ms + 1.0;
        } else {
            sum += exp(sink - M);
        }
#endif
        v = sum == 0.0 ? 0.0 : v / sum;
#if SOFT_MAX_ATTN
        data_y[at(p.y, d, t, h, s)] = v;
#else
        data_y[at(p.y, d, h, t, s)] = v;
#endif
    }
}
