#version 450
// b of a matmul converted to the weight's vec_dot_type, as ggml's CPU mul_mat converts it before
// its dot products (llamir/ir/quants.py: cpu_from_float), into contiguous rows (the scratch
// buffer mul_mm.comp / mul_mv.comp then read it from, through mul_b.glsl). b is read from any
// strides. f16 / bf16: one thread per element; q8_0 / q8_1 / q8_K: one thread per block.
// Defines: A_TYPE/LOAD_A (b's storage, see cpy_types.glsl), and QB_F16, QB_BF16 or QUANT_Q8_0,
// QUANT_Q8_1, QUANT_Q8_K (the vec_dot_type, see quantize.glsl).
#include "common.glsl"
#include "cpy_types.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor d; } p;
layout(std430, binding = 1) readonly buffer A { A_TYPE data_a[]; };
#if defined(QB_F16) || defined(QB_BF16)
layout(std430, binding = 2) writeonly buffer D { uint16_t data_d[]; };
#else
layout(std430, binding = 2) writeonly buffer Q { uint8_t data_q[]; };
#include "quantize.glsl"
#endif

void main() {
    uint t = thread_id();
#if defined(QB_F16) || defined(QB_BF16)
    if (t >= nelements(p.a)) {
        return;
    }
    uvec4 c = unravel(p.a, t);
    float v = LOAD_A(data_a[at(p.a, c.x, c.y, c.z, c.w)]);
#ifdef QB_F16
    data_d[at(p.d, c.x, c.y, c.z, c.w)] = uint16_t(f16_bits(v));
#else
    data_d[at(p.d, c.x, c.y, c.z, c.w)] = uint16_t(bf16_bits(v));
#endif
#else
    uint nblocks = p.a.ne0 / QK;
    if (t >= nblocks * nrows(p.a)) {
        return;
    }
    uint blk = t % nblocks;
    uint r = t / nblocks;
    uint i1 = r % p.a.ne1;
    r /= p.a.ne1;
    uint i2 = r % p.a.ne2;
    uint i3 = r / p.a.ne2;
    for (uint j = 0; j < QK; ++j) {
        qx[j] = LOAD_A(data_a[at(p.a, blk * QK + j, i1, i2, i3)]);
    }
    quantize_block(at(p.d, blk, i1, i2, i3));  // nb0 of a quantized tensor is its block's size
#endif
}
