"""The model body an engine runs, built once for its placement.

`file_layers` reads every weight in the file's own GGML blocks; `file_blocks_model` runs them,
each layer as its `LayerRun` (`layer_runs`) says, fixed at build: by default the whole body in
one C++ call per pass (a decoded token, a prompt chunk or a tree's rows alike), its LM head
from the same blocks; `tier_layers` makes a layer's copies for the GPU tier; `ffn_rows` says
where a split takes an FFN layer's rows from; `input_sparsity` applies calibrated input
thresholds; `protocol` is what the runner asks of a model. The float32 `Transformer`
(models/transformer.py) is the reference it is tested against, and what `--weights fp32`
and a GPU device without a budget run as is.

Imports only `options`."""
