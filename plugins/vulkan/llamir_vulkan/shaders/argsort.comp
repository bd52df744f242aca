#version 450
// The indices that sort each row of x, one workgroup per row: ggml's argsort (ascending, or
// DESCENDING) and, writing only the first dst.ne0 of them, top_k (descending). A bitonic sort
// of (value, index) pairs in shared memory over NPAD slots (the row padded to a power of two
// with slots that sort last); ties keep the index order, so the sort is stable.
// Defines: NPAD (a power of two >= the row length), DESCENDING, WG (<= NPAD).
#include "common.glsl"

layout(std430, binding = 0) readonly buffer Params { Tensor x; Tensor d; } p;
layout(std430, binding = 1) readonly buffer X { float data_x[]; };
layout(std430, binding = 2) writeonly buffer D { int data_d[]; };

shared float vals[NPAD];
shared uint idxs[NPAD];

// Whether slot a sorts before slot b: padding (index >= n) last, else by value, ties by index.
bool before(uint a, uint b, uint n) {
    uint ia = idxs[a];
    uint ib = idxs[b];
    if (ia >= n || ib >= n) {
        return ia < ib;
    }
#ifdef DESCENDING
    return vals[a] > vals[b] || (vals[a] == vals[b] && ia < ib);
#else
    return vals[a] < vals[b] || (vals[a] == vals[b] && ia < ib);
#endif
}

void main() {
    uint r = group_id();
    if (r >= nrows(p.x)) {
        return;  // the whole workgroup leaves
    }
    uint t = gl_LocalInvocationID.x;
    uint n = p.x.ne0;
    uint row = row_at(p.x, r);
    for (uint i = t; i < NPAD; i += WG) {
        vals[i] = i < n ? data_x[row + i * p.x.nb0] : 0.0;
        idxs[i] = i;
    }
    barrier();
    for (uint k = 2u; k <= NPAD; k <<= 1) {
        for (uint j = k >> 1; j > 0u; j >>= 1) {
            for (uint i = t; i < NPAD; i += WG) {
                uint partner = i ^ j;
                if (partner > i) {
                    // blocks of k alternate direction, so that each pair of them merges bitonically
                    bool ascending = (i & k) == 0u;
                    if (before(partner, i, n) == ascending) {
                        float v = vals[i];
                        vals[i] = vals[partner];
                        vals[partner] = v;
                        uint x = idxs[i];
                        idxs[i] = idxs[partner];
                        idxs[partner] = x;
                    }
                }
            }
            barrier();
        }
    }
    uint out_row = row_at(p.d, r);
    for (uint i = t; i < p.d.ne0; i += WG) {
        data_d[out_row + i * p.d.nb0] = int(idxs[i]);
    }
}
