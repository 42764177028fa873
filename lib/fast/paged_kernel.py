"""Paged attention, compiled: every new row attends straight from the block pool, reading each
block's codes and scales where they lie, whatever the pool stores.

PagedAttention (Kwon et al. 2023, vLLM) walks each sequence's block table inside the kernel, so
no contiguous copy of the cache is gathered. A quantized cache (vLLM's fp8 cache; KIVI, Liu et al.
2024) can only save time if the kernel also turns codes into numbers in registers, as it reads
them, instead of dequantizing the cache into a float32 copy first: then a step reads the codes'
bytes, not four bytes per value. One kernel (numba, `fastmath` so LLVM can reorder the sums
into SIMD lanes) reads every stored form; `decoding` says how codes become numbers, and LLVM moves
that choice out of the inner loops:

- a decoder from a code to a float32: int8 and float32 convert; an fp8 (e4m3) or float16 code
  becomes a float32 by moving its bit fields into place (its value times a constant power of two,
  undone by multiplying the softmax weights, and for keys half before and half after the
  products, so that no product falls into float32's slow subnormal range and no scaled query
  overflows), a few vectorisable integer operations instead of a table lookup. Subnormal codes
  still decode to subnormal float32 operands (slow without flush-to-zero), and the NaN codes,
  which the store never writes, are not checked here;
  int4 codes are unpacked from nibbles, two channels per byte;
- four keys' dot products at once, each query value loaded once for four keys, and four values
  added into the output per pass over it (`_dot`, `_axpy`; `_dot_nibbles`, `_axpy_nibbles`);
- a prefetch of the next block's codes while this one is read: the blocks of a sequence lie
  apart in the pool, and without it each block starts with a wait for memory. The softmax's
  exponential is a polynomial (Cephes' expf) that vectorises, where numba's `np.exp` is a call per
  value.

The machine code is cached beside this file, one version per code dtype, so only the first
process compiles it.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

LINE = 64  # bytes per cache line: one prefetch each


@intrinsic
def prefetch(typingctx, array, index):
    """Hint the CPU to fetch the cache line of element `index` of a C-contiguous array (as if flat)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [ptr.type] + [ir.IntType(32)] * 3))
        builder.call(fn, [ptr] + [ir.Constant(ir.IntType(32), v) for v in (0, 3, 1)])  # read, keep, data
        return context.get_dummy_value()
    return types.void(array, index), codegen


@intrinsic
def bits_to_float(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@njit(inline="always")
def _number(c):
    """float32 and int8 codes: the value itself."""
    return np.float32(c)


@njit(inline="always")
def _e4m3(c):
    """An fp8 e4m3 byte s.eeee.mmm as float32 bits s.0000eeee.mmm0...: its value times 2^-120
    (exponent bias 127 against 7), subnormals included."""
    b = np.int32(c)
    return bits_to_float(np.int32(((b & 0x80) << 24) | ((b & 0x7F) << 20)))


@njit(inline="always")
def _half(c):
    """A float16 bit pattern s.eeeee.m(10) as float32 bits: its value times 2^-112 (bias 127 against 15)."""
    b = np.int32(c)
    return bits_to_float(np.int32(((b & 0x8000) << 16) | ((b & 0x7FFF) << 13)))


NUMBER, E4M3_BITS, HALF, NIBBLES = range(4)  # how codes become numbers: the `decoding` the kernel is compiled for
# Per stored form: (decoding, what decoding multiplies values by, how the kernel views the codes)
DECODINGS = {"float32": (NUMBER, 1.0, None), "int8": (NUMBER, 1.0, None), "fp8": (E4M3_BITS, 2.0 ** -120, None),
         "float16": (HALF, 2.0 ** -112, np.uint16), "int4": (NIBBLES, 1.0, None)}


@njit(inline="always")
def _decode(decoding, c):
    """A code as float32, times DECODINGS' factor (`decoding` is a compile-time constant: one branch remains)."""
    if decoding == E4M3_BITS:
        return _e4m3(c)
    if decoding == HALF:
        return _half(c)
    return _number(c)


@njit(fastmath=True, inline="always")
def exp_nonpositive(x):
    """e^x for x <= 0 in float32 (Cephes expf: 2^n times a degree-7 polynomial), about 1 ulp;
    below -87 it returns e^-87."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))  # x / ln 2, rounded
    f = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # x - n ln 2, in [-ln2/2, ln2/2]
    p = np.float32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * f + np.float32(c)
    return (p * f * f + f + np.float32(1.0)) * bits_to_float(np.int32((np.int32(n) + 127) << 23))


@njit(inline="always")
def _scale_at(scales, block, head, slot):
    """A slot's scale from (blocks, Hkv, bs) per-slot scales or (1, Hkv or 1, 1) fixed ones."""
    return scales[block if scales.shape[0] > 1 else 0, head if scales.shape[1] > 1 else 0,
                  slot if scales.shape[2] > 1 else 0]


@njit(inline="always")
def _fetch_next(pool, table, i, head, blocks):
    """While head `head` of the i-th block of `table` is read, prefetch the codes read next: the
    same block's next head, or the next block's first (pool: (blocks, Hkv, bs, W))."""
    if head + 1 < pool.shape[1]:
        block, head = table[i], head + 1
    elif i + 1 < blocks:
        block, head = table[i + 1], 0
    else:
        return
    size = pool.shape[2] * pool.shape[3]
    start = (block * pool.shape[1] + head) * size
    for offset in range(0, size, LINE // pool.itemsize):
        prefetch(pool, start + offset)


@njit(inline="always")
def _dot(decoding, qh, kb, n, out):
    """q . k_j into out[j] for the first n slots of one block and head (kb: (bs, W) codes)."""
    if decoding == NIBBLES:
        _dot_nibbles(qh, kb, n, out)
        return
    j = 0
    while j + 4 <= n:  # four keys per pass: each query value loaded once for all four
        k0, k1, k2, k3 = kb[j], kb[j + 1], kb[j + 2], kb[j + 3]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for d in range(qh.size):
            x = qh[d]
            a0 += x * _decode(decoding, k0[d])
            a1 += x * _decode(decoding, k1[d])
            a2 += x * _decode(decoding, k2[d])
            a3 += x * _decode(decoding, k3[d])
        out[j], out[j + 1], out[j + 2], out[j + 3] = a0, a1, a2, a3
        j += 4
    for t in range(j, n):
        a, k = np.float32(0.0), kb[t]
        for d in range(qh.size):
            a += qh[d] * _decode(decoding, k[d])
        out[t] = a


@njit(inline="always")
def _axpy(decoding, w, vb, n, acc):
    """acc += w_j v_j over the first n slots of one block and head (vb: (bs, W) codes)."""
    if decoding == NIBBLES:
        _axpy_nibbles(w, vb, n, acc)
        return
    j = 0
    while j + 4 <= n:  # four values per pass over acc
        v0, v1, v2, v3 = vb[j], vb[j + 1], vb[j + 2], vb[j + 3]
        w0, w1, w2, w3 = w[j], w[j + 1], w[j + 2], w[j + 3]
        for d in range(acc.size):
            acc[d] += (w0 * _decode(decoding, v0[d]) + w1 * _decode(decoding, v1[d]) + w2 * _decode(decoding, v2[d])
                       + w3 * _decode(decoding, v3[d]))
        j += 4
    for t in range(j, n):
        wt, v = w[t], vb[t]
        for d in range(acc.size):
            acc[d] += wt * _decode(decoding, v[d])


@njit(inline="always")
def _low(c):
    return np.float32(np.int32(c) & 15)


@njit(inline="always")
def _high(c):
    return np.float32(np.int32(c) >> 4)


@njit(inline="always")
def _dot_nibbles(qh, kb, n, out):
    """dot for int4: byte d of a slot holds channel 2d in its low nibble and 2d + 1 in its high one,
    each stored plus 8; qh holds the query's even channels, then its odd ones. The 8 is taken off
    once per key: q . (c - 8) = q . c - 8 sum(q). Low nibbles and high nibbles in two passes."""
    half, offset = kb.shape[1], np.float32(8.0) * qh.sum()
    for j in range(0, n - n % 4, 4):
        k0, k1, k2, k3 = kb[j], kb[j + 1], kb[j + 2], kb[j + 3]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for d in range(half):
            x = qh[d]
            a0 += x * _low(k0[d])
            a1 += x * _low(k1[d])
            a2 += x * _low(k2[d])
            a3 += x * _low(k3[d])
        for d in range(half):
            x = qh[half + d]
            a0 += x * _high(k0[d])
            a1 += x * _high(k1[d])
            a2 += x * _high(k2[d])
            a3 += x * _high(k3[d])
        out[j], out[j + 1], out[j + 2], out[j + 3] = a0 - offset, a1 - offset, a2 - offset, a3 - offset
    for t in range(n - n % 4, n):
        a, k = np.float32(0.0), kb[t]
        for d in range(half):
            a += qh[d] * _low(k[d]) + qh[half + d] * _high(k[d])
        out[t] = a - offset


@njit(inline="always")
def _axpy_nibbles(w, vb, n, acc):
    """axpy for int4, acc split like qh in _dot_nibbles; the 8 is taken off once: sum w_j (c_j - 8)
    = sum w_j c_j - 8 sum w_j."""
    half = vb.shape[1]
    for j in range(0, n - n % 4, 4):
        v0, v1, v2, v3 = vb[j], vb[j + 1], vb[j + 2], vb[j + 3]
        w0, w1, w2, w3 = w[j], w[j + 1], w[j + 2], w[j + 3]
        for d in range(half):
            acc[d] += w0 * _low(v0[d]) + w1 * _low(v1[d]) + w2 * _low(v2[d]) + w3 * _low(v3[d])
        for d in range(half):
            acc[half + d] += w0 * _high(v0[d]) + w1 * _high(v1[d]) + w2 * _high(v2[d]) + w3 * _high(v3[d])
    for t in range(n - n % 4, n):
        wt, v = w[t], vb[t]
        for d in range(half):
            acc[d] += wt * _low(v[d])
            acc[half + d] += wt * _high(v[d])
    offset = np.float32(8.0) * w[:n].sum()
    for d in range(acc.size):
        acc[d] -= offset


@njit(fastmath=True, nogil=True, cache=True)
def paged_attention(decoding, q, k_pool, v_pool, k_scale, v_scale, unit, tables, seq, pos, scale, out):
    """Row r, of sequence seq[r] at position pos[r], attends to keys 0..pos[r] through the
    block table tables[seq[r]]; query head h reads K/V head h // G.

    q, out: (R, H, D); k_pool, v_pool: (blocks, Hkv, bs, W) codes, W = D or D/2;
    k_scale, v_scale: (blocks, Hkv, bs) or (1, Hkv or 1, 1); tables: (B, width); seq, pos: (R,)"""
    split = decoding == NIBBLES  # int4: query and output channels even first, then odd, as the nibbles lie
    root = np.float32(np.sqrt(unit))  # keys: half of the decoding's factor before the products, half after
    R, H, D = q.shape
    Hkv, bs = k_pool.shape[1], k_pool.shape[2]
    G, half = H // Hkv, D // 2
    scores = np.empty((H, tables.shape[1] * bs), np.float32)  # (H, S) then weights
    qs, acc = np.empty((H, D), np.float32), np.empty((H, D), np.float32)
    w, total = np.empty(bs, np.float32), np.empty(H, np.float32)
    for r in range(R):
        table, S = tables[seq[r]], pos[r] + 1
        blocks = (S + bs - 1) // bs
        for h in range(H):
            for d in range(D):  # int4: even channels first, then odd, as the nibbles lie
                qs[h, d // 2 + (d % 2) * half if split else d] = q[r, h, d] * scale * root
        for i in range(blocks):  # scores: q . k_j times the slot's scale
            block, n = table[i], min(bs, S - i * bs)
            for g in range(Hkv):
                _fetch_next(k_pool, table, i, g, blocks)
                for h in range(g * G, g * G + G):
                    sc = scores[h, i * bs:i * bs + n]
                    _dot(decoding, qs[h], k_pool[block, g], n, sc)
                    for j in range(n):
                        sc[j] *= _scale_at(k_scale, block, g, j) * root
        for h in range(H):  # softmax, row by row (normalised at the end)
            top = scores[h, :S].max()
            t = np.float32(0.0)
            for s in range(S):
                scores[h, s] = exp_nonpositive(scores[h, s] - top)
                t += scores[h, s]
            total[h] = t
        acc[:] = 0.0
        for i in range(blocks):  # the weighted sum of values
            block, n = table[i], min(bs, S - i * bs)
            for g in range(Hkv):
                _fetch_next(v_pool, table, i, g, blocks)
                for h in range(g * G, g * G + G):
                    for j in range(n):
                        w[j] = scores[h, i * bs + j] * _scale_at(v_scale, block, g, j) * unit
                    _axpy(decoding, w, v_pool[block, g], n, acc[h])
        for h in range(H):
            for d in range(D):
                out[r, h, d] = acc[h, d // 2 + (d % 2) * half if split else d] / total[h]


def attend_paged(q, pool, layer, tables, seq, pos, scale):
    """paged attention over one layer of `pool` (a lib.cache.paged.PagedKVCache of any dtype): q (R, H, D) -> (R, H, D)."""
    decoding, unit, view = DECODINGS[pool.form.name]
    k, v = (a if view is None else a.view(view) for a in (pool.k[layer], pool.v[layer]))
    out = np.empty(q.shape, np.float32)  # (R, H, D)
    paged_attention(decoding, np.ascontiguousarray(q), k, v, pool.k_scale[layer], pool.v_scale[layer], np.float32(1 / unit),
                    tables, seq, pos, np.float32(scale), out)
    return out

