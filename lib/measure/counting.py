"""Counting what a step runs, and the steps that are timed and counted.

`count_ops` runs a function on parameters viewed as an ndarray subclass whose
`__array_ufunc__` / `__array_function__` hooks see every numpy call: each `matmul` adds
2*m*k*n (times its batch) FLOPs and the bytes of its operands and result, the roofline
model's "bytes moved" (Williams et al. 2009); every call is also kept as an `Op`, so a cost
model can charge each one.

The `*_call` functions build one repeatable step (a cached call, a batched step over a fresh
paged pool, or over given sequences) that undoes its own writes, ready to time or count.
"""
from dataclasses import dataclass, field

import numpy as np

from lib.cache.kv_cache import KVCache
from lib.cache.paged import PagedKVCache
from lib.fast.batch import BatchedModel


@dataclass(frozen=True)
class Op:
    """One numpy call of a counted function."""
    kind: str  # "matmul", "ufunc" (elementwise, reductions, masked writes) or "function" (copies, ...)
    name: str  # for a matmul: "weights" (a 2-D second operand) or "attention" (batched, cached K or V)
    flops: int = 0  # 2*m*k*n per matmul (times its batch); elements computed for a ufunc
    bytes: int = 0  # operands read + result written
    rows: int = 0  # a matmul's rows that share each read of the second operand (all of a batch, for weights)
    streamed: int = 0  # a matmul's second operand (weights, cached K or V): the bytes read once per call
    batch: int = 1  # a matmul's batch of products (heads, for attention)


@dataclass
class OpCounts:
    flops: int = 0  # 2*m*k*n per matmul
    bytes: int = 0  # operands read + result written, per matmul
    matmuls: int = 0
    numpy_calls: int = 0  # every ufunc and array-function call that touched a counted array
    ops: list = field(default_factory=list)  # every call, as an Op

    @property
    def intensity(self) -> float:
        """Arithmetic intensity of the products, FLOP per byte."""
        return self.flops / self.bytes if self.bytes else 0.0


def _nbytes(values) -> int:
    return sum(v.nbytes for v in values if isinstance(v, np.ndarray))


def _product_op(a, b, out) -> Op:
    """One matrix product a @ b = out, as the roofline counts it: 2*m*k*n FLOPs for each product of
    the batch, and every byte of both operands and the result, each moved once. What streams from
    memory is the weight matrix, or of an attention product its larger operand: the cached K or V
    (K as the left operand when `attention` computes k @ q^T), or a long prefill's T x T scores."""
    m, k, n = a.shape[-2] if a.ndim > 1 else 1, a.shape[-1], b.shape[-1]  # (..., m, k) @ (..., k, n)
    batch = int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), dtype=np.int64))  # heads, or 1
    weights = b.ndim == 2  # one matrix for every row (and every batch of rows)
    return Op("matmul", "weights" if weights else "attention", flops=2 * batch * m * k * n,
              bytes=a.nbytes + b.nbytes + out.nbytes, rows=m * batch if weights else m,
              streamed=b.nbytes if weights else max(a.nbytes, b.nbytes), batch=batch)


def count_ops(fn, params: dict, counts: OpCounts = None) -> OpCounts:
    """Run fn(counted_params) and count its numpy calls, and the FLOPs and bytes of its matmuls
    (into `counts` if given, which fn may read as it runs)."""
    counts = OpCounts() if counts is None else counts

    def plain(x):
        return x.view(np.ndarray) if isinstance(x, Counted) else x

    def wrap(result):
        if isinstance(result, np.ndarray) and not isinstance(result, Counted):
            return result.view(Counted)
        if isinstance(result, tuple):
            return tuple(wrap(r) for r in result)
        return result

    def record_product(a, b, out):
        op = _product_op(a, b, out)
        counts.matmuls += 1
        counts.flops += op.flops
        counts.bytes += op.bytes
        counts.ops.append(op)

    class Counted(np.ndarray):
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            counts.numpy_calls += 1
            inputs = [plain(x) for x in inputs]
            if "out" in kwargs:
                kwargs["out"] = tuple(plain(x) for x in kwargs["out"])
            result = getattr(ufunc, method)(*inputs, **kwargs)
            out = np.asarray(result)
            if ufunc is np.matmul and method == "__call__":
                a, b = np.asarray(inputs[0]), np.asarray(inputs[1])
                record_product(a, b, out)
            else:
                elements = max([out.size] + [x.size for x in inputs if isinstance(x, np.ndarray)])
                read = _nbytes(inputs) + _nbytes(kwargs.get("out", ()))
                counts.ops.append(Op("ufunc", f"{ufunc.__name__}.{method}", elements, read + out.nbytes))
            return wrap(result)

        def __setitem__(self, index, value):  # not a numpy call, but masked writes cost like one
            view = self.view(np.ndarray)
            view[index] = plain(value)
            written = view[index].size if isinstance(index, np.ndarray) or (
                isinstance(index, tuple) and any(isinstance(i, np.ndarray) for i in index)) else 0
            if written:  # a fancy (mask or index array) write: a call, an element at a time
                counts.ops.append(Op("ufunc", "setitem", written, written * view.itemsize))

        def __array_function__(self, func, types, args, kwargs):
            counts.numpy_calls += 1
            args = tuple(plain(a) if not isinstance(a, (list, tuple)) else type(a)(plain(x) for x in a) for a in args)
            result = func(*args, **{k: plain(v) for k, v in kwargs.items()})
            if func is np.dot and np.ndim(args[1]) == 2:
                record_product(np.asarray(args[0]), np.asarray(args[1]), np.asarray(result))
            else:
                moved = _nbytes(result if isinstance(result, tuple) else (result,))
                counts.ops.append(Op("function", func.__name__, 0, 2 * moved))  # read and written once
            return wrap(result)

    fn({k: v.view(Counted) for k, v in params.items()})
    return counts


def cached_call(step, cfg, position: int, n_tokens: int = 1):
    """A function that runs step(new_tokens, cache) on n_tokens new tokens after `position`
    cached ones, then drops them again: one cached call, ready to time."""
    cache = KVCache(cfg)
    step(np.arange(position) % cfg.vocab_size, cache)
    new = np.arange(n_tokens) % cfg.vocab_size

    def call():
        step(new, cache)
        cache.truncate(position)
    return call


def _totals(ops) -> OpCounts:
    products = [op for op in ops if op.kind == "matmul"]
    calls = sum(op.name != "setitem" for op in ops)  # a masked write is not a numpy call
    return OpCounts(sum(op.flops for op in products), sum(op.bytes for op in products), len(products), calls, ops)


def step_counts(step_builder, params, cfg, position: int = 128, sizes=(1,)) -> dict:
    """{T: the ops of one cached call over T new tokens after `position`} for T in sizes, by
    step_builder(params) (a function of (new_tokens, cache)), built once; its building not counted."""
    cache, counts, marks = KVCache(cfg), OpCounts(), []
    if position:
        step_builder(params)(np.arange(position) % cfg.vocab_size, cache)

    def run(p):
        step = step_builder(p)
        for T in sizes:
            marks.append(len(counts.ops))
            step(np.arange(T) % cfg.vocab_size, cache)
            cache.truncate(position)
        marks.append(len(counts.ops))
    count_ops(run, params, counts)
    return {T: _totals(counts.ops[a:b]) for T, a, b in zip(sizes, marks, marks[1:])}


def numpy_calls_per_step(step_builder, params, cfg, position: int = 128) -> int:
    """Numpy calls of one decode step at `position` by step_builder(params) (a function of
    (new_tokens, cache)), not counting the calls that build it."""
    return step_counts(step_builder, params, cfg, position)[1].numpy_calls


def pool_call(model, seqs, n_tokens: int = 1):
    """A function that runs one batched step of `model` (a LeanModel or a BatchedModel) over the
    paged sequences `seqs`, each fed `n_tokens` new tokens, then truncated back to where it was."""
    batched = model if isinstance(model, BatchedModel) else BatchedModel(model)
    lengths, new = [s.n for s in seqs], [[1] * n_tokens] * len(seqs)

    def call():
        batched.feed(seqs, new)
        for seq, n in zip(seqs, lengths):
            seq.truncate(n)
    return call


def batched_call(batched: BatchedModel, positions, block_size: int = 16, n_tokens: int = 1):
    """`pool_call` over sequences with `positions` cached tokens in a fresh paged pool, each fed
    `n_tokens` new ones (1: decode; more: a prompt's chunk)."""
    cfg, positions = batched.cfg, [int(p) for p in positions]
    pool = PagedKVCache(cfg, sum(-(-(p + n_tokens) // block_size) for p in positions), block_size, prefix_caching=False)
    prompts = [np.arange(p) % cfg.vocab_size for p in positions]
    seqs = [pool.add(b, p) for b, p in enumerate(prompts)]
    batched.feed(seqs, prompts)
    return pool_call(batched, seqs, n_tokens)
