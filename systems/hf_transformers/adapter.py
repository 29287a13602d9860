"""Plain transformers `generate()`: the numerical and performance reference.

Uses transformers' fastest MoE experts implementation on a CPU (`grouped_mm`, ahead of `eager`;
`batched_mm` is far slower there) and records which one ran, with the transformers version.
"""
from __future__ import annotations

from typing import Any, Callable

from systems.base import GenerationRequest, GenerationResult, SystemAdapter

# preference order for `experts_implementation=auto`
_FASTEST_FIRST = ("grouped_mm", "eager")


class HFTransformersAdapter(SystemAdapter):
    def server_command(self, serve) -> list[str]:
        """`transformers serve` with continuous batching, the checkpoint preloaded (its serving extra), through
        systems/hf_transformers/serve.py, which adds vLLM's `ignore_eos` to its completions (the load
        generators force output lengths with it)."""
        import sys

        from transformers.utils.import_utils import is_serve_available

        from systems.base import SystemUnavailable

        if not is_serve_available():
            raise SystemUnavailable("`transformers serve` needs its serving extra (openai, fastapi, uvicorn): "
                                    "pip install 'transformers[serving]'")
        return [sys.executable, "-m", "systems.hf_transformers.serve", "serve", "--continuous-batching",
                "--host", serve.host, "--port", str(serve.port), self.model.path]

    def server_notes(self) -> dict[str, Any]:
        return {"server": "transformers serve --continuous-batching (systems/hf_transformers/serve.py: with vLLM's "
                          "ignore_eos)"}

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(self.ctx.threads)
        self.device = torch.device("cuda" if self.ctx.has_cuda else "cpu")
        impl = self.config.experts_implementation.value
        if impl == "auto":
            impl = self._fastest_available()
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model.path, dtype=getattr(torch, self.model.dtype), experts_implementation=impl,
        ).to(self.device).eval()
        self.experts_implementation = self.model.config._experts_implementation

    @staticmethod
    def _fastest_available() -> str:
        from transformers.integrations import moe

        registered = set(getattr(moe, "ALL_EXPERTS_FUNCTIONS", {}).keys()) | {"eager"}
        return next(i for i in _FASTEST_FIRST if i in registered)

    def generate(self, request: GenerationRequest, on_first_token: Callable[[], None]) -> GenerationResult:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        class FirstToken(LogitsProcessor):
            """Called once per step after the forward pass; the first call ends the prefill."""

            def __init__(self):
                self.fired = False

            def __call__(self, input_ids, scores):
                # NaN/+inf logits make a run an error, not a result (-inf is legitimate: masked tokens)
                if torch.isnan(scores).any() or torch.isposinf(scores).any():
                    raise FloatingPointError(f"non-finite logits (NaN/inf) at sequence length {input_ids.shape[1]}")
                if not self.fired:
                    self.fired = True
                    on_first_token()
                return scores

        ids = torch.tensor([request.input_ids], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_new_tokens,
                min_new_tokens=request.max_new_tokens,  # EOS can never end a sequence early
                do_sample=False, num_beams=request.beam_width, early_stopping=False,
                logits_processor=LogitsProcessorList([FirstToken()]), pad_token_id=0,
            )
        return GenerationResult(tokens=out[0, ids.shape[1]:].tolist())

    def synchronize(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def info(self) -> dict[str, Any]:
        import torch
        import transformers

        return {"transformers": transformers.__version__, "torch": torch.__version__,
                "experts_implementation": self.experts_implementation, "device": str(self.device),
                "torch_threads": torch.get_num_threads(), "dtype": self.model.dtype.__repr__()}

    def close(self) -> None:
        self.model = None
