"""Batch-1 execution over the paged KV cache: chunked prefill, one token per decode step.

Each named session (one chat conversation) owns a KV sequence and remembers the token ids it
holds, so a new request that extends the previous one (the next chat turn) prefills only the
new tokens. Switching sessions leaves the idle one's blocks where they are; the cache swaps
them to host RAM if the device pool needs room and back in when the session returns. A
session the cache had to drop is recomputed from its tokens, transparently.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from ember.models.support.errors import ConfigError, PromptTooLong

from ..body.protocol import BodyModel
from ..kv.plan import DEFAULT_PREFILL_CHUNK
from ..kv.paged import DROPPED, PagedKVCache


# A prefill that can be cancelled (a server's client may leave) runs in chunks sized to take
# about CANCEL_CHUNK_S each, from the time the previous chunk took per token: cancelling then
# acts within about that long, on a loaded machine too (its chunks shrink). The cost: smaller
# chunks prefill slower. Default model, one thread, one process (a loaded machine): chunks of
# 512/128/64/32/16 tokens ran at 124/127/116/100/95 tokens/s; unloaded, 50 ms is ~40 tokens.
# Chunks are whole multiples of MIN_CANCEL_CHUNK: the prefill kernels take 16 tokens at a time
# (block_gemm_*.h) and fewer go through the row kernels, at a fraction of the speed on a big
# model. So on a 7B (16 tokens ~0.7 s here) cancelling waits out one such chunk.
CANCEL_CHUNK_S = 0.05
FIRST_CANCEL_CHUNK = 16  # before anything was measured (then the pace of the latest chunk)
MIN_CANCEL_CHUNK = 16


@dataclass
class Session:
    seq_id: int
    tokens: list[int] = field(default_factory=list)  # ids whose K/V the sequence holds
    recomputed: int = 0  # times its cache was dropped and rebuilt


class Runner:
    def __init__(self, model: BodyModel, kv: PagedKVCache, n_ctx: int,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if n_ctx > model.cfg.context_length:
            raise ConfigError(f"context size {n_ctx} exceeds the model's maximum "
                              f"{model.cfg.context_length}")
        self.model, self.kv, self.n_ctx, self.prefill_chunk = model, kv, n_ctx, prefill_chunk
        model.use_context(n_ctx)  # Phi-3 LongRoPE picks its factors by the context size
        self.sessions: dict[str, Session] = {}
        self.last_prefill_tokens = 0  # tokens the last prefill actually computed
        self._s_per_token: float | None = None  # a cancellable prefill's latest pace

    def session(self, name: str) -> Session:
        if name not in self.sessions:
            self.sessions[name] = Session(self.kv.allocate())
        return self.sessions[name]

    def tokens(self, name: str) -> list[int]:
        return self.sessions[name].tokens if name in self.sessions else []

    def reset(self, name: str) -> None:
        """Forget a session's cache (its next prefill starts from scratch)."""
        if name in self.sessions:
            self.kv.free(self.sessions.pop(name).seq_id)

    def prefill(self, name: str, ids: list[int],
                cancel: threading.Event | None = None) -> torch.Tensor | None:
        """Make session `name` hold exactly the prompt `ids`; returns the logits after the
        last one. A ConfigError if the prompt is empty, leaves no room in the context for a
        generated token, or holds an id outside the vocabulary.

        Reuses the longest common prefix with what the session already holds. With `cancel`,
        checked before each chunk (chunks of ~CANCEL_CHUNK_S): once it is set, returns None,
        the session holding the chunks already done (a later prompt extending them reuses them).
        """
        self.check_prompt(ids)
        return self._fill(name, ids, cancel)

    def check_prompt(self, ids: list[int]) -> None:
        """The rules every prompt meets before anything runs (ConfigError, PromptTooLong)."""
        if not ids:
            raise ConfigError("the prompt is empty")
        # The last position's logits give the first generated token, which needs a slot too.
        if len(ids) >= self.n_ctx:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens but the context holds "
                              f"{self.n_ctx} for the prompt and its reply together; shorten "
                              "the prompt or raise --ctx-size")
        vocab = self.model.cfg.vocab_size
        if not 0 <= min(ids) <= max(ids) < vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ConfigError(f"token id {bad} is outside the model's vocabulary of {vocab} "
                              "(does the tokenizer belong to this model?)")

    def sync(self, name: str, ids: list[int]) -> int:
        """Make session `name` hold exactly `ids` (no logits: a draft model's cache kept in
        step with the target's tokens); reuses the longest common prefix and computes the rest
        in one chunked pass. Returns how many tokens it computed."""
        if len(ids) > self.n_ctx:
            raise ConfigError(f"the context is full ({self.n_ctx} tokens)")
        s = self.session(name)
        if len(ids) == len(s.tokens) == _common_prefix(s.tokens, ids):
            return 0
        self._hold(name, ids, keep_last=False)
        return self.last_prefill_tokens

    def _fill(self, name: str, ids: list[int],
              cancel: threading.Event | None = None) -> torch.Tensor | None:
        """`prefill` without the prompt checks: also rebuilds a dropped session from the
        tokens it held (up to the whole context)."""
        # Keep at least the last token to recompute: its logits are what we return.
        hidden = self._hold(name, ids, True, cancel)
        return None if hidden is None else self.model.logits(hidden[-1:])[0]

    def _hold(self, name: str, ids: list[int], keep_last: bool,
              cancel: threading.Event | None = None) -> torch.Tensor | None:
        """Make the session hold `ids`; the last chunk's hidden states (None if cancelled,
        or if nothing was computed)."""
        s = self.session(name)
        keep = min(_common_prefix(s.tokens, ids), len(ids) - keep_last)
        if self.kv.seqs[s.seq_id].tier == DROPPED or not self.kv.can_truncate(s.seq_id, keep):
            self._restart(s)
            keep = 0
        else:
            self.kv.truncate(s.seq_id, keep)
            del s.tokens[keep:]
        hidden = None
        self.last_prefill_tokens = len(ids) - keep
        lo = keep
        while lo < len(ids):
            if cancel is not None and cancel.is_set():
                return None
            size = self.prefill_chunk if cancel is None else self._cancellable_chunk()
            chunk = ids[lo: lo + size]
            t0 = time.perf_counter()
            hidden = self.model.hidden(self._tensor(chunk), self.kv.view(s.seq_id))
            if cancel is not None and len(chunk) == size:  # a whole chunk: a fair pace
                self._s_per_token = (time.perf_counter() - t0) / size
            s.tokens.extend(chunk)
            lo += len(chunk)
        return hidden

    def _cancellable_chunk(self) -> int:
        """Tokens for the next chunk of a cancellable prefill: ~CANCEL_CHUNK_S at the latest
        pace, a multiple of MIN_CANCEL_CHUNK within [MIN_CANCEL_CHUNK, prefill_chunk]."""
        if self._s_per_token is None:
            want = FIRST_CANCEL_CHUNK
        else:
            want = int(CANCEL_CHUNK_S / max(self._s_per_token, 1e-9))
            want -= want % MIN_CANCEL_CHUNK
        return max(min(MIN_CANCEL_CHUNK, self.prefill_chunk), min(self.prefill_chunk, want))

    def decode(self, name: str, token: int) -> torch.Tensor:
        """Append one token to session `name`; returns the logits for the next position."""
        s = self.sessions[name]
        if len(s.tokens) >= self.n_ctx:
            raise ConfigError(f"the context is full ({self.n_ctx} tokens)")
        if self.kv.seqs[s.seq_id].tier == DROPPED:  # rebuilt from its tokens, then continue
            return self._fill(name, s.tokens + [token])
        hidden = self.model.hidden(self._tensor([token]), self.kv.view(s.seq_id))
        s.tokens.append(token)
        return self.model.logits(hidden)[0]

    # -- speculation: a token tree in the slots after the committed context ---------------
    # All tree nodes go through the body in one pass when the model is batch-invariant (a
    # T-row pass gives each row the bits a one-row pass gives: the file-blocks model unless
    # its FFNs are split); otherwise one node at a time, each given exactly its path: the very
    # computation plain decoding does, so equality with it holds bit for bit either way.

    def begin_tree(self, name: str, max_nodes: int) -> int:
        """Reserve slots for up to `max_nodes` tree nodes; returns how many fit (>= 1), or 0
        when the context is full."""
        s = self.sessions[name]
        if self.kv.seqs[s.seq_id].tier == DROPPED:
            self._fill(name, list(s.tokens))  # rebuilt; these logits are not needed
        n = min(max_nodes, self.n_ctx - len(s.tokens))
        if n > 0:
            self.kv.view(s.seq_id).reserve(n)
        return max(n, 0)

    def end_tree(self, name: str) -> None:
        """Release the slots `begin_tree` reserved, when nothing was drafted into them."""
        s = self.sessions[name]
        self.kv.view(s.seq_id).truncate(len(s.tokens))

    @torch.inference_mode()
    def tree_hidden(self, name: str, tree, upto: int | None = None) -> None:
        """Fill `tree.hidden` for nodes 0..upto-1 (all by default) whose state is unknown."""
        s = self.sessions[name]
        view, context = self.kv.view(s.seq_id), len(s.tokens)
        upto = len(tree) if upto is None else upto
        todo = [i for i in range(upto) if tree.hidden[i] is None]
        if not todo:
            return
        # One node (every self-drafter step) needs no batching decision.
        if len(todo) > 1 and todo == list(range(todo[0], upto)) and self.model.batch_invariant:
            rows = tree.rows_for(context, todo[0], len(todo))
            hidden = self.model.hidden(self._tensor(tree.tokens[todo[0]:upto]), view, rows)
            for j, i in enumerate(todo):
                tree.hidden[i] = hidden[j: j + 1]
            return
        for i in todo:
            tree.hidden[i] = self.model.hidden(self._tensor([tree.tokens[i]]), view,
                                               tree.row_for(context, i))

    @torch.inference_mode()
    def verify(self, name: str, tree) -> torch.Tensor:
        """Target logits (N, vocab) at every node of `tree`."""
        self.tree_hidden(name, tree)
        hidden = torch.cat(tree.hidden)
        if self.model.head_batch_invariant:  # all rows at once
            return self.model.logits(hidden)
        return torch.cat([self.model.logits(hidden[i: i + 1]) for i in range(len(tree))])

    def commit_path(self, name: str, tree, path: list[int]) -> None:
        """Keep the nodes of `path` (root first) as the next positions; drop the rest."""
        s = self.sessions[name]
        context = len(s.tokens)
        self.kv.compact(s.seq_id, [context + i for i in path],
                        [context + j for j in range(len(path))])
        view = self.kv.view(s.seq_id)
        view.commit(len(path))
        view.truncate(context + len(path))  # frees blocks reserved past the path
        s.tokens.extend(tree.tokens[i] for i in path)

    def _restart(self, s: Session) -> None:
        if self.kv.seqs[s.seq_id].tier == DROPPED:
            s.recomputed += 1
        self.kv.free(s.seq_id)
        s.seq_id = self.kv.allocate()
        s.tokens = []

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.model.device)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
