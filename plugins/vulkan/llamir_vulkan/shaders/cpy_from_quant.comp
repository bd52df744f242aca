#version 450
// dst = src dequantized (ggml's cpy from a quantized type to f32, f16 or bf16), src rows of whole
// blocks, any row strides. One thread per four elements of a row (rows are whole blocks, so a
// multiple of 32 elements long).
// Defines: A_<TYPE> (see dequant.glsl), D_TYPE/STORE_D (see cpy_types.glsl).
#include "common.glsl"
#include "cpy_types.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor d; } p;
#define A_BINDING 1
#include "dequant.glsl"
layout(std430, binding = 2) writeonly buffer D { D_TYPE data_d[]; };

void main() {
    uint units = p.d.ne0 / 4u;
    uint i = thread_id();
    if (i >= units * nrows(p.d)) {
        return;
    }
    uint k = i % units * 4u;
    uint r = i / units;
    vec4 v = dequant4(row_at(p.a, r), k, p.a.nb0);
    uint row = row_at(p.d, r);
    [[unroll]] for (uint c = 0; c < 4u; ++c) {
        data_d[row + (k + c) * p.d.nb0] = STORE_D(v[c]);
    }
}
