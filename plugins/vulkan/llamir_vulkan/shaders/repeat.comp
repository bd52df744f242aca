#version 450
// dst = a tiled to dst's shape (ggml's repeat: each of a's dims divides dst's), one thread per
// dst element. Defines: A_TYPE (the storage type of a and dst: the copy is unconverted).
#include "common.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor d; } p;
layout(std430, binding = 1) readonly buffer A { A_TYPE data_a[]; };
layout(std430, binding = 2) writeonly buffer D { A_TYPE data_d[]; };

void main() {
    uint i = thread_id();
    if (i >= nelements(p.d)) {
        return;
    }
    uvec4 c = unravel(p.d, i);
    data_d[at(p.d, c.x, c.y, c.z, c.w)] = data_a[at(p.a, c.x % p.a.ne0, c.y % p.a.ne1, c.z % p.a.ne2, c.w % p.a.ne3)];
}
