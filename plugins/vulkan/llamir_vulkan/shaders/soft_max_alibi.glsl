// The ALiBi slope of head h as ggml computes it (soft_max_ext, flash_attn_ext): m0^(h+1) for the
// first n_head_log2 heads, m1^(2(h - n_head_log2) + 1) after them, 1 when max_bias == 0.
// The Python side passes m0 = 2^(-max_bias/n_head_log2), m1 = 2^(-max_bias/2/n_head_log2).
float alibi_slope(uint h, float max_bias, float m0, float m1, uint n_head_log2) {
    if (max_bias <= 0.0) {
        return 1.0;
    }
    return h < n_head_log2 ? pow(m0, float(h + 1)) : pow(m1, float(2 * (h - n_head_log2) + 1));
}
