#version 450
// dst = src converted to dst's type, src read from any strides in dst's flat element order:
// ggml's cpy and cont (a cont may reshape). One thread per element.
// Defines: A_TYPE/LOAD_A (src), D_TYPE/STORE_D (dst) as cpy_types.glsl describes; RAW copies
// the storage unconverted (src and dst of one type); QK and BLOCK copy quantized rows (QK
// elements and BLOCK bytes a block, A_TYPE and D_TYPE uint8_t) byte by byte, one thread a byte.
#include "common.glsl"
#include "cpy_types.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor d; } p;
layout(std430, binding = 1) readonly buffer A { A_TYPE data_a[]; };
layout(std430, binding = 2) writeonly buffer D { D_TYPE data_d[]; };

#ifdef BLOCK
// Block b (a flat index over t's blocks) of t, as its first byte.
uint block_at(Tensor t, uint b) {
    uint n0 = t.ne0 / QK;
    uint i0 = b % n0;
    return row_at(t, b / n0) + i0 * t.nb0;
}

void main() {
    uint i = thread_id();
    if (i >= nelements(p.d) / QK * BLOCK) {
        return;
    }
    uint b = i / BLOCK;
    uint j = i % BLOCK;
    data_d[block_at(p.d, b) + j] = data_a[block_at(p.a, b) + j];
}
#else
void main() {
    uint i = thread_id();
    if (i >= nelements(p.d)) {
        return;
    }
    uvec4 c = unravel(p.d, i);
    uvec4 s = unravel(p.a, i);
#ifdef RAW
    data_d[at(p.d, c.x, c.y, c.z, c.w)] = data_a[at(p.a, s.x, s.y, s.z, s.w)];
#else
    data_d[at(p.d, c.x, c.y, c.z, c.w)] = STORE_D(LOAD_A(data_a[at(p.a, s.x, s.y, s.z, s.w)]));
#endif
}
#endif
