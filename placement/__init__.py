"""Hot/cold neuron placement: the problem, the PuLP ILP, a greedy baseline (filled by `ember profile`)."""
