"""Greedy agreement between two engines up to the reference's first near-tie.

A quantized GPU tier changes logits by a little; where the reference's two best tokens are
closer than that, either pick is right and the continuations part ways. So a split model is
held to the unsplit one's greedy tokens up to (and including) the first step whose top-2 gap
in the reference is below `NEAR_TIE`, and must agree there only when the gap is wider."""

from __future__ import annotations

NEAR_TIE = 0.5


def greedy_with_gaps(engine, prompt: list[int], n: int, session: str = "near-ties"):
    """(tokens, top-2 logit gaps) of n greedy steps after `prompt`, through the runner."""
    runner = engine.runner
    logits = runner.prefill(session, list(prompt))
    tokens, gaps = [], []
    for _ in range(n):
        top = logits.float().topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        tokens.append(int(top.indices[0]))
        logits = runner.decode(session, tokens[-1])
    return tokens, gaps


def agreed_steps(reference, gaps, got) -> tuple[int, int]:
    """(steps that must agree, steps that did): the first differing step counts as allowed
    only at or after the reference's first near-tie."""
    first_tie = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(reference))
    same = next((i for i, (a, b) in enumerate(zip(reference, got)) if a != b), len(reference))
    return first_tie, same


def assert_agrees_until_near_tie(reference, gaps, got) -> None:
    must, same = agreed_steps(reference, gaps, got)
    assert same >= must, (f"the split model parts from the reference at step {same}, before "
                          f"its first near-tie at step {must} (gaps {gaps[:must + 1]})")
