#version 450
// Normalisations, one workgroup per row of x (ggml's rms_norm, norm, l2_norm, and the fused
// rms_norm_mul and norm_mul_add) or per channel group of a batch (ggml's group_norm over
// [W, L, C, N]: `group` channels, all of their W*L values). The sums reduce in shared memory.
// Defines: OP (0 rms_norm, 1 norm, 2 l2_norm), GROUP (group_norm: OP 1 over channel groups),
// MUL (y *= w, w tiled to x's shape), ADD (y += b, tiled likewise), A_TYPE/LOAD_A (x),
// W_TYPE/LOAD_W (w and b), D_TYPE/STORE_D (y), as cpy_types.glsl describes.
#include "common.glsl"
#include "cpy_types.glsl"
#include "sum.glsl"

layout(std430, binding = 0) readonly buffer Params {
    Tensor x;
    Tensor d;
#ifdef MUL
    Tensor w;
#endif
#ifdef ADD
    Tensor b;
#endif
    float eps;
    uint group;  // GROUP: channels per group
} p;
layout(std430, binding = 1) readonly buffer X { A_TYPE data_x[]; };
layout(std430, binding = 2) writeonly buffer D { D_TYPE data_d[]; };
#ifdef MUL
layout(std430, binding = 3) readonly buffer W { W_TYPE data_w[]; };
#endif
#ifdef ADD
layout(std430, binding = 4) readonly buffer B { W_TYPE data_b[]; };
#endif

// The segment a workgroup normalises: its first element's coordinates and its extent.
#ifdef GROUP
uint n_segments() {
    return (p.x.ne2 + p.group - 1u) / p.group * p.x.ne3;
}

uvec4 origin(uint seg) {
    uint n_groups = (p.x.ne2 + p.group - 1u) / p.group;
    return uvec4(0, 0, seg % n_groups * p.group, seg / n_groups);
}

uint extent(uvec4 o) {
    return p.x.ne0 * p.x.ne1 * (min(o.z + p.group, p.x.ne2) - o.z);
}

// Element j of the segment: W fastest, then L, then the group's channels.
uvec4 coord(uvec4 o, uint j) {
    return uvec4(j % p.x.ne0, j / p.x.ne0 % p.x.ne1, o.z + j / (p.x.ne0 * p.x.ne1), o.w);
}
#else
uint n_segments() {
    return nrows(p.x);
}

uvec4 origin(uint seg) {
    return uvec4(0, seg % p.x.ne1, seg / p.x.ne1 % p.x.ne2, seg / (p.x.ne1 * p.x.ne2));
}

uint extent(uvec4 o) {
    return p.x.ne0;
}

uvec4 coord(uvec4 o, uint j) {
    return uvec4(j, o.yzw);
}
#endif

float load_x(uvec4 c) {
    return LOAD_A(data_x[at(p.x, c.x, c.y, c.z, c.w)]);
}

void main() {
    uint seg = group_id();
    if (seg >= n_segments()) {
        return;  // the whole workgroup leaves: no barrier is skipped by part of it
    }
    uint t = gl_LocalInvocationID.x;
    uvec4 o = origin(seg);
    uint n = extent(o);
#if OP == 0 || OP == 2
    float acc = 0.0;
    for (uint j = t; j < n; j += WG) {
        float v = load_x(coord(o, j));
        acc += v * v;
    }
    float sum2 = workgroup_sum(acc);
    const float mean = 0.0;
#if OP == 0
    float scale = 1.0 / sqrt(sum2 / float(n) + p.eps);
#else
    float scale = 1.0 / max(sqrt(sum2), p.eps);
#endif
#else
    float acc = 0.0;
    for (uint j = t; j < n; j += WG) {
        acc += load_x(coord(o, j));
    }
    float mean = workgroup_sum(acc) / float(n);
    acc = 0.0;
    for (uint j = t; j < n; j += WG) {
        float v = load_x(coord(o, j)) - mean;
        acc += v * v;
    }
    float scale = 1.0 / sqrt(workgroup_sum(acc) / float(n) + p.eps);
#endif
    for (uint j = t; j < n; j += WG) {
        uvec4 c = coord(o, j);
        float y = (load_x(c) - mean) * scale;
#ifdef MUL
        y *= LOAD_W(data_w[at(p.w, c.x % p.w.ne0, c.y % p.w.ne1, c.z % p.w.ne2, c.w % p.w.ne3)]);
#endif
#ifdef ADD
        y += LOAD_W(data_b[at(p.b, c.x % p.b.ne0, c.y % p.b.ne1, c.z % p.b.ne2, c.w % p.b.ne3)]);
#endif
        data_d[at(p.d, c.x, c.y, c.z, c.w)] = STORE_D(y);
    }
}
