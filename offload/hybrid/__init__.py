"""The hybrid FFN: each layer's hot neurons on the GPU tier, cold ones on CPU threads.

`setup` turns a dense model into a split one (`memory_plan` sizes the tier from
`component_bytes`, `placement_solver` and `cost_probe` choose the hot rows from a profile's
`side_costs`, `tier_dtypes` their formats); `ffn` is the split layer, `cpu_worker` its CPU
side, `tier_transfer` the copies to the GPU tier and back, `neuron_selectors` which cold rows
a token computes. The whole-model plan (`layer_plan`: per layer gpu/split/cpu and the LM
head) prices its choices with `decode_costs` for a card of `gpu_cards`; `forecast` sets it
against llama.cpp's layer offload (`llama_offload`) on `paper_shapes` before anything is
loaded.

May import `body`, `kv` and `options`."""
