#version 450
// ggml's rope_ext: rotary position embedding of x [..., T, H, d] (ne0 = d, ne1 = H, ne2 = T) at
// positions pos i32 [T]. One thread per pair of elements: pair i < n_dims/2 (NORM: elements 2i
// and 2i+1; NEOX: i and i + n_dims/2) is rotated by theta_i = pos * theta_scale^i / ff[i], with
// YaRN's blend of the interpolated and extrapolated angle; the elements at or beyond n_dims pass
// through. x may be a strided view; y may be x itself (each thread reads its pair, then writes it).
// Defines: X_TYPE (the storage type of x and y), NEOX (0 or 1), HAS_FF (0 or 1: input 3, the
// freq factors f32 [>= n_dims/2]).
#include "common.glsl"

layout(std430, binding = 0) readonly buffer Params {
    Tensor x;
    Tensor pos;
#if HAS_FF
    Tensor ff;
#endif
    Tensor y;
    uint n_dims;
    float theta_scale;   // freq_base^(-2/n_dims)
    float freq_scale;
    float ext_factor;
    float mscale;        // attn_factor (times 1 + 0.1 ln(1/freq_scale) when ext_factor != 0)
    float corr_low;      // YaRN's correction dims (ggml_rope_yarn_corr_dims)
    float corr_high;
} p;
layout(std430, binding = 1) readonly buffer X { X_TYPE data_x[]; };
layout(std430, binding = 2) readonly buffer Pos { int data_pos[]; };
#if HAS_FF
layout(std430, binding = 3) readonly buffer FF { float data_ff[]; };
#endif
layout(std430, binding = 3 + HAS_FF) writeonly buffer Y { X_TYPE data_y[]; };

// The rotation angle of pair i at position `pos`, as ggml_rope_cache_init and rope_yarn compute it.
float rope_theta(uint i, int pos) {
    // theta *= theta_scale once per pair, in f32 and in order, as ggml's cache does
    precise float theta = float(pos);
    for (uint k = 0; k < i; k++) {
        theta *= p.theta_scale;
    }
#if HAS_FF
    theta /= data_ff[at(p.ff, i, 0, 0, 0)];
#endif
    precise float theta_interp = p.freq_scale * theta;
    if (p.ext_factor == 0.0) {
        return theta_interp;
    }
    // rope_yarn_ramp: 1 below corr_low, 0 above corr_high, linear between
    float y = (float(i) - p.corr_low) / max(0.001, p.corr_high - p.corr_low);
    float ramp_mix = (1.0 - min(1.0, max(0.0, y))) * p.ext_factor;
    return fma(theta_interp, 1.0 - ramp_mix, theta * ramp_mix);
}

void main() {
    uint n_pairs = (p.y.ne0 + 1) / 2;
    uint idx = thread_id();
    if (idx >= n_pairs * nrows(p.y)) {
        return;
    }
    uint i = idx % n_pairs;
    uint r = idx / n_pairs;
    uint i1 = r % p.y.ne1;
    r /= p.y.ne1;
    uint i2 = r % p.y.ne2;
    uint i3 = r / p.y.ne2;

    uint half_dims = p.n_dims / 2;
    if (i >= half_dims) {  // past n_dims: elements 2i and 2i+1 pass through
        for (uint e = 2 * i; e < min(2 * i + 2, p.y.ne0); e++) {
            data_y[at(p.y, e, i1, i2, i3)] = data_x[at(p.x, e, i1, i2, i3)];
        }
        return;
    }
#if NEOX
    uint e0 = i, e1 = i + half_dims;
#else
    uint e0 = 2 * i, e1 = 2 * i + 1;
#endif
    float theta = rope_theta(i, data_pos[at(p.pos, i2, 0, 0, 0)]);
    float c = cos(theta) * p.mscale;
    float s = sin(theta) * p.mscale;
    float x0 = float(data_x[at(p.x, e0, i1, i2, i3)]);
    float x1 = float(data_x[at(p.x, e1, i1, i2, i3)]);
    data_y[at(p.y, e0, i1, i2, i3)] = X_TYPE(fma(x0, c, -(x1 * s)));
    data_y[at(p.y, e1, i1, i2, i3)] = X_TYPE(fma(x0, s, x1 * c));
}
