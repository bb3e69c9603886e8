"""The model body an engine runs on the CPU.

`quant_model` reads every weight in the file's own GGML blocks and runs the body in one C++
call per pass (a decoded token, a prompt chunk or a tree's rows alike), its LM head from the
same blocks; `ffn_rows` says where a split takes an FFN layer's rows from; `input_sparsity`
applies calibrated input thresholds. The float32 `Transformer` (models/transformer.py) is
the reference it is tested against, and what `--weights fp32` and a GPU device run as is.

Imports only `options`."""
