"""HF transformers rollout engine: batched sampling with a KV cache and left padding, behind `Generator`.

One worker thread owns the model. `submit` validates each request in the caller's thread (a bad request
gets error completions at once and never reaches a batch), then queues its `n` sample rows; the worker
takes up to `max_batch_size` rows per batch. A batch is one prefill over the left-padded prompts and one
cached forward per new token; each row stops at its own eos/stop token or budget, leaves the batch with its
KV cache rows, and its request's future is answered then (the other rows go on). Continuous batching
(`admission.py`): rows queued while a batch runs join it between two decode steps, up to `max_batch_size`
(only the new rows are prefilled; their KV cache is merged into the running one), so an agent's next turn
never waits for a long batch. Constrained rows, and every row of a VLM or an MoE-routing engine, wait for
the next batch instead. Sampled tokens and
logprobs stay on the model's device until the batch ends (`live_rows.py`); constrained rows (`choices`,
`allowed_token_ids`) walk a transition table there too (`constraints.py`). Sleep and wake wait for the
running batch; so do weight updates, unless the engine is `partial`.

Partial rollouts (`partial=True`): a weight update that arrives while a batch runs is applied by the worker
between two decode steps. The rows still running pause there, the new weights load, and their KV cache is
recomputed: one prefill of prompt + tokens so far under the new weights, so every later token is sampled
from the new policy given its whole context. Each completion's `version_runs` says which tokens each
version made (its `policy_version` is the oldest).

VLM prompts (the Qwen2-VL family, `hf_inputs.py`): images from `Prompt.media` go through the image processor; the prompt's
`<|image_pad|>` placeholders are expanded to the image token count, `mm_token_type_ids` marks them, and
M-RoPE positions come from the model's `get_rope_index` (prefill) plus its per-row deltas (decode).

Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral): hooks on the routers record, for every prompt
position and generated token, the experts each layer chose (`routing.py`); each completion carries them as
`routed_experts` for rollout routing replay (R3). A partial rollout's re-prefill records its positions again
under the new weights (the routing that made the KV cache the later tokens read).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch

from yatt_rollout import admission, sampling
from yatt_rollout.adapters import AdapterMerger
from yatt_rollout.buckets import bucket_tensors
from yatt_rollout.device import decode_attention, release_free_memory
from yatt_rollout.hf_inputs import (
    BatchRequest,
    BatchRow,
    mrope_step,
    prefill_inputs,
    request_constraint,
    vision_inputs,
)
from yatt_rollout.live_rows import LiveRows
from yatt_rollout.requests import check_request, error_completions
from yatt_rollout.routing import RouteBuffer, RoutingRecorder
from yatt_rollout.types import Completion, FinishReason, GenerateRequest, RoutedExperts, WeightBucket
from yatt_rollout.weights import WeightSlots


class HFEngine:
    """Rollout engine over an HF causal LM (or Qwen2-VL), implementing `yatt_rollout.types.Generator`.

    `tokenizer` supplies eos and pad ids (else the model's generation config); `processor` is the image
    processor (or a full processor with `.image_processor`) for VLM prompts. `max_context` defaults to the
    model's `max_position_embeddings`. Unseeded requests draw from one generator seeded with `seed`.
    `partial`: weight updates pause the running batch between two decode steps instead of waiting for it.
    `record_routing`: record a mixture-of-experts model's expert choices in each completion (default: when
    the model has routers).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        processor: Any = None,
        max_batch_size: int = 64,
        device: str = "cpu",
        max_context: int | None = None,
        seed: int = 0,
        partial: bool = False,
        record_routing: bool | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        text_config = model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_context = max_context or text_config.max_position_embeddings
        self.tokenizer = tokenizer
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)
        self.image_processor = getattr(processor, "image_processor", processor)
        self.image_token_id = getattr(model.config, "image_token_id", None)
        self.slots = WeightSlots(model)
        self.adapters = AdapterMerger(self.model)  # LoRA adapter-only sync (`load_adapter`)
        self.partial = partial  # weight updates pause a running batch instead of waiting for it
        recorder: RoutingRecorder | None = RoutingRecorder(self.model)
        assert recorder is not None
        if record_routing and not recorder.routers:
            raise ValueError("record_routing=True needs a mixture-of-experts model; this one has no routers")
        if not recorder.routers or record_routing is False:
            recorder.close()
            recorder = None
        self.routing = recorder  # hooks on the MoE routers, or None
        # admitted_rows: rows that joined a running batch (continuous batching); admissions: the times they did
        self.stats = {
            "batches": 0,
            "rows": 0,
            "generated_tokens": 0,
            "resumed_rows": 0,
            "admitted_rows": 0,
            "admissions": 0,
        }
        self.recent_batches: deque[list[str]] = deque(maxlen=256)  # request ids of the latest batches
        self._default_gen = torch.Generator(self.device).manual_seed(seed)
        self._version = 0
        self._asleep = False
        self._busy = False
        self._waiting = 0  # callers waiting for the running batch to end: no admission meanwhile
        self._swap: tuple[Sequence[tuple[str, torch.Tensor]], int] | None = None  # a partial update to apply
        self._cv = threading.Condition()
        self._rows: queue.SimpleQueue[list[BatchRow] | None] = queue.SimpleQueue()
        self._pending: list[BatchRow] = []
        # torch's intra-op thread count is per thread (OpenMP): the worker takes the builder's setting
        self._num_threads = torch.get_num_threads()
        self._worker = threading.Thread(target=self._serve, name="yatt-hf-engine", daemon=True)
        self._worker.start()

    # ---- Generator -------------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Complete every request; completions in request order, then sample index."""
        return [c for fut in self.submit(requests) for c in fut.result()]

    async def stream(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[Completion]:
        """Yield each request's completions as soon as that request finishes."""
        import asyncio

        for fut in asyncio.as_completed([asyncio.wrap_future(f) for f in self.submit(requests)]):
            for completion in await fut:
                yield completion

    def submit(self, requests: Sequence[GenerateRequest]) -> list[Future]:
        """Queue requests atomically (they can share one batch); one future of completions per request."""
        with self._cv:
            if self._asleep:
                raise RuntimeError("HFEngine is asleep: call wake_up() before generating")
            if self.slots.missing:
                raise RuntimeError(
                    f"HFEngine has no weights for {len(self.slots.missing)} tensors (discarded by sleep(level=2)); "
                    f"update_weights must supply them, e.g. {sorted(self.slots.missing)[:3]}"
                )
        futures, rows = [], []
        for req in requests:
            fut: Future = Future()
            futures.append(fut)
            try:
                prepared = self._prepare(req, fut)
            except ValueError as err:
                fut.set_result(error_completions(req, str(err), self._version))
                continue
            rows += [BatchRow(prepared, i) for i in range(req.sampling.n)]
        if rows:
            self._rows.put(rows)
        return futures

    def update_weights(self, buckets: Sequence[WeightBucket], version: int) -> None:
        """Copy named tensors into the model between batches; later batches report `version`."""
        self.load_weights([pair for bucket in buckets for pair in bucket_tensors(bucket)], version)

    def load_weights(self, named: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        """`update_weights` for tensors already in this process (colocated sync: no bucket packing). Returns
        once loaded: after the running batch, or (partial) at its next decode step."""
        with self._cv:
            while self._swap is not None:  # one partial update at a time
                self._cv.wait()
            if self.partial and self._busy:
                ticket = self._swap = (named, version)
                while self._swap is ticket and self._busy:
                    self._cv.wait()
                if self._swap is not ticket:
                    return  # the worker loaded it between two steps
                self._swap = None  # the batch ended first: load it here
            self._wait_idle()
            self.slots.load(named)
            self.adapters.forget(name for name, _ in named)
            self._version = version
            self._cv.notify_all()  # a worker waiting for discarded weights may go on

    def load_adapter(self, named: Sequence[tuple[str, torch.Tensor]], *, scaling: float, version: int) -> int:
        """LoRA adapter-only sync (`adapters.py`): peft-named lora_A / lora_B tensors applied onto the engine's
        base weights (W = W0 + scaling * B @ A) between batches; later batches report `version`. Returns the
        bytes received (the adapter's, not the model's)."""
        with self._cv:
            while self._swap is not None:
                self._cv.wait()
            self._wait_idle()
            received = self.adapters.apply(named, scaling)
            self._version = version
            self._cv.notify_all()
        return received

    def sleep(self, level: int = 1) -> None:
        """Stop serving and free memory until `wake_up`; `generate` meanwhile is a RuntimeError.

        Level 1 frees caches: the KV cache lives only while a batch runs, so this returns the allocator's
        free blocks (CUDA's cache; on CPU, glibc's free heap pages via `malloc_trim`); on an accelerator the
        weights also move to host memory. Level 2 also discards the weights (each parameter's storage is
        released, its name, shape and dtype kept), so the process's resident memory drops by about their
        bytes; after `wake_up` the weights come back only through the next `load_weights` /
        `update_weights` (of every parameter), and `generate` refuses until then.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._cv:
            self._wait_idle()
            self._asleep = True
            if level == 2:
                self.slots.discard()
            elif self.device.type != "cpu":
                self.model.to("cpu")
            release_free_memory(self.device)

    def _wait_idle(self) -> None:
        """Wait (holding `_cv`) until no batch runs; the running one admits no more rows meanwhile."""
        self._waiting += 1
        try:
            while self._busy:
                self._cv.wait()
        finally:
            self._waiting -= 1

    def wake_up(self) -> None:
        """Serve again. After level 2, weights must still be loaded before `generate`."""
        with self._cv:
            if not self.slots.discarded:  # after level 2 the weights return with the next load
                self.model.to(self.device)
            self._asleep = False
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the worker thread after the queued batches."""
        self._rows.put(None)
        self._worker.join()

    # ---- requests ----------------------------------------------------------------------------------------

    def _prepare(self, req: GenerateRequest, fut: Future) -> BatchRequest:
        """Validate one request and load its images. ValueError names what is wrong."""
        check_request(req, vocab_size=self.vocab_size, max_context=self.max_context)
        ids = list(req.prompt.token_ids)
        vision: dict[str, Any] = {}
        if req.prompt.media:
            ids, vision = vision_inputs(req, ids, self.image_processor, self.image_token_id)
            check_request(req, vocab_size=self.vocab_size, max_context=self.max_context, num_tokens=len(ids))
        spec = request_constraint(req, self.tokenizer, self.eos_ids, self.vocab_size)
        return BatchRequest(req, ids, vision, fut, spec)

    # ---- the worker ----------------------------------------------------------------------------------------

    def _serve(self) -> None:
        # torch._C's setter: an in-process vLLM CPU engine (a judge beside this rollout) replaces
        # `torch.set_num_threads` with a no-op once it has bound its threads
        torch._C.set_num_threads(self._num_threads)
        while True:
            if not self._pending:
                rows = self._rows.get()  # block until work arrives
                if rows is None:
                    return
                self._pending += rows
            self._drain()  # everything that arrived meanwhile joins this batch, up to the limit
            batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
            with self._cv:
                # rows queued before a sleep wait for weights; a caller waiting for the engine to be idle (an
                # update, a sleep) goes before the next batch, as it went before joins into the last one
                while self._asleep or self.slots.missing or self._waiting:
                    self._cv.wait()
                self._busy = True
                version = self._version
            try:
                self._run(batch, version)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _drain(self) -> None:
        """Move the queued rows to `_pending` (worker thread); a close (None) stays queued."""
        while True:
            try:
                more = self._rows.get_nowait()
            except queue.Empty:
                return
            if more is None:
                self._rows.put(None)
                return
            self._pending += more

    def _admit(self, room: int) -> list[BatchRow]:
        """Up to `room` queued rows that may join the running batch now (`admission.admissible`), in queue
        order; the others stay pending. None while a caller waits for the batch to end (sleep, an update)."""
        if self._waiting or room <= 0:
            return []
        self._drain()
        admitted: list[BatchRow] = []
        rest: list[BatchRow] = []
        for row in self._pending:
            (admitted if len(admitted) < room and admission.admissible(row.request) else rest).append(row)
        self._pending = rest
        return admitted

    def _take_swap(self) -> int:
        """Apply the pending partial update (worker thread, between decode steps); its version."""
        with self._cv, torch.inference_mode(False):
            assert self._swap is not None  # set by the updating thread before it asked for the swap
            named, version = self._swap
            self.slots.load(named)
            self.adapters.forget(name for name, _ in named)
            self._version, self._swap = version, None
            self._cv.notify_all()
        return version

    def _run(self, batch: list[BatchRow], version: int) -> None:
        self.recent_batches.append(sorted({row.request.req.request_id for row in batch}))
        self.stats["batches"] += 1
        self.stats["rows"] += len(batch)
        switches = [(0, version)]  # (first decode step, version) of each policy the batch decoded under
        rows = list(batch)  # every row of the batch, those admitted while it runs included
        try:
            with decode_attention(self.device):
                self._decode(rows, switches)
        except Exception as err:  # a failing batch fails its own unanswered rows; the engine keeps serving
            message = f"{type(err).__name__}: {err}"
            for row in rows:
                if row.index not in row.request.done:
                    self._finish(row, error_completions(row.request.req, message, version)[row.index])

    def _complete(
        self,
        row: BatchRow,
        segment: tuple[list[int], list[float], FinishReason],
        switches: list[tuple[int, int]],
        routes: RoutedExperts | None = None,
    ) -> None:
        """Answer a row that ended: its tokens of earlier segments, then those of `segment`."""
        tokens, logprobs = row.tokens + segment[0], row.logprobs + segment[1]
        self.stats["generated_tokens"] += len(tokens)
        runs = _version_runs(switches, len(tokens), row.start)
        self.stats["resumed_rows"] += len(runs) > 1
        completion = Completion(
            request_id=row.request.req.request_id,
            index=row.index,
            token_ids=tokens,
            logprobs=logprobs if row.request.req.sampling.logprobs else [],
            finish_reason=segment[2],
            policy_version=runs[0][0] if runs else switches[-1][1],
            version_runs=runs,
            routed_experts=routes,
        )
        self._finish(row, completion)

    @staticmethod
    def _finish(row: BatchRow, completion: Completion) -> None:
        req = row.request
        req.done[row.index] = completion
        if len(req.done) == req.req.sampling.n and not req.future.cancelled():
            with contextlib.suppress(
                InvalidStateError
            ):  # cancelled meanwhile by its caller: nothing to deliver
                req.future.set_result([req.done[i] for i in range(req.req.sampling.n)])

    def _left_pad(self, batch: list[BatchRow]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """input_ids [B, T] and attention mask [B, T] of the rows' contexts (`BatchRow.ids`), right-aligned; each
        row's token budget left."""
        contexts = [row.ids for row in batch]
        lengths = [len(ids) for ids in contexts]
        width = max(lengths)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(contexts):
            input_ids[i, width - lengths[i] :] = torch.tensor(ids)
            mask[i, width - lengths[i] :] = 1
        # a row may not run past the model's context
        budget = [
            min(r.request.req.sampling.max_new_tokens - len(r.tokens), self.max_context - n)
            for r, n in zip(batch, lengths, strict=True)
        ]
        return input_ids.to(self.device), mask.to(self.device), budget

    @torch.inference_mode()
    def _decode(self, batch: list[BatchRow], switches: list[tuple[int, int]]) -> None:
        """Prefill the left-padded batch, then one cached step per token; each row is answered when it ends
        (with an MoE recorder: all at the end, with their routes). A row that stops leaves the batch (its KV
        cache rows too), so the others run at their own size. A partial weight update taken at a step is
        appended to `switches` and the running rows are prefilled again under it. Rows queued meanwhile join
        between two steps (`admission.join`); `batch` (the caller's list) gains them.

        Tokens and logprobs stay on the device while a row runs; per step the host reads one flag (did any
        row end?) and, on the steps where rows end, which ones and their tokens. With an MoE model the
        routers' choices of every forward go into a `RouteBuffer` (each row's `RoutedExperts`)."""
        seg = list(batch)  # the current segment's rows, in LiveRows' batch order
        prompt_ids, prompt_mask, budget = self._left_pad(seg)
        rows = LiveRows.build(seg, budget, self.eos_ids, self.vocab_size, self.device)
        routes = None
        if self.routing is not None:
            routes = RouteBuffer(self.routing, len(seg), prompt_ids.shape[1], max(budget), self.device)
        out, cache, mask, pos, deltas = self._prefill(seg, prompt_ids, prompt_mask)
        logits = out.logits[:, -1]
        if routes is not None:
            routes.prefill(rows.live, prompt_ids.shape[1])
        joins = routes is None and deltas is None and admission.mergeable(cache)
        base, step = 0, 0  # the batch's decode steps before this segment; this segment's step
        while True:
            if self._swap is not None:  # partial: new weights, then the KV cache of the running rows again
                switches.append((base + step, self._take_swap()))
                live = rows.live
                ids = torch.cat([prompt_ids[live], rows.tokens[live, :step]], dim=1)
                m = torch.cat([prompt_mask[live], prompt_mask.new_ones((len(live), step))], dim=1)
                out, cache, mask, pos, deltas = self._prefill([seg[i] for i in live.tolist()], ids, m)
                logits = out.logits[:, -1]
                if routes is not None:
                    routes.prefill(live, ids.shape[1])
            elif joins and step and rows.constraint is None:
                new = self._admit(self.max_batch_size - len(rows.live))
                if new:
                    for row in new:
                        row.start = base + step
                    batch += new
                    seg, rows, prompt_ids, prompt_mask, mask, pos, logits = admission.join(
                        self, seg, rows, step, new, (cache, mask, pos, logits)
                    )
                    base, step = base + step, 0
            lg = logits.float()  # [L, V]
            if rows.constraint is not None:  # logprobs below are then the constrained distribution's
                lg = rows.constraint.mask(lg)
            tokens = sampling.sample_from(
                lg, rows.params, rows.seeded, rows.uniforms(step), self._default_gen
            )
            before = rows.live
            keep = rows.record(step, tokens, sampling.raw_logprobs(lg, tokens))
            if keep is not None:  # some rows ended: the rest go on with their own cache rows
                if routes is None:  # answered now: an agent's next turn may join this very batch
                    for i, result in admission.ended(rows, before, keep):
                        self._complete(seg[i], result, switches)
                if keep.numel() == 0:
                    break
                cache.batch_select_indices(keep)
                mask, pos, tokens = mask[keep], pos[keep], tokens[keep]
                deltas = None if deltas is None else deltas[keep]
            mask = torch.cat([mask, mask.new_ones((len(tokens), 1))], dim=1)
            pos = pos + 1
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=pos if deltas is None else mrope_step(pos, deltas),
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
            if routes is not None:
                routes.step(rows.live, step)
            step += 1
        if routes is not None:  # MoE: every row at the end (no admission: `seg` is the whole batch)
            results = rows.results()
            prompt_lens = [len(row.request.token_ids) for row in seg]
            experts = routes.rows(prompt_lens, [len(tokens) for tokens, _, _ in results])
            for row, result, route in zip(seg, results, experts, strict=True):
                self._complete(row, result, switches, route)

    def _prefill(self, batch: list[BatchRow], input_ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        """One forward over left-padded `input_ids` [L, T]: (output, KV cache, mask, last positions [L, 1],
        M-RoPE deltas or None)."""
        text_pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [L, T]; padding positions are never attended
        vision = [row.request.vision for row in batch if row.request.vision]
        kwargs, deltas = prefill_inputs(self.model, self.image_token_id, vision, input_ids, mask, text_pos)
        out = self.model(input_ids=input_ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **kwargs)
        return out, out.past_key_values, mask, text_pos[:, -1:], deltas


def _version_runs(switches: list[tuple[int, int]], num_tokens: int, start: int = 0) -> list[tuple[int, int]]:
    """(version, tokens) runs of a row of `num_tokens` tokens whose first token was sampled at the batch's step
    `start`, from the batch's (first step, version) switches."""
    firsts = [(max(step - start, 0), v) for step, v in switches]  # in the row's own token count
    bounds = [first for first, _ in firsts[1:]] + [num_tokens]
    runs = [
        (v, min(end, num_tokens) - min(s, num_tokens)) for (s, v), end in zip(firsts, bounds, strict=True)
    ]
    return [(v, n) for v, n in runs if n > 0]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
