#version 450
// dst = src quantized (ggml's cpy from a float type to q4_0, q4_1, q5_0, q5_1 or q8_0), src
// read from any strides. One thread per block of dst.
// Defines: A_TYPE/LOAD_A (src, see cpy_types.glsl), QUANT_<type> (see quantize.glsl).
#include "common.glsl"
#include "cpy_types.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor d; } p;
layout(std430, binding = 1) readonly buffer A { A_TYPE data_a[]; };
layout(std430, binding = 2) writeonly buffer Q { uint8_t data_q[]; };
#include "quantize.glsl"

void main() {
    uint t = thread_id();
    uint nblocks = p.d.ne0 / QK;
    if (t >= nblocks * nrows(p.d)) {
        return;
    }
    uint blk = t % nblocks;
    uint r = t / nblocks;
    uint i1 = r % p.d.ne1;
    r /= p.d.ne1;
    uint i2 = r % p.d.ne2;
    uint i3 = r / p.d.ne2;
    for (uint j = 0; j < QK; ++j) {
        qx[j] = LOAD_A(data_a[at(p.a, blk * QK + j, i1, i2, i3)]);
    }
    quantize_block(at(p.d, blk, i1, i2, i3));  // nb0 of a quantized tensor is its block's size
}
