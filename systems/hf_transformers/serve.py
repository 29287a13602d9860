"""`transformers serve` as workload=serving runs it: the same server, taking vLLM's `ignore_eos`.

Load generators (guidellm, aiperf) force every request's output length with vLLM's `ignore_eos: true` beside
`max_tokens`, as the other servers under test accept. transformers serve (5.2x) answers 422 to any field its
completions schema lacks, so every request failed. Here `ignore_eos` is one more accepted field of
`/v1/completions`, and true means what it means to vLLM: the request's end-of-sequence tokens are disabled (its
generation config's eos_token_id is -1, which the continuous-batching manager reads as "none"), so it stops at
`max_tokens` only. Nothing else of the server changes. The CLI's check for a newer transformers (a request to
PyPI at start) is skipped.

    python -m systems.hf_transformers.serve serve --continuous-batching --host 127.0.0.1 --port 8000 MODEL
"""
from __future__ import annotations

import sys

NO_EOS = -1  # continuous batching's RequestState: an eos_token_id below 0 adds no end-of-sequence token


def accept_ignore_eos() -> None:
    """Patches transformers serve's completions handler in this process (idempotent)."""
    from transformers.cli.serving import completion

    params = completion.TransformersTextCompletionCreateParams
    params.__mutable_keys__ = frozenset(params.__mutable_keys__) | {"ignore_eos"}
    handler = completion.CompletionHandler
    if getattr(handler, "_fiddler_ignore_eos", False):
        return
    build = handler._build_generation_config

    def build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        config = build(self, body, model_generation_config, use_cb=use_cb)
        if body.get("ignore_eos"):
            config.eos_token_id = NO_EOS
        return config

    handler._build_generation_config = build_generation_config
    handler._fiddler_ignore_eos = True


def main(argv: list[str] | None = None) -> None:
    from transformers.cli.transformers import app

    accept_ignore_eos()
    app(args=sys.argv[1:] if argv is None else argv, prog_name="transformers")


if __name__ == "__main__":
    main()
