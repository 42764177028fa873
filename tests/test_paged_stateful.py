"""The paged cache under any sequence of operations: add, feed (the planned prompt, other tokens,
or a step that fails halfway), fork, truncate, free and re-add of shared and unshared prompts.
Checked after every step against the plain reference: logits, every live sequence's K/V against
a contiguous cache of its tokens, reference counts, and no leaked block. A refused call changes
nothing; a step that fails after its slots were reserved leaves every sequence holding its K/V."""
import numpy as np
import pytest
from conftest import GQA, perturbed_params
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lib.cache.kv_cache import KVCache
from lib.cache.paged import PagedKVCache
from lib.fast.lean import LeanModel
from lib.generation import generate
from lib.model import forward, forward_cached, load
from lib.speculative import speculative_generate
from lib.tokenizer import encode

PARAMS = perturbed_params(GQA, seed=41)
step = lambda tokens, cache: forward_cached(PARAMS, GQA, tokens, cache)
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 40, 41, 42, 43], [70, 71, 72, 73, 74]]
MAX_LEN = 30  # positions per sequence, well inside the context of 64


class Failure(Exception):
    pass


def failing_step(tokens, cache):
    """Writes garbage K/V into the reserved slots of every layer, then fails."""
    junk = np.full((GQA.n_kv_head, len(tokens), GQA.head_dim), 1e3, np.float32)
    for layer in range(GQA.n_layer):
        cache.write(layer, junk, junk)
    raise Failure("the step failed after writing")


class PagedMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagedKVCache(GQA, num_blocks=14, block_size=4)
        self.live = {}  # seq_id -> (PagedSequence, tokens whose K/V it holds)
        self.next_id = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _snapshot(self):
        m = self.pool.manager
        return (list(m.ref), list(m.free), {s: list(t) for s, t in m.tables.items()},
                {s: list(t) for s, t in m.tokens.items()}, dict(m.computed), dict(m.hash_to_block))

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 95), max_size=6))
    def add(self, prefix, suffix):
        prompt = prefix + suffix
        seq_id, before = self._new_id(), self._snapshot()
        try:
            seq = self.pool.add(seq_id, prompt)
        except ValueError as e:
            assert "out of blocks" in str(e)
            assert self._snapshot() == before
            return
        assert 0 <= seq.n < len(prompt) and seq.tokens == prompt
        self.live[seq_id] = (seq, prompt[:seq.n])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), planned=st.booleans(), count=st.integers(1, 4))
    def feed(self, data, planned, count):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        seq, held = self.live[seq_id]
        plan = seq.tokens[seq.n:]
        new = plan[:count] if planned and plan else data.draw(st.lists(st.integers(0, 95), min_size=1, max_size=count))
        if seq.n + len(new) > MAX_LEN:
            return
        before = self._snapshot()
        try:
            logits = seq.feed(new, step)
        except ValueError as e:
            assert "out of blocks" in str(e)
            assert self._snapshot() == before
            return
        full = held + list(new)
        np.testing.assert_allclose(logits, forward(PARAMS, GQA, full)[len(held):], atol=1e-5, rtol=0)
        self.live[seq_id] = (seq, full)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 95), min_size=1, max_size=3))
    def failing_feed(self, data, new):
        seq, held = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if seq.n + len(new) > MAX_LEN:
            return
        before = self._snapshot()
        try:
            seq.feed(new, failing_step)
        except ValueError as e:  # refused before anything was reserved
            assert "out of blocks" in str(e)
            assert self._snapshot() == before
            return
        except Failure:
            pass
        after = self._snapshot()
        others = lambda snap: [{s: t for s, t in d.items() if s != seq.seq_id} for d in snap[2:4]]
        assert others(after) == others(before) and after[4] == before[4]  # other tables and tokens; computed
        assert set(after[5].items()) <= set(before[5].items())  # at most a block no longer findable

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        seq, held = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = self.pool.fork(seq, self._new_id())
        self.live[child.seq_id] = (child, list(held))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        seq, held = self.live[seq_id]
        n = data.draw(st.integers(0, seq.n))
        seq.truncate(n)
        self.live[seq_id] = (seq, held[:n])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.free(self.live.pop(seq_id)[0])

    @invariant()
    def reference_counts_and_free_list_are_consistent(self):
        m = self.pool.manager
        counts = np.zeros(m.num_blocks, int)
        for table in m.tables.values():
            np.add.at(counts, table, 1)
        assert list(counts) == m.ref
        assert sorted(m.free) == [b for b in range(m.num_blocks) if m.ref[b] == 0]  # none leaked, none twice
        assert set(m.tables) == set(self.live)

    @invariant()
    def every_sequence_holds_the_kv_of_its_tokens(self):
        for seq, held in self.live.values():
            assert seq.n == len(held) and seq.tokens[:seq.n] == held
            if not held:
                continue
            ref = KVCache(GQA, len(held))
            forward_cached(PARAMS, GQA, held, ref)
            for layer in range(GQA.n_layer):
                for mine, theirs in zip(seq.read(layer, seq.n), ref.read(layer, seq.n)):
                    np.testing.assert_allclose(mine, theirs, atol=1e-5, rtol=0)


TestPagedMachine = PagedMachine.TestCase
TestPagedMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_decoding_on_paged_sequences_is_greedy_at_temperature_0(k):
    """Two requests share a system prompt's blocks; speculative decoding truncates their paged
    caches after every rejection, and each gives the target's greedy text."""
    target, draft = LeanModel(*load("target")), LeanModel(*load("draft"))
    pool = PagedKVCache(target.cfg, num_blocks=40, block_size=8)
    for seq_id, tail in enumerate(["os\n", "sys\n"]):
        prompt = encode("import numpy as np\nimport " + tail)
        seq = pool.add(seq_id, prompt)
        assert seq_id == 0 or seq.n > 0  # the second request reuses the first one's full blocks
        tokens, _ = speculative_generate(target, draft, prompt, 40, k=k, temperature=0.0, cache=seq)
        np.testing.assert_array_equal(tokens, generate(target, prompt, 40).tokens)
        read = np.concatenate([prompt, tokens])[:seq.n]  # the last token emitted may be unread
        assert len(prompt) + 39 <= seq.n <= len(prompt) + 40
        ref = KVCache(target.cfg, seq.n)
        forward_cached(*load("target"), read, ref)
        for layer in range(target.cfg.n_layer):
            for mine, theirs in zip(seq.read(layer, seq.n), ref.read(layer, seq.n)):
                np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=0)
