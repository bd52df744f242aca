// Shared by every llamir Vulkan shader: the tensor descriptor the Python side packs
// (lowering.py: offset, ne0..ne3, nb0..nb3 in elements, ggml order), workgroup indexing.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : enable

#ifndef WG
#define WG 256
#endif
#ifndef WG_Y
#define WG_Y 1
#endif
layout(local_size_x = WG, local_size_y = WG_Y, local_size_z = 1) in;

struct Tensor {
    uint offset;
    uint ne0, ne1, ne2, ne3;
    uint nb0, nb1, nb2, nb3;
};

// The flat workgroup index over an x*y grid (lowering.groups_for).
uint group_id() {
    return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
}

// One thread per element: the flat thread index.
uint thread_id() {
    return group_id() * WG + gl_LocalInvocationID.x;
}

uint nelements(Tensor t) {
    return t.ne0 * t.ne1 * t.ne2 * t.ne3;
}

uint nrows(Tensor t) {
    return t.ne1 * t.ne2 * t.ne3;
}

// Element (i0, i1, i2, i3) of t, as an index into its binding.
uint at(Tensor t, uint i0, uint i1, uint i2, uint i3) {
    return t.offset + i0 * t.nb0 + i1 * t.nb1 + i2 * t.nb2 + i3 * t.nb3;
}

// A flat index over t's shape, as (i0, i1, i2, i3).
uvec4 unravel(Tensor t, uint i) {
    uint i0 = i % t.ne0; i /= t.ne0;
    uint i1 = i % t.ne1; i /= t.ne1;
    uint i2 = i % t.ne2;
    return uvec4(i0, i1, i2, i / t.ne2);
}

// Row r (the flat index of (i1, i2, i3)) of t, as the index of its first element.
uint row_at(Tensor t, uint r) {
    uint i1 = r % t.ne1; r /= t.ne1;
    uint i2 = r % t.ne2;
    return at(t, 0, i1, i2, r / t.ne2);
}
