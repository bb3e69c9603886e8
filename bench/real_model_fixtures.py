"""Make the llama.cpp reference fixtures of the catalog's real instruct models, once, with the
`[baseline]` extra installed: tests/data/<name>_llamacpp.json, which tests/test_real_models.py
holds Ember to. Not run by CI (the fixtures are committed); rerun when a prompt changes.

    .venv/bin/python -m bench.real_model_fixtures [NAME ...]   (default: every pulled one)

Everything here comes from llama.cpp alone (its tokenizer, its chat-template rendering, its
logits), so the fixture is an independent reference: token ids of texts, with and without
special tokens; greedy steps (the top two ids and logits) after plain and coding prompts and
after a conversation written by the file's chat template; perplexity over tests/data/english.txt
with flash attention off and on (llama.cpp's two attention paths round differently: on these
492 tokens of the 0.5B their figures are 0.54% apart, so both are the reference).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ember.app.baseline import LlamaCpp
from ember.models.catalog import CATALOG, catalog_model, installed_path

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
THREADS, N_CTX, STEPS, WINDOW = 2, 1024, 24, 512

TEXTS = ["Hello, world!", "", " ", "  leading and trailing spaces  ",
         "tabs\tand\nnewlines\n\n\nthree", "def add(a, b):\n    return a + b\n",
         "Ünïcödé, 日本語, emoji 🙂 and numbers 1234567", "<|im_start|>user\nhi<|im_end|>",
         "x = [i**2 for i in range(10)]  # squares"]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "# Python: read a CSV file and print the sum of the second column\nimport csv\n",
           "Once upon a time, in a small village by the sea,",
           "SELECT name, COUNT(*) FROM orders",
           "The three primary colours are"]
# Contents without special-token text: the template alone writes the markers.
CHATS = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
         [{"role": "system", "content": "You are a terse assistant."},
          {"role": "user", "content": "What does HTTP status 404 mean?"}],
         [{"role": "user", "content": "Name a sorting algorithm."},
          {"role": "assistant", "content": "Merge sort."},
          {"role": "user", "content": "What is its time complexity?"}]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="catalog names (default: every pulled instruct one)")
    args = p.parse_args(argv)
    models = ([catalog_model(n) for n in args.names] if args.names
              else [m for m in CATALOG if m.instruct and installed_path(m) is not None])
    for model in models:
        path = installed_path(model)
        if path is None:
            print(f"{model.name}: not pulled; run `ember pull {model.name}`", file=sys.stderr)
            return 1
        out = DATA / f"{model.name}_llamacpp.json"
        out.write_text(json.dumps(fixture(model.name, path), indent=1, ensure_ascii=False) + "\n")
        print(out)
    return 0


def fixture(name: str, path: Path) -> dict:
    import llama_cpp

    base = LlamaCpp(path, THREADS, N_CTX)
    llm = base.llm
    english = (DATA / "english.txt").read_text()
    text_ids = llm.tokenize(english.encode(), add_bos=False)
    ppl = {flash: LlamaCpp(path, THREADS, WINDOW, logits_all=True, flash_attn=flash).perplexity(
        text_ids, llm.token_bos(), WINDOW) for flash in (False, True)}
    return {
        "model": name, "file": path.name,
        "source": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp, CPU, no AMX)",
        "tokenize": [{"text": t, "ids": llm.tokenize(t.encode(), special=False),
                      "ids_special": llm.tokenize(t.encode(), special=True)} for t in TEXTS],
        "greedy": [_greedy(llm, p, llm.tokenize(p.encode(), special=False)) for p in PROMPTS],
        "chat": [_chat(llm, messages) for messages in CHATS],
        "perplexity": {"text": "english.txt", "window": WINDOW, "bos_id": llm.token_bos(),
                       "tokens": ppl[False].tokens, "ppl": ppl[False].ppl,
                       "ppl_flash_attn": ppl[True].ppl},
    }


def _chat(llm, messages: list[dict]) -> dict:
    """The conversation as llama.cpp renders the file's template, and greedy steps after it."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    vocab = lambda i: llm.detokenize([i], special=True).decode("utf-8", "replace")  # noqa: E731
    formatter = Jinja2ChatFormatter(template, eos_token=vocab(llm.token_eos()),
                                    bos_token=vocab(llm.token_bos()), add_generation_prompt=True)
    prompt = formatter(messages=messages).prompt
    case = _greedy(llm, prompt, llm.tokenize(prompt.encode(), special=True))
    return {"messages": messages, **case}


def _greedy(llm, prompt: str, ids: list[int]) -> dict:
    """STEPS greedy steps after `ids`: each step's id and top-two logits."""
    import llama_cpp

    llm.reset()
    llm.eval(ids)
    steps = []
    for _ in range(STEPS):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                       shape=(llm.n_vocab(),))
        top2 = np.argsort(logits)[-2:][::-1]
        steps.append({"id": int(top2[0]), "top1_logit": float(logits[top2[0]]),
                      "top2_id": int(top2[1]), "top2_logit": float(logits[top2[1]])})
        llm.eval([int(top2[0])])
    return {"prompt": prompt, "prompt_ids": ids, "steps": steps}


if __name__ == "__main__":
    sys.exit(main())
