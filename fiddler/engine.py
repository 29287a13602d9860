"""`Engine`: the user-facing API. Load a checkpoint, build the expert executor, generate.

    engine = Engine.from_pretrained(path, gpu=GpuSide.cuda(12 << 30))
    out = engine.generate(ids, max_new_tokens=64, beam_width=4)
    out.tokens, out.sequences_scores, out.stats

The engine talks to its executor only through fiddler.executors.ExpertExecutor; a policy plugs in as an
`executor` factory (fiddler.executors.ExecutorFactory).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import quant as fquant
from .config import MoEConfig
from .decode_graph import DecodeGraphs
from .executors import BuildContext, ExecutorFactory, ExpertExecutor, FiddlerPolicy
from .generate import GenerationOutput, generate
from .gpu_side import GpuSide
from . import hostmem
from .hostmem import host_storages
from .kernel_loader import load_kernels
from .model import KERNEL_EVERY_COUNT, MoETransformer
from .plain import plain
from .placement import DensePlacement, dense_placement, layer_dense_bytes
from .step import PATHS, Segment, rows
from .threads import torch_threads
from .weights import load_weights

DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MAX_BATCH = 4


# Token counts the linears' crossover is measured at: up to prefill sizes, since a kernel that wins at 256
# tokens may lose at 2048 (issue 21: 1.8x slower there than oneDNN on a Xeon with AMX).
CROSSOVER_TOKENS = (16, 32, 64, 128, 256, 512, 1024)


def choose_kernel_max_tokens(weight: torch.Tensor, candidates=CROSSOVER_TOKENS, repeats: int = 3, floor: int = 8) -> int:
    """Largest token count at which the packed kernel still beats torch's matmul (oneDNN/AMX) on `weight`;
    beyond it Linear uses torch (every count when it wins at the last candidate). Compared per thread, in CPU time of the calling thread (both run with one
    thread here): the machine may be shared, and wall time of a multi-threaded call then measures the
    scheduler; while the kernel is active torch keeps one thread anyway (see Engine). At most `floor`
    tokens (decode, beams) the kernel is always used: that is the memory-bound GEMV regime where torch's
    bf16 path is far from the limit."""
    k = load_kernels()
    if k is None:
        return 0
    packed = k.PackedLinear(weight)

    from .kernels.timing import best_time  # the kernels loaded above

    def cpu_time(fn) -> float:  # the calling thread's CPU time
        return best_time(fn, repeats + 1, warmup=0, clock=time.thread_time)

    best_n = floor
    with torch_threads(1):
        for n in candidates:
            x = torch.randn(n, weight.shape[1]).to(weight.dtype)
            if cpu_time(lambda: packed.forward(x, threads=1)) <= cpu_time(lambda: F.linear(x, weight)):
                best_n = n
            else:
                break
    return best_n if best_n < candidates[-1] else KERNEL_EVERY_COUNT


ATTENTION_PROBE_TOKENS = 256
PREFILL_ATTENTION = ("auto", "kernel", "torch")


def choose_prefill_attention(cfg: MoEConfig, tokens: int = ATTENTION_PROBE_TOKENS, repeats: int = 3,
                             measure: bool = True) -> dict:
    """Whether a prompt's causal attention runs on the kernel (fiddler.kernels.attention) or torch's SDPA:
    both timed on random operands of the model's heads at `tokens` tokens, per thread in CPU time of the
    calling thread (as choose_kernel_max_tokens, for the same reason), the faster kept; measure=False
    takes the kernel wherever it can run. torch's SDPA can win where oneDNN multiplies on AMX tiles; on a
    Zen 5 core pair the kernel ran 3.5-6x faster at 512-4096 tokens. Returns {"path": "kernel" |
    "torch", ...the times, or why not}."""
    from .kernel_loader import load_attention_kernel

    ka = load_attention_kernel()
    if ka is None:
        return {"path": "torch", "why": "no AVX512-BF16 kernel path in this process"}
    nh, dk, dv = cfg.num_heads, cfg.qk_head_dim, cfg.attn_v_dim
    nkv = nh if cfg.attention == "mla" else cfg.num_kv_heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, tokens, d, generator=g).to(torch.bfloat16) for h, d in ((nh, dk), (nkv, dk), (nkv, dv)))
    if not ka.supports(q, k, v):
        return {"path": "torch", "why": f"heads the kernel does not take (head dims {dk}/{dv})"}
    if not measure:
        return {"path": "kernel", "why": "prefill_attention='kernel'"}
    scale = dk ** -0.5

    from .kernels.timing import best_time  # the kernels loaded above

    def cpu_time(fn) -> float:  # the calling thread's CPU time
        return best_time(fn, repeats + 1, warmup=0, clock=time.thread_time)

    with torch_threads(1):
        t_kernel = cpu_time(lambda: ka.causal_attention(q, k, v, scale, threads=1))
        t_torch = cpu_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                  enable_gqa=nh != nkv))
    return {"path": "kernel" if t_kernel <= t_torch else "torch", "tokens": tokens,
            "kernel_ms": round(t_kernel * 1e3, 3), "torch_ms": round(t_torch * 1e3, 3)}


def settle_prefill_attention(model: MoETransformer, cfg: MoEConfig, dtype: torch.dtype, layer_devices,
                             choice: str) -> dict:
    """Give the model the kernel's prefill attention where `choice` (PREFILL_ATTENTION) and this process
    allow it; returns what was decided, for info()."""
    from .kernel_loader import load_attention_kernel

    if choice == "torch":
        return {"path": "torch", "why": "prefill_attention='torch'"}
    if dtype != torch.bfloat16:
        decided = {"path": "torch", "why": f"the kernel's attention is bf16 (dtype {str(dtype).replace('torch.', '')})"}
    elif all(model.gpu_layers):
        decided = {"path": "torch", "why": "no layer on the CPU (the GPU side runs torch's attention)"}
    else:
        decided = choose_prefill_attention(cfg, measure=choice == "auto")
    if decided["path"] == "kernel":
        model.prefill_attention = load_attention_kernel()
    elif choice == "kernel":
        raise ValueError(f"prefill_attention='kernel' cannot be used here: {decided['why']}")
    return decided


def set_cpu_threads(n: int) -> None:
    """Threads of torch (process-wide) and of the CPU kernel's pool."""
    torch.set_num_threads(n)
    k = load_kernels()
    if k is not None:
        k.set_num_threads(n)


def finalise_linears(model: MoETransformer, executor: ExpertExecutor) -> int | None:
    """Bind the executor to the model (its hook may read routers or replace projections), then settle the
    CPU linears: up to which token count the packed kernel serves them (measured), dropping torch's dense
    copy where it serves every count. Returns torch's intra-op thread count while generating (None:
    unchanged).

    While the packed kernel runs the CPU linears (and the executor's CPU experts), torch keeps one intra-op
    thread: libgomp's workers spin for milliseconds after each parallel region, and two spinning pools on
    the same cores slow decode several-fold. torch then only runs small ops; where it serves the linears
    (more tokens than the kernel's crossover: long prefills) it gets the cores back for that forward
    (MoETransformer.torch_linear_threads)."""
    kernel_linears = any(l.packed is not None for l in model.linears())
    # measured on the first layer's first packed projection (the fused qkv in GQA models)
    probe = next((l for l in model.layers[0].linears() if l.packed is not None), None) if kernel_linears else None
    max_tokens = choose_kernel_max_tokens(probe.weight) if probe is not None else None
    executor.bind_model(model)
    if max_tokens is not None:
        model.set_kernel_max_tokens(max_tokens)
    if kernel_linears:
        model.torch_linear_threads = torch.get_num_threads()  # the engine's cores (set_cpu_threads ran)
    return 1 if kernel_linears else None


def _quantize_weights(path, cfg: MoEConfig, weights, quant: str, quant_cache, gguf):
    """Experts (in place) and attention projections as llama.cpp blocks: from a GGUF file, the on-disk
    cache, or quantized now (and cached). Returns (per-layer attention blocks, facts for info())."""
    t = time.perf_counter()
    entry, problem = None, None
    if gguf is not None:
        cache, source = fquant.load_gguf_blocks(gguf, cfg, quant), f"gguf:{gguf}"
    elif quant_cache:
        entry = fquant.cache_entry(path, quant, None if quant_cache is True else quant_cache)
        # verified against its hash, type, checkpoint and these weights' block shapes; else rebuilt
        cache, problem = fquant.load_cache(entry, fquant.expected_block_shapes(weights, quant))
        cache = cache or {}
        source = f"cache:{entry.file}" if cache else "quantized at load"
    else:
        cache, source = {}, "quantized at load"
    n_before = len(cache)
    fquant.quantize_experts(weights.experts, quant, cache)
    attn = fquant.quantize_attention(weights, quant, cache)
    if entry is not None and len(cache) > n_before:
        fquant.save_cache(entry, cache)
    k = load_kernels()
    return attn, {"source": source, "cache_rebuilt": problem, "seconds": time.perf_counter() - t,
                  "cpu_mode": k.quant.mode() if k is not None else None,
                  "expert_bytes": cfg.expert_bytes(torch.bfloat16, quant),
                  "attention_bytes_per_layer": cfg.attention_bytes(torch.bfloat16, quant)}


def _host_bytes_to_load(cfg: MoEConfig, dtype: torch.dtype, gpu: GpuSide, dense: DensePlacement, max_seq_len: int,
                        max_batch: int) -> dict[str, int]:
    """Host memory loading fills: every expert in dtype (load_weights holds them all before the executor
    copies them one by one), and the dense parts and KV cache that live on the CPU."""
    need = {"experts": int(cfg.all_expert_bytes(dtype))}
    if gpu.device.type == "cpu":
        need["dense"] = int(cfg.non_expert_bytes(dtype))
        need["kv_cache"] = int(cfg.kv_cache_bytes(max_seq_len, max_batch, dtype))
    elif dense.cpu_layers:
        per_layer = layer_dense_bytes(cfg, dtype, max_seq_len, max_batch)
        need["dense_cpu_layers_and_kv"] = sum(per_layer[i] for i in dense.cpu_layers)
    return need


class Engine:
    def __init__(self, config: MoEConfig, model: MoETransformer, executor: ExpertExecutor, *, dtype, gpu: GpuSide,
                 seed: int, info: dict, torch_threads: int | None = None):
        self.config, self.model, self.executor = config, model, executor
        self.dtype, self.gpu, self.device = dtype, gpu, gpu.device
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._info = info
        self.torch_threads = torch_threads  # torch intra-op threads while generating (None: unchanged)
        self.step_paths = dict.fromkeys(PATHS, 0)  # steps run by path, since load (step())

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.bfloat16,
        gpu: GpuSide | None = None,
        executor: ExecutorFactory | None = None,
        cpu_threads: int | None = None,
        max_seq_len: int | None = None,
        max_batch: int | None = None,
        seed: int = 0,
        quant: str | None = None,
        quant_cache: bool | str | Path = True,
        gguf: str | Path | None = None,
        prefill_attention: str = "auto",
        decode_graphs: bool = False,
    ) -> "Engine":
        """Load an HF Mixtral checkpoint (original per-expert safetensors layout, sharded or not).

        dtype: model dtype (bf16; fp32 for exactness checks). gpu: where the GPU side is and its budget
        (default GpuSide.default(): CUDA with 90% of its free memory if present, else no GPU); non-expert
        weights, the KV cache and resident experts live on its device. executor: the expert executor's
        factory (default FiddlerPolicy(): Fiddler's orchestration; fiddler.executors.local_executor is the
        reference). cpu_threads: threads for the CPU kernel and torch (default: all cores; note
        torch.set_num_threads is process-wide). max_seq_len / max_batch: KV-cache size (default
        min(context, 4096) positions x 4 rows; beam_width <= max_batch). seed: placement and sampling.
        quant: None, "q8_0" or "q4_0": expert and attention projection weights as llama.cpp blocks
        (fiddler.quant; round-to-nearest like llama.cpp's quantizer), embeddings, norms, router and
        lm_head stay in dtype (bf16 only). quant_cache: keep the quantized blocks on disk, keyed by the
        checkpoint's content hash and the quant type (True: $FIDDLER_CACHE/quant; a path: that
        directory; False: quantize at every load). gguf: take the quantized tensors from this GGUF file
        (llama.cpp's converter/quantizer output of the same checkpoint) instead of quantizing.
        prefill_attention: where a prompt's causal attention runs on CPU layers: "auto" (the faster of
        the kernel and torch's SDPA, measured at load), "kernel" (an error where it cannot) or "torch".
        decode_graphs: decode steps run each layer's dense part as a CUDA graph captured per batch size, the
        experts between replays (fiddler.decode_graph; on an emulated GPU side the same static ops run
        eagerly); needs every dense part on the GPU side. Off by default until a device run has timed it."""
        t_load = time.perf_counter()
        if prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention must be one of {PREFILL_ATTENTION}, got {prefill_attention!r}")
        quant = fquant.check_quant(quant)
        if quant is not None and dtype != torch.bfloat16:
            raise ValueError(f"quant={quant!r} needs dtype=torch.bfloat16, got {dtype}")
        if gguf is not None and quant is None:
            raise ValueError("gguf= reads quantized tensors: give quant='q8_0' or 'q4_0' too")
        cfg = MoEConfig.from_pretrained(path)
        if quant is not None:
            fquant.check_attention(cfg)
        gpu = gpu if gpu is not None else GpuSide.default()
        max_seq_len = max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        max_batch = max_batch or DEFAULT_MAX_BATCH
        if cpu_threads is not None:
            set_cpu_threads(cpu_threads)
        cuda_cap = gpu.apply_cap()  # on CUDA the budget holds: the caching allocator cannot grow past it
        # Dense parts that do not fit the GPU budget stay on the CPU, whole layers at a time (-ngl style);
        # the executor's placement makes the same decision from the same function.
        try:
            dense = dense_placement(cfg, dtype, gpu.budget_bytes, max_seq_len=max_seq_len, max_batch=max_batch,
                                    quant=quant, overhead=gpu.overhead_bytes())
        except ValueError:  # not even the fixed part fits: the executor's own sizing decides (and explains)
            dense = DensePlacement((True,) * cfg.num_layers)
        cpu = torch.device("cpu")
        layer_devices = [gpu.device if g else cpu for g in dense.gpu_layers]
        hostmem.check_fits(f"loading {path}", _host_bytes_to_load(cfg, dtype, gpu, dense, max_seq_len, max_batch))
        weights = load_weights(path, cfg, dtype=dtype, device=gpu.device, layer_devices=layer_devices)
        quant_info = None
        if quant is not None:
            attn_blocks, quant_info = _quantize_weights(path, cfg, weights, quant, quant_cache, gguf)
        ctx = BuildContext(cfg, dtype, gpu, max_seq_len=max_seq_len, max_batch=max_batch, cpu_threads=cpu_threads,
                           seed=seed, quant=quant)
        ex = (executor or FiddlerPolicy())(ctx, weights.experts)
        model = MoETransformer(cfg, weights, ex, max_batch=max_batch, max_seq_len=max_seq_len, dtype=dtype,
                               device=gpu.device, layer_devices=layer_devices,
                               gpu_layers=dense.gpu_layers if gpu.has_gpu else None)
        weights.experts = []  # the executor owns them now
        fp32_acts = quant is not None and fquant.use_fp32_activations(model)
        torch_threads_in_run = finalise_linears(model, ex)
        attention = settle_prefill_attention(model, cfg, dtype, layer_devices, prefill_attention)
        if quant is not None:
            fquant.install_attention(model, attn_blocks, quant)
        if decode_graphs:
            if not gpu.has_gpu:
                raise ValueError("decode_graphs=True needs a GPU side (CUDA or emulated)")
            model.decode_graphs = DecodeGraphs(model)
        k = load_kernels()
        kernel_linears = torch_threads_in_run is not None
        info = {
            "path": str(path),
            "device": str(gpu.device),
            "dtype": str(dtype).replace("torch.", ""),
            "model": {k_: v for k_, v in vars(cfg).items()},
            "dense_cpu_layers": dense.cpu_layers,
            "max_seq_len": max_seq_len,
            "max_batch": max_batch,
            "gpu_side": gpu.kind,
            "gpu_budget_bytes": gpu.budget_bytes,
            **({"cuda_memory_cap": cuda_cap} if cuda_cap else {}),
            "executor": type(ex).__module__ + "." + type(ex).__name__,
            "kernel_isa": k.isa() if k is not None else None,
            "kernel_stream": k.stream() if k is not None else None,
            "kernel_amx": k.amx_choice() if k is not None else None,
            "kernel_blocking": k.blocking_choice() if k is not None else None,
            "kernel_linears": kernel_linears,
            "kernel_max_tokens": model.lm_head.kernel_max_tokens if kernel_linears else 0,
            "torch_threads": torch_threads_in_run or torch.get_num_threads(),
            "prefill_attention": attention,
            "quant": quant,
            **({"quant_fp32_activations": fp32_acts} if quant is not None else {}),
            **({"quant_info": quant_info} if quant_info else {}),
            **({"quant_amx": k.quant.amx()} if quant is not None and k is not None else {}),
            "load_s": time.perf_counter() - t_load,
        }
        if cuda_cap:
            cuda_cap["load_max_memory_reserved"] = int(torch.cuda.max_memory_reserved(gpu.device))
        return cls(cfg, model, ex, dtype=dtype, gpu=gpu, seed=seed, info=info, torch_threads=torch_threads_in_run)

    # ------------------------------------------------------------------ API

    def prompt_ids(self, input_ids) -> torch.Tensor:
        """One prompt's token ids as a 1-D long tensor (from a list, a 1-D or a [1, S] tensor), checked against
        the vocabulary: what generate and the batch engine take a prompt through."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"one prompt at a time: got a batch of {ids.shape[0]} (use beam_width for beams)")
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D or [1, S], got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
        return ids

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 32,
        beam_width: int = 1,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        on_first_token: Callable[[], None] | None = None,
    ) -> GenerationOutput:
        """Generate exactly `max_new_tokens` (fewer only if `eos_token_id` is given and produced).
        Sampling is seeded by `seed`, or by the engine's seed stream when None."""
        prompt = self.prompt_ids(input_ids)
        gen = self._generator if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        self.executor.reset_stats()
        if self.gpu.is_cuda:  # cuda_memory in the stats: this generate's peak
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model.multi_row_expert_loads = self.model.multi_row_layer_steps = 0
        paths_before = dict(self.step_paths)
        with torch_threads(self.torch_threads):
            out = generate(
                self.model,
                prompt,
                max_new_tokens,
                beam_width=beam_width,
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                generator=gen,
                eos_token_id=eos_token_id,
                on_first_token=on_first_token,
                step=self.step,
            )
        self._add_stats(out, prompt.shape[0])
        out.stats["step_paths"] = {p: self.step_paths[p] - paths_before[p] for p in PATHS}
        return out

    def step(self, tokens: torch.Tensor, segments: list[Segment], *, all_logits: bool = False) -> torch.Tensor:
        """The engine step: advance each sequence (a Segment: a prompt chunk or one decode token on its own
        KV-cache row and positions) and return the fp32 logits of those that emit
        (MoETransformer.forward). Everything that runs the model runs this: generate() (single requests and
        beams), fiddler.batch's BatchEngine (continuous batching, the server) and so every measurement."""
        with torch_threads(self.torch_threads):
            logits = self.model.forward(tokens.to(self.device), segments, all_logits=all_logits)
        self.step_paths[self.model.last_path] += 1
        return logits

    def _add_stats(self, out: GenerationOutput, S: int):
        st = out.stats
        lat = st["decode_latencies_s"]
        st["prefill_tok_s"] = S / st["ttft_s"]
        st["new_tokens"] = int(out.tokens.shape[0])
        st["decode_s"] = sum(lat)
        st["decode_tok_s"] = len(lat) / sum(lat) if lat else None
        st["executor"] = plain(self.executor.stats.to_dict())
        if self.gpu.is_cuda:  # what this generate really reserved under the cap, and whether it had to retry
            ms = torch.cuda.memory_stats(self.device)
            st["cuda_memory"] = {"max_memory_reserved": int(torch.cuda.max_memory_reserved(self.device)),
                                 "max_memory_allocated": int(torch.cuda.max_memory_allocated(self.device)),
                                 "num_alloc_retries": int(ms.get("num_alloc_retries", 0)),
                                 "num_ooms": int(ms.get("num_ooms", 0)),
                                 "cap_bytes": self.gpu.cap_bytes()}
        if lat:
            # distinct experts a decode step ran per layer: with beams, the ones the beams actually used
            # (they share most of them); what a decode bound counts (config.decode_bytes_per_token)
            m = self.model
            st["decode_experts_per_layer"] = (int(m.multi_row_expert_loads) / m.multi_row_layer_steps
                                              if m.multi_row_layer_steps else self.config.active_slots)

    @torch.inference_mode()
    def forward_logits(self, input_ids) -> torch.Tensor:
        """Teacher-forced fp32 logits [S, vocab] for one prompt (no generation; the KV cache is overwritten)."""
        prompt = self.prompt_ids(input_ids)
        if prompt.shape[0] > self.model.max_seq_len:
            raise ValueError(f"prompt of {prompt.shape[0]} tokens exceeds max_seq_len={self.model.max_seq_len}")
        return self.step(prompt, rows(1, 0, prompt.shape[0]), all_logits=True)

    def host_bytes(self) -> dict[str, int]:
        """Host memory the engine holds now, by part: dense (non-expert weights, packed or not, rope tables),
        experts and buffers (the executor's; on an emulated GPU its "device" memory too, which is host memory),
        kv_cache (the layers whose cache is on the CPU), buffers (plus the model's decode-step buffers)."""
        m = self.model
        kv = host_storages(m.cache)
        bufs = {p: n for p, n in host_storages(m._bufs).items() if p not in kv}
        dense = host_storages(m, skip=(m.executor, m.cache, m._bufs))
        ex = self.executor.host_bytes()
        return {"dense": sum(n for p, n in dense.items() if p not in kv and p not in bufs),
                "experts": int(ex["experts"]), "kv_cache": sum(kv.values()),
                "buffers": int(ex["buffers"]) + sum(bufs.values())}

    def info(self) -> dict:
        """Plain facts about the engine and its executor (executor_info), and its host memory now."""
        return {**self._info, "host_bytes": self.host_bytes(), "executor_info": plain(self.executor.info()),
                "decode_path": self.model.decode_path(), "step_paths": dict(self.step_paths)}

