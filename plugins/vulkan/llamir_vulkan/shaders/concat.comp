#version 450
// dst = a and b joined along ggml axis `dim` (ggml's concat), one thread per dst element.
// Defines: A_TYPE (the storage type of a, b and dst: the copy is unconverted).
#include "common.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor b; Tensor d; uint dim; } p;
layout(std430, binding = 1) readonly buffer A { A_TYPE data_a[]; };
layout(std430, binding = 2) readonly buffer B { A_TYPE data_b[]; };
layout(std430, binding = 3) writeonly buffer D { A_TYPE data_d[]; };

void main() {
    uint i = thread_id();
    if (i >= nelements(p.d)) {
        return;
    }
    uvec4 c = unravel(p.d, i);
    uvec4 ne_a = uvec4(p.a.ne0, p.a.ne1, p.a.ne2, p.a.ne3);
    if (all(lessThan(c, ne_a))) {  // off the axis, a and dst have the same extent
        data_d[at(p.d, c.x, c.y, c.z, c.w)] = data_a[at(p.a, c.x, c.y, c.z, c.w)];
    } else {
        uvec4 s = c - uvec4(equal(uvec4(0u, 1u, 2u, 3u), uvec4(p.dim))) * ne_a;
        data_d[at(p.d, c.x, c.y, c.z, c.w)] = data_b[at(p.b, s.x, s.y, s.z, s.w)];
    }
}
