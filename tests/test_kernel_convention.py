"""One kernel convention across kernels/ (see kernels/__init__.py): each op module has
`available()`, each op with a fast path has `op_reference` beside it, no op takes a `backend=`
and no reference is named with a `reference_` prefix; kernels/ knows no model (it imports
only the activation table and the GGML formats from models/), and the references it carries
give the reference model's very bits."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from ember.kernels import attention, fused_ops
from ember.models import rotary, transformer

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
# Modules that are not ops: the build (C++ and Triton), the memory layout of the bundles and of
# the input-major tiles, the tier's formats, madvise on buffers.
NOT_OP_MODULES = {"__init__", "cpu_extension", "triton_support", "ffn_bundles", "tier_weights",
                  "tile_layout", "page_advice"}
# Public functions that reach the C++ module without being ops: choosing the CPU path, and
# decoder_step's per-layer entry point (its reference is attention_reference, per layer).
NOT_OPS = {"available", "cpu_path", "set_cpu_path", "cpu_paths", "layer_attention"}
# What kernels/ may import from models/: the activation table, the GGML formats and the
# rotary math (a function of tensors, no model knowledge), and the ground floor (models/support/:
# where the compiled kernels are cached).
MODEL_MODULES_ALLOWED = {"activations", "quants", "quantize", "weights", "support", "rotary"}


def _modules():
    for path in sorted(KERNELS.glob("*.py")):
        if path.stem not in NOT_OP_MODULES:
            yield path.stem, ast.parse(path.read_text())


def _reaches_the_extension(fn: ast.FunctionDef) -> bool:
    """Whether the function asks for the compiled module (`cpu_extension.load()`, `_module()`)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "load") or \
                    (isinstance(f, ast.Name) and f.id == "_module"):
                return True
    return False


def test_every_op_module_says_whether_its_fast_path_runs():
    for name, tree in _modules():
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "available" in defined, f"kernels/{name}.py has no available()"


def test_every_op_with_a_fast_path_has_its_reference_beside_it():
    missing = []
    for name, tree in _modules():
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        defined = {f.name for f in functions}
        for f in functions:
            if f.name.startswith("_") or f.name in NOT_OPS or f.name.endswith("_reference"):
                continue
            # (an in-place op, `op_`, has its reference as `op_reference`)
            if _reaches_the_extension(f) and f"{f.name.rstrip('_')}_reference" not in defined:
                missing.append(f"{name}.{f.name}")
    assert not missing, f"ops without an op_reference in their module: {missing}"


def test_no_reference_prefix_and_no_backend_switch():
    for name, tree in _modules():
        for f in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            assert not f.name.startswith("reference_"), f"{name}.{f.name}: use {f.name[10:]}_reference"
            params = [a.arg for a in f.args.args + f.args.kwonlyargs]
            assert "backend" not in params, f"{name}.{f.name} takes backend=: use op / op_reference"


def test_kernels_know_no_model():
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "models" in node.module:
                names = [node.module.split("ember.models")[-1].lstrip(".")] if \
                    node.module != "ember.models" else [a.name for a in node.names]
                for mod in names:
                    assert mod.split(".")[0] in MODEL_MODULES_ALLOWED, \
                        f"kernels/{path.name} imports models.{mod}: pass tensors and switches instead"


def test_references_give_the_reference_models_bits():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    assert torch.equal(fused_ops.rms_norm_reference(x, w, 1e-6), transformer.rms_norm(x, w, 1e-6))
    heads = torch.randn(3, 4, 16, generator=g)
    cos, sin = torch.rand(3, 1, 8, generator=g), torch.rand(3, 1, 8, generator=g)
    for interleaved in (False, True):
        assert torch.equal(fused_ops.rotate_reference(heads, cos, sin, interleaved),
                           rotary.rotate(heads, cos, sin, interleaved))
    k_pool, v_pool = torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    q, slots = torch.randn(1, 4, 16, generator=g), torch.tensor([7, 0, 3, 5])
    for softcap in (0.0, 2.5):
        got = attention.attend_reference(q, k_pool, v_pool, [slots], torch.tensor([3]), 0.25,
                                         softcap)
        want = transformer.attend(q, k_pool[slots], v_pool[slots], None, None, None, 0.25,
                                  softcap or None)
        assert torch.equal(got, want), softcap
