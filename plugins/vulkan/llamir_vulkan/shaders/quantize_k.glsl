// The K-quant encoders of quantize.glsl (QK = 256): ggml's quantize_row_{q2,q3,q4,q5,q6}_K_ref,
// statement by statement (ggml-quants.c; llamir/ir/quants.py vectorises the same arithmetic).
// Each block is fitted sub-block by sub-block (make_qkx2_quants: an affine fit searched over
// nstep scales; make_q3_quants / make_qx_quants: symmetric fits), the sub-block scales are
// quantized against the block's largest, and the levels are recomputed from the stored scales.
// Sums run in ggml's loop order and every rounding step is `precise`.

const float GROUP_MAX_EPS = 1e-15;

uint qL[QK];    // the block's levels
float qw[32];   // make_qkx2_quants' weights for the sub-block being fitted

// ggml's nearest_int: round half to even.
int nearest_int(float v) {
    return int(roundEven(v));
}

#if defined(QUANT_Q2_K) || defined(QUANT_Q4_K) || defined(QUANT_Q5_K)
// ggml's make_qkx2_quants over qx[base .. base + n) with weights qw: levels 0..nmax into qL, the
// scale returned and the offset (-min) in the_min.
float make_qkx2_quants(uint base, uint n, int nmax, float rmin, float rdelta, int nstep, bool use_mad,
                       out float the_min) {
    precise float lo = qx[base];
    precise float hi = qx[base];
    precise float sum_w = qw[0];
    precise float sum_x = sum_w * qx[base];
    for (uint i = 1; i < n; ++i) {
        float v = qx[base + i];
        if (v < lo) {
            lo = v;
        }
        if (v > hi) {
            hi = v;
        }
        sum_w += qw[i];
        sum_x += qw[i] * v;
    }
    if (lo > 0.0) {
        lo = 0.0;
    }
    if (hi == lo) {
        for (uint i = 0; i < n; ++i) {
            qL[base + i] = 0u;
        }
        the_min = -lo;
        return 0.0;
    }
    precise float iscale = float(nmax) / (hi - lo);
    precise float scale = 1.0 / iscale;
    precise float best_error = 0.0;
    for (uint i = 0; i < n; ++i) {
        int l = clamp(nearest_int(iscale * (qx[base + i] - lo)), 0, nmax);
        qL[base + i] = uint(l);
        precise float diff = scale * float(l) + lo - qx[base + i];
        diff = use_mad ? abs(diff) : diff * diff;
        best_error += qw[i] * diff;
    }
    uint laux[32];
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * float(is) + float(nmax)) / (hi - lo);
        precise float sum_l = 0.0;
        precise float sum_l2 = 0.0;
        precise float sum_xl = 0.0;
        for (uint i = 0; i < n; ++i) {
            int l = clamp(nearest_int(iscale * (qx[base + i] - lo)), 0, nmax);
            laux[i] = uint(l);
            precise float wl = qw[i] * float(l);
            sum_l += wl;
            sum_l2 += wl * float(l);
            sum_xl += wl * qx[base + i];
        }
        precise float det = sum_w * sum_l2 - sum_l * sum_l;
        if (det > 0.0) {
            precise float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            precise float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if (this_min > 0.0) {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            precise float cur_error = 0.0;
            for (uint i = 0; i < n; ++i) {
                precise float diff = this_scale * float(laux[i]) + this_min - qx[base + i];
                diff = use_mad ? abs(diff) : diff * diff;
                cur_error += qw[i] * diff;
            }
            if (cur_error < best_error) {
                for (uint i = 0; i < n; ++i) {
                    qL[base + i] = laux[i];
                }
                best_error = cur_error;
                scale = this_scale;
                lo = this_min;
            }
        }
    }
    the_min = -lo;
    return scale;
}
#endif

// The first value of largest magnitude of qx[base .. base + 16), sign kept (0 for none).
float signed_absmax16(uint base) {
    float amax = 0.0;
    float vmax = 0.0;
    for (uint i = 0; i < 16u; ++i) {
        float ax = abs(qx[base + i]);
        if (ax > amax) {
            amax = ax;
            vmax = qx[base + i];
        }
    }
    return vmax;
}

#ifdef QUANT_Q6_K
// ggml's make_qx_quants with rmse_type 1 and no weights over qx[base .. base + 16): levels
// 0..2 nmax - 1 into qL, the scale returned.
float make_qx_quants(uint base, int nmax) {
    float vmax = signed_absmax16(base);
    if (abs(vmax) < GROUP_MAX_EPS) {
        for (uint i = 0; i < 16u; ++i) {
            qL[base + i] = 0u;
        }
        return 0.0;
    }
    precise float iscale = -float(nmax) / vmax;
    precise float sumlx = 0.0;
    precise float suml2 = 0.0;
    for (uint i = 0; i < 16u; ++i) {
        float x = qx[base + i];
        int l = clamp(nearest_int(iscale * x), -nmax, nmax - 1);
        qL[base + i] = uint(l + nmax);
        precise float w = x * x;
        sumlx += w * x * float(l);
        suml2 += w * float(l) * float(l);
    }
    precise float scale = suml2 != 0.0 ? sumlx / suml2 : 0.0;
    precise float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) {
            continue;
        }
        iscale = -(float(nmax) + 0.1 * float(is)) / vmax;
        sumlx = 0.0;
        suml2 = 0.0;
        for (uint i = 0; i < 16u; ++i) {
            float x = qx[base + i];
            int l = clamp(nearest_int(iscale * x), -nmax, nmax - 1);
            precise float w = x * x;
            sumlx += w * x * float(l);
            suml2 += w * float(l) * float(l);
        }
        if (suml2 > 0.0 && sumlx * sumlx > best * suml2) {
            for (uint i = 0; i < 16u; ++i) {
                qL[base + i] = uint(clamp(nearest_int(iscale * qx[base + i]), -nmax, nmax - 1) + nmax);
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}
#endif

#ifdef QUANT_Q3_K
// ggml's make_q3_quants with do_rmse over qx[base .. base + 16): a symmetric fit, then up to
// five sweeps that move one level at a time where that improves sumlx^2 / suml2. Levels
// 0..2 nmax - 1 into qL, the scale returned.
float make_q3_quants(uint base, int nmax) {
    float vmax = signed_absmax16(base);
    if (abs(vmax) < GROUP_MAX_EPS) {
        for (uint i = 0; i < 16u; ++i) {
            qL[base + i] = 0u;
        }
        return 0.0;
    }
    precise float iscale = -float(nmax) / vmax;
    int l16[16];
    precise float sumlx = 0.0;
    precise float suml2 = 0.0;
    for (uint i = 0; i < 16u; ++i) {
        float x = qx[base + i];
        l16[i] = clamp(nearest_int(iscale * x), -nmax, nmax - 1);
        precise float w = x * x;
        sumlx += w * x * float(l16[i]);
        suml2 += w * float(l16[i]) * float(l16[i]);
    }
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (uint i = 0; i < 16u; ++i) {
            float x = qx[base + i];
            precise float w = x * x;
            precise float slx = sumlx - w * x * float(l16[i]);
            if (slx > 0.0) {
                precise float sl2 = suml2 - w * float(l16[i]) * float(l16[i]);
                precise float t = x * sl2 / slx;
                int new_l = clamp(nearest_int(t), -nmax, nmax - 1);
                if (new_l != l16[i]) {
                    slx += w * x * float(new_l);
                    sl2 += w * float(new_l) * float(new_l);
                    precise float gain_new = slx * slx * suml2;
                    precise float gain_old = sumlx * sumlx * sl2;
                    if (sl2 > 0.0 && gain_new > gain_old) {
                        l16[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (n_changed == 0) {
            break;
        }
    }
    for (uint i = 0; i < 16u; ++i) {
        qL[base + i] = uint(l16[i] + nmax);
    }
    return suml2 > 0.0 ? sumlx / suml2 : 0.0;
}
#endif

// 2-bit fields as q2_K and q3_K pack them: per 128 values, byte l holds l, l+32, l+64, l+96.
void put_crumbs(uint at_) {
    for (uint j = 0; j < QK; j += 128u) {
        for (uint l = 0; l < 32u; ++l) {
            put_byte(at_ + j / 4u + l, (qL[j + l] & 3u) | ((qL[j + l + 32u] & 3u) << 2) |
                                      ((qL[j + l + 64u] & 3u) << 4) | ((qL[j + l + 96u] & 3u) << 6));
        }
    }
}

#ifdef QUANT_Q2_K
// q2_K: scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin; per 16 values an affine fit
// of 2-bit levels (absolute error).
void quantize_block(uint at_) {
    float scales[16];
    float mins[16];
    float max_scale = 0.0;
    float max_min = 0.0;
    for (uint j = 0; j < 16u; ++j) {
        for (uint l = 0; l < 16u; ++l) {
            qw[l] = abs(qx[16u * j + l]);
        }
        scales[j] = make_qkx2_quants(16u * j, 16u, 3, -0.5, 0.1, 15, true, mins[j]);
        if (scales[j] > max_scale) {  // not max(): a -0.0 min must not replace 0.0
            max_scale = scales[j];
        }
        if (mins[j] > max_min) {
            max_min = mins[j];
        }
    }
    uint sc[16];
    precise float d = 0.0;
    precise float dmin = 0.0;
    for (uint j = 0; j < 16u; ++j) {
        sc[j] = 0u;
    }
    if (max_scale > 0.0) {
        precise float iscale = 15.0 / max_scale;
        for (uint j = 0; j < 16u; ++j) {
            sc[j] = uint(nearest_int(iscale * scales[j]));
        }
        d = max_scale / 15.0;
    }
    if (max_min > 0.0) {
        precise float iscale = 15.0 / max_min;
        for (uint j = 0; j < 16u; ++j) {
            sc[j] |= uint(nearest_int(iscale * mins[j])) << 4;
        }
        dmin = max_min / 15.0;
    }
    float dq = f16_rounded(d);
    float dmq = f16_rounded(dmin);
    for (uint j = 0; j < 16u; ++j) {
        sc[j] &= 0xFFu;  // stored in a byte
        precise float ds = dq * float(sc[j] & 0xFu);
        if (ds == 0.0) {
            continue;
        }
        precise float dm = dmq * float(sc[j] >> 4);
        for (uint i = 0; i < 16u; ++i) {
            precise float t = (qx[16u * j + i] + dm) / ds;
            qL[16u * j + i] = uint(clamp(nearest_int(t), 0, 3));
        }
    }
    for (uint j = 0; j < 16u; ++j) {
        put_byte(at_ + j, sc[j]);
    }
    put_crumbs(at_ + 16u);
    put_f16(at_ + 80u, d);
    put_f16(at_ + 82u, dmin);
}
#endif

#ifdef QUANT_Q3_K
// q3_K: hmask[32] (bit j/32 of byte j%32: level j's bit 2), qs[64] (its low two bits),
// scales[12] (16 6-bit scales biased by 32), d; per 16 values a symmetric fit of 3-bit levels.
void quantize_block(uint at_) {
    float scales[16];
    float max_scale = 0.0;
    float amax = 0.0;
    for (uint j = 0; j < 16u; ++j) {
        scales[j] = make_q3_quants(16u * j, 4);
        if (abs(scales[j]) > amax) {
            amax = abs(scales[j]);
            max_scale = scales[j];
        }
    }
    uint sb[12];
    for (uint j = 0; j < 12u; ++j) {
        sb[j] = 0u;
    }
    precise float d = 0.0;
    if (max_scale != 0.0) {
        precise float iscale = -32.0 / max_scale;
        for (uint j = 0; j < 16u; ++j) {
            uint l = uint(clamp(nearest_int(iscale * scales[j]), -32, 31) + 32);
            if (j < 8u) {
                sb[j] = l & 0xFu;
            } else {
                sb[j - 8u] |= (l & 0xFu) << 4;
            }
            sb[j % 4u + 8u] |= (l >> 4) << (2u * (j / 4u));
        }
        d = 1.0 / iscale;
    }
    float dq = f16_rounded(d);
    for (uint j = 0; j < 16u; ++j) {
        uint lo = j < 8u ? sb[j] & 0xFu : sb[j - 8u] >> 4;
        int sc = int(lo | (((sb[8u + j % 4u] >> (2u * (j / 4u))) & 3u) << 4)) - 32;
        precise float ds = dq * float(sc);
        if (ds == 0.0) {
            continue;
        }
        for (uint i = 0; i < 16u; ++i) {
            precise float t = qx[16u * j + i] / ds;
            qL[16u * j + i] = uint(clamp(nearest_int(t), -4, 3) + 4);
        }
    }
    uint hmask[32];
    for (uint m = 0; m < 32u; ++m) {
        hmask[m] = 0u;
    }
    for (uint j = 0; j < QK; ++j) {
        if (qL[j] > 3u) {
            hmask[j % 32u] |= 1u << (j / 32u);
            qL[j] -= 4u;
        }
    }
    for (uint m = 0; m < 32u; ++m) {
        put_byte(at_ + m, hmask[m]);
    }
    put_crumbs(at_ + 32u);
    for (uint j = 0; j < 12u; ++j) {
        put_byte(at_ + 96u + j, sb[j]);
    }
    put_f16(at_ + 108u, d);
}
#endif

#if defined(QUANT_Q4_K) || defined(QUANT_Q5_K)
// q4_K / q5_K: d, dmin, scales[12] (8 6-bit scale and min pairs, as get_scale_min_k4 reads
// them), then (q5_K) qh[32] and qs[128]; per 32 values an affine fit of 4-bit (5-bit) levels
// weighted by rms(x) + |x|.
#ifdef QUANT_Q4_K
const int K_NMAX = 15;
const float K_RMIN = -1.0;
const int K_NSTEP = 20;
#else
const int K_NMAX = 31;
const float K_RMIN = -0.5;
const int K_NSTEP = 15;
#endif

void quantize_block(uint at_) {
    float scales[8];
    float mins[8];
    float max_scale = 0.0;
    float max_min = 0.0;
    for (uint j = 0; j < 8u; ++j) {
        precise float sum_x2 = 0.0;
        for (uint l = 0; l < 32u; ++l) {
            sum_x2 += qx[32u * j + l] * qx[32u * j + l];
        }
        precise float av_x = sqrt(sum_x2 / 32.0);
        for (uint l = 0; l < 32u; ++l) {
            qw[l] = av_x + abs(qx[32u * j + l]);
        }
        scales[j] = make_qkx2_quants(32u * j, 32u, K_NMAX, K_RMIN, 0.1, K_NSTEP, false, mins[j]);
        if (scales[j] > max_scale) {  // not max(): a -0.0 min must not replace 0.0
            max_scale = scales[j];
        }
        if (mins[j] > max_min) {
            max_min = mins[j];
        }
    }
    precise float inv_scale = max_scale > 0.0 ? 63.0 / max_scale : 0.0;
    precise float inv_min = max_min > 0.0 ? 63.0 / max_min : 0.0;
    uint sb[12];
    for (uint j = 0; j < 8u; ++j) {
        // uint8_t ls = nearest_int(...): a negative level wraps before MIN(63, ls)
        uint ls = min(63u, uint(nearest_int(inv_scale * scales[j])) & 0xFFu);
        uint lm = min(63u, uint(nearest_int(inv_min * mins[j])) & 0xFFu);
        if (j < 4u) {
            sb[j] = ls;
            sb[j + 4u] = lm;
        } else {
            sb[j + 4u] = (ls & 0xFu) | ((lm & 0xFu) << 4);
            sb[j - 4u] |= (ls >> 4) << 6;
            sb[j] |= (lm >> 4) << 6;
        }
    }
    precise float d = max_scale / 63.0;
    precise float dmin = max_min / 63.0;
    float dq = f16_rounded(d);
    float dmq = f16_rounded(dmin);
    for (uint j = 0; j < 8u; ++j) {
        uint sc = j < 4u ? sb[j] & 63u : (sb[j + 4u] & 0xFu) | ((sb[j - 4u] >> 6) << 4);
        uint m = j < 4u ? sb[j + 4u] & 63u : (sb[j + 4u] >> 4) | ((sb[j] >> 6) << 4);
        precise float ds = dq * float(sc);
        if (ds == 0.0) {
            continue;
        }
        precise float dm = dmq * float(m);
        for (uint i = 0; i < 32u; ++i) {
            precise float t = (qx[32u * j + i] + dm) / ds;
            qL[32u * j + i] = uint(clamp(nearest_int(t), 0, K_NMAX));
        }
    }
    put_f16(at_, d);
    put_f16(at_ + 2u, dmin);
    for (uint j = 0; j < 12u; ++j) {
        put_byte(at_ + 4u + j, sb[j]);
    }
#ifdef QUANT_Q4_K
    // qs: sub-blocks 2c and 2c + 1 in the low and high nibbles of qs[32c .. 32c + 31]
    for (uint c = 0; c < 4u; ++c) {
        for (uint l = 0; l < 32u; ++l) {
            put_byte(at_ + 16u + 32u * c + l, qL[64u * c + l] | (qL[64u * c + l + 32u] << 4));
        }
    }
#else
    // qh: bit s of qh[l] is bit 4 of sub-block s's level l; qs: the low nibbles as in q4_K
    for (uint l = 0; l < 32u; ++l) {
        uint qh = 0u;
        for (uint s = 0; s < 8u; ++s) {
            qh |= (qL[32u * s + l] >> 4) << s;
        }
        put_byte(at_ + 16u + l, qh);
    }
    for (uint c = 0; c < 4u; ++c) {
        for (uint l = 0; l < 32u; ++l) {
            put_byte(at_ + 48u + 32u * c + l, (qL[64u * c + l] & 0xFu) | ((qL[64u * c + l + 32u] & 0xFu) << 4));
        }
    }
#endif
}
#endif

#ifdef QUANT_Q6_K
// q6_K: ql[128], qh[64], scales[16] (int8), d; per 16 values a symmetric fit of 6-bit levels.
void quantize_block(uint at_) {
    float scales[16];
    float max_scale = 0.0;
    float max_abs_scale = 0.0;
    for (uint j = 0; j < 16u; ++j) {
        scales[j] = make_qx_quants(16u * j, 32);
        if (abs(scales[j]) > max_abs_scale) {
            max_abs_scale = abs(scales[j]);
            max_scale = scales[j];
        }
    }
    if (max_abs_scale < GROUP_MAX_EPS) {  // an all-zero block
        for (uint i = 0; i < 210u; ++i) {
            put_byte(at_ + i, 0u);
        }
        return;
    }
    precise float iscale = -128.0 / max_scale;
    precise float d = 1.0 / iscale;
    float dq = f16_rounded(d);
    int sc[16];
    for (uint j = 0; j < 16u; ++j) {
        sc[j] = min(127, nearest_int(iscale * scales[j]));
        precise float ds = dq * float(sc[j]);
        if (ds == 0.0) {
            continue;
        }
        for (uint i = 0; i < 16u; ++i) {
            precise float t = qx[16u * j + i] / ds;
            qL[16u * j + i] = uint(clamp(nearest_int(t), -32, 31) + 32);
        }
    }
    // per 128 values (h): ql[64h + l] holds levels l and l + 64 (low nibbles), ql[64h + 32 + l]
    // levels l + 32 and l + 96; qh[32h + l] their high two bits, 2 bits each
    for (uint h = 0; h < 2u; ++h) {
        uint j = 128u * h;
        for (uint l = 0; l < 32u; ++l) {
            put_byte(at_ + 64u * h + l, (qL[j + l] & 0xFu) | ((qL[j + l + 64u] & 0xFu) << 4));
            put_byte(at_ + 64u * h + 32u + l, (qL[j + l + 32u] & 0xFu) | ((qL[j + l + 96u] & 0xFu) << 4));
            put_byte(at_ + 128u + 32u * h + l, (qL[j + l] >> 4) | ((qL[j + l + 32u] >> 4) << 2) |
                                               ((qL[j + l + 64u] >> 4) << 4) | ((qL[j + l + 96u] >> 4) << 6));
        }
    }
    for (uint j = 0; j < 16u; ++j) {
        put_byte(at_ + 192u + j, uint(sc[j]));
    }
    put_f16(at_ + 208u, d);
}
#endif
