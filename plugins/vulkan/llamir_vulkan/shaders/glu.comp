#version 450
// dst = act(a) * b (ggml's swiglu, geglu, reglu, geglu_erf, geglu_quick), split (two tensors)
// or fused (a and b the halves of one row; `swapped` puts b first). Defines: OP_<the op's
// name in upper case>, FUSED, A_TYPE/LOAD_A (a and b), D_TYPE/STORE_D (see cpy_types.glsl).
#include "common.glsl"
#include "cpy_types.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor b; Tensor d; uint swapped; } p;
layout(std430, binding = 1) readonly buffer A { A_TYPE data_a[]; };
layout(std430, binding = 2) readonly buffer B { A_TYPE data_b[]; };
layout(std430, binding = 3) writeonly buffer D { D_TYPE data_d[]; };

const float SQRT_2_OVER_PI = 0.79788456080286535587989211986876;
const float GELU_COEF_A = 0.044715;
const float SQRT_2_INV = 0.70710678118654752440084436210484;

float erf_approx(float x) {
    float t = 1.0 / (1.0 + 0.3275911 * abs(x));
    float y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
                     + 0.254829592) * t * exp(-x * x);
    return sign(x) * y;
}

float act(float x) {
#if defined(OP_SWIGLU)
    return x / (1.0 + exp(-x));
#elif defined(OP_GEGLU)
    return 0.5 * x * (1.0 + tanh(clamp(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x), -15.0, 15.0)));
#elif defined(OP_REGLU)
    return max(x, 0.0);
#elif defined(OP_GEGLU_ERF)
    return 0.5 * x * (1.0 + erf_approx(x * SQRT_2_INV));
#elif defined(OP_GEGLU_QUICK)
    return x / (1.0 + exp(-1.702 * x));
#else
#error unknown OP
#endif
}

void main() {
    uint i = thread_id();
    if (i >= nelements(p.d)) {
        return;
    }
    uvec4 c = unravel(p.d, i);
#ifdef FUSED
    // a and b are the halves of src's row (binding 1 and 2 are the same tensor)
    uint half_ = p.d.ne0;
    uint ia = at(p.a, c.x + (p.swapped != 0 ? half_ : 0), c.y, c.z, c.w);
    uint ib = at(p.a, c.x + (p.swapped != 0 ? 0 : half_), c.y, c.z, c.w);
    float x = LOAD_A(data_a[ia]);
    float g = LOAD_A(data_b[ib]);
#else
    float x = LOAD_A(data_a[at(p.a, c.x, c.y, c.z, c.w)]);
    float g = LOAD_A(data_b[at(p.b, c.x, c.y, c.z, c.w)]);
#endif
    data_d[at(p.d, c.x, c.y, c.z, c.w)] = STORE_D(act(x) * g);
}
