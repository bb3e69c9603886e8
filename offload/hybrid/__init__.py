"""The hybrid FFN: each layer's hot neurons on the GPU tier, cold ones on CPU threads.

`setup` turns a dense model into a split one (`memory_plan` sizes the tier, `placement_solver`
and `cost_probe` choose the hot rows, `tier_dtypes` their formats); `ffn` is the split layer,
`cpu_worker` its CPU side, `tier_transfer` the copies to the GPU tier and back,
`neuron_selectors` which cold rows a token computes, `forecast` what fits before anything is
loaded.

May import `body`, `kv` and `options`."""
