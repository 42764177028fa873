"""Chapter 10's exercise: the best k from the acceptance rate, the draft's cost and V(k+1).

The reader writes `best_k`: the k of a list with the highest expected speed-up
E / (k c + V(k+1)), E = (1 - alpha^(k+1)) / (1 - alpha) tokens per target call (Leviathan et al.
2023, eq. 1 and Theorem 3.8 with the measured cost of a (k+1)-token call). The check asks it for
the chapter's measured alpha, c and V, then for three pairs whose best k tells the usual slips
apart (a verify call priced as one token, a free draft, tokens per call alone, alpha^k for
alpha^(k+1)), and names the slip a wrong answer fits.
"""
from lib.book.exercises import Wrong, call, run, verdict

KS = tuple(range(1, 9))
PAIRS = (  # (name, alpha, c, V(T) = 1 + growth (T - 1)): where the slips choose another k
    ("an H100 pair, 8B target and 1B draft", 0.8, 0.2, 0.0),
    ("a draft head", 0.75, 0.05, 0.02),
    ("a target whose calls grow 25% a token", 0.7, 0.05, 0.25),
)


def best_k(alpha, c, V, ks):
    """The k in ks with the highest (1 - alpha^(k+1)) / ((1 - alpha)(k c + V[k + 1]))."""
    def speedup(k):
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)  # expected tokens per target call
        return tokens / (k * c + V[k + 1])  # a round: k draft calls and one call over k + 1 tokens
    return max(ks, key=speedup)


def formula(alpha, c, V, k, exponent: int = 1) -> float:
    """The expected speed-up at k (exponent 0: the slip alpha^k)."""
    return (1 - alpha ** (k + exponent)) / (1 - alpha) / (k * c + V[k + 1])


SLIPS = {  # what a wrong k fits: the objective it maximises
    "a (k+1)-token call priced as one token (V = 1): divide by k c + V(k+1), with V measured":
        lambda a, c, V, k: formula(a, c, {T: 1.0 for T in V}, k),
    "the draft's calls left out: a round also costs k c": lambda a, c, V, k: formula(a, 0.0, V, k),
    "tokens per call alone: divide by the round's cost, k c + V(k+1)": lambda a, c, V, k: formula(a, 0.0, {T: 1.0 for T in V}, k),
    "alpha^k for alpha^(k+1): k drafts give up to k + 1 tokens": lambda a, c, V, k: formula(a, c, V, k, exponent=0),
}


def cases(measured) -> list:
    """The chapter's measured (name, alpha, c, V) and the check's own pairs, with V as {T: V(T)}."""
    made = [(name, alpha, c, {T: 1 + growth * (T - 1) for T in range(2, max(KS) + 2)}) for name, alpha, c, growth in PAIRS]
    return list(measured) + made


def _slip(answers) -> str:
    """The slip that gives every answer (alpha, c, V, k) the reader gave, if one does."""
    fits = lambda f, a, c, V, k: max(KS, key=lambda j: f(a, c, V, j)) == k
    every = [s for s, f in SLIPS.items() if all(fits(f, *answer) for answer in answers)]
    return f": {every[0]}" if every else ""


@verdict
def check(fn, measured):
    """Verdict on the reader's best_k for each (name, alpha, c, V) of `measured`, then PAIRS."""
    answers, first = [], None
    for name, alpha, c, V in cases(measured):
        V = {T: V[T] for T in range(2, max(KS) + 2)}  # V(k+1) of each k
        case = f"{name} (alpha = {alpha:.3f}, c = {c:.3f}, V(k+1) from {V[2]:.2f} to {V[max(KS) + 1]:.2f})"
        got = call(fn, alpha, c, dict(V), list(KS), case=case)
        if got not in KS:
            raise Wrong(f"{case}: best_k must return one of ks {list(KS)}, got {got!r}")
        answers.append((alpha, c, V, got))
        expected = best_k(alpha, c, V, KS)
        if got != expected and first is None:
            first = (f"{case}: the best k is {expected} (speed-up {formula(alpha, c, V, expected):.3f} by the "
                     f"formula), got k = {got} ({formula(alpha, c, V, got):.3f})")
    if first:
        raise Wrong(first + _slip(answers))


def attempt(fn, measured) -> None:
    """Chapter 10's check cell."""
    run(check, (fn,), (best_k,), measured)
