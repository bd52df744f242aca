#version 450
// ggml's get_rows: d[i3, i2, n, :] = a[i3, i2, idx[i3, i2, n], :], dequantized to f32 (i32 rows
// are copied as they are). One thread per four elements of an output row. The binding of a may
// hold only rows row_base .. row_base + a.ne1 (a large src0 bound in chunks): other rows are
// left to the dispatch that holds them.
// Defines: A_<TYPE> and A_UNIT (dequant.glsl), or A_I32; WG.
#include "common.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor idx; Tensor d; uint row_base; } p;
layout(std430, binding = 2) readonly buffer Idx { int data_idx[]; };
#ifdef A_I32
layout(std430, binding = 1) readonly buffer A { int data_a[]; };
layout(std430, binding = 3) writeonly buffer D { int data_d[]; };
#else
#define A_BINDING 1
#include "dequant.glsl"
layout(std430, binding = 3) writeonly buffer D { float data_d[]; };
#endif

void main() {
    const uint C = p.a.ne0;
    uint units = (C + 3) / 4;
    uint i = thread_id();
    if (i >= units * nrows(p.d)) {
        return;
    }
    uint k = (i % units) * 4;
    uint r = i / units;
    uint n = r % p.d.ne1;
    r /= p.d.ne1;
    uint i2 = r % p.d.ne2, i3 = r / p.d.ne2;
    uint row = uint(data_idx[at(p.idx, n, i2, i3, 0)]) - p.row_base;
    if (row >= p.a.ne1) {
        return;
    }
    uint src = at(p.a, 0, row, i2, i3), dst = at(p.d, 0, n, i2, i3);
#if defined(A_I32)
    for (uint c = k; c < min(k + 4, C); c++) {
        data_d[dst + c * p.d.nb0] = data_a[src + c * p.a.nb0];
    }
#else
    if (k + 4 <= C) {
        vec4 v = dequant4(src, k, p.a.nb0);
        [[unroll]] for (uint c = 0; c < 4; c++) {
            data_d[dst + (k + c) * p.d.nb0] = v[c];
        }
    }
#ifdef A_FLOAT
    else {  // a float row's tail
        for (uint c = k; c < C; c++) {
            data_d[dst + c * p.d.nb0] = dequant1(src, c, p.a.nb0);
        }
    }
#endif
#endif
}
