"""The model body an engine runs and what is swapped into it at load.

`quant_model` reads every weight in the file's own GGML blocks and runs the body in one C++
call per pass; `quant_body`, `fused_block` and `fused_body` speed up the float32 reference
(`--weights fp32/q8`, GPU devices); `lm_head` picks the LM head; `ffn_rows` says where a split
takes an FFN layer's rows from; `input_sparsity` applies calibrated input thresholds.

Imports no other room."""
