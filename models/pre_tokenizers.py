"""The pre-tokenizers of byte-level BPE (`gpt2`) GGUF vocabularies, by `tokenizer.ggml.pre`.

Before BPE merges anything, the text is cut into words by a list of regexes applied one after
another (each splits the pieces the previous one left; matches and the text between them both
stay). The names, the regexes and the per-name flags are llama.cpp's (llama-vocab.cpp), since
token ids must be identical to its: a pre-tokenizer cutting in another place gives other ids.
Where llama.cpp rewrote a Hugging Face regex for its engine (case-insensitive groups spelled
out, `\\p{Lu}` approximated by "a letter not in a-z"), the rewrite is what is used here.

A name llama.cpp does not know is refused by it, and by Ember with the name in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 2: Llama 3's regex with single digits.
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
# "An upper-case run then lower-case letters" with \p{Lu}/\p{Ll} approximated as llama.cpp does.
_UPPER = r"((?=[\p{L}])([^a-z]))"
_LOWER = r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# Qwen 3.5: letters take their combining marks along.
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_MINICPM5 = _QWEN2.replace(r"\p{N}|", r"\p{N}+|", 1)
# Jais 2: Llama 3's, with whitespace runs cut in power-of-two lengths.
_JAIS2 = _LLAMA3.replace(r"|\s+(?!\S)|\s+", "".join(
    rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}")
_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
_UFAKZEKA = _QWEN2[len(_CONTRACTIONS) + 1:]  # Qwen 2's without the English contractions
# Its middle range (U+0800 to U+4E00) spans spaces such as U+3000; llama.cpp's engine turns
# non-ASCII whitespace into a vertical tab before this regex runs, so spaces never match it.
_CJK = r"[一-龥ࠀ-一가-퟿&&[^\s]]+"
_KANA_HAN = r"[一-龥぀-ゟ゠-ヿ]+"
# DeepSeek V3 and kin. llama.cpp's engine files ASCII "~" under neither punctuation nor
# symbol (its table of ASCII symbols stops at "|"), so here too.
_NOT_LPS = r"(?:[^\r\n\p{L}\p{P}\p{S}]|~)"
_PS = r"[\p{P}\p{S}&&[^~]]"
_DEEPSEEK3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
              rf"|{_NOT_LPS}?[\p{{L}}\p{{M}}]+| ?{_PS}+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPARK = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
          rf"|{_NOT_LPS}?[\p{{L}}\p{{M}}]+| ?{_PS}+|[\r\n]|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """regexes: applied in order. ignore_merges: a word that is itself a vocabulary token is
    taken whole, unmerged. add_bos: the default when the file has no add_bos_token."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2_PRE = PreTokenizer((_GPT2,))
_QWEN2_PRE = PreTokenizer((_QWEN2,))
_STARCODER_PRE = PreTokenizer((r"\p{N}", _GPT2))
_BLOOM_PRE = PreTokenizer((_BLOOM,))


def _names(pre: PreTokenizer, *names: str) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names, pre)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # The file names no pre-tokenizer (an old conversion): llama.cpp's fallback.
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **_names(_LLAMA3_PRE, "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
             "midm-2.0", "lfm2", "jina-v5-nano"),
    **_names(PreTokenizer((_LLAMA3,)), "dbrx", "smaug-bpe", "chatglm-bpe", "glm4"),
    **_names(_GPT2_PRE, "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
             "jina-v2-de", "a.x-4.0", "mellum", "mpt", "olmo", "jais", "trillion",
             "granite-docling", "exaone4"),
    **_names(_QWEN2_PRE, "qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "hunyuan", "megrez",
             "solar-open", "grok-2", "f2llmv2"),
    **_names(_STARCODER_PRE, "starcoder", "refact", "command-r", "smollm", "codeshell",
             "exaone", "minerva-7b", "mellum2"),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **_names(PreTokenizer((_GPT4O,)), "gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"),
    **_names(_BLOOM_PRE, "bloom", "poro-chat", "gpt3-finnish"),
    "viking": PreTokenizer((_BLOOM, r"\p{N}")),
    "seed-coder": PreTokenizer((_SEED_CODER,)),
    **_names(PreTokenizer((_BAILINGMOE,)), "bailingmoe", "bailingmoe2", "llada-moe"),
    "qwen35": PreTokenizer((_QWEN35,)),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _MINICPM5), ignore_merges=True),
    "jais-2": PreTokenizer((_JAIS2,)),
    "exaone-moe": PreTokenizer((_EXAONE_MOE,)),
    "ufakzeka": PreTokenizer((_UFAKZEKA,)),
    "laguna": PreTokenizer((r"[^\n]+|[\n]+", _QWEN2)),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    **_names(PreTokenizer((r"\p{N}{1,3}", _KANA_HAN, _DEEPSEEK3)), "deepseek-v3",
             "hunyuan-dense", "joyai-llm", "hy_v4"),
    "spark2_5": PreTokenizer((r"\p{N}{1,3}", _KANA_HAN, _SPARK, r"\p{N}")),
}


def pre_tokenizer(name: str | None) -> PreTokenizer | None:
    """The pre-tokenizer `tokenizer.ggml.pre` names (None: the file names none), or None if
    Ember does not know the name."""
    return PRE_TOKENIZERS.get(name or "default")
