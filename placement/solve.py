"""One entry point for `ember profile` and the benchmarks: solve a placement problem."""

from __future__ import annotations

from ember.models.support.errors import ConfigError

from .cost_model import PlacementResult
from .greedy import solve_greedy
from .ilp import solve_ilp
from .problem import PlacementProblem

METHODS = ("ilp", "greedy")
DEFAULT_TIME_LIMIT_S = 8.0


def solve(problem: PlacementProblem, method: str = "ilp",
          time_limit_s: float = DEFAULT_TIME_LIMIT_S, threads: int | None = None) -> PlacementResult:
    """Choose the hot neurons of every layer.

    Args:
        method: "ilp" (exact, CBC; the greedy answer is its first incumbent) or "greedy"
            (hottest neurons per byte first, as a plain top-K placement would).
        time_limit_s: ILP only; past it the best placement found so far is returned.
        threads: ILP only; CBC threads.
    Returns:
        PlacementResult: `.placement` (hot indices per layer, original numbering),
        `.objective_ms`, `.layer_ms`, `.status`, `.solve_s`, `.summary()`.
    """
    if method == "greedy":
        return solve_greedy(problem)
    if method != "ilp":
        raise ConfigError(f"unknown placement method {method!r}; choose one of {', '.join(METHODS)}")
    if not time_limit_s > 0:
        raise ConfigError(f"the placement time limit must be > 0 seconds, got {time_limit_s!r}")
    return solve_ilp(problem, time_limit_s=time_limit_s, threads=threads)
