// A sum over the workgroup's WG threads (WG a power of two) through shared memory: a tree of
// pairwise additions. Every thread must call it (it has barriers) and every thread gets the sum.

shared float sum_partials[WG];

float workgroup_sum(float v) {
    uint t = gl_LocalInvocationID.x;
    sum_partials[t] = v;
    barrier();
    [[unroll]] for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (t < s) {
            sum_partials[t] += sum_partials[t + s];
        }
        barrier();
    }
    float total = sum_partials[0];
    barrier();  // sum_partials may be reused as soon as the call returns
    return total;
}
