"""Chapter 9's exercise: the accept-or-resample rule of speculative sampling.

The reader writes `accept_draft`: keep a drafted token x ~ q with probability
min(1, p(x)/q(x)), else draw a token from the residual norm(max(0, p - q)) (Leviathan et al. 2023).
The check draws from it as chapter 9's second check draws from the engine's rule: for the target's
and the draft's distributions after three prefixes, tokens drafted from q and judged, seeded. It
holds the draws to p within twice the TVD noise floor of that many samples (`lib.measure.stats`)
and, to say what is wrong, looks at the two parts apart: accepted tokens are the drafted ones, at
the rate sum min(p, q), and tokens after a rejection follow the residual.
"""
import numpy as np

from lib.book.exercises import Wrong, call, run, verdict
from lib.measure.stats import tvd, tvd_noise_floor
from lib.model import forward
from lib.sampling import probs_from_logits
from lib.tokenizer import encode

PREFIXES = ("import ", "    return self.", "        if not ")  # chapter 9's
DRAWS = 40_000  # per prefix


def accept_draft(p, q, x, rng):
    """(True, x) with probability min(1, p[x] / q[x]), else (False, a token from the residual)."""
    if rng.random() < min(1.0, p[x] / q[x]):
        return True, x
    residual = np.maximum(p - q, 0.0)  # (V,)
    return False, int(rng.choice(len(p), p=residual / residual.sum()))


def next_distributions(target, draft, prefix):
    """(p, q): the target's and the draft's next-token distributions after `prefix`, temperature 1."""
    return tuple(probs_from_logits(forward(params, cfg, encode(prefix))[-1], 1.0) for params, cfg in (target, draft))


def _draws(fn, p, q, case, n, seed):
    """(drafted, accepted, tokens) of n judged drafts, as arrays."""
    rng = np.random.default_rng(seed)
    drafted = rng.choice(len(q), n, p=q)  # (n,) x ~ q
    accepted, tokens = np.zeros(n, bool), np.zeros(n, np.int64)
    for i, x in enumerate(drafted):
        try:
            got = call(fn, p, q, int(x), rng, case=case)
        except Wrong as wrong:  # numpy refuses an unnormalised distribution
            hint = ": divide the residual max(0, p - q) by its sum" if "sum to 1" in str(wrong) else ""
            raise Wrong(f"{wrong}{hint}") from None
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Wrong(f"{case}: accept_draft must return (accepted, token), got {got!r:.60}")
        if not (isinstance(got[1], (int, np.integer)) and 0 <= got[1] < len(p)):
            raise Wrong(f"{case}: tokens are integers 0..{len(p) - 1}, got {got[1]!r:.30} for the draft {x}"
                        + (" after a rejection: is the residual normalised (divided by its sum)?" if not got[0] else ""))
        accepted[i], tokens[i] = bool(got[0]), int(got[1])
        if accepted[i] and tokens[i] != x:
            raise Wrong(f"{case}: an accepted draft is emitted as itself: drafted {x}, got (True, {tokens[i]})")
    return drafted, accepted, tokens


def _rate_hint(rate, p, q) -> str:
    """The rule the measured acceptance rate fits, among known slips."""
    slips = {"every draft accepted: compare a uniform draw with p(x)/q(x)": 1.0,
             "the ratio is upside down: accept with probability min(1, p(x)/q(x)), not q(x)/p(x)":
                 float(np.sum(q * np.minimum(1.0, q / np.maximum(p, 1e-300)))),
             "drafts accepted only where p(x) >= q(x): the rest need a draw against p(x)/q(x)": float(q[p >= q].sum()),
             "the test is inverted: keep the draft when the uniform draw is below p(x)/q(x)": 1 - float(np.minimum(p, q).sum())}
    name, value = min(slips.items(), key=lambda item: abs(item[1] - rate))
    return f": {name}" if abs(value - rate) < 0.01 else ""


def _residual_hint(freq, p, q) -> str:
    candidates = {"p": p, "q": q, "norm(max(0, q - p))": np.maximum(q - p, 0) / np.maximum(q - p, 0).sum()}
    name = min(candidates, key=lambda c: tvd(freq, candidates[c]))
    return f" (they follow {name}: draw from the residual instead)" if tvd(freq, candidates[name]) < 0.05 else ""


def _check_prefix(fn, prefix, p, q, n, seed):
    case = f"prefix {prefix!r}"
    drafted, accepted, tokens = _draws(fn, p, q, case, n, seed)
    beta, rate = float(np.minimum(p, q).sum()), float(accepted.mean())
    sigma = np.sqrt(beta * (1 - beta) / n)
    if abs(rate - beta) > 5 * sigma + 1e-9:
        raise Wrong(f"{case}: {rate:.1%} of drafts were accepted, expected sum min(p, q) = {beta:.1%} "
                    f"(± {5 * sigma:.1%}){_rate_hint(rate, p, q)}")
    rejected = tokens[~accepted]
    if len(rejected):
        residual = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()  # (V,)
        freq = np.bincount(rejected, minlength=len(p)) / len(rejected)
        floor = tvd_noise_floor(residual, len(rejected))
        if tvd(freq, residual) > 2 * floor:
            raise Wrong(f"{case}: the {len(rejected):,} tokens drawn after a rejection are TVD {tvd(freq, residual):.3f} "
                        f"from the residual norm(max(0, p - q)), more than twice its noise floor "
                        f"({floor:.3f}){_residual_hint(freq, p, q)}")
    freq, floor = np.bincount(tokens, minlength=len(p)) / n, tvd_noise_floor(p, n)
    if tvd(freq, p) > 2 * floor:
        raise Wrong(f"{case}: the {n:,} tokens are TVD {tvd(freq, p):.4f} from p, more than twice the noise floor "
                    f"({floor:.4f})")


@verdict
def check(fn, target, draft, prefixes=PREFIXES, n: int = DRAWS):
    """Verdict on the reader's accept_draft: draws after each prefix against p, seeded."""
    for seed, prefix in enumerate(prefixes):
        _check_prefix(fn, prefix, *next_distributions(target, draft, prefix), n, seed)


def attempt(fn, target, draft) -> None:
    """Chapter 9's check cell."""
    run(check, (fn,), (accept_draft,), target, draft)
