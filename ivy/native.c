/* Ivy's native encoders, ids only, as Hugging Face `tokenizers` computes them: XLM-RoBERTa's converted
 * tokenizer.json (Precompiled charsmap, spaces collapsed, Metaspace, Unigram) and BERT's (BertNormalizer,
 * BertPreTokenizer, WordPiece) on ASCII text. Built and loaded by ivy/native.py (which says what they
 * cover and when they hand a text back).
 *
 * Returns of ut_encode: >= 0 ids written (or needed, when more than `cap`); -1 a text this encoder
 * does not decide, for the caller's exact path: for Unigram invalid UTF-8, or a character the
 * charsmap rewrites inside what may be a multi-code-point grapheme of under 6 bytes (`tokenizers`
 * rewrites those whole; graphemes of 6 bytes or more character by character, as here); for
 * WordPiece a character its table does not cover (past the BMP, or one ivy/native.py could not derive).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EMPTY UINT64_MAX
#define WB 0x2581u           /* SentencePiece's word mark */
#define NCP 0x110000u
#define CACHE_WORD 64        /* words up to this many code points are remembered */
#define ARENA_MAX (1u << 24) /* code points (and ids) the remembered words may hold before a reset */

typedef struct { uint64_t key; uint32_t child; int32_t piece; } Edge;
/* A remembered word, one cache line: short words (BMP code points, few ids) in the entry itself,
 * others (klen OUT) in the arenas. */
#define KEY_IN 14
#define IDS_IN 6
#define OUT 255
typedef struct {
    uint64_t hash;  /* 0: empty */
    uint8_t klen, nids; uint16_t pad;
    union { uint16_t key[KEY_IN]; struct { uint32_t key_off, key_len, ids_off, ids_len; } out; };
    int32_t ids[IDS_IN];
} __attribute__((aligned(64))) Word;

typedef struct {
    /* the pieces' trie: (node, code point) -> child, and the piece ending there */
    Edge *edges; uint64_t mask; int shift; uint32_t nodes;
    double *scores; int32_t unk_id; double unk_score;
    /* the charsmap: per code point its rewrite (index into repl_*), or -1 */
    int32_t *map;
    uint32_t *repl, *repl_off, *repl_len; uint32_t nrepl;
    uint8_t *multi;   /* bit per code point: a key of several code points starts with it */
    uint8_t *join;    /* bit per code point: may share a grapheme with a neighbour (from ivy/unigram.py) */
    uint8_t *prepend; /* bit per code point: joins the grapheme after it */
    uint8_t *alone;   /* bit per code point: a grapheme of its own (UAX #29's Control) */
    uint8_t plain[128];  /* ASCII characters the charsmap leaves alone (keys they begin need a non-ASCII next) */
    int32_t crlf;     /* the rewrite `tokenizers` applies to the grapheme "\r\n", or -2: per character */
    /* scratch, grown on demand */
    uint32_t *cps; size_t cps_cap;
    uint32_t *norm; size_t norm_cap;
    double *best; int32_t *from, *bid; size_t vit_cap;
    uint32_t *wnode; int32_t *wact, *nm; uint64_t *wslot;  /* the walks from every start */
    int32_t *mpiece; size_t m_cap;                          /* their matches: start x depth */
    uint32_t *wpos; size_t wpos_cap; uint64_t *whash; size_t whash_cap;  /* a text's words */
    int maxlen;                                             /* the longest piece, in code points */
    int32_t *tmp; size_t tmp_cap;
    /* remembered words */
    Word *cache; uint64_t cmask; size_t cused;
    uint32_t *ckeys; size_t ckeys_len, ckeys_cap;
    int32_t *cids; size_t cids_len, cids_cap;
    uint64_t hits, misses, resets;
    int32_t pre[8], suf[8]; int npre, nsuf;  /* the special tokens around a text */
    int kind;                /* 0 Unigram, 1 WordPiece */
    int max_chars, lower;    /* WordPiece: longest word split, lower-casing */
    int64_t cont;            /* WordPiece: the trie node after the continuing prefix, -1 none */
    uint8_t *wp_class;       /* WordPiece: per BMP character, see ut_wordpiece_table (NULL: ASCII only) */
    uint32_t *wend; size_t wend_cap;  /* a text's words' ends */
} UT;

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 256;
    while (n < need) n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q) return -1;
    *p = q; *cap = n;
    return 0;
}

static inline uint64_t mix(uint64_t k) { return k * 0x9E3779B97F4A7C15ull; }

static inline const Edge *child(const UT *u, uint32_t node, uint32_t cp) {
    uint64_t key = ((uint64_t)node << 21) | cp;
    uint64_t i = mix(key) >> u->shift;
    for (;;) {
        const Edge *e = &u->edges[i];
        if (e->key == key) return e;
        if (e->key == EMPTY) return NULL;
        i = (i + 1) & u->mask;
    }
}

static Edge *insert(UT *u, uint32_t node, uint32_t cp) {
    uint64_t key = ((uint64_t)node << 21) | cp;
    uint64_t i = mix(key) >> u->shift;
    for (;;) {
        Edge *e = &u->edges[i];
        if (e->key == key) return e;
        if (e->key == EMPTY) {
            e->key = key; e->child = ++u->nodes; e->piece = -1;
            return e;
        }
        i = (i + 1) & u->mask;
    }
}

/* UTF-8 -> code points; -1 on invalid input (overlong forms, surrogates and values past U+10FFFF too). */
static long decode(const uint8_t *s, size_t n, uint32_t *out) {
    size_t i = 0; long k = 0;
    while (i < n) {
        uint32_t c = s[i];
        if (c < 0x80) { out[k++] = c; i++; continue; }
        int len; uint32_t min;
        if ((c & 0xE0) == 0xC0) { len = 2; c &= 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { len = 3; c &= 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { len = 4; c &= 0x07; min = 0x10000; }
        else return -1;
        if (i + len > n) return -1;
        for (int j = 1; j < len; j++) {
            uint8_t b = s[i + j];
            if ((b & 0xC0) != 0x80) return -1;
            c = (c << 6) | (b & 0x3F);
        }
        if (c < min || c >= NCP || (c >= 0xD800 && c < 0xE000)) return -1;
        out[k++] = c; i += len;
    }
    return k;
}

/* ---- the charsmap: darts-clone double array (SentencePiece's format) ---- */
static inline uint32_t d_leaf(uint32_t u) { return (u >> 8) & 1; }
static inline uint32_t d_value(uint32_t u) { return u & ((1u << 31) - 1); }
static inline uint32_t d_label(uint32_t u) { return u & ((1u << 31) | 0xFF); }
static inline uint32_t d_offset(uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); }

typedef struct { const uint32_t *a; size_t n; const uint8_t *blob; size_t nblob; UT *u; int bad; } Darts;

/* The first (shortest) key that is a prefix of s: its value, or -1 (spm_precompiled's transform). */
static long d_first(const Darts *d, const uint8_t *s, size_t n) {
    size_t pos = d_offset(d->a[0]);
    for (size_t i = 0; i < n; i++) {
        pos ^= s[i];
        if (pos >= d->n) return -1;
        uint32_t unit = d->a[pos];
        if (d_label(unit) != s[i]) return -1;
        pos ^= d_offset(unit);
        if (pos >= d->n) return -1;
        if (d_leaf(unit)) return d_value(d->a[pos]);
    }
    return -1;
}

static int add_repl(UT *u, uint32_t value, size_t *cap_repl, size_t *nrepl_cps, size_t *cap_idx, const Darts *d) {
    /* the rewrite at `value` in the blob (NUL-terminated UTF-8) as code points */
    if (value >= d->nblob) return -1;
    size_t end = value;
    while (end < d->nblob && d->blob[end]) end++;
    if (grow((void **)&u->repl, cap_repl, *nrepl_cps + (end - value) + 1, sizeof(uint32_t))) return -1;
    long k = decode(d->blob + value, end - value, u->repl + *nrepl_cps);
    if (k < 0) return -1;
    if (grow((void **)&u->repl_off, cap_idx, u->nrepl + 1, sizeof(uint32_t))) return -1;
    u->repl_len = realloc(u->repl_len, *cap_idx * sizeof(uint32_t));
    if (!u->repl_len) return -1;
    u->repl_off[u->nrepl] = (uint32_t)*nrepl_cps;
    u->repl_len[u->nrepl] = (uint32_t)k;
    *nrepl_cps += (size_t)k;
    return (int)u->nrepl++;
}

typedef struct { size_t cap_repl, nrepl_cps, cap_idx; } ReplState;

static void d_walk(Darts *d, size_t pos, uint8_t *key, int depth, ReplState *rs) {
    if (depth >= 32 || d->bad) { if (depth >= 32) d->bad = 1; return; }
    for (uint32_t c = 1; c < 256; c++) {
        size_t ch = pos ^ c;
        if (ch >= d->n) continue;
        uint32_t unit = d->a[ch];
        if (d_label(unit) != c) continue;
        size_t next = ch ^ d_offset(unit);
        if (next >= d->n) { d->bad = 1; return; }
        key[depth] = (uint8_t)c;
        if (d_leaf(unit)) {
            uint32_t cps[32];
            long k = decode(key, depth + 1, cps);
            if (k <= 0) { d->bad = 1; return; }   /* keys are whole characters here */
            if (k == 1) {
                int r = add_repl(d->u, d_value(d->a[next]), &rs->cap_repl, &rs->nrepl_cps, &rs->cap_idx, d);
                if (r < 0) { d->bad = 1; return; }
                d->u->map[cps[0]] = r;
            } else {
                d->u->multi[cps[0] >> 3] |= (uint8_t)(1 << (cps[0] & 7));
            }
        }
        d_walk(d, next, key, depth + 1, rs);
    }
}

void ut_free(UT *u);
static inline int bit(const uint8_t *b, uint32_t c) { return (b[c >> 3] >> (c & 7)) & 1; }

/* What both models share: the pieces' trie (pieces as UTF-8, back to back, offsets[npieces + 1]) and
 * 2^cache_bits remembered words at most (64 bytes each; all forgotten at 70 %). NULL on failure. */
static UT *new_common(const uint8_t *pieces, const uint32_t *offsets, int32_t npieces, int32_t unk_id, int cache_bits) {
    UT *u = calloc(1, sizeof(UT));
    if (!u) return NULL;
    u->unk_id = unk_id;
    /* the trie: sized for every code point of every piece at a load below 0.6 */
    size_t total = 0;
    for (int32_t i = 0; i < npieces; i++) total += offsets[i + 1] - offsets[i];
    int bits = 10;
    while ((1ull << bits) * 6 < total * 10) bits++;
    u->mask = (1ull << bits) - 1; u->shift = 64 - bits;
    u->edges = malloc(sizeof(Edge) << bits);
    if (!u->edges) { ut_free(u); return NULL; }
    for (uint64_t i = 0; i <= u->mask; i++) u->edges[i].key = EMPTY;
    uint32_t buf[1024];
    for (int32_t i = 0; i < npieces; i++) {
        size_t len = offsets[i + 1] - offsets[i];
        if (len == 0) continue;  /* matches nothing */
        if (len > sizeof(buf) / sizeof(buf[0])) { ut_free(u); return NULL; }  /* no vocabulary has such pieces */
        long k = decode(pieces + offsets[i], len, buf);
        if (k <= 0) { ut_free(u); return NULL; }
        uint32_t node = 0; Edge *e = NULL;
        for (long j = 0; j < k; j++) { e = insert(u, node, buf[j]); node = e->child; }
        if (k > u->maxlen) u->maxlen = (int)k;
        e->piece = i;  /* a repeated piece: the last id, as tokenizers' token -> id map keeps it */
    }
    /* pieces share prefixes: again at a load below 0.6 of the edges there are */
    int fit = 10;
    while ((1ull << fit) * 6 < (uint64_t)u->nodes * 10) fit++;
    if (fit < bits) {
        Edge *old = u->edges; uint64_t old_n = u->mask + 1;
        u->mask = (1ull << fit) - 1; u->shift = 64 - fit;
        u->edges = malloc(sizeof(Edge) << fit);
        if (!u->edges) { u->edges = old; ut_free(u); return NULL; }
        for (uint64_t i = 0; i <= u->mask; i++) u->edges[i].key = EMPTY;
        for (uint64_t j = 0; j < old_n; j++) {
            if (old[j].key == EMPTY) continue;
            uint64_t i = mix(old[j].key) >> u->shift;
            while (u->edges[i].key != EMPTY) i = (i + 1) & u->mask;
            u->edges[i] = old[j];
        }
        free(old);
    }
    if (cache_bits < 4 || cache_bits > 26) { ut_free(u); return NULL; }
    u->cmask = (1ull << cache_bits) - 1;
    u->cache = aligned_alloc(64, sizeof(Word) << cache_bits);
    if (!u->cache) { ut_free(u); return NULL; }
    memset(u->cache, 0, sizeof(Word) << cache_bits);
    return u;
}

/* Unigram (XLM-R): the pieces with their scores; charsmap: the Precompiled normalizer's bytes; join:
 * three bitmaps of NCP / 8 bytes (join, prepend, alone). NULL on failure. */
UT *ut_new(const uint8_t *pieces, const uint32_t *offsets, const double *scores, int32_t npieces, int32_t unk_id,
           const uint8_t *charsmap, size_t ncharsmap, const uint8_t *join, int cache_bits) {
    UT *u = new_common(pieces, offsets, npieces, unk_id, cache_bits);
    if (!u) return NULL;
    u->scores = malloc(sizeof(double) * (size_t)(npieces ? npieces : 1));
    u->map = malloc(sizeof(int32_t) * NCP);
    u->multi = calloc(NCP / 8, 1);
    u->join = malloc(3 * (NCP / 8));
    if (!u->scores || !u->map || !u->multi || !u->join) { ut_free(u); return NULL; }
    memcpy(u->join, join, 3 * (NCP / 8));
    u->prepend = u->join + NCP / 8;
    u->alone = u->join + 2 * (NCP / 8);
    for (uint32_t c = 0; c < NCP; c++) u->map[c] = -1;
    double lo = 0.0;
    for (int32_t i = 0; i < npieces; i++) {
        u->scores[i] = scores[i];
        if (i == 0 || scores[i] < lo) lo = scores[i];
    }
    u->unk_score = lo - 10.0;  /* tokenizers' K_UNK_PENALTY */
    /* the charsmap */
    if (ncharsmap < 4) { ut_free(u); return NULL; }
    uint32_t tsize; memcpy(&tsize, charsmap, 4);
    if (tsize % 4 || 4 + (size_t)tsize > ncharsmap || tsize == 0) { ut_free(u); return NULL; }
    uint32_t *arr = malloc(tsize);
    if (!arr) { ut_free(u); return NULL; }
    memcpy(arr, charsmap + 4, tsize);
    Darts d = {arr, tsize / 4, charsmap + 4 + tsize, ncharsmap - 4 - tsize, u, 0};
    ReplState rs = {0, 0, 0};
    uint8_t key[40];
    d_walk(&d, d_offset(arr[0]), key, 0, &rs);
    long crlf = d_first(&d, (const uint8_t *)"\r\n", 2);
    if (crlf >= 0) {
        /* shortest first: "\r" alone if it is a key, else "\r\n" */
        int r = add_repl(u, (uint32_t)crlf, &rs.cap_repl, &rs.nrepl_cps, &rs.cap_idx, &d);
        if (r < 0) d.bad = 1;
        u->crlf = r;
    } else {
        u->crlf = -2;
    }
    free(arr);
    if (d.bad) { ut_free(u); return NULL; }
    for (uint32_t c = 0; c < 128; c++) u->plain[c] = u->map[c] < 0 && c != '\r';
    return u;
}

/* WordPiece (BERT) over ASCII text: the pieces (the continuing ones with their prefix, e.g. "##"),
 * the longest word it splits (longer ones are <unk> whole), whether BertNormalizer lower-cases. */
UT *ut_new_wordpiece(const uint8_t *pieces, const uint32_t *offsets, int32_t npieces, int32_t unk_id,
                     int max_chars, int lowercase, const uint8_t *prefix, size_t nprefix, int cache_bits) {
    UT *u = new_common(pieces, offsets, npieces, unk_id, cache_bits);
    if (!u) return NULL;
    u->kind = 1; u->max_chars = max_chars; u->lower = lowercase;
    uint32_t node = 0; const Edge *e = NULL;
    for (size_t i = 0; i < nprefix && (i == 0 || e); i++) {
        e = child(u, node, prefix[i]);
        if (e) node = e->child;
    }
    for (size_t i = 0; i < nprefix; i++)
        if (prefix[i] >= 0x80) { ut_free(u); return NULL; }  /* an ASCII prefix ("##") */
    u->cont = nprefix == 0 ? 0 : e ? (int64_t)node : -1;  /* -1: no piece continues a word */
    return u;
}

void ut_free(UT *u) {
    if (!u) return;
    free(u->edges); free(u->scores); free(u->map); free(u->repl); free(u->repl_off); free(u->repl_len);
    free(u->multi); free(u->join); free(u->cps); free(u->norm); free(u->best); free(u->from); free(u->bid);
    free(u->tmp); free(u->cache); free(u->ckeys); free(u->cids);
    free(u->wnode); free(u->wact); free(u->nm); free(u->wslot); free(u->mpiece); free(u->wpos); free(u->whash); free(u->wend); free(u->wp_class);
    free(u);
}

void ut_stats(const UT *u, uint64_t *out) {
    out[0] = u->hits; out[1] = u->misses; out[2] = u->resets; out[3] = u->cused; out[4] = u->nodes;
}


static inline int len8(uint32_t c) { return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4; }

/* Whether x and the y after it may be in one grapheme of under 6 bytes, the only graphemes
 * `tokenizers` rewrites whole (over-approximated: never false when they are). */
static inline int joined(const UT *u, uint32_t x, uint32_t y) {
    if (bit(u->alone, x) || bit(u->alone, y)) return x == '\r' && y == '\n';  /* controls break (GB4, GB5) */
    /* y extends x's grapheme; x carries it on (Prepend always; an extender before a non-ASCII
     * consonant or pictograph: GB9c, GB11) */
    return (bit(u->join, y) || bit(u->prepend, x) || (bit(u->join, x) && y >= 0x80)) && len8(x) + len8(y) < 6;
}

/* The exact piece for cps[0..n), or -1. */
static int32_t lookup(const UT *u, const uint32_t *w, int n) {
    uint32_t node = 0; const Edge *e = NULL;
    for (int j = 0; j < n; j++) {
        e = child(u, node, w[j]);
        if (!e) return -1;
        node = e->child;
    }
    return e ? e->piece : -1;
}

/* Viterbi over one word (tokenizers' encode_optimized, unknown runs fused): ids to u->tmp, their count.
 * The trie is walked from every start at once, one depth at a time, each probe's line prefetched
 * before any is read (a rare word's probes miss the caches; this way they overlap), then the
 * matches (by start, shortest first, as tokenizers meets them) go through the usual dynamic program. */
static long viterbi(UT *u, const uint32_t *w, int n) {
    size_t need = (size_t)n + 1, ml = (size_t)u->maxlen;
    if (need > u->vit_cap) {
        size_t c = u->vit_cap ? u->vit_cap : 256;
        while (c < need) c *= 2;
        void *p[7] = {realloc(u->best, c * sizeof(double)), realloc(u->from, c * sizeof(int32_t)),
                      realloc(u->bid, c * sizeof(int32_t)), realloc(u->wnode, c * sizeof(uint32_t)),
                      realloc(u->wact, c * sizeof(int32_t)), realloc(u->wslot, c * sizeof(uint64_t)),
                      realloc(u->nm, c * sizeof(int32_t))};
        if (p[0]) u->best = p[0];
        if (p[1]) u->from = p[1];
        if (p[2]) u->bid = p[2];
        if (p[3]) u->wnode = p[3];
        if (p[4]) u->wact = p[4];
        if (p[5]) u->wslot = p[5];
        if (p[6]) u->nm = p[6];
        for (int i = 0; i < 7; i++) if (!p[i]) return -1;
        u->vit_cap = c;
    }
    if (grow((void **)&u->mpiece, &u->m_cap, need * ml, sizeof(int32_t))) return -1;
    double *best = u->best; int32_t *from = u->from, *bid = u->bid, *act = u->wact, *nm = u->nm, *mp = u->mpiece;
    uint32_t *node = u->wnode; uint64_t *slot = u->wslot;
    int na = 0;
    for (int i = 0; i < n; i++) { node[i] = 0; nm[i] = 0; act[na++] = i; }
    for (int d = 0; na > 0 && d < u->maxlen; d++) {
        for (int a = 0; a < na; a++) {
            int i = act[a];
            uint64_t key = ((uint64_t)node[i] << 21) | w[i + d];
            slot[a] = mix(key) >> u->shift;
            __builtin_prefetch(&u->edges[slot[a]]);
        }
        int nb = 0;
        for (int a = 0; a < na; a++) {
            int i = act[a];
            uint64_t key = ((uint64_t)node[i] << 21) | w[i + d], x = slot[a];
            const Edge *e;
            for (;;) {
                e = &u->edges[x];
                if (e->key == key || e->key == EMPTY) break;
                x = (x + 1) & u->mask;
            }
            if (e->key == EMPTY) continue;
            node[i] = e->child;
            if (e->piece >= 0) {
                mp[(size_t)i * ml + d] = e->piece;
                nm[i] = d + 1;  /* walked this far; -1 marks the depths without a piece */
                __builtin_prefetch(&u->scores[e->piece]);
            } else {
                mp[(size_t)i * ml + d] = -1;
            }
            if (i + d + 1 < n) act[nb++] = i;
        }
        na = nb;
    }
    for (int i = 0; i <= n; i++) from[i] = -1;
    best[0] = 0.0;
    for (int i = 0; i < n; i++) {
        double here = best[i];
        int single = 0;
        const int32_t *m = mp + (size_t)i * ml;
        for (int d = 0; d < nm[i]; d++) {
            int32_t piece = m[d];
            if (piece < 0) continue;
            double cand = here + u->scores[piece];
            int j = i + d + 1;
            if (from[j] < 0 || cand > best[j]) { best[j] = cand; from[j] = i; bid[j] = piece; }
            if (d == 0) single = 1;
        }
        if (!single) {
            double cand = here + u->unk_score;
            if (from[i + 1] < 0 || cand > best[i + 1]) { best[i + 1] = cand; from[i + 1] = i; bid[i + 1] = u->unk_id; }
        }
    }
    /* back from the end: pieces in reverse, a run of unknowns as one span looked up whole */
    if (grow((void **)&u->tmp, &u->tmp_cap, (size_t)n + 1, sizeof(int32_t))) return -1;
    long k = 0;
    int end = n, unk_end = -1;
    while (end > 0) {
        int start = from[end];
        if (bid[end] == u->unk_id) {
            if (unk_end < 0) unk_end = end;
        } else {
            if (unk_end >= 0) {
                int32_t id = lookup(u, w + end, unk_end - end);
                u->tmp[k++] = id >= 0 ? id : u->unk_id;
                unk_end = -1;
            }
            u->tmp[k++] = bid[end];
        }
        end = start;
    }
    if (unk_end >= 0) {
        int32_t id = lookup(u, w, unk_end);
        u->tmp[k++] = id >= 0 ? id : u->unk_id;
    }
    for (long a = 0, b = k - 1; a < b; a++, b--) { int32_t t = u->tmp[a]; u->tmp[a] = u->tmp[b]; u->tmp[b] = t; }
    return k;
}

static void reset_cache(UT *u) {
    memset(u->cache, 0, (u->cmask + 1) * sizeof(Word));
    u->cused = 0; u->ckeys_len = 0; u->cids_len = 0; u->resets++;
}

static inline int inline_key(const uint32_t *w, int n) {
    if (n > KEY_IN) return 0;
    for (int j = 0; j < n; j++) if (w[j] > 0xFFFF) return 0;
    return 1;
}

/* ids of one word: remembered, or computed (and remembered when short). Pointer to them in *ids. */
static inline uint64_t word_hash(const uint32_t *w, int n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int j = 0; j < n; j++) h = (h ^ w[j]) * 0x100000001b3ull;
    return h | 1;  /* 0 marks an empty slot */
}

static long wordpiece(UT *u, const uint32_t *w, int n);

/* h: word_hash(w, n) */
static long word_ids(UT *u, const uint32_t *w, int n, uint64_t h, const int32_t **ids) {
    if (n <= CACHE_WORD) {
        uint64_t i = h & u->cmask;
        int short_key = inline_key(w, n);
        for (;;) {
            Word *e = &u->cache[i];
            if (!e->hash) break;
            if (e->hash == h) {
                int same;
                if (e->klen != OUT) {
                    same = short_key && e->klen == n;
                    for (int j = 0; same && j < n; j++) same = e->key[j] == w[j];
                } else {
                    same = e->out.key_len == (uint32_t)n && !memcmp(u->ckeys + e->out.key_off, w, n * sizeof(uint32_t));
                }
                if (same) {
                    u->hits++;
                    *ids = e->klen != OUT && e->nids <= IDS_IN ? e->ids : u->cids + e->out.ids_off;
                    return e->klen != OUT ? e->nids : e->out.ids_len;
                }
            }
            i = (i + 1) & u->cmask;
        }
    }
    u->misses++;
    long k = u->kind ? wordpiece(u, w, n) : viterbi(u, w, n);
    if (k < 0) return -1;
    *ids = u->tmp;
    if (n > CACHE_WORD) return k;
    if (u->cused * 10 > (u->cmask + 1) * 7 || u->ckeys_len + n > ARENA_MAX || u->cids_len + k > ARENA_MAX) reset_cache(u);
    uint64_t i = h & u->cmask;
    while (u->cache[i].hash) i = (i + 1) & u->cmask;
    Word *e = &u->cache[i];
    if (inline_key(w, n) && k <= IDS_IN) {
        e->klen = (uint8_t)n; e->nids = (uint8_t)k;
        for (int j = 0; j < n; j++) e->key[j] = (uint16_t)w[j];
        memcpy(e->ids, u->tmp, k * sizeof(int32_t));
    } else {
        if (grow((void **)&u->ckeys, &u->ckeys_cap, u->ckeys_len + n, sizeof(uint32_t))) return k;
        if (grow((void **)&u->cids, &u->cids_cap, u->cids_len + k, sizeof(int32_t))) return k;
        e->klen = OUT;
        e->out.key_off = (uint32_t)u->ckeys_len; e->out.key_len = (uint32_t)n;
        e->out.ids_off = (uint32_t)u->cids_len; e->out.ids_len = (uint32_t)k;
        memcpy(u->ckeys + u->ckeys_len, w, n * sizeof(uint32_t)); u->ckeys_len += n;
        memcpy(u->cids + u->cids_len, u->tmp, k * sizeof(int32_t)); u->cids_len += k;
    }
    e->hash = h;
    u->cused++;
    return k;
}

/* The ids of the words norm[wpos[q] .. wend[q]) into out[0 .. cap), `budget` at most (< 0: all); their
 * count (over cap: nothing past cap written). Each word's hash first, so that its cache line is asked
 * for a few words before it is read. */
static long emit(UT *u, const uint32_t *norm, size_t nw, long budget, int32_t *out, long cap) {
    if (grow((void **)&u->whash, &u->whash_cap, nw + 1, sizeof(uint64_t))) return -3;
    const uint32_t *pos = u->wpos, *end = u->wend; uint64_t *hs = u->whash;
    for (size_t q = 0; q < nw; q++) hs[q] = word_hash(norm + pos[q], (int)(end[q] - pos[q]));
    enum { AHEAD = 6 };
    for (size_t q = 0; q < nw && q < AHEAD; q++) __builtin_prefetch(&u->cache[hs[q] & u->cmask]);
    long count = 0;
    for (size_t q = 0; q < nw; q++) {
        if (budget >= 0 && count >= budget) return count;
        if (q + AHEAD < nw) __builtin_prefetch(&u->cache[hs[q + AHEAD] & u->cmask]);
        const int32_t *ids;
        long got = word_ids(u, norm + pos[q], (int)(end[q] - pos[q]), hs[q], &ids);
        if (got < 0) return -3;
        for (long j = 0; j < got; j++) {
            if (budget >= 0 && count >= budget) return count;
            if (count < cap) out[count] = ids[j];
            count++;
        }
    }
    return count;
}

/* Content ids of `s` (no special tokens) into out[0 .. cap), stopping after `budget` ids (budget < 0: all):
 * their count (over cap: nothing past cap was written), -1 for the caller's exact path (see the top),
 * -3 out of memory. */
static long encode_content(UT *u, const uint8_t *s, size_t n, long budget, int32_t *out, long cap) {
    if (grow((void **)&u->cps, &u->cps_cap, n + 1, sizeof(uint32_t))) return -3;
    long m = decode(s, n, u->cps);
    if (m < 0) return -1;
    u->cps[m] = 0;  /* ASCII after the end: the fast path's look-ahead */
    const uint32_t *cp = u->cps;
    /* normalize: the charsmap per character, runs of spaces collapsed, spaces as the word mark;
     * norm[0] is kept for the mark Metaspace prepends */
    size_t room = (size_t)m + 2;
    if (grow((void **)&u->norm, &u->norm_cap, room, sizeof(uint32_t))) return -3;
    uint32_t *norm = u->norm;
    size_t k = 1;
    int space = 0;
    for (long i = 0; i < m; i++) {
        uint32_t c = cp[i];
        if (c < 0x80 && u->plain[c] && (cp[i + 1] < 0x80 || !bit(u->multi, c))) {  /* most of most texts */
            if (c != ' ') { space = 0; norm[k++] = c; }
            else if (!space) { space = 1; norm[k++] = WB; }
            continue;
        }
        const uint32_t *r; uint32_t rl;
        int32_t idx;
        if (c == '\r' && i + 1 < m && cp[i + 1] == '\n' && u->crlf != -2) {
            idx = u->crlf; i++;  /* the grapheme "\r\n" rewritten whole */
        } else {
            idx = u->map[c];
            if (idx >= 0 || bit(u->multi, c)) {
                if (idx >= 0 && i > 0 && joined(u, cp[i - 1], c)) return -1;
                if (i + 1 < m && joined(u, c, cp[i + 1])) return -1;
            }
        }
        if (idx >= 0) { r = u->repl + u->repl_off[idx]; rl = u->repl_len[idx]; }
        else { r = &cp[i]; rl = 1; }
        if (k + rl + 1 > u->norm_cap) {
            if (grow((void **)&u->norm, &u->norm_cap, k + rl + (size_t)(m - i) + 2, sizeof(uint32_t))) return -3;
            norm = u->norm;
        }
        for (uint32_t j = 0; j < rl; j++) {
            uint32_t x = r[j];
            if (x == ' ') {
                if (space) continue;
                space = 1;
                norm[k++] = WB;
            } else {
                space = 0;
                norm[k++] = x;
            }
        }
    }
    if (k == 1) return 0;  /* nothing left: no mark is prepended to an empty string */
    size_t first = 1;
    if (norm[1] != WB) { norm[0] = WB; first = 0; }
    /* words: each starts at a mark */
    if (grow((void **)&u->wpos, &u->wpos_cap, k + 1, sizeof(uint32_t))) return -3;
    if (grow((void **)&u->wend, &u->wend_cap, k + 1, sizeof(uint32_t))) return -3;
    size_t nw = 0;
    for (size_t a = first; a < k;) {
        size_t b = a + 1;
        while (b < k && norm[b] != WB) b++;
        u->wpos[nw] = (uint32_t)a; u->wend[nw++] = (uint32_t)b;
        a = b;
    }
    return emit(u, norm, nw, budget, out, cap);
}

/* WordPiece (else -1: the caller's exact path): BertNormalizer (NUL and control characters dropped,
 * whitespace as spaces, CJK ideographs spaced, accents stripped and lower-cased where it does both),
 * BertPreTokenizer (split at spaces, each punctuation mark a word of its own), then the words' ids.
 * ASCII here; other BMP characters by ut_wordpiece_table's table (what ivy/native.py could derive
 * exactly; a character it could not is class 0: the exact path). */
static long wordpiece_content(UT *u, const uint8_t *s, size_t n, long budget, int32_t *out, long cap) {
    if (grow((void **)&u->norm, &u->norm_cap, n + 1, sizeof(uint32_t))) return -3;
    if (grow((void **)&u->wpos, &u->wpos_cap, n + 1, sizeof(uint32_t))) return -3;
    if (grow((void **)&u->wend, &u->wend_cap, n + 1, sizeof(uint32_t))) return -3;
    uint32_t *norm = u->norm;
    size_t k = 0, nw = 0;
    long open = -1;  /* where the word being read began */
#define CLOSE() do { if (open >= 0) { u->wpos[nw] = (uint32_t)open; u->wend[nw++] = (uint32_t)k; open = -1; } } while (0)
    for (size_t i = 0; i < n; i++) {
        uint32_t c = s[i];
        if (c >= 0x80) {
            if (!u->wp_class) return -1;
            uint32_t c2;
            if ((c & 0xE0) == 0xC0 && i + 1 < n && (s[i + 1] & 0xC0) == 0x80) {
                c2 = ((c & 0x1F) << 6) | (s[i + 1] & 0x3F); i += 1;
                if (c2 < 0x80) return -1;
            } else if ((c & 0xF0) == 0xE0 && i + 2 < n && (s[i + 1] & 0xC0) == 0x80 && (s[i + 2] & 0xC0) == 0x80) {
                c2 = ((c & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F); i += 2;
                if (c2 < 0x800) return -1;
            } else {
                return -1;  /* past the BMP, or not UTF-8 */
            }
            uint8_t cls = u->wp_class[c2];
            if (cls == 0) return -1;
            if (cls == 1) continue;
            if (cls == 2) { CLOSE(); continue; }
            const uint32_t *r = u->repl + u->repl_off[c2];
            uint32_t rl = u->repl_len[c2];
            size_t need = k + rl + (n - i) + 2;
            if (need > u->norm_cap) {
                if (grow((void **)&u->norm, &u->norm_cap, need, sizeof(uint32_t))) return -3;
                norm = u->norm;
            }
            if (grow((void **)&u->wpos, &u->wpos_cap, u->norm_cap, sizeof(uint32_t))) return -3;
            if (grow((void **)&u->wend, &u->wend_cap, u->norm_cap, sizeof(uint32_t))) return -3;
            if (cls == 3) {  /* a word of its own: a CJK ideograph, a punctuation mark */
                CLOSE();
                u->wpos[nw] = (uint32_t)k;
                for (uint32_t j = 0; j < rl; j++) norm[k++] = r[j];
                u->wend[nw++] = (uint32_t)k;
                continue;
            }
            if (rl && open < 0) open = (long)k;  /* class 4: part of a word (a lone combining mark: nothing) */
            for (uint32_t j = 0; j < rl; j++) norm[k++] = r[j];
            continue;
        }
        if (c == '\t' || c == '\n' || c == '\r') c = ' ';
        else if (c < 0x20 || c == 0x7F) continue;
        else if (u->lower && c >= 'A' && c <= 'Z') c += 32;
        int punct = (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
        if (c == ' ' || punct) {
            CLOSE();
            if (punct) { u->wpos[nw] = (uint32_t)k; norm[k++] = c; u->wend[nw++] = (uint32_t)k; }
            continue;
        }
        if (open < 0) open = (long)k;
        norm[k++] = c;
    }
    CLOSE();
#undef CLOSE
    return emit(u, norm, nw, budget, out, cap);
}

/* WordPiece's table for the BMP's non-ASCII characters: cls[c] 0 the exact path, 1 dropped, 2 a
 * space, 3 a word of its own, 4 part of a word; the characters it becomes, cps[off[c] .. + len[c]). */
int ut_wordpiece_table(UT *u, const uint8_t *cls, const uint32_t *off, const uint32_t *len, const uint32_t *cps,
                       size_t ncps) {
    if (u->kind != 1) return -1;
    u->wp_class = malloc(0x10000);
    u->repl_off = malloc(0x10000 * sizeof(uint32_t));
    u->repl_len = malloc(0x10000 * sizeof(uint32_t));
    u->repl = malloc((ncps ? ncps : 1) * sizeof(uint32_t));
    if (!u->wp_class || !u->repl_off || !u->repl_len || !u->repl) return -1;
    for (uint32_t c = 0; c < 0x10000; c++)
        if (cls[c] > 4 || (cls[c] >= 3 && off[c] + len[c] > ncps)) return -1;
    memcpy(u->wp_class, cls, 0x10000);
    memcpy(u->repl_off, off, 0x10000 * sizeof(uint32_t));
    memcpy(u->repl_len, len, 0x10000 * sizeof(uint32_t));
    memcpy(u->repl, cps, ncps * sizeof(uint32_t));
    return 0;
}

/* WordPiece of one word (tokenizers' greedy longest match: the first piece bare, the next ones
 * continuing; a word it cannot cover, or over max_chars, is <unk> whole): ids to u->tmp. */
static long wordpiece(UT *u, const uint32_t *w, int n) {
    if (grow((void **)&u->tmp, &u->tmp_cap, (size_t)n + 1, sizeof(int32_t))) return -1;
    if (n > u->max_chars) { u->tmp[0] = u->unk_id; return 1; }
    long k = 0;
    int start = 0;
    while (start < n) {
        if (start > 0 && u->cont < 0) { u->tmp[0] = u->unk_id; return 1; }
        uint32_t node = start == 0 ? 0 : (uint32_t)u->cont;
        int end = -1; int32_t piece = -1;
        for (int j = start; j < n; j++) {
            const Edge *e = child(u, node, w[j]);
            if (!e) break;
            node = e->child;
            if (e->piece >= 0) { end = j + 1; piece = e->piece; }
        }
        if (end < 0) { u->tmp[0] = u->unk_id; return 1; }
        u->tmp[k++] = piece;
        start = end;
    }
    return k;
}

/* The special tokens around every text (the post-processor's fixed prefix and suffix), up to 8 each. */
int ut_wrap(UT *u, const int32_t *pre, int npre, const int32_t *suf, int nsuf) {
    if (npre < 0 || npre > 8 || nsuf < 0 || nsuf > 8) return -1;
    memcpy(u->pre, pre, npre * sizeof(int32_t)); u->npre = npre;
    memcpy(u->suf, suf, nsuf * sizeof(int32_t)); u->nsuf = nsuf;
    return 0;
}

/* The ids of `s`: prefix, content (cut to `budget` ids when budget >= 0), suffix, into out[0 .. cap).
 * Returns their count (over cap: call again with that much room), -1 for the caller's exact path
 * (see the top), -3 out of memory. */
long ut_encode(UT *u, const uint8_t *s, size_t n, long budget, int32_t *out, long cap) {
    long room = cap - u->npre - u->nsuf;
    long c = (u->kind ? wordpiece_content : encode_content)(u, s, n, budget, out + u->npre, room < 0 ? 0 : room);
    if (c < 0) return c;
    long total = c + u->npre + u->nsuf;
    if (total > cap) return total;
    memcpy(out, u->pre, u->npre * sizeof(int32_t));
    memcpy(out + u->npre + c, u->suf, u->nsuf * sizeof(int32_t));
    return total;
}
