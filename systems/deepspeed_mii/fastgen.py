"""DeepSpeed-MII FastGen (`mii.pipeline`): ragged batching, dynamic SplitFuse, CUDA kernels.

FastGen keeps every weight in GPU memory (no offloading), so Mixtral-8x7B does not fit the
paper's 24 GB / 48 GB cards; that is why the Fiddler authors measured ZeRO-Inference instead
(``engine=zero_offload``). This engine is here for GPUs where the model fits.

Token ids in, token ids out: ``MIIPipeline.__call__`` only takes strings and re-tokenises them,
so ``generate`` drives the same pipeline one level lower with MII's own methods
(``make_request`` with the request's ids, ``generate()`` steps, the per-thread result queue), in
the order ``__call__`` uses them. Streaming (``stream=True``) puts each new token on the result
queue as soon as it is sampled; the first one triggers ``on_first_token``.
"""
from __future__ import annotations

import queue
from typing import Any, Callable

from systems.base import GenerationRequest, GenerationResult, SystemUnavailable, one_line
from systems.deepspeed_mii.common import (
    checkpoint_bytes, enforce_gpu_budget, free_port, require, restore_env, snapshot_env,
)


class FastGenEngine:
    def __init__(self, model_path: str, has_cuda: bool, gpu_memory_gb: float, tensor_parallel: int = 1,
                 max_length: int | None = None):
        self.model_path = model_path
        self.has_cuda = has_cuda
        self.gpu_memory_gb = gpu_memory_gb
        self.tensor_parallel = tensor_parallel
        self.max_length = max_length
        self.pipe = None
        self.facts: dict[str, Any] = {}

    def load(self) -> None:
        mii = require("mii")
        require("deepspeed")
        if self.tensor_parallel != 1:
            raise SystemUnavailable(f"engine=mii with tensor_parallel={self.tensor_parallel} needs the deepspeed "
                                    "launcher (one process per GPU); this harness runs one process")
        if self.has_cuda and self.gpu_memory_gb:
            need = checkpoint_bytes(self.model_path)
            if need > self.gpu_memory_gb * 2**30:
                raise SystemUnavailable(
                    f"engine=mii: DeepSpeed-MII FastGen keeps every weight on the GPU and has no offloading; the "
                    f"checkpoint is {need / 2**30:.1f} GiB but the GPU budget is {self.gpu_memory_gb:g} GiB "
                    "(use engine=zero_offload, the ZeRO-Inference path the Fiddler paper measured)")
        kwargs: dict[str, Any] = {"tensor_parallel": self.tensor_parallel, "torch_dist_port": free_port(),
                                  "zmq_port_number": free_port()}
        if self.max_length is not None:
            kwargs["max_length"] = self.max_length
        budget = enforce_gpu_budget(self.gpu_memory_gb) if self.has_cuda else {}
        saved = snapshot_env()
        try:
            # Tried for real even without CUDA: it fails within seconds, before any weight is loaded.
            self.pipe = mii.pipeline(self.model_path, **kwargs)
        except Exception as exc:
            restore_env(saved)  # mii.utils.init_distributed sets RANK/WORLD_SIZE/MASTER_* for itself
            if not self.has_cuda:
                raise SystemUnavailable(
                    "engine=mii: DeepSpeed-MII FastGen needs CUDA (NCCL process group, CUDA-only FastGen "
                    f"kernels); on this machine mii.pipeline raised {one_line(exc)}") from exc
            raise
        from deepspeed.accelerator import get_accelerator

        self.facts = {"accelerator": get_accelerator().device_name(), "paper_setup": False,
                      "max_length": self.pipe.max_length, "tensor_parallel": self.tensor_parallel,
                      "first_token": "MII streaming: the first token put on the pipeline's result queue",
                      "tokens": "request token ids fed to MIIPipeline.make_request (no re-tokenising); "
                                "ignore_eos=True, greedy (do_sample=False, top_p=1.0)", **budget}

    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        import torch
        from mii.batching.data_classes import RequestBatch
        from mii.constants import GenerationFinishReason

        if request.beam_width != 1:
            raise SystemUnavailable("engine=mii: DeepSpeed-MII FastGen has no beam search "
                                    "(its generation options are greedy or sampling only)")
        pipe = self.pipe
        n = request.max_new_tokens
        tid, uid = pipe.tid, 0  # MIIPipeline.__call__ numbers its prompts 0.. in every call, so do we
        pipe.result_queues[tid] = queue.Queue()
        params = {"max_new_tokens": n, "min_new_tokens": n, "ignore_eos": True, "do_sample": False,
                  "top_p": 1.0, "stream": True}
        if self.max_length is not None:
            params["max_length"] = self.max_length
        pipe.request_queue.put(pipe.make_request(tid, uid, torch.tensor(request.input_ids, dtype=torch.long), params))
        tokens: list[int] = []
        finished = False
        while not finished:
            results = pipe.result_queues[tid]
            while not results.empty():
                _uid, new, _prompt_len, _n_generated, reason, _stream = results.get()
                if reason == GenerationFinishReason.NONE:
                    if not tokens:
                        on_first_token()
                    tokens.extend(int(t) for t in new)
                else:
                    finished = True
            if not finished:
                pipe.generate()
        # the same clean-up as MIIPipeline.__call__: free this sequence's KV blocks
        pipe._queue_flush_request(uid)
        pipe._bcast_requests(force=True)
        pipe.flush(pipe.scheduled_requests.requests_to_flush.uids)
        pipe.scheduled_requests = RequestBatch()
        if len(tokens) != n:
            raise RuntimeError(f"MII returned {len(tokens)} new tokens, expected {n} (reason {reason})")
        return GenerationResult(tokens=tokens, stats={"engine": "mii"})

    def synchronize(self) -> None:
        if self.pipe is not None:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()

    def close(self) -> None:
        if self.pipe is not None:
            try:
                self.pipe.destroy()
            except Exception:
                pass
        self.pipe = None
