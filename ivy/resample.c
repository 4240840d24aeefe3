/* Ivy's image resampler (ivy/resample.py loads it): Pillow's resize of an 8-bit image (RGB read as Pillow stores
   it, 4 bytes a pixel; L, 1 byte), followed by a crop, computing only the pixels the crop keeps, and giving Pillow's
   bytes exactly.

   Why by hand and not Pillow's Image.resize: speed, measured. For CLIP's preprocessing of a 640 x 480 JPEG (bicubic to
   298 x 224, centre crop 224) Pillow's two passes took 2.8 ms of the image thread's ~5 ms (2-core CPU machine,
   2026-12-06; Pillow runs each output pixel's taps one at a time, scalar, over the whole resized image). Here the
   same integer sums are laid out so that the compiler vectorises them, only over the crop's pixels and the input
   lines they reach, read straight from Pillow's own buffer; docs/performance.md has the figures.

   What "exactly" rests on (Pillow's libImaging/Resample.c, ImagingResampleInner): a resize is two separable passes,
   one along rows and one along columns, through an 8-bit image between them, in an order Pillow picks from the
   sizes (the caller passes it: ivy.images._vertical_first), a pass whose length does not change skipped. Each pass
   computes, for each output position, its taps' weights in double precision (precompute_coeffs: the filter, its
   support widened by the downscale factor, the bounds rounded, the weights divided by their sum), rounds them to
   fixed point with 22 fraction bits (normalize_coeffs_8bpc), and sums input * weight in 32-bit integers from half
   (1 << 21), then shifts and clips to 0..255 (clip8). The weights here come from the same double expressions in the
   same order (built with -ffp-contract=off: no fused multiply-adds that would round otherwise), and an integer sum
   is the same in any order (|sum| < 2^31 for every filter: 255 * sum|w| < 2^30.5; the sums run in unsigned
   arithmetic, so even an overflow would wrap back), so the kernels below may sum lanes in whatever order vectorises.
   NEAREST is not a pass in Pillow but an affine transform (Geometry.c, ImagingScaleAffine): the source index of each
   output column / row is COORD(x), x accumulated in double from a half step, added one step at a time. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

#define PRECISION_BITS 22
#define HALF (1u << (PRECISION_BITS - 1))

/* the integer kernels in a build for each of these CPUs too, picked at load (the gateway image is built on one
   machine and runs on others: no -march=native) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__ELF__)
#define KERNEL __attribute__((target_clones("default", "avx2", "arch=x86-64-v4")))
#else
#define KERNEL
#endif

enum { NEAREST = 0, LANCZOS = 1, BILINEAR = 2, BICUBIC = 3, BOX = 4, HAMMING = 5 };

/* Pillow's filters, expression for expression */
static double box_filter(double x) { return (x > -0.5 && x <= 0.5) ? 1.0 : 0.0; }

static double bilinear_filter(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static double hamming_filter(double x) {
    if (x < 0.0) x = -x;
    if (x == 0.0) return 1.0;
    if (x >= 1.0) return 0.0;
    x = x * M_PI;
    return sin(x) / x * (0.54f + 0.46f * cos(x));
}

static double bicubic_filter(double x) {
    const double a = -0.5;
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

static double sinc_filter(double x) {
    if (x == 0.0) return 1.0;
    x = x * M_PI;
    return sin(x) / x;
}

static double lanczos_filter(double x) {
    if (-3.0 <= x && x < 3.0) return sinc_filter(x) * sinc_filter(x / 3);
    return 0.0;
}

static double filter_at(int f, double x) {
    switch (f) {
    case BOX: return box_filter(x);
    case BILINEAR: return bilinear_filter(x);
    case HAMMING: return hamming_filter(x);
    case BICUBIC: return bicubic_filter(x);
    default: return lanczos_filter(x);
    }
}

static double support_of(int f) {
    return f == BOX ? 0.5 : f == BICUBIC ? 2.0 : f == LANCZOS ? 3.0 : 1.0;
}

/* One pass's taps for outputs [first, first + count) of in_size -> out_size: for output i, its first input xmin[i],
   its tap count n[i] and its fixed-point weights k[i * ksize ...]; returns ksize (the row stride of k, Pillow's), 0
   when out of memory. As precompute_coeffs + normalize_coeffs_8bpc with the box (0, 0, in_size) (a float in Pillow:
   exact below 2^24, which Ivy's pixel limit keeps to). */
static int coeffs(int in_size, int out_size, int first, int count, int f, int *xmin, int *n, int32_t **kp) {
    double scale, filterscale, support;
    filterscale = scale = (double)((float)in_size - 0.0f) / out_size;
    if (filterscale < 1.0) filterscale = 1.0;
    support = support_of(f) * filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    double *w = malloc(sizeof(double) * (size_t)ksize);
    int32_t *k = calloc((size_t)count * (size_t)ksize, sizeof(int32_t));
    if (!w || !k) {
        free(w);
        free(k);
        return 0;
    }
    double inv = 1.0 / filterscale;
    for (int i = 0; i < count; i++) {
        int xx = first + i;
        double center = 0.0f + (xx + 0.5) * scale;
        double ww = 0.0;
        int lo = (int)(center - support + 0.5);
        if (lo < 0) lo = 0;
        int hi = (int)(center + support + 0.5);
        if (hi > in_size) hi = in_size;
        int m = hi - lo;
        for (int x = 0; x < m; x++) {
            double v = filter_at(f, (x + lo - center + 0.5) * inv);
            w[x] = v;
            ww += v;
        }
        for (int x = 0; x < m; x++) {
            double v = ww != 0.0 ? w[x] / ww : w[x];
            k[(size_t)i * ksize + x] = v < 0 ? (int)(-0.5 + v * (1 << PRECISION_BITS))
                                             : (int)(0.5 + v * (1 << PRECISION_BITS));
        }
        xmin[i] = lo;
        n[i] = m < 0 ? 0 : m;
    }
    free(w);
    *kp = k;
    return ksize;
}

static inline uint8_t clip8(uint32_t sum) {
    int32_t v = (int32_t)sum >> PRECISION_BITS;
    return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v;
}

/* A pass along columns, one output line: dst[i] = clip8(HALF + sum_t rows[t][i] * k[t]) for i < len (bytes: the
   channels are independent). 64 sums at a time stay in registers over the taps. */
KERNEL static void vline(const uint8_t *base, ptrdiff_t stride, const int32_t *k, int taps, int len, uint8_t *dst) {
    int i = 0;
    for (; i + 64 <= len; i += 64) {
        uint32_t acc[64];
        for (int l = 0; l < 64; l++) acc[l] = HALF;
        for (int t = 0; t < taps; t++) {
            const uint8_t *r = base + t * stride + i;
            uint32_t kt = (uint32_t)k[t];
            for (int l = 0; l < 64; l++) acc[l] += r[l] * kt;
        }
        for (int l = 0; l < 64; l++) dst[i + l] = clip8(acc[l]);
    }
    if (i < len) {
        int rest = len - i;
        uint32_t acc[64];
        for (int l = 0; l < rest; l++) acc[l] = HALF;
        for (int t = 0; t < taps; t++) {
            const uint8_t *r = base + t * stride + i;
            uint32_t kt = (uint32_t)k[t];
            for (int l = 0; l < rest; l++) acc[l] += r[l] * kt;
        }
        for (int l = 0; l < rest; l++) dst[i + l] = clip8(acc[l]);
    }
}

/* A pass along a row. The row is first widened to 32 bits (one vectorised loop: GCC 12 turns a vector conversion
   from 8-bit lanes into scalar code). Output pixel i then reads `e` values from wide + start[i] * px (its taps'
   pixels, every channel, the window widened to a multiple of 8 values with zero weights: kx holds each weight once
   per channel), 8 at a time as one vector of 8 sums (GCC / Clang vector extensions: the compiler's SIMD for each
   target, SSE2 to AVX-512, no intrinsics); its channel c is the sum of the lanes l = c (mod px), stored as 32 bits
   (RGB packed: oc = 3 sums a pixel), and one vectorised loop shifts and clips the row's sums to bytes. Rows go two
   at a time. */
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint32_t v4u __attribute__((vector_size(16)));

KERNEL static void widen(const uint8_t *src, int n, uint32_t *dst) {
    for (int j = 0; j < n; j++) dst[j] = src[j];
}

KERNEL static void clipline(const uint32_t *sum, int n, uint8_t *dst) {
    for (int j = 0; j < n; j++) dst[j] = clip8(sum[j]);
}

/* two rows at once (the same windows and weights: each weight vector loaded once for both) */
static inline void window2(const uint32_t *s0, const uint32_t *s1, const int32_t *k, int e, v8u *a0, v8u *a1) {
    v8u acc0 = {HALF, HALF, HALF, HALF, 0, 0, 0, 0}, acc1 = acc0;
    for (int j = 0; j < e; j += 8) {
        v8u x0, x1, kv;
        memcpy(&kv, k + j, 32);
        memcpy(&x0, s0 + j, 32);
        memcpy(&x1, s1 + j, 32);
        acc0 += x0 * kv;
        acc1 += x1 * kv;
    }
    *a0 = acc0, *a1 = acc1;
}

static inline v4u fold(v8u acc) { /* lanes c and c + 4 */
    v4u lo, hi;
    memcpy(&lo, &acc, 16);
    memcpy(&hi, (char *)&acc + 16, 16);
    return lo + hi;
}

/* pixel i's 4 sums stored at sum + i * oc: with oc 3 the next pixel's overwrites the X sum (RGB packed) */
KERNEL static void hrow4(const uint32_t *r0, const uint32_t *r1, const int *start, const int32_t *kx, int e,
                         int count, int oc, uint32_t *sum0, uint32_t *sum1) {
    for (int i = 0; i < count; i++) {
        v8u a0, a1;
        window2(r0 + (size_t)start[i] * 4, r1 + (size_t)start[i] * 4, kx + (size_t)i * e, e, &a0, &a1);
        v4u f0 = fold(a0), f1 = fold(a1);
        memcpy(sum0 + (size_t)i * oc, &f0, 16);
        memcpy(sum1 + (size_t)i * oc, &f1, 16);
    }
}

KERNEL static void hrow1(const uint32_t *r0, const uint32_t *r1, const int *start, const int32_t *kx, int e,
                         int count, uint32_t *sum0, uint32_t *sum1) {
    for (int i = 0; i < count; i++) {
        v8u a0, a1;
        window2(r0 + start[i], r1 + start[i], kx + (size_t)i * e, e, &a0, &a1);
        v4u f0 = fold(a0), f1 = fold(a1);
        sum0[i] = f0[0] + f0[1] + f0[2] + f0[3] - 3 * HALF;
        sum1[i] = f1[0] + f1[1] + f1[2] + f1[3] - 3 * HALF;
    }
}

/* A row pass over rows of `width` pixels (px bytes each) whose first is input column `origin`: each output's window
   start and its weights spread over the window's values. The window is the widest tap count rounded up to 8 values;
   it starts at the first tap, or earlier where it would end past the row; a row narrower than the window is
   zero-padded to it. Scratch: the widened row (`wide`, `cap` values), the sums (`sum`). */
typedef struct {
    int *start;
    int32_t *kx;
    int e, count, width, px, oc; /* oc: bytes an output pixel (RGB packed: 3) */
    uint32_t *wide[2], *sum[2];
} HPlan;

static int hplan(HPlan *p, const int *xmin, const int *n, const int32_t *k, int ksize, int count, int origin,
                 int width, int px, int oc) {
    int most = 1;
    for (int i = 0; i < count; i++)
        if (n[i] > most) most = n[i];
    int e = (most * px + 7) / 8 * 8;
    int wpx = e / px; /* the window in pixels */
    int eff = width < wpx ? wpx : width;
    p->e = e, p->count = count, p->width = width, p->px = px, p->oc = oc;
    p->start = malloc(sizeof(int) * (size_t)count);
    p->kx = calloc((size_t)count * (size_t)e, sizeof(int32_t));
    for (int r = 0; r < 2; r++) {
        p->wide[r] = calloc((size_t)eff * px, sizeof(uint32_t));
        p->sum[r] = malloc(sizeof(uint32_t) * ((size_t)count * px + 4));
        if (!p->wide[r] || !p->sum[r]) return 0;
    }
    if (!p->start || !p->kx) return 0;
    for (int i = 0; i < count; i++) {
        int x0 = xmin[i] - origin;
        int s = x0 < eff - wpx ? x0 : eff - wpx;
        p->start[i] = s;
        for (int t = 0; t < n[i]; t++)
            for (int c = 0; c < px; c++) p->kx[(size_t)i * e + (size_t)(x0 - s + t) * px + c] = k[(size_t)i * ksize + t];
    }
    return 1;
}

/* rows r0 (and r1, where not NULL) through a plan into `count` pixels of oc bytes each (the padding past a row
   stays zero) */
static void hrun(const HPlan *p, const uint8_t *r0, const uint8_t *r1, uint8_t *d0, uint8_t *d1) {
    int n = p->width * p->px;
    widen(r0, n, p->wide[0]);
    if (r1) widen(r1, n, p->wide[1]);
    if (p->px == 4)
        hrow4(p->wide[0], p->wide[1], p->start, p->kx, p->e, p->count, p->oc, p->sum[0], p->sum[1]);
    else
        hrow1(p->wide[0], p->wide[1], p->start, p->kx, p->e, p->count, p->sum[0], p->sum[1]);
    clipline(p->sum[0], p->count * p->oc, d0);
    if (r1) clipline(p->sum[1], p->count * p->oc, d1);
}

/* `count` pixels of px bytes -> outc bytes each (RGBX -> RGB drops X; 4 pixels as 3 words where the byte order
   lets it) */
static void pack(const uint8_t *src, int count, int px, int outc, uint8_t *dst) {
    if (px == outc) {
        memcpy(dst, src, (size_t)count * px);
        return;
    }
    int i = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (outc == 3)
        for (; i + 4 <= count; i += 4) {
            uint32_t p[4], q[3];
            memcpy(p, src + (size_t)i * 4, 16);
            q[0] = (p[0] & 0xffffff) | p[1] << 24;
            q[1] = (p[1] >> 8 & 0xffff) | p[2] << 16;
            q[2] = (p[2] >> 16 & 0xff) | p[3] << 8;
            memcpy(dst + (size_t)i * 3, q, 12);
        }
#endif
    for (; i < count; i++)
        for (int c = 0; c < outc; c++) dst[(size_t)i * outc + c] = src[(size_t)i * px + c];
}

/* Pillow's NEAREST resize (ImagingScaleAffine with a = (w / nw, 0, 0, 0, h / nh, 0)), the crop's pixels */
static int nearest(const uint8_t *src, int w, int h, ptrdiff_t stride, int px, int outc, int nw, int nh, int top,
                   int left, int ch, int cw, uint8_t *out) {
    int *xs = malloc(sizeof(int) * (size_t)cw);
    if (!xs) return -2;
    double a0 = (double)((float)w - 0.0f) / nw, a4 = (double)((float)h - 0.0f) / nh;
    double xo = 0.0f + a0 * 0.5, yo = 0.0f + a4 * 0.5;
    for (int x = 0; x < left + cw; x++) {
        if (x >= left) xs[x - left] = xo < 0.0 ? -1 : (int)xo;
        xo += a0;
    }
    for (int y = 0; y < top + ch; y++) {
        if (y >= top) {
            int yi = yo < 0.0 ? -1 : (int)yo;
            uint8_t *o = out + (size_t)(y - top) * cw * outc;
            for (int i = 0; i < cw; i++)
                for (int c = 0; c < outc; c++)
                    o[(size_t)i * outc + c] = (yi >= 0 && yi < h && xs[i] >= 0 && xs[i] < w)
                                                  ? src[yi * stride + (ptrdiff_t)xs[i] * px + c] : 0;
        }
        yo += a4;
    }
    free(xs);
    return 0;
}

/* The crop [top, top + ch) x [left, left + cw) of `src` (w x h pixels of px bytes, rows `stride` bytes apart; px 4:
   RGB as Pillow stores it, X ignored; px 1: L) resized to nw x nh with PIL's filter number `filter`, into `out`
   (ch rows of cw pixels of outc bytes: 3 for px 4, 1 for px 1), rows first unless `vfirst` (Pillow's order for
   these sizes). 0: done; -1: arguments it does not take; -2: out of memory. */
int ivy_resize_crop(const uint8_t *src, int w, int h, long stride, int px, int outc, int nw, int nh, int filter,
                    int vfirst, int top, int left, int ch, int cw, uint8_t *out) {
    if (!(px == 4 && (outc == 3 || outc == 4)) && !(px == 1 && outc == 1)) return -1;
    if (w < 1 || h < 1 || nw < 1 || nh < 1 || ch < 1 || cw < 1 || top < 0 || left < 0 || top + ch > nh ||
        left + cw > nw || stride < (long)w * px || filter < 0 || filter > 5)
        return -1;
    if (filter == NEAREST) return nearest(src, w, h, stride, px, outc, nw, nh, top, left, ch, cw, out);
    int hpass = nw != w, vpass = nh != h, rc = -2;
    int *hx = malloc(sizeof(int) * (size_t)cw), *hn = malloc(sizeof(int) * (size_t)cw);
    int *vy = malloc(sizeof(int) * (size_t)ch), *vn = malloc(sizeof(int) * (size_t)ch);
    int32_t *hk = NULL, *vk = NULL;
    uint8_t *tmp = NULL, *line = malloc((size_t)cw * px + 64);
    HPlan plan = {0};
    int hks = 0, vks = 0;
    if (!hx || !hn || !vy || !vn || !line) goto done;
    /* the input rows [lo, hi) the crop's rows reach (through the columns pass, else the rows themselves), the input
       columns [jlo, jhi) its columns reach */
    int lo = top, hi = top + ch, jlo = left, jhi = left + cw;
    if (vpass) {
        if (!(vks = coeffs(h, nh, top, ch, filter, vy, vn, &vk))) goto done;
        lo = vy[0], hi = 0;
        for (int i = 0; i < ch; i++) {
            if (vy[i] < lo) lo = vy[i];
            if (vy[i] + vn[i] > hi) hi = vy[i] + vn[i];
        }
    }
    if (hpass) {
        if (!(hks = coeffs(w, nw, left, cw, filter, hx, hn, &hk))) goto done;
        jlo = hx[0], jhi = 0;
        for (int i = 0; i < cw; i++) {
            if (hx[i] < jlo) jlo = hx[i];
            if (hx[i] + hn[i] > jhi) jhi = hx[i] + hn[i];
        }
        if (!hplan(&plan, hx, hn, hk, hks, cw, jlo, jhi - jlo, px, outc)) goto done;
    }
    const uint8_t *from = src + (ptrdiff_t)jlo * px; /* input column jlo of each row */
    size_t row = (size_t)cw * outc;
    if (!vfirst) { /* rows first: rows [lo, hi) to the crop's columns (px bytes a pixel), then the columns */
        const uint8_t *mid = from + (ptrdiff_t)lo * stride;
        ptrdiff_t mstride = stride;
        int mpx = px; /* bytes a pixel between the passes */
        if (hpass) {
            tmp = malloc((size_t)(hi - lo) * row);
            if (!tmp) goto done;
            for (int y = lo; y < hi; y += 2) {
                int two = y + 1 < hi;
                hrun(&plan, from + (ptrdiff_t)y * stride, two ? from + (ptrdiff_t)(y + 1) * stride : NULL,
                     tmp + (size_t)(y - lo) * row, tmp + (size_t)(y + 1 - lo) * row);
            }
            mid = tmp, mstride = (ptrdiff_t)row, mpx = outc;
        } else {
            mid += (ptrdiff_t)(left - jlo) * px;
        }
        for (int y = 0; y < ch; y++) {
            uint8_t *o = out + (size_t)y * row;
            if (vpass) {
                uint8_t *d = mpx == outc ? o : line;
                vline(mid + (vy[y] - lo) * mstride, mstride, vk + (size_t)y * vks, vn[y], cw * mpx, d);
                if (d != o) pack(d, cw, mpx, outc, o);
            } else {
                pack(mid + (top + y - lo) * mstride, cw, mpx, outc, o);
            }
        }
    } else { /* columns first: the crop's rows over columns [jlo, jhi), then the rows to the crop's columns */
        int span = jhi - jlo;
        const uint8_t *mid = from + (ptrdiff_t)top * stride;
        ptrdiff_t mstride = stride;
        if (vpass) {
            tmp = malloc((size_t)ch * span * px);
            if (!tmp) goto done;
            for (int y = 0; y < ch; y++)
                vline(from + (ptrdiff_t)vy[y] * stride, stride, vk + (size_t)y * vks, vn[y], span * px,
                      tmp + (size_t)y * span * px);
            mid = tmp, mstride = (ptrdiff_t)span * px;
        }
        for (int y = 0; y < ch; y++) {
            uint8_t *o = out + (size_t)y * row;
            if (hpass) { /* two rows at once, straight into out */
                int two = y + 1 < ch;
                hrun(&plan, mid + y * mstride, two ? mid + (y + 1) * mstride : NULL, o, o + row);
                y += two;
            } else {
                pack(mid + y * mstride + (ptrdiff_t)(left - jlo) * px, cw, px, outc, o);
            }
        }
    }
    rc = 0;
done:
    free(hx), free(hn), free(vy), free(vn), free(hk), free(vk), free(tmp), free(line);
    free(plan.start), free(plan.kx), free(plan.wide[0]), free(plan.wide[1]), free(plan.sum[0]), free(plan.sum[1]);
    return rc;
}
