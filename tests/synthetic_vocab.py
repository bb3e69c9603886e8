"""Small byte-level BPE vocabularies (the `gpt2` GGUF tokenizer model) for tests.

No real vocabulary can be downloaded here, so one is trained with Hugging Face `tokenizers`
on local text and written into a GGUF file the way llama.cpp's converter writes Llama 3 and
Qwen vocabularies: the 256 byte symbols, merged tokens, `tokenizer.ggml.merges` in rank
order, control tokens appended after the learned ones, and `tokenizer.ggml.pre` naming the
pre-tokenizer. Training sees each line whole (no pre-tokenizer), so merges cross the
boundaries pre-tokenizers draw (" 1", "e,", runs of spaces): a pre-tokenizer that splits
in the wrong place then yields different ids, which is what parity tests need to see.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED = 1, 2, 3, 4

# Control tokens of the chat formats Ember knows (ChatML, Llama 3, Phi-3, Gemma), so one
# vocabulary serves every template test.
CONTROL_TOKENS = ("<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<|im_end|>",
                  "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<bos>", "<eos>",
                  "<start_of_turn>", "<end_of_turn>", "<s>", "</s>")
USER_DEFINED_TOKENS = ("<tool_call>",)
UNKNOWN_TOKEN = "<unk>"


@dataclass
class ByteLevelVocab:
    """A `gpt2`-model GGUF vocabulary: tokens by id, their types, merges by rank."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str = "gpt-2"
    bos: str = "<|begin_of_text|>"
    eos: str = "<|end_of_text|>"
    add_bos: bool | None = None  # None: leave it to the reader's default for `pre`
    extra: dict = field(default_factory=dict)  # more tokenizer.ggml.* ids, e.g. eot_token_id

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)

    def write(self, writer) -> None:
        """Add the tokenizer.ggml.* fields to a gguf.GGUFWriter."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        writer.add_token_merges(self.merges)
        writer.add_bos_token_id(self.id_of(self.bos))
        writer.add_eos_token_id(self.id_of(self.eos))
        if self.add_bos is not None:
            writer.add_add_bos_token(self.add_bos)
        for key, token in self.extra.items():
            writer.add_uint32(f"tokenizer.ggml.{key}", self.id_of(token))


def train_byte_level_vocab(texts: list[str], size: int = 2000) -> ByteLevelVocab:
    """Train a byte-level BPE of about `size` tokens on `texts` (one training word a line)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=size, initial_alphabet=alphabet,
                                  min_frequency=1, show_progress=False)
    specials = CONTROL_TOKENS + USER_DEFINED_TOKENS + (UNKNOWN_TOKEN,)
    # Special-token text is kept out of training: a learned token spelling one would be a
    # duplicate, which llama.cpp refuses.
    lines = [_without(line, specials) for text in texts for line in text.splitlines(keepends=True)]
    hf.train_from_iterator(lines, trainer)
    model = json.loads(hf.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens += list(specials)
    types = ([TYPE_NORMAL] * len(by_id) + [TYPE_CONTROL] * len(CONTROL_TOKENS)
             + [TYPE_USER_DEFINED] * len(USER_DEFINED_TOKENS) + [TYPE_UNKNOWN])
    return ByteLevelVocab(tokens, types, merges)


def _without(text: str, words) -> str:
    for word in words:
        text = text.replace(word, " ")
    return text


def write_vocab_gguf(path, vocab: ByteLevelVocab, architecture: str = "llama",
                     chat_template: str | None = None, name: str | None = None):
    """A GGUF file holding only hyper-parameters and `vocab` (no tensors): enough for
    llama.cpp's vocab_only loading and for Ember's tokenizer and chat template."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    if name is not None:
        writer.add_name(name)
    a = architecture + "."
    for key, value in (("context_length", 256), ("embedding_length", 64), ("block_count", 1),
                       ("feed_forward_length", 128), ("attention.head_count", 4)):
        writer.add_uint32(a + key, value)
    writer.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-5)
    vocab.write(writer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
