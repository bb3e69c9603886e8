"""`ember models` and `--model NAME`: the stores of Hugging Face, Ollama and LM Studio, laid
out as each tool lays them out, holding tiny models; read in place, never copied."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ember.app.cli import main
from ember.models.testing import synthetic
from ember.models.support.errors import EmberError
from ember.models.loader import open_model
from ember.models.model_list import list_models
from ember.models.resolve import resolve_model
from ember.models.stores import store_roots

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}<|im_start|>assistant\n")


def _other_arch(path: Path, arch: str) -> Path:
    """A small GGUF of architecture `arch` (a vision projector, an unknown family)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("v.blk.0.attn_q.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hf_repo(hub: Path, repo: str, files: dict[str, Path]) -> Path:
    """`hub/models--ORG--REPO` as huggingface_hub leaves it: blobs named by hash, a
    snapshot of links to them, refs/main naming the snapshot."""
    root = hub / ("models--" + repo.replace("/", "--"))
    revision = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    for name, source in files.items():
        data = source.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def _ollama_model(root: Path, host_ns_model: str, tag: str, gguf: Path | None,
                  projector: bool = False) -> None:
    """A manifest at manifests/HOST/NS/MODEL/TAG and its model blob, as `ollama pull` writes."""
    data = gguf.read_bytes() if gguf is not None else b"missing"
    digest = hashlib.sha256(data).hexdigest()
    if gguf is not None:
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    layers = [{"mediaType": "application/vnd.ollama.image.model",
               "digest": f"sha256:{digest}", "size": len(data)},
              {"mediaType": "application/vnd.ollama.image.template",
               "digest": "sha256:" + "0" * 64, "size": 10}]
    if projector:
        layers.append({"mediaType": "application/vnd.ollama.image.projector",
                       "digest": "sha256:" + "1" * 64, "size": 10})
    manifest = root / "manifests" / host_ns_model / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers,
                                    "mediaType": "application/vnd.docker.distribution."
                                                 "manifest.v2+json"}))


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """A home folder with models in every store; (env, home, {what: source file})."""
    src = tmp_path_factory.mktemp("sources")
    home = tmp_path_factory.mktemp("home")
    cfg = synthetic.tiny_config(arch="llama", activation="silu_glu", name="tiny-chat")
    weights = synthetic.tiny_weights(cfg, seed=11)
    chat = synthetic.write_gguf(src / "tiny-chat-q8_0.gguf", cfg, weights, qtype=8,
                                chat_template=CHATML)
    base = synthetic.write_gguf(src / "tiny-base-f32.gguf", cfg, weights)
    first = synthetic.write_gguf(src / "tiny-split.gguf", cfg, weights, split_tensors=9)
    parts = {p.name: p for p in src.glob("tiny-split-*.gguf")}
    mmproj = _other_arch(src / "mmproj-tiny-f16.gguf", "clip")
    mamba = _other_arch(src / "tiny-mamba.gguf", "mamba")

    hub = home / ".cache" / "huggingface" / "hub"
    _hf_repo(hub, "Org/Tiny-Chat-GGUF", {"tiny-chat-q8_0.gguf": chat})
    _hf_repo(hub, "Org/Tiny-Split-GGUF", {f"Q8_0/{n}": p for n, p in parts.items()})
    _hf_repo(hub, "Org/Tiny-Multi-GGUF", {"tiny-base-f32.gguf": base, "tiny-chat-q8_0.gguf": chat,
                                         "mmproj-tiny-f16.gguf": mmproj})
    ollama = home / ".ollama" / "models"
    _ollama_model(ollama, "registry.ollama.ai/library/tinychat", "latest", chat)
    _ollama_model(ollama, "registry.ollama.ai/library/tinychat", "base", base, projector=True)
    _ollama_model(ollama, "hf.co/Org/Tiny-Chat-GGUF", "Q8_0", chat)
    _ollama_model(ollama, "registry.ollama.ai/someone/gone", "latest", None)
    for root in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        root.mkdir(parents=True)
    studio = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-Chat-GGUF"
    studio.mkdir(parents=True)
    (studio / "tiny-chat-q8_0.gguf").write_bytes(chat.read_bytes())
    (studio / "mmproj-tiny-f16.gguf").write_bytes(mmproj.read_bytes())
    old = home / ".cache" / "lm-studio" / "models" / "Org" / "Tiny-Chat-GGUF"
    old.mkdir(parents=True)
    (old / "tiny-mamba.gguf").write_bytes(mamba.read_bytes())
    return {}, home, {"chat": chat, "base": base, "split": first}


def _by_name(machine):
    env, home, _ = machine
    return {m.name: m for m in list_models(env, home)}


def test_every_store_is_found_with_the_names_its_tool_uses(machine):
    found = _by_name(machine)
    assert {n: m.store for n, m in found.items()} == {
        "Org/Tiny-Chat-GGUF": "huggingface",
        "Org/Tiny-Multi-GGUF/mmproj-tiny-f16": "huggingface",
        "Org/Tiny-Multi-GGUF/tiny-base-f32": "huggingface",
        "Org/Tiny-Multi-GGUF/tiny-chat-q8_0": "huggingface",
        "Org/Tiny-Split-GGUF": "huggingface",
        "tinychat:base": "ollama",
        "tinychat:latest": "ollama",
        "hf.co/Org/Tiny-Chat-GGUF:Q8_0": "ollama",
        "someone/gone:latest": "ollama",
        "lmstudio-community/Tiny-Chat-GGUF/mmproj-tiny-f16": "lm-studio",
        "lmstudio-community/Tiny-Chat-GGUF/tiny-chat-q8_0": "lm-studio",
        # the same name as the Hugging Face repository: the store says which
        "lm-studio:Org/Tiny-Chat-GGUF": "lm-studio",
    }


def test_listing_reads_each_header(machine):
    found = _by_name(machine)
    chat, base = found["tinychat:latest"], found["Org/Tiny-Multi-GGUF/tiny-base-f32"]
    assert (chat.architecture, chat.quant, chat.chat_format) == ("llama", "Q8_0",
                                                                 "template (chatml)")
    assert (base.quant, base.chat_format) == ("F32", "transcript (base model)")
    assert chat.parameters == base.parameters > 0
    assert chat.size_bytes == machine[2]["chat"].stat().st_size
    split = found["Org/Tiny-Split-GGUF"]
    assert split.runnable and split.path.endswith(f"Q8_0/{machine[2]['split'].name}")
    assert split.size_bytes == sum(p.stat().st_size
                                   for p in machine[2]["split"].parent.glob("tiny-split-*"))
    assert found["tinychat:base"].note.startswith("a vision projector layer")


def test_what_cannot_run_is_listed_with_the_reason(machine):
    found = _by_name(machine)
    assert "vision projector (mmproj)" in found["Org/Tiny-Multi-GGUF/mmproj-tiny-f16"].problem
    assert "architecture 'mamba' is not supported" in found["lm-studio:Org/Tiny-Chat-GGUF"].problem
    assert "blob is missing" in found["someone/gone:latest"].problem
    runnable = {n for n, m in found.items() if m.runnable}
    assert len(runnable) == 8


def test_models_are_read_in_place(machine):
    env, home, _ = machine
    before = sorted(p for p in home.rglob("*"))
    list_models(env, home)
    resolve_model("tinychat", env, home)
    assert sorted(p for p in home.rglob("*")) == before


@pytest.mark.parametrize("name, expect", [
    ("tinychat", "blobs/sha256-"),  # an Ollama name without its tag is :latest
    ("tinychat:latest", "blobs/sha256-"),
    ("TINYCHAT:base", "blobs/sha256-"),
    ("hf.co/Org/Tiny-Chat-GGUF:Q8_0", "blobs/sha256-"),
    ("Org/Tiny-Chat-GGUF", "snapshots/"),
    ("org/tiny-chat-gguf", "snapshots/"),
    ("huggingface:Org/Tiny-Chat-GGUF", "snapshots/"),
    ("Org/Tiny-Multi-GGUF:q8_0", "tiny-chat-q8_0.gguf"),  # a repository and a tag its file has
    ("Org/Tiny-Multi-GGUF/tiny-base-f32", "tiny-base-f32.gguf"),
    ("Org/Tiny-Split-GGUF", "Q8_0/tiny-split-00001-of-0000"),
    ("lm-studio:Org/Tiny-Chat-GGUF", None),  # listed, not runnable: loading says why
    ("lmstudio-community/Tiny-Chat-GGUF/tiny-chat-q8_0", ".lmstudio/models/"),
])
def test_names_resolve_to_the_files_in_place(machine, name, expect):
    env, home, _ = machine
    if expect is None:
        with pytest.raises(EmberError, match="architecture 'mamba' is not supported"):
            open_model(resolve_model(name, env, home))
        return
    path = resolve_model(name, env, home)
    assert expect in str(path) and str(path).startswith(str(home))


def test_resolved_models_open_as_their_source(machine):
    env, home, sources = machine
    want = open_model(sources["chat"]).fingerprint
    for name in ("tinychat", "Org/Tiny-Chat-GGUF", "lmstudio-community/Tiny-Chat-GGUF/tiny-chat-q8_0"):
        assert open_model(resolve_model(name, env, home)).fingerprint == want
    split = open_model(resolve_model("Org/Tiny-Split-GGUF", env, home))
    assert split.config.n_layers == open_model(sources["base"]).config.n_layers


def test_an_unknown_name_says_what_exists(machine):
    env, home, _ = machine
    with pytest.raises(EmberError, match="did you mean tinychat:latest"):
        resolve_model("tinychat:lates", env, home)
    with pytest.raises(EmberError, match="no such file, and no model of that name"):
        resolve_model("nothing-like-it", env, home)


def test_catalog_model_not_pulled_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(EmberError, match="run `ember pull qwen2.5-coder-1.5b-instruct`"):
        resolve_model("Qwen2.5-Coder-1.5B-Instruct", {}, tmp_path)


def test_store_roots_follow_each_tools_variables(tmp_path):
    env = {"HF_HOME": "/hf", "OLLAMA_MODELS": "/ol", "XDG_CACHE_HOME": "/xdg"}
    roots = store_roots(env, tmp_path)
    assert roots["huggingface"] == [Path("/hf/hub")]
    assert roots["ollama"] == [Path("/ol")]
    assert roots["ember"] == [Path("/xdg/ember/models")]
    assert roots["lm-studio"] == [tmp_path / ".lmstudio" / "models", Path("/xdg/lm-studio/models")]
    assert store_roots({"HF_HUB_CACHE": "/cache"}, tmp_path)["huggingface"] == [Path("/cache")]
    assert store_roots({}, tmp_path)["huggingface"] == [tmp_path / ".cache/huggingface/hub"]


def test_ember_models_command_lists_and_explains(machine, monkeypatch, capsys):
    _, home, _ = machine
    for var in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.split("\n\n")[0].splitlines()
    assert header.split() == ["NAME", "ARCH", "PARAMS", "SIZE", "QUANT", "CHAT", "FROM"]
    assert any(r.split()[0] == "tinychat:latest" and "template (chatml)" in r for r in rows)
    assert "Found, but Ember cannot run them:" in out and "architecture 'mamba'" in out
    assert "ember pull qwen2.5-coder-0.5b-instruct" in out
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {m["name"] for m in listed["models"] if m["runnable"]} >= {"tinychat:latest",
                                                                      "Org/Tiny-Split-GGUF"}


def test_commands_take_a_store_name_for_model(machine, monkeypatch, capsys):
    """--model NAME through the one resolver: `ember tokenize` on an Ollama model."""
    _, home, sources = machine
    monkeypatch.setenv("HOME", str(home))
    for var in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    assert main(["tokenize", "hello", "--model", "tinychat:latest"]) == 0
    by_name = capsys.readouterr().out
    assert main(["tokenize", "hello", "--model", str(sources["chat"])]) == 0
    assert capsys.readouterr().out == by_name
    assert main(["tokenize", "hello", "--model", "no-such-model"]) == 2
    assert "no model of that name" in capsys.readouterr().err
