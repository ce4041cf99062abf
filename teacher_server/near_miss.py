"""Near-misses of the server's request parameter names, which are refused instead of ignored.

A Triton server ignores parameters it does not know, and so does teacher-server: clients send
several of their own (`sequence_id`, `binary_data_output`, ...). But a misspelt parameter of ours
(`topk`, `log_probs`, `outputdtype`) would then silently change the answer (raw fp32 logits
instead of top-k log-probs, 250x the bytes), so validation refuses a name that `near_miss` finds
close to one of `known_parameters()` (the transform registry's and the scheduling ones) and names
the one meant.
"""

from __future__ import annotations

from teacher_server.transforms import OTHER_PARAMETERS, PARAMETERS


def _normal(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _distance(a: str, b: str, limit: int) -> int:
    """Levenshtein distance of `a` and `b`, or `limit + 1` once it is known to exceed `limit`."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        if min(cur) > limit:
            return limit + 1
        prev = cur
    return prev[-1]


def known_parameters() -> tuple[str, ...]:
    """Every request parameter name the server reads (the registry may grow: read it each time)."""
    return (*PARAMETERS, *OTHER_PARAMETERS)


def near_miss(key: str) -> str | None:
    """The parameter of ours that `key` looks like a misspelling of, or None.

    A near-miss differs from one of ours only in case, underscores and dashes (`topk`,
    `log_probs`, `Output-Dtype`), or by one edit (two for names of 10 letters or more) when ours
    has at least 5 letters; shorter names need the exact letters, so `top_p` stays foreign.
    Parameters that are genuinely foreign (Triton's `sequence_id`, `binary_data_output`) return None.
    """
    known_names = known_parameters()
    if key in known_names or len(key) > 64:
        return None
    n = _normal(key)
    for known in known_names:
        if _normal(known) == n:
            return known
    for known in known_names:
        m = _normal(known)
        limit = 2 if len(m) >= 10 else 1 if len(m) >= 5 else 0
        if limit and _distance(n, m, limit) <= limit:
            return known
    return None
