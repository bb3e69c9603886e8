"""Hot/cold neuron placement: the problem, the PuLP ILP, a greedy baseline, the placement layout.

Torch-free: numpy for the data, PuLP (CBC) for the integer program, imported only when solving.
"""

from .cost_model import Evaluation, PlacementResult, evaluate
from .layout import Placement
from .problem import PlacementProblem, default_group_size
from .solve import METHODS, solve

__all__ = ["Evaluation", "METHODS", "Placement", "PlacementProblem", "PlacementResult",
           "default_group_size", "evaluate", "solve"]
