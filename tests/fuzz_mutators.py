"""Mutations of valid tiny model files, shared by `tests/test_fuzz.py` and `bench/fuzz_models.py`.

A case is (seed kind, mutator name, integer seed): `build_seeds` writes one valid tiny model per
seed kind, `mutate_case` copies it into a fresh place and damages it with `random.Random(seed)`,
so any case can be replayed from its three values alone.

GGUF mutators are structure-aware: `gguf_layout` walks the valid file once and lists where each
header field lives (counts, string lengths, value types, dimensions, quant types, offsets), so
"huge count" or "bad offset" hits the field it names instead of a random byte.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

# Values that break size arithmetic: sign bits, 32-bit wrap-arounds, "all ones".
HUGE = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
SMALL = [0, 1, 2, 3, 7, 255]

# ----------------------------------------------------------------------- seed models


def _q4k_config():
    """A tiny model whose every matrix row is a whole Q4_K block (256 elements)."""
    from ember.models.testing import synthetic

    return synthetic.tiny_config("llama", activation="silu_glu", hidden_size=256, n_heads=4,
                                 n_kv_heads=2, head_dim=64, ffn_size=256, n_layers=2)


def _seed_specs():
    from gguf import GGMLQuantizationType as Q

    from ember.models.testing import synthetic

    return {
        "gguf-f32": ("gguf", lambda: synthetic.tiny_config("gemma3"), Q.F32),
        "gguf-q8_0": ("gguf", lambda: synthetic.tiny_config("llama", activation="relu_glu"),
                      Q.Q8_0),
        "gguf-q4_k": ("gguf", _q4k_config, Q.Q4_K),
        "hf-gemma3": ("hf", lambda: synthetic.tiny_config("gemma3"), None),
        "hf-llama": ("hf", lambda: synthetic.tiny_config("llama", activation="silu_glu"), None),
    }


SEED_KINDS = ("gguf-f32", "gguf-q8_0", "gguf-q4_k", "hf-gemma3", "hf-llama")


def build_seeds(root: Path) -> dict[str, Path]:
    """Write every seed model under `root`: kind -> .gguf file or HF folder."""
    from ember.models.testing import synthetic

    out = {}
    for i, (kind, (fmt, make_cfg, qtype)) in enumerate(_seed_specs().items()):
        cfg = make_cfg()
        weights = synthetic.tiny_weights(cfg, seed=i)
        if fmt == "gguf":
            out[kind] = synthetic.write_gguf(Path(root) / f"{kind}.gguf", cfg, weights, qtype=qtype)
        else:
            out[kind] = synthetic.write_hf(Path(root) / kind, cfg, weights)
    return out


# ----------------------------------------------------------------------- GGUF layout


@dataclass(frozen=True)
class Field:
    offset: int
    size: int
    kind: str  # count, length, vtype, value, item (of an array), ndims, dim, qtype, offset, header


@dataclass(frozen=True)
class GGUFLayout:
    fields: list[Field]
    data_start: int  # first byte after the tensor directory (before alignment padding)
    tensor_offsets: list[int]  # relative to the data section, as stored
    values: dict[str, tuple[int, int]]  # metadata key -> (offset of its type field, end)

    def of_kind(self, *kinds: str) -> list[Field]:
        return [f for f in self.fields if f.kind in kinds]


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_layout(data: bytes) -> GGUFLayout:
    """Where every header field of a *valid* GGUF file lives (no validation: trusted input)."""
    fields = [Field(0, 4, "header"), Field(4, 4, "header"), Field(8, 8, "count"),
              Field(16, 8, "count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(pos: int) -> int:
        fields.append(Field(pos, 8, "length"))
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(pos: int, vtype: int, kind: str = "value") -> int:
        if vtype in _SCALAR_SIZES:
            fields.append(Field(pos, _SCALAR_SIZES[vtype], kind))
            return pos + _SCALAR_SIZES[vtype]
        if vtype == 8:
            return string(pos)
        item = struct.unpack_from("<I", data, pos)[0]
        fields.append(Field(pos, 4, "vtype"))
        fields.append(Field(pos + 4, 8, "count"))
        count = struct.unpack_from("<Q", data, pos + 4)[0]
        pos += 12
        for _ in range(count):
            pos = value(pos, item, "item")
        return pos

    values = {}
    for _ in range(n_kv):
        key_at = pos
        pos = string(pos)
        key = data[key_at + 8: pos].decode()
        fields.append(Field(pos, 4, "vtype"))
        vtype = struct.unpack_from("<I", data, pos)[0]
        values[key] = (pos, value(pos + 4, vtype))
        pos = values[key][1]
    offsets = []
    for _ in range(n_tensors):
        pos = string(pos)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields.append(Field(pos, 4, "ndims"))
        fields += [Field(pos + 4 + 8 * d, 8, "dim") for d in range(n_dims)]
        pos += 4 + 8 * n_dims
        fields.append(Field(pos, 4, "qtype"))
        fields.append(Field(pos + 4, 8, "offset"))
        offsets.append(struct.unpack_from("<Q", data, pos + 4)[0])
        pos += 12
    return GGUFLayout(fields, pos, offsets, values)


def _put(data: bytearray, field: Field, value: int) -> None:
    data[field.offset: field.offset + field.size] = (value % (1 << 8 * field.size)).to_bytes(
        field.size, "little")


def _random_field(rng: random.Random, layout: GGUFLayout, *kinds: str) -> Field:
    fields = layout.of_kind(*kinds)
    # Token strings dominate the field list; sample kinds first so rare fields get their turn.
    kind = rng.choice(sorted({f.kind for f in fields}))
    return rng.choice([f for f in fields if f.kind == kind])


# ----------------------------------------------------------------------- byte mutators


def _bit_flips(data: bytearray, rng: random.Random, header_end: int) -> None:
    for _ in range(rng.randint(1, 8)):
        end = header_end if rng.random() < 0.7 else len(data)
        pos = rng.randrange(end)
        data[pos] ^= 1 << rng.randrange(8)


def _truncate(data: bytearray, rng: random.Random, header_end: int) -> None:
    end = header_end if rng.random() < 0.6 else len(data)
    del data[rng.randrange(end):]


def _append_garbage(data: bytearray, rng: random.Random) -> None:
    n = rng.choice([1, 7, 64, 4096, rng.randrange(1, 1 << 16)])
    data += rng.randbytes(n) if rng.random() < 0.7 else bytes(data[:n])


def _boundary_value(rng: random.Random, file_size: int) -> int:
    return rng.choice(HUGE + SMALL + [file_size, file_size + 1, rng.getrandbits(64)])


# ----------------------------------------------------------------------- GGUF mutators


def g_bit_flips(data, layout, rng):
    _bit_flips(data, rng, layout.data_start)


def g_byte_overwrite(data, layout, rng):
    field = _random_field(rng, layout, *{f.kind for f in layout.fields})
    pattern = rng.choice([b"\x00", b"\xff", b"\x7f", b"\x80", None])
    raw = rng.randbytes(field.size) if pattern is None else pattern * field.size
    data[field.offset: field.offset + field.size] = raw


def g_truncate(data, layout, rng):
    _truncate(data, rng, layout.data_start)


def g_huge_count(data, layout, rng):
    _put(data, _random_field(rng, layout, "count", "length", "dim", "ndims"),
         _boundary_value(rng, len(data)))


def g_bad_offset(data, layout, rng):
    fields = layout.of_kind("offset")
    i = rng.randrange(len(fields))
    data_size = len(data) - layout.data_start
    choices = [0, layout.tensor_offsets[i] + 1, layout.tensor_offsets[i] + 32,
               rng.choice(layout.tensor_offsets), data_size, data_size - 32, *HUGE]
    _put(data, fields[i], rng.choice(choices))


def g_wrong_type(data, layout, rng):
    _put(data, _random_field(rng, layout, "vtype"),
         rng.choice([*range(14), 255, 2**31, 2**32 - 1]))


def g_bad_qtype(data, layout, rng):
    _put(data, _random_field(rng, layout, "qtype"), rng.choice([*range(42), 255, 2**32 - 1]))


def g_meta_value(data, layout, rng):
    """A scalar metadata value (block count, head counts, ids, epsilons) set to an extreme."""
    field = _random_field(rng, layout, "value" if rng.random() < 0.8 else "item")
    if field.size == 4 and rng.random() < 0.3:  # maybe a float32: NaN, inf, negative, tiny
        value = struct.unpack("<I", struct.pack("<f", rng.choice(
            [float("nan"), float("inf"), -1.0, 0.0, 1e-45, 3e38])))[0]
    else:
        value = _boundary_value(rng, len(data))
    _put(data, field, value)


def g_append_garbage(data, layout, rng):
    _append_garbage(data, rng)


def g_splice(data, layout, rng):
    """Copy a run of header bytes over another place in the header (shifted structures)."""
    n = rng.randint(1, 64)
    src, dst = rng.randrange(layout.data_start - n), rng.randrange(24, layout.data_start - n)
    data[dst: dst + n] = data[src: src + n]


def _encode(vtype: int, value) -> bytes:
    """A GGUF value (its type field included), well formed."""
    out = struct.pack("<I", vtype)
    if vtype == 8:
        raw = value.encode()
        return out + struct.pack("<Q", len(raw)) + raw
    if vtype == 9:
        item, items = value
        return out + struct.pack("<IQ", item, len(items)) + b"".join(
            _encode(item, v)[4:] for v in items)
    fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}[vtype]
    return out + struct.pack(fmt, value)


def _retyped_value(rng: random.Random, n: int):
    """(vtype, value): a well-formed value of some type; `n` is the vocabulary's length, so
    arrays can be as long as the token list while holding the wrong kind of item."""
    return rng.choice([
        (4, rng.choice(SMALL + [2**31, 2**32 - 1])), (5, -1), (10, 2**63), (11, -(2**63)),
        (6, float("nan")), (6, -1.0), (12, 1e308), (7, True), (8, ""), (8, "x" * 300),
        (9, (8, ["a", "b"])), (9, (8, ["a"] * n)), (9, (8, [""] * n)), (9, (4, [7] * n)),
        (9, (6, [0.5] * n)), (9, (5, [-1] * n)), (9, (0, [1, 2])), (9, (6, [])), (9, (8, [])),
        (9, (9, [(4, [1])])), (9, (9, [(8, ["a"])] * n)),
    ])


def g_retype(data, layout, rng):
    """One metadata value replaced by a well-formed value of another type or length.

    Unlike byte damage this parses, so it reaches the code that *uses* metadata: vocabularies,
    hyper-parameters, ids. Tensor data keeps its place (offsets are relative to the data
    section, which is re-aligned after the shorter or longer header).
    """
    key = rng.choice(sorted(layout.values))
    n = struct.unpack_from("<Q", data, layout.values["tokenizer.ggml.tokens"][0] + 8)[0]
    replace_value(data, layout, key, *_retyped_value(rng, n))


def replace_value(data: bytearray, layout: GGUFLayout, key: str, vtype: int, value) -> None:
    """Metadata `key` of a valid GGUF file (in `data`) replaced by a `vtype` value."""
    start, end = layout.values[key]
    header = bytes(data[:start]) + _encode(vtype, value) + bytes(data[end: layout.data_start])
    body = bytes(data[-(-layout.data_start // 32) * 32:])  # the seeds use the default alignment
    data[:] = header + bytes(-len(header) % 32) + body


GGUF_MUTATORS = {
    "bit_flips": g_bit_flips, "byte_overwrite": g_byte_overwrite, "truncate": g_truncate,
    "huge_count": g_huge_count, "bad_offset": g_bad_offset, "wrong_type": g_wrong_type,
    "bad_qtype": g_bad_qtype, "meta_value": g_meta_value, "append_garbage": g_append_garbage,
    "splice": g_splice, "retype": g_retype,
}

# ----------------------------------------------------------------------- HF folder mutators

_JSON_VALUES = [0, -1, 1, 2, 2**31, 2**63, 10**30, 1.5, -0.5, 1e308, "", "x", "linear", [], [1],
                {}, {"type": "linear", "factor": 0}, {"rope_type": "linear", "factor": [2]},
                None, True, False]
# Keys the loaders read, so additions and edits reach code paths.
_CONFIG_KEYS = ["query_pre_attn_scalar", "rope_scaling", "sliding_window", "sliding_window_pattern",
                "bos_token_id", "eos_token_id", "ffn_activation", "hidden_act", "head_dim",
                "final_logit_softcapping", "rope_local_base_freq", "tie_word_embeddings",
                "vocab_size", "num_hidden_layers", "model_type"]


def _st_header(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", data, 0)[0]
    return json.loads(data[8: 8 + n]), data[8 + n:]


def _st_pack(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def st_bit_flips(folder: Path, rng):
    path, data = _read(folder, "model.safetensors")
    _bit_flips(data, rng, 8 + struct.unpack_from("<Q", data, 0)[0])
    path.write_bytes(data)


def st_truncate(folder: Path, rng):
    path, data = _read(folder, "model.safetensors")
    _truncate(data, rng, 8 + struct.unpack_from("<Q", data, 0)[0])
    path.write_bytes(data)


def st_header_length(folder: Path, rng):
    path, data = _read(folder, "model.safetensors")
    data[:8] = (_boundary_value(rng, len(data)) % 2**64).to_bytes(8, "little")
    path.write_bytes(data)


def st_header_edit(folder: Path, rng):
    """One tensor entry's dtype, shape or data_offsets set to something wrong."""
    path, data = _read(folder, "model.safetensors")
    header, body = _st_header(bytes(data))
    name = rng.choice([k for k in header if k != "__metadata__"])
    entry = header[name]
    what = rng.choice(["dtype", "shape", "offsets", "metadata"])
    if what == "dtype":
        entry["dtype"] = rng.choice(["F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3",
                                     "XX", 7])
    elif what == "shape":
        shape = list(entry["shape"])
        op = rng.choice(["huge", "zero", "negative", "extra", "drop", "swap"])
        if op == "extra":
            shape.append(rng.choice([1, 2, 2**40]))
        elif op == "drop" and shape:
            shape.pop()
        elif op == "swap":
            shape.reverse()
        elif shape:
            shape[rng.randrange(len(shape))] = {"huge": rng.choice(HUGE), "zero": 0,
                                                "negative": -1}[op]
        entry["shape"] = shape
    elif what == "offsets":
        lo, hi = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[hi, lo], [lo, hi + 4], [lo + 4, hi + 4], [0, hi - lo],
                                            [lo, 2**63], [-1, hi], [lo, len(body) + 1]])
    else:
        header["__metadata__"] = rng.choice([{"format": "pt"}, {"x": 1}, [], "x"])
    path.write_bytes(_st_pack(header, body))


def st_append_garbage(folder: Path, rng):
    path, data = _read(folder, "model.safetensors")
    _append_garbage(data, rng)
    path.write_bytes(data)


def config_edit(folder: Path, rng):
    """Random JSON edits of config.json: wrong types or ranges, keys removed or added."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(["set", "delete", "add"])
        if op == "delete" and config:
            del config[rng.choice(sorted(config))]
        else:
            key = rng.choice(sorted(config) if op == "set" and config else _CONFIG_KEYS)
            config[key] = rng.choice(_JSON_VALUES)
    path.write_text(json.dumps(config))


def config_bytes(folder: Path, rng):
    """config.json damaged as text: bit flips, truncation, deep nesting, not an object."""
    path, data = _read(folder, "config.json")
    op = rng.choice(["flip", "truncate", "nest", "array"])
    if op == "flip":
        _bit_flips(data, rng, len(data))
    elif op == "truncate":
        _truncate(data, rng, len(data))
    elif op == "nest":
        depth = rng.choice([100, 10_000, 100_000])
        data = bytearray(b'{"a": ' + b"[" * depth + b"]" * depth + b"}")
    else:
        data = bytearray(b"[" + bytes(data) + b"]")
    path.write_bytes(data)


def tokenizer_json(folder: Path, rng):
    """tokenizer.json truncated, bit-flipped, or with its model section replaced."""
    path, data = _read(folder, "tokenizer.json")
    op = rng.choice(["flip", "truncate", "model", "side"])
    if op == "side":  # tokenizer_config.json, read for bos/eos names and the chat template
        side = rng.choice([b"[" * 100_000, b"{", b'{"bos_token": {"content": 5}}',
                           b'{"chat_template": [1], "add_bos_token": "yes"}',
                           b'{"bos_token": "<bos>", "eos_token": ["x"]}'])
        (folder / "tokenizer_config.json").write_bytes(side)
        return
    if op == "flip":
        _bit_flips(data, rng, len(data))
    elif op == "truncate":
        _truncate(data, rng, len(data))
    else:
        tok = json.loads(bytes(data))
        tok["model"] = rng.choice([None, {}, {"type": "BPE"}, {"type": "Nope"}, [], 3])
        data = bytearray(json.dumps(tok).encode())
    path.write_bytes(data)


HF_MUTATORS = {
    "st_bit_flips": st_bit_flips, "st_truncate": st_truncate,
    "st_header_length": st_header_length, "st_header_edit": st_header_edit,
    "st_append_garbage": st_append_garbage, "config_edit": config_edit,
    "config_bytes": config_bytes, "tokenizer_json": tokenizer_json,
}


def _read(folder: Path, name: str) -> tuple[Path, bytearray]:
    path = Path(folder) / name
    return path, bytearray(path.read_bytes())


# ----------------------------------------------------------------------- cases


def mutators_for(kind: str) -> list[str]:
    return sorted(GGUF_MUTATORS if kind.startswith("gguf") else HF_MUTATORS)


def case_for(index: int) -> tuple[str, str, int]:
    """The index-th case of a long run: (seed kind, mutator, seed), cycling kinds and mutators."""
    kind = SEED_KINDS[index % len(SEED_KINDS)]
    names = mutators_for(kind)
    return kind, names[(index // len(SEED_KINDS)) % len(names)], index


def mutate_case(seed_path: Path, kind: str, mutator: str, seed: int, work: Path) -> Path:
    """Copy the seed model into `work` (emptied first) and damage it; returns the model path."""
    rng = random.Random(seed)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if kind.startswith("gguf"):
        out = work / "model.gguf"
        data = bytearray(Path(seed_path).read_bytes())
        GGUF_MUTATORS[mutator](data, gguf_layout(bytes(data)), rng)
        out.write_bytes(data)
        return out
    out = work / "model"
    shutil.copytree(seed_path, out)
    HF_MUTATORS[mutator](out, rng)
    return out
