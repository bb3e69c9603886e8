"""Open a model file or folder: config, weights, tokenizer, chat template, fingerprint.

`open_model` is cheap (metadata, tensor directory, tokenizer; no dequantization) and is what
`ember info` uses; `load_model` also builds the float32 `Transformer`.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .config import ModelConfig
from .support.errors import ModelFormatError
from .fields import typed
from .gguf_file import GGUF_MAGIC, GGUFFile
from .gguf_vocab import VocabSpec, tokenizer_cache_path
from .hf_chat import hf_chat_template, hf_stop_ids
from .hf_config import HFConfig
from .pre_tokenizers import pre_tokenizer
from .registry import family_for_gguf, family_for_hf, unfused
from .tokenizer import Tokenizer
from .transformer import Transformer
from .weights import WeightStore

# Tokens that end an assistant turn: those llama.cpp ends generation at (found by their text,
# as it does: files rarely say), for Gemma, Llama 3 (<|eom_id|> after a tool call), ChatML
# (Qwen), Phi-3, end-of-text markers, and EOS spellings llama.cpp stops at even where the
# file's EOS is another token. A model that starts a new turn has finished its own,
# so turn openers stop generation too (base models, like the default Gemma 3 270M, readily
# write "<start_of_turn>user" in chat mode).
END_OF_TURN_TOKENS = ("<end_of_turn>", "<start_of_turn>", "<|eot_id|>", "<|eom_id|>",
                      "<|start_header_id|>", "<|im_end|>", "<|im_start|>", "<|end|>",
                      "<|endoftext|>", "<|end_of_text|>", "<EOT>", "<eos>", "</s>")
# Ids a GGUF file names besides EOS: end of turn, end of message (a tool call pending).
_FILE_STOP_KEYS = ("eot_token_id", "eom_token_id")


@dataclass
class ModelSource:
    """Everything about a model except its float32 compute modules."""

    path: Path
    format: str  # "gguf" or "safetensors"
    config: ModelConfig
    weights: WeightStore
    tokenizer: Tokenizer
    chat_template: str | None
    fingerprint: str  # identifies the file's content (profile artifacts record it)
    file_stop_ids: tuple[int, ...] = ()  # the file's own end-of-turn/message ids

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end generation: EOS, the ids the file names, and any end-of-turn
        token of the vocabulary."""
        ids = [self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else []
        ids += self.file_stop_ids
        ids += [i for t in END_OF_TURN_TOKENS if (i := self.tokenizer.id_of(t)) is not None]
        return tuple(dict.fromkeys(ids))


class LoadedModel:
    """An opened model: its source (config, the file's weights, tokenizer) and the float32
    reference `Transformer`, built only when something asks for `model`.

    The runtime reads the file's own blocks (offload/body/file_blocks_model.py), so running a model never
    needs the float copy (four times a 4-bit file's bytes); the reference serves tests,
    `--weights fp32`, and the paths that still compute on float weights.
    """

    def __init__(self, source: ModelSource, model: Transformer | None = None,
                 on_layer: Callable[[int], None] | None = None):
        self.source = source
        self._model = model
        self._on_layer = on_layer
        self._lock = threading.Lock()

    @property
    def model(self) -> Transformer:
        """The float32 reference model (built on first use: seconds, 4 bytes a parameter)."""
        with self._lock:
            if self._model is None:
                self._model = Transformer(self.source.config, self.source.weights,
                                          on_layer=self._on_layer)
            return self._model

    @property
    def config(self) -> ModelConfig:
        return self.source.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.source.tokenizer


def open_model(path: str | Path) -> ModelSource:
    return _open(path)[0]


def _open(path: str | Path) -> tuple[ModelSource, GGUFFile | None]:
    """The model's source, and for a GGUF file the parsed file itself (its metadata holds
    the whole vocabulary, so callers keep it only as long as they need it)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _open_hf_folder(path), None
    if not path.exists():
        raise ModelFormatError(path, "no such file or folder")
    if path.suffix == ".safetensors" or path.name == "config.json":
        return _open_hf_folder(path.parent), None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(
            path, "not a GGUF file or a Hugging Face folder (config.json + *.safetensors)"
        )
    gguf = GGUFFile(path)
    return _open_gguf(gguf), gguf


# Share of loading spent opening the file (metadata, tokenizer) before layers are built:
# roughly what the default model takes; the rest is spread evenly over its layers.
OPEN_SHARE = 0.35


def load_model(path: str | Path, check: Callable[[ModelSource], None] | None = None,
               progress: Callable[[float, str], None] | None = None,
               in_ram: Callable[[ModelSource], bool] | None = None,
               row_groups: bool = False) -> LoadedModel:
    """open_model, then `check(source)`: the last moment to refuse (e.g. not enough memory)
    before anything large is built. The float32 reference is built later, if asked for.

    `progress(fraction, stage)`, if given, is called as loading goes on: fraction in [0, 1],
    stage a short phrase such as "layer 3 of 18" (the layers, when the float model is built).
    `in_ram(source)` True reads a GGUF file's bytes into RAM on huge pages instead of using
    the memory map (see ram_copy.py); asked after `check`, so a refusal copies nothing.
    `row_groups` puts that copy's K-quant matrices in row groups (`WeightStore.in_row_groups`:
    the one-token AVX-512 kernel's layout; the caller knows whether its path reads them).
    """
    report = progress or (lambda fraction, stage: None)
    report(0.0, "reading the model file")
    source, gguf = _open(path)
    if check is not None:
        check(source)
    if in_ram is not None and gguf is not None and in_ram(source):
        source = _with_weights_in_ram(source, gguf, report)
        if row_groups:
            source = replace(source, weights=source.weights.in_row_groups())
    del gguf  # its metadata (the vocabulary) is no longer needed
    n = source.config.n_layers
    report(OPEN_SHARE, "model file opened")

    def layer_built(i: int) -> None:
        report(OPEN_SHARE + (1 - OPEN_SHARE) * (i + 1) / n, f"layer {i + 1} of {n}")

    return LoadedModel(source, on_layer=layer_built)


def _with_weights_in_ram(source: ModelSource, f: GGUFFile, report) -> ModelSource:
    """`source` with its weights read from a RAM copy of `f`, the file it was opened from
    (the views onto the map are dropped with the old store)."""
    mib = f.nbytes >> 20
    f.read_into_ram(lambda done, size: report(
        OPEN_SHARE * done / max(size, 1), f"reading weights into RAM ({done >> 20} of {mib} MiB)"))
    weights = unfused(family_for_gguf(f.architecture, f.path), WeightStore.from_gguf(f),
                      source.config)
    return replace(source, weights=weights)


def _open_gguf(f: GGUFFile) -> ModelSource:
    path = f.path
    family = family_for_gguf(f.architecture, path)
    spec = vocab_spec_from_gguf(f)
    config = _checked_config(path, lambda: family.config_from_gguf(f, vocab_size=len(spec.tokens)))
    fingerprint = _gguf_fingerprint(f)
    tokenizer = Tokenizer.from_vocab(spec, cache_path=tokenizer_cache_path(fingerprint), source=path)
    template = f.field("tokenizer.chat_template", str, None)
    weights = unfused(family, WeightStore.from_gguf(f), config)
    return ModelSource(path, "gguf", config, weights, tokenizer, template, fingerprint,
                       _file_stop_ids(f, len(spec.tokens)))


def _gguf_fingerprint(f: GGUFFile) -> str:
    """`file_fingerprint` of the file; of a split model, a hash over its parts' own."""
    if len(f.parts) == 1:
        return file_fingerprint(f.path)
    return hashlib.sha256("".join(file_fingerprint(p.path) for p in f.parts).encode()).hexdigest()


def _file_stop_ids(f: GGUFFile, n_tokens: int) -> tuple[int, ...]:
    """tokenizer.ggml.eot_token_id / eom_token_id; one outside the vocabulary is ignored, as
    llama.cpp ignores it (with a warning), rather than refusing a file that otherwise works."""
    ids = (f.field(f"tokenizer.ggml.{key}", int, None) for key in _FILE_STOP_KEYS)
    return tuple(i for i in ids if i is not None and 0 <= i < n_tokens)


def _checked_config(path: Path, build) -> ModelConfig:
    """ModelConfig validates itself with ValueError; from a file that is a format error."""
    try:
        return build()
    except ModelFormatError:
        raise
    except ValueError as exc:
        raise ModelFormatError(path, f"invalid model hyper-parameters: {exc}") from None


def vocab_spec_from_gguf(f: GGUFFile) -> VocabSpec:
    t = "tokenizer.ggml."
    tokens = f.field(t + "tokens", list)
    if not tokens or not all(isinstance(s, str) for s in tokens[:1]):
        raise ModelFormatError(f.path, f"metadata '{t}tokens' must be a non-empty string list")
    n = len(tokens)
    scores = f.field(t + "scores", list, None)
    types = f.field(t + "token_type", list, None)
    merges = f.field(t + "merges", list, None)
    for key, values, kind in (("scores", scores, float), ("token_type", types, int),
                              ("merges", merges, str)):
        if key != "merges" and values is not None and len(values) != n:
            raise ModelFormatError(f.path, f"metadata '{t}{key}' has {len(values)} entries, "
                                           f"the vocabulary {n}")
        if values:  # a GGUF array has one item type, so its first item stands for all
            typed(f.path, f"items of metadata '{t}{key}'", values[0], kind)
    ids = {}
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        value = f.field(t + key, int, None)
        if value is not None and not 0 <= value < n:
            raise ModelFormatError(f.path, f"metadata '{t}{key}' = {value} is outside the vocabulary")
        ids[key] = value
    model = f.field(t + "model", str, "llama")
    pre = f.field(t + "pre", str, None)
    return VocabSpec(
        tokens=tokens,
        scores=scores,
        token_types=types,
        model=model,
        merges=merges,
        pre=pre,
        bos_id=ids["bos_token_id"],
        eos_id=ids["eos_token_id"],
        unk_id=ids["unknown_token_id"],
        pad_id=ids["padding_token_id"],
        add_bos=f.field(t + "add_bos_token", bool, _default_add_bos(model, pre)),
        # llama.cpp's default: SentencePiece vocabularies prefix a space unless told otherwise.
        add_space_prefix=f.field(t + "add_space_prefix", bool, model == "llama"),
        rstrip_specials=_strips_after_specials(f.field("general.name", str, "")),
    )


def _strips_after_specials(name: str) -> bool:
    """llama.cpp makes special tokens swallow the whitespace after them ("<|user|>\\n" reads
    as "<|user|>") for files whose general.name says Phi-3, as Phi-3's own tokenizer does;
    GGUF has no per-token flag for it, so the name is all there is to go by."""
    name = name.lower()
    return "phi-3" in name or "phi3" in name


def _default_add_bos(model: str, pre: str | None) -> bool:
    """llama.cpp's default when the file has no add_bos_token: SentencePiece vocabularies add
    BOS, byte-level ones only for the pre-tokenizers that say so (Llama 3's, Tekken)."""
    if model != "gpt2":
        return True
    known = pre_tokenizer(pre)
    return known is not None and known.add_bos


def _open_hf_folder(folder: Path) -> ModelSource:
    from .safetensors_file import load_weights, shard_paths

    hf = HFConfig(folder)
    family = family_for_hf(hf.model_type, hf.path)
    config = _checked_config(hf.path, lambda: family.config_from_hf(hf))
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ModelFormatError(folder, "no tokenizer.json in this model folder")
    tokenizer = Tokenizer.from_tokenizer_json(tokenizer_json)
    weights = unfused(family, load_weights(folder, family), config)
    fingerprint = hashlib.sha256(
        "".join(file_fingerprint(p) for p in [hf.path, *shard_paths(folder)]).encode()
    ).hexdigest()
    return ModelSource(folder, "safetensors", config, weights, tokenizer,
                       hf_chat_template(folder), fingerprint,
                       hf_stop_ids(folder, tokenizer.vocab_size))


def file_fingerprint(path: Path, sample: int = 1 << 22) -> str:
    """sha256 over the file size, its first 4 MiB and its last 4 MiB.

    Headers (metadata, tensor directory) sit at the start and most weights at the end, so this
    distinguishes real model files in milliseconds, where hashing 250 MB+ would take seconds.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(sample))
        if size > sample:
            f.seek(max(sample, size - sample))
            h.update(f.read(sample))
    return h.hexdigest()
