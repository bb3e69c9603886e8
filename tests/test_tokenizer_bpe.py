"""Byte-level BPE (`gpt2`) GGUF vocabularies: token ids identical to llama.cpp's, for each
pre-tokenizer, over digits, code, whitespace runs, non-Latin scripts and emoji.

No real vocabulary can be downloaded, so one is trained on local text (tests/synthetic_vocab.py)
and written into a tiny GGUF per pre-tokenizer; llama.cpp loads it vocab-only and tokenizes.
The parity tests skip without the llama.cpp baseline (the [baseline] extra).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from ember.models.support.errors import UnsupportedModelError
from ember.models.gguf_file import GGUFFile
from ember.models.loader import vocab_spec_from_gguf
from ember.models.pre_tokenizers import PRE_TOKENIZERS
from ember.models.tokenizer import Tokenizer

from .synthetic_vocab import train_byte_level_vocab, write_vocab_gguf

DATA = Path(__file__).parent / "data"

# One name per distinct regex list and flag set (the three Llama 3, Qwen and GPT-2 files name
# first) gets many random cases; every other name llama.cpp knows is checked on the fixed ones.
REPRESENTATIVES = ["llama-bpe", "qwen2", "gpt-2", "qwen35", "deepseek-v3", "default", "dbrx",
                   "starcoder", "falcon", "tekken", "gpt-4o", "bloom", "viking", "seed-coder",
                   "bailingmoe", "deepseek-coder"]

CASES = [
    # digits
    "0 1 12 123 1234 12345 123456 1234567", "3.14159 1,000,000 2024-06-30 0xFF 1e-9 ½ ²³ x₁",
    "In 1969, 102 hours; 42nd 7th", "٣٤٥ ١٢ (Arabic-Indic) and 一二三 ४२",
    # code
    "def area(radius: float) -> float:\n    return 3.14159 * radius ** 2  # r^2\n",
    "for i in range(10):\n\tif i % 2 == 0 and i != 4:\n\t\tprint(f\"{i:>3}\")",
    'x = {"key": [1, 2, 3]}; y = x["key"][0] << 2 | ~0xFF && a->b::c ~= d`e`',
    "if (a && b) || !c { return a->b + c::d; }   // C-ish\r\n#include <stdio.h>\r\n",
    # whitespace runs
    "a  b   c    d\n\n\n  \t\t x  ", "   leading and trailing   ", "\n", "\r\n\r\n", " \n \n",
    "tabs\tbetween\t\twords\t\t\tand", "two  \n  lines \t\n", "\u00a0nbsp\u2003em\u3000ideo",
    # contractions, case
    "I'm sure they'll say it's fine, but we'd've DON'T and I'LL and You'Re", "McDonald's iPhone HTTPServer camelCaseWord ALLCAPS",
    # non-Latin scripts
    "Русский текст: Привет, мир! Всё хорошо.", "Ελληνικά: Καλημέρα κόσμε",
    "日本語のテキスト：今日は良い天気ですね。", "中文：你好，世界！我们今天学习分词。",
    "한국어: 안녕하세요, 세계!", "العربية: مرحبا بالعالم، كيف حالك؟", "हिन्दी: नमस्ते दुनिया। आप कैसे हैं?", "اردو: سلام دنیا۔ آپ کیسے ہیں؟",
    "Türkçe: İstanbul'da güzel; Straße, naïve café, résumé, Æsir",
    # emoji and symbols
    "🙂 🚀🚀 👩‍💻 👍🏽 ❤️ 🇫🇷 — ©®™ €£¥ ∑∫√∞ ← → ★", "emoji🙂glued🚀to words",
    # special tokens, as text and parsed
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "a<tool_call>b <|endoftext|> c",
    "",
]


def random_cases(n: int, seed: int = 7) -> list[str]:
    """Fragments of the cases above glued at random: boundaries pre-tokenizers disagree on."""
    rng = random.Random(seed)
    words = [w for c in CASES for w in c.replace("\n", " \n ").split(" ") if w]
    glue = ["", " ", "  ", "\n", "\t", "'", "1", "  \n", "\r\n", "🙂", "é", ".", "'S"]
    return ["".join(rng.choice(words) + rng.choice(glue) for _ in range(rng.randint(1, 12)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def vocab():
    # Trained on the cases too: merges then span what each pre-tokenizer would keep apart.
    texts = [(DATA / "english.txt").read_text(), (DATA / "mixed_scripts.txt").read_text(), *CASES]
    return train_byte_level_vocab(texts)


@pytest.fixture(scope="module")
def gguf_for(vocab, tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")

    def make(pre: str) -> Path:
        return write_vocab_gguf(root / f"{pre}.gguf", replace(vocab, pre=pre))

    return make


def ember_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_vocab(vocab_spec_from_gguf(GGUFFile(path)), source=path)


def llama_cpp_vocab(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp baseline is not installed")
    try:
        return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    except ValueError:  # this llama.cpp build does not know the pre-tokenizer
        pytest.skip(f"the installed llama.cpp cannot load {path.stem!r}")


# A second engine loaded per pre-tokenizer (~0.3 s each): the full run's, not the quick loop's.
@pytest.mark.slow
@pytest.mark.parametrize("pre", REPRESENTATIVES + sorted(set(PRE_TOKENIZERS) - set(REPRESENTATIVES)))
def test_token_ids_match_llama_cpp(pre, gguf_for):
    path = gguf_for(pre)
    theirs = llama_cpp_vocab(path)
    ours = ember_tokenizer(path)
    mismatches = []
    for text in CASES + random_cases(150 if pre in REPRESENTATIVES else 20):
        for special in (False, True):
            want = theirs.tokenize(text.encode(), add_bos=True, special=special)
            got = ours.encode(text, add_bos=True, parse_special=special)
            if got != want:
                mismatches.append((text, special, got, want))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]}"


def test_merges_and_pre_tokenizers_matter(vocab, gguf_for):
    """The trained vocabulary merges across the cuts pre-tokenizers make, so a pre-tokenizer
    in the wrong place shows in the ids (what makes the parity test able to fail)."""
    text = "\n".join(CASES)
    ids = {pre: ember_tokenizer(gguf_for(pre)).encode(text, add_bos=False)
           for pre in ("gpt-2", "llama-bpe", "qwen2", "starcoder")}
    assert len({tuple(v) for v in ids.values()}) == len(ids)
    assert len(ids["qwen2"]) < len(text.encode()) / 1.5  # merges do happen
    assert len(vocab.merges) > 300


def test_digit_grouping_and_bos_defaults(gguf_for):
    llama3, qwen2, gpt2 = (ember_tokenizer(gguf_for(p)) for p in ("llama-bpe", "qwen2", "gpt-2"))

    def pieces(tok, text):
        return [tok.token_bytes(i) for i in tok.encode(text, add_bos=False)]

    # Llama 3 cuts digit runs in threes, Qwen 2 into single digits.
    assert b"".join(pieces(llama3, "1234567")) == b"1234567"
    assert all(len(p) <= 3 for p in pieces(llama3, "1234567"))
    assert all(len(p) == 1 for p in pieces(qwen2, "1234567"))
    # Without add_bos_token in the file, only Llama 3's pre-tokenizer adds BOS (llama.cpp's rule).
    assert llama3.encode("a")[0] == llama3.bos_id
    assert qwen2.encode("a")[0] != qwen2.bos_id and gpt2.encode("a")[0] != gpt2.bos_id


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_known_pre_tokenizer_round_trips(pre, gguf_for):
    tok = ember_tokenizer(gguf_for(pre))
    for text in CASES:
        assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_unknown_pre_tokenizer_is_one_clear_error(gguf_for):
    path = gguf_for("qwen-next-7")
    with pytest.raises(UnsupportedModelError, match="unknown pre-tokenizer 'qwen-next-7'") as err:
        ember_tokenizer(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


PHI3_PROMPTS = ["<|system|>\nBe brief.<|end|>\n<|user|>\n  Hi there\t<|end|>\n<|assistant|>\n",
                "<s> a</s>\n b<unk> c<|endoftext|> d<tool_call>  e<|end|>\r\n\tf"]


@pytest.fixture(scope="module")
def phi3_gguf(vocab, tmp_path_factory):
    """A file llama.cpp takes for Phi-3 by its name."""
    path = tmp_path_factory.mktemp("phi3") / "phi3.gguf"
    return write_vocab_gguf(path, replace(vocab, pre="gpt-2"), name="Phi3 mini instruct")


def test_phi3_special_tokens_swallow_the_whitespace_after_them(phi3_gguf, gguf_for):
    ours, plain = ember_tokenizer(phi3_gguf), ember_tokenizer(gguf_for("gpt-2"))
    text = PHI3_PROMPTS[0]
    ids = ours.encode(text, add_bos=False, parse_special=True)
    assert ours.token_text(ids[0]) == "<|system|>" and ours.token_bytes(ids[1])[:1] == b"B"
    # Control tokens decode to nothing: what is left is the text between them.
    assert ours.decode(ids) == "Be brief.Hi there\t"
    assert plain.decode(plain.encode(text, add_bos=False, parse_special=True)) == \
        "\nBe brief.\n\n  Hi there\t\n\n"


def test_phi3_rule_matches_llama_cpp(phi3_gguf):
    theirs = llama_cpp_vocab(phi3_gguf)
    ours = ember_tokenizer(phi3_gguf)
    for text in PHI3_PROMPTS + CASES:
        for special in (False, True):
            assert ours.encode(text, parse_special=special) == \
                theirs.tokenize(text.encode(), add_bos=True, special=special), (text, special)
