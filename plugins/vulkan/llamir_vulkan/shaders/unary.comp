#version 450
// dst = f(src) element-wise (ggml's unary ops, scale, clamp, fill), src read from any strides
// in dst's element order. Defines: OP_<the op's name in upper case>, A_TYPE/LOAD_A,
// D_TYPE/STORE_D (see cpy_types.glsl).
#include "common.glsl"
#include "cpy_types.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor a; Tensor d; float p0; float p1; } p;
layout(std430, binding = 1) readonly buffer A { A_TYPE data_a[]; };
layout(std430, binding = 2) writeonly buffer D { D_TYPE data_d[]; };

const float SQRT_2_OVER_PI = 0.79788456080286535587989211986876;
const float GELU_COEF_A = 0.044715;
const float SQRT_2_INV = 0.70710678118654752440084436210484;

// Abramowitz-Stegun 7.1.26, |error| < 1.5e-7 (GLSL has no erf)
float erf_approx(float x) {
    float t = 1.0 / (1.0 + 0.3275911 * abs(x));
    float y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
                     + 0.254829592) * t * exp(-x * x);
    return sign(x) * y;
}

float f(float x) {
#if defined(OP_NEG)
    return -x;
#elif defined(OP_ABS)
    return abs(x);
#elif defined(OP_SGN)
    return x > 0.0 ? 1.0 : (x < 0.0 ? -1.0 : 0.0);
#elif defined(OP_STEP)
    return x > 0.0 ? 1.0 : 0.0;
#elif defined(OP_TANH)
    return tanh(clamp(x, -15.0, 15.0));
#elif defined(OP_ELU)
    return x > 0.0 ? x : exp(x) - 1.0;
#elif defined(OP_RELU)
    return max(x, 0.0);
#elif defined(OP_SIGMOID)
    return 1.0 / (1.0 + exp(-x));
#elif defined(OP_GELU)
    return 0.5 * x * (1.0 + tanh(clamp(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x), -15.0, 15.0)));
#elif defined(OP_GELU_ERF)
    return 0.5 * x * (1.0 + erf_approx(x * SQRT_2_INV));
#elif defined(OP_GELU_QUICK)
    return x / (1.0 + exp(-1.702 * x));
#elif defined(OP_SILU)
    return x / (1.0 + exp(-x));
#elif defined(OP_HARDSIGMOID)
    return clamp((x + 3.0) / 6.0, 0.0, 1.0);
#elif defined(OP_HARDSWISH)
    return x * clamp((x + 3.0) / 6.0, 0.0, 1.0);
#elif defined(OP_EXP)
    return exp(x);
#elif defined(OP_LOG)
    return log(x);
#elif defined(OP_SQR)
    return x * x;
#elif defined(OP_SQRT)
    return sqrt(x);
#elif defined(OP_SIN)
    return sin(x);
#elif defined(OP_COS)
    return cos(x);
#elif defined(OP_SOFTPLUS)
    return x > 20.0 ? x : log(1.0 + exp(x));
#elif defined(OP_SCALE)
    return x * p.p0 + p.p1;
#elif defined(OP_CLAMP)
    return min(max(x, p.p0), p.p1);
#elif defined(OP_FILL)
    return p.p0;
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
    data_d[at(p.d, c.x, c.y, c.z, c.w)] = STORE_D(f(LOAD_A(data_a[at(p.a, c.x, c.y, c.z, c.w)])));
}
