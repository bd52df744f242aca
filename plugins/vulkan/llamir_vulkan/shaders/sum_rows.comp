#version 450
// Row sums, one workgroup per row of x: ggml's sum_rows (y[r] = sum of row r), mean (divided
// by the row's length) and, with ALL, sum (one workgroup over every element of x).
// Defines: MEAN, ALL, A_TYPE/LOAD_A (x), D_TYPE/STORE_D (y), as cpy_types.glsl describes.
#include "common.glsl"
#include "cpy_types.glsl"
#include "sum.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor x; Tensor d; } p;
layout(std430, binding = 1) readonly buffer X { A_TYPE data_x[]; };
layout(std430, binding = 2) writeonly buffer D { D_TYPE data_d[]; };

void main() {
    uint r = group_id();
    uint t = gl_LocalInvocationID.x;
    float acc = 0.0;
#ifdef ALL
    uint n = nelements(p.x);
    for (uint j = t; j < n; j += WG) {
        uvec4 c = unravel(p.x, j);
        acc += LOAD_A(data_x[at(p.x, c.x, c.y, c.z, c.w)]);
    }
    float total = workgroup_sum(acc);
    if (t == 0u) {
        data_d[at(p.d, 0, 0, 0, 0)] = STORE_D(total);
    }
#else
    if (r >= nrows(p.x)) {
        return;  // the whole workgroup leaves
    }
    uint row = row_at(p.x, r);
    for (uint j = t; j < p.x.ne0; j += WG) {
        acc += LOAD_A(data_x[row + j * p.x.nb0]);
    }
    float total = workgroup_sum(acc);
#ifdef MEAN
    total /= float(p.x.ne0);
#endif
    if (t == 0u) {
        data_d[row_at(p.d, r)] = STORE_D(total);
    }
#endif
}
