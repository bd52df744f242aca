#version 450
// ggml's soft_max_ext: y = softmax(x*scale + slope_h*mask) over each row of x [..., H, T, n]
// (ne0 = n, ne1 = T, ne2 = H, ne3 = streams). One workgroup per row, three strided passes over
// it: the max (with the sink's logit), the sum of exp (with the sink's term), then the write, the
// first two reduced in shared memory. mask [..., H', T', n] repeats over heads and streams
// (h % H', s % S'); its row t of T' >= T applies. slope_h is head h's ALiBi slope (soft_max_alibi.glsl).
// y may be x itself: x is last read, element by element, by the thread that writes y there.
// Defines: HAS_MASK (0 or 1) and M_TYPE (the mask's storage type), HAS_SINKS (0 or 1: sinks f32 [H]),
// WG (a power of two).
#include "common.glsl"
#include "soft_max_alibi.glsl"

layout(std430, binding = 0) readonly buffer Params {
    Tensor x;
#if HAS_MASK
    Tensor m;
#endif
#if HAS_SINKS
    Tensor sinks;
#endif
    Tensor y;
    float scale;
    float max_bias;
    float m0;
    float m1;
    uint n_head_log2;
} p;
layout(std430, binding = 1) readonly buffer X { float data_x[]; };
#if HAS_MASK
layout(std430, binding = 2) readonly buffer M { M_TYPE data_m[]; };
#endif
#if HAS_SINKS
layout(std430, binding = 2 + HAS_MASK) readonly buffer Sinks { float data_sinks[]; };
#endif
layout(std430, binding = 2 + HAS_MASK + HAS_SINKS) writeonly buffer Y { float data_y[]; };

shared float red[WG];

float reduce_max(float v) {
    uint tid = gl_LocalInvocationID.x;
    red[tid] = v;
    barrier();
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (tid < s) {
            red[tid] = max(red[tid], red[tid + s]);
        }
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

float reduce_sum(float v) {
    uint tid = gl_LocalInvocationID.x;
    red[tid] = v;
    barrier();
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (tid < s) {
            red[tid] += red[tid + s];
        }
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

// The logit of element i of row (t, h, s): x*scale + slope*mask.
float logit(uint i, uint t, uint h, uint s, float slope) {
    float w = data_x[at(p.x, i, t, h, s)] * p.scale;
#if HAS_MASK
    w = fma(slope, float(data_m[at(p.m, i, t % p.m.ne1, h % p.m.ne2, s % p.m.ne3)]), w);
#endif
    return w;
}

void main() {
    uint row = group_id();
    if (row >= nrows(p.x)) {
        return;
    }
    uint tid = gl_LocalInvocationID.x;
    uint n = p.x.ne0;
    uint t = row % p.x.ne1;
    uint h = (row / p.x.ne1) % p.x.ne2;
    uint s = row / p.x.ne1 / p.x.ne2;
    float slope = alibi_slope(h, p.max_bias, p.m0, p.m1, p.n_head_log2);

    float mx = uintBitsToFloat(0xFF800000u);  // -inf
    for (uint i = tid; i < n; i += WG) {
        mx = max(mx, logit(i, t, h, s, slope));
    }
    mx = reduce_max(mx);
#if HAS_SINKS
    float sink = data_sinks[at(p.sinks, h, 0, 0, 0)];
    mx = max(mx, sink);
#endif

    float sum = 0.0;
    for (uint i = tid; i < n; i += WG) {
        sum += exp(logit(i, t, h, s, slope) - mx);
    }
    sum = reduce_sum(sum);
#if HAS_SINKS
    sum += exp(sink - mx);
#endif

    float inv = 1.0 / sum;
    for (uint i = tid; i < n; i += WG) {
        float e = exp(logit(i, t, h, s, slope) - mx);
        data_y[at(p.y, i, t, h, s)] = e * inv;
    }
}
