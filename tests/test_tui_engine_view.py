"""The live engine view of `ember chat`: loading progress, the status bar's engine figures
(speculation, FFN sparsity, hot fraction) and the placement screen, on the fake engine and
on a tiny real model split by a GPU-tier budget."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("textual")
pytest.importorskip("pytest_asyncio")

from rich.console import Console

from ember.app.tui.app import ChatApp
from ember.app.tui.engine_port import EngineBackend
from ember.app.tui.screens.help import HelpScreen
from ember.app.tui.screens.placement import PlacementScreen
from ember.app.tui.store import ChatStore
from ember.app.tui.widgets.placement_chart import LayerBars, PlanHeader, layer_runs
from ember.app.tui.widgets.status_bar import hybrid_parts, speculation_parts
from tests.test_tui_chat import SIZE, make_app, ready, send, status_text, wait_for
from .tui_fakes import FakeEngine, PreloadedBackend, sample_hybrid_report

SPECULATION = {"drafter": "self", "verifications": 12, "mean_accepted_length": 2.44}


def text_of(widget, width: int = 76) -> str:
    """What a placement widget draws, as plain text `width` columns wide."""
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(widget.render())
    return console.export_text()


# -- status bar ---------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_status_shows_speculation_sparsity_and_hot_fraction(tmp_path):
    engine = FakeEngine(["ok"], hybrid=sample_hybrid_report(), speculate="self",
                        speculation=SPECULATION)
    app = make_app(tmp_path / "chat.db", engine)
    async with app.run_test(size=(160, 24)) as pilot:
        await ready(pilot)
        # Before any reply: how the engine runs.
        assert status_text(app) == ("fake model · ready · ctx 4096 · FFN 45% sparse · "
                                    "GPU 40% hot · speculate self")
        await send(pilot, "hello")
        wide = status_text(app)
        assert "spec 2.4 tok/step · FFN 45% sparse · GPU 40% hot · KV 18/1803 dev" in wide
        await pilot.resize_terminal(*SIZE)
        await wait_for(pilot, lambda: status_text(app) != wide)
        # At 80 columns the engine figures outrank the KV cache, TTFT and the model name.
        at_80 = status_text(app)
        assert at_80.endswith(" tok/s · ctx 6/4096 · spec 2.4 tok/step · FFN 45% sparse · "
                              "GPU 40% hot")
        assert len(at_80) <= SIZE[0] - 2


@pytest.mark.asyncio
async def test_status_without_engine_figures_is_as_before(tmp_path):
    # A dense engine, speculation off: nothing to show, and nothing shown.
    app = make_app(tmp_path / "chat.db", FakeEngine(["ok"]))
    async with app.run_test(size=(160, 24)) as pilot:
        await ready(pilot)
        assert status_text(app) == "fake model · ready · ctx 4096"
        await send(pilot, "hello")
        status = status_text(app)
        assert "spec" not in status and "sparse" not in status and "hot" not in status
        assert status.endswith(" · KV 18/1803 dev · 0 host · 0 swaps")


def test_engine_figure_parts_tolerate_missing_figures():
    assert speculation_parts(None) == [] and speculation_parts({}) == []
    assert speculation_parts({"verifications": 0, "mean_accepted_length": 0.0}) == []
    assert [t for _, t in speculation_parts(SPECULATION)] == ["spec 2.4 tok/step"]
    assert hybrid_parts(None) == []
    unmeasured = sample_hybrid_report(measured=False)
    assert [t for _, t in hybrid_parts(unmeasured)] == ["GPU 40% hot"]
    assert [t for _, t in hybrid_parts({"sparsity": 0.625})] == ["FFN 62% sparse"]


# -- loading progress ---------------------------------------------------------------------

@pytest.mark.asyncio
async def test_loading_progress_is_shown_and_reaches_100_percent(tmp_path):
    gate = threading.Event()
    app = make_app(tmp_path / "chat.db", FakeEngine(["ok"], load_gate=gate))
    async with app.run_test(size=SIZE) as pilot:
        # The fake reports all but its last step, then waits for the gate.
        await wait_for(pilot, lambda: app.load_progress == 0.5)
        assert status_text(app) == "loading fake model… 50% · layer 6 of 18"
        await send(pilot, "early", wait=False)
        assert status_text(app) == ("loading fake model… 50% · layer 6 of 18 "
                                    "(your message is sent once it is ready)")
        gate.set()
        await wait_for(pilot, lambda: app.model_state == "ready")
        assert app.load_progress == 1.0
        await wait_for(pilot, lambda: not app.busy)  # the queued message answered
        assert "%" not in status_text(app)


# -- placement screen ---------------------------------------------------------------------

@pytest.mark.asyncio
async def test_placement_screen_draws_each_layer_and_scrolls(tmp_path):
    report = sample_hybrid_report()
    app = make_app(tmp_path / "chat.db", FakeEngine(["ok"], hybrid=report))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        shown = app.active_bindings["f3"]  # what the footer lists
        assert shown.binding.description == "Placement" and shown.binding.show and shown.enabled
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, PlacementScreen)
        header = text_of(screen.query_one(PlanHeader))
        assert "GPU tier cuda:0 · budget 150.0 MiB (auto) · 140.5 MiB planned" in header
        for charge in ("workspace", "attention", "KV pool", "predictors", "LM head", "hot FFN"):
            assert charge in header
        assert "45% of FFN neurons skipped per decode token" in header
        rows = text_of(screen.query_one(LayerBars)).splitlines()
        assert len(rows) == 1 + 18  # a header, then one row per layer
        assert rows[1].split()[0] == "0" and rows[1].split()[-4:] == ["60%", "9.0", "MiB", "70%"]
        assert rows[18].split()[0] == "17" and "20%" in rows[18]
        # 18 layers do not fit in 24 rows: the chart scrolls.
        scroll = screen.query_one("#layers")
        assert scroll.max_scroll_y > 0 and screen.focused is scroll
        await pilot.press("end")
        await wait_for(pilot, lambda: scroll.scroll_y == scroll.max_scroll_y)
        await pilot.press("escape")
        assert not isinstance(app.screen, PlacementScreen)


@pytest.mark.asyncio
async def test_placement_screen_updates_when_the_model_is_loaded(tmp_path):
    gate = threading.Event()
    engine = FakeEngine(["ok"], load_gate=gate, hybrid=sample_hybrid_report(measured=False))
    app = make_app(tmp_path / "chat.db", engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        screen = app.screen
        assert "still loading" in str(screen.query_one("#message").render())
        gate.set()
        await wait_for(pilot, lambda: screen.query_one("#layers").display)
        header = text_of(screen.query_one(PlanHeader))
        assert "Measured" not in header and "░ cold (host)" in header
        assert "computed" not in text_of(screen.query_one(LayerBars))
        # Measured after a reply (the bar gains its computed part).
        engine.hybrid = sample_hybrid_report()
        await pilot.press("escape")
        await send(pilot, "hi")
        await pilot.press("f3")
        assert "computed" in text_of(app.screen.query_one(LayerBars))


@pytest.mark.asyncio
async def test_placement_screen_explains_gpu_budget_for_a_dense_engine(tmp_path):
    app = make_app(tmp_path / "chat.db", FakeEngine(["ok"]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f3")
        message = str(app.screen.query_one("#message").render())
        assert "No FFN split" in message and "ember chat --gpu-budget 4GiB" in message
        assert not app.screen.query_one("#layers").display


@pytest.mark.asyncio
async def test_help_lists_the_placement_key(tmp_path):
    app = make_app(tmp_path / "chat.db", FakeEngine(["ok"]))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        from ember.app.tui.screens.help import KEYS

        assert ("F3", "placement: each FFN layer's hot (GPU tier) and cold (host) neurons") in KEYS


def test_layer_runs_split_hot_computed_and_skipped():
    assert [f for f, _, _ in layer_runs(0.25, None)] == [0.25, 0.75]
    runs = layer_runs(0.25, 0.5)
    assert [round(f, 6) for f, _, _ in runs] == [0.25, 0.25, 0.5]
    assert [role for _, _, role in runs] == ["chart--hot", "chart--computed", "chart--cold"]
    assert [f for f, _, _ in layer_runs(0.5, 0.2)] == [0.5, 0.0, 0.5]  # computed >= hot


# -- a tiny real model, split ---------------------------------------------------------------

@pytest.mark.asyncio
async def test_tiny_model_loads_with_progress_and_shows_its_placement(tmp_path, tiny_gemma_gguf):
    from ember.offload.hybrid.memory_plan import workspace_bytes
    from ember.models.loader import open_model

    seen = []

    class Recording(EngineBackend):
        def load(self, progress=None):
            super().load(lambda fraction, stage: (seen.append(fraction), progress(fraction, stage)))

    budget = workspace_bytes(open_model(tiny_gemma_gguf).config) + 100_000
    from ember.offload.options.engine_options import EngineOptions

    backend = Recording(tiny_gemma_gguf, EngineOptions(device="cpu", n_ctx=128, gpu_budget=budget))
    app = ChatApp(backend, ChatStore(tmp_path / "chat.db"))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.model_state != "loading", timeout=60)
            assert app.model_state == "ready", app.model_error
            assert app.load_progress == 1.0 and seen == sorted(seen) and seen[-1] == 1.0
            assert "GPU " in status_text(app) and " hot" in status_text(app)
            await pilot.press("f3")
            rows = text_of(app.screen.query_one(LayerBars)).splitlines()
            assert len(rows) == 1 + 6  # the tiny model's six layers
            report = backend.stats()["hybrid"]
            assert len(report["gpu_ffn_bytes_per_layer"]) == 6
            assert sum(report["gpu_ffn_bytes_per_layer"]) == report["gpu_ffn_bytes"]
            await pilot.press("ctrl+q")
    finally:
        app.store.close()
        backend._engine.close()


def test_engine_load_reports_progress_per_layer(tiny_gemma_gguf):
    from ember.offload.runtime.engine import Engine, EngineOptions

    calls = []
    # The float32 model (what --weights fp32 builds) reports each layer it builds; the default
    # runtime builds none (test_file_blocks_model).
    engine = Engine.load(tiny_gemma_gguf, EngineOptions(device="cpu", n_ctx=64, weights="fp32"),
                         progress=lambda fraction, stage: calls.append((fraction, stage)))
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and fractions[0] == 0.0
    assert calls[-1] == (1.0, "ready")
    assert [s for _, s in calls if s.startswith("layer ")] == [f"layer {i} of 6"
                                                              for i in range(1, 7)]
    assert engine.n_ctx == 64


# -- `ember chat` flags ---------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--gpu-budget", "lots"], "--gpu-budget 'lots' is not a size"),
    (["--split", "cpu-only"], "--split cpu-only needs --gpu-budget"),
    (["--profile", "/no/such/profile"], "--profile /no/such/profile: no such file"),
    (["--ffn-mode", "sparse", "--profile", "none"], "--ffn-mode sparse needs --profile"),
])
def test_bad_chat_flags_are_one_line_before_the_app_starts(monkeypatch, capsys, tmp_path,
                                                           flags, message):
    from ember.app.cli import main

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(ChatApp, "run", lambda self: pytest.fail("the app started"))
    assert main(["chat", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: ") and message in err and err.count("\n") == 1


def test_chat_flags_reach_the_engine_options(monkeypatch, tmp_path, tiny_gemma_gguf):
    from ember.app.cli import main

    started = []
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(ChatApp, "run", lambda self: started.append(self.port.options))
    assert main(["chat", "--model", str(tiny_gemma_gguf), "--gpu-budget", "2MB",
                 "--split", "cpu-only", "--cold-dtype", "int8", "--profile", "none",
                 "--speculate", "lookup", "--tree", "1,1,2"]) == 0
    options = started[0]
    assert options.gpu_budget == 2_000_000 and options.split == "cpu-only"
    assert options.cold_dtype == "int8" and options.profile is None
    assert options.speculate == "lookup" and options.tree == "1,1,2"


def test_speculation_flags_are_checked_before_the_app_starts(monkeypatch, capsys, tmp_path):
    from ember.app.cli import main

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(ChatApp, "run", lambda self: pytest.fail("the app started"))
    for flags, message in ((["--speculate", "model"], "--speculate model needs --draft-model"),
                           (["--speculate", "model", "--draft-model", str(tmp_path / "no.gguf")],
                            "no such file or folder"),
                           (["--speculate", "self", "--tree", "1,0"], "--tree takes")):
        assert main(["chat", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_backend_reports_speculation_from_a_real_engine(tiny_gemma_gguf):
    from ember.app.tui.settings import ChatSettings
    from ember.models.chat_format import ChatMessage
    from ember.models.loader import load_model
    from ember.offload.runtime.engine import Engine, EngineOptions

    # Gemma's turns, not the transcript a file without a template gets: the transcript's
    # preamble alone is ~230 tokens of the tiny model's character-level vocabulary.
    engine = Engine(load_model(tiny_gemma_gguf),
                    EngineOptions(device="cpu", n_ctx=128, speculate="lookup", chat_format="gemma"))
    backend = PreloadedBackend(engine, "tiny")
    before = backend.stats()
    assert before["speculate"] == "lookup" and before["speculation"] is None
    assert before["hybrid"] is None  # dense: no split
    list(backend.stream_reply([ChatMessage("user", "the cat the cat the cat")],
                              ChatSettings(max_tokens=12), threading.Event()))
    spec = backend.stats()["speculation"]
    assert spec["verifications"] >= 1
    assert speculation_parts(spec) == [(3, f"spec {spec['mean_accepted_length']:.1f} tok/step")]


def test_backend_writes_a_conversation_in_its_settings_chat_format(tiny_gemma_gguf):
    from ember.app.tui.settings import ChatSettings
    from ember.models.chat_format import ChatMessage
    from ember.models.support.errors import ConfigError
    from ember.models.loader import load_model
    from ember.offload.runtime.engine import Engine, EngineOptions

    engine = Engine(load_model(tiny_gemma_gguf),
                    EngineOptions(device="cpu", n_ctx=256, chat_format="gemma"))
    backend = PreloadedBackend(engine, "tiny")
    assert backend.stats()["chat_format"] == "gemma"  # the engine's, before any reply
    msgs = [ChatMessage("user", "hi")]
    events = list(backend.stream_reply(msgs, ChatSettings(max_tokens=2, chat_format="transcript"),
                                       threading.Event()))
    assert engine.tokenizer.decode(events[-1].prompt_token_ids).endswith("User: hi\nAssistant:")
    assert backend.stats()["chat_format"] == "transcript"
    with pytest.raises(ConfigError, match="no chat template"):
        list(backend.stream_reply(msgs, ChatSettings(chat_format="template"), threading.Event()))


def test_a_conversation_that_outgrows_the_context_goes_on_and_says_what_it_left_out(
        tiny_gemma_gguf):
    from ember.app.tui.settings import ChatSettings
    from ember.models.chat_format import ChatMessage
    from ember.models.loader import load_model
    from ember.offload.runtime.engine import Engine, EngineOptions

    engine = Engine(load_model(tiny_gemma_gguf),
                    EngineOptions(device="cpu", n_ctx=128, chat_format="gemma"))
    backend = PreloadedBackend(engine, "tiny")
    msgs = [ChatMessage("user", "the cat sat"), ChatMessage("assistant", "on the mat")] * 12
    msgs.append(ChatMessage("user", "and then"))
    events = list(backend.stream_reply(msgs, ChatSettings(max_tokens=8), threading.Event()))
    assert events[-1].token_ids  # a reply, not an error
    dropped = backend.stats()["dropped_messages"]
    assert dropped > 0 and dropped % 2 == 0
    assert len(events[-1].prompt_token_ids) <= engine.n_ctx - 8
