#version 450
// dst = src0 (OP) src1, src1 repeated (tiled) to dst's shape: ggml's add/sub/mul/div.
// Defines: OP (0 add, 1 sub, 2 mul, 3 div), A_TYPE/LOAD_A, B_TYPE/LOAD_B, D_TYPE/STORE_D (see
// cpy_types.glsl).
#include "common.glsl"
#include "cpy_types.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor b; Tensor d; } p;
layout(std430, binding = 1) readonly buffer A { A_TYPE data_a[]; };
layout(std430, binding = 2) readonly buffer B { B_TYPE data_b[]; };
layout(std430, binding = 3) writeonly buffer D { D_TYPE data_d[]; };

void main() {
    uint i = thread_id();
    if (i >= nelements(p.d)) {
        return;
    }
    uvec4 c = unravel(p.d, i);
    float x = LOAD_A(data_a[at(p.a, c.x, c.y, c.z, c.w)]);
    float y = LOAD_B(data_b[at(p.b, c.x % p.b.ne0, c.y % p.b.ne1, c.z % p.b.ne2, c.w % p.b.ne3)]);
#if OP == 0
    float r = x + y;
#elif OP == 1
    float r = x - y;
#elif OP == 2
    float r = x * y;
#else
    float r = x / y;
#endif
    data_d[at(p.d, c.x, c.y, c.z, c.w)] = STORE_D(r);
}
