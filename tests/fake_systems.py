"""A system adapter whose behaviour is chosen by the prompt length, for harness tests that need
configurations which crash, hang, exhaust memory or run slowly -- without loading a model.

input_len 11: raises; 12: hangs; 13: allocates until the OS memory limit stops it;
14: kills its own process with SIGSEGV; 15-19: sleeps 1 s per generate; else: returns at once.
Environment: FIDDLER_FAKE_LOAD_LOG=file gets a line per load; FIDDLER_FAKE_LOAD_S=seconds slows the load.
"""
from __future__ import annotations

import os
import signal
import time

from systems.base import GenerationRequest, GenerationResult, SystemAdapter


class FakeSystem(SystemAdapter):
    def load(self) -> None:
        self.calls = 0
        log = os.environ.get("FIDDLER_FAKE_LOAD_LOG")  # tests count loads, also in child processes
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
        time.sleep(float(os.environ.get("FIDDLER_FAKE_LOAD_S", 0)))  # a slow load

    def generate(self, request: GenerationRequest, on_first_token) -> GenerationResult:
        self.calls += 1
        n = len(request.input_ids)
        if n == 11:
            raise RuntimeError("fake failure for input_len 11")
        if n == 12:
            time.sleep(3600)
        if n == 13:
            hog = []
            while True:  # bytes(n) is calloc'd: no page is touched, so the limit stops it at once on any machine
                hog.append(bytes(256 * 2**20))
        if n == 14:
            os.kill(os.getpid(), signal.SIGSEGV)
        if 15 <= n <= 19:
            time.sleep(1.0)
        on_first_token()
        # deterministic tokens: a function of the prompt, like a greedy decoder
        return GenerationResult(tokens=[(sum(request.input_ids) + i) % 97 for i in range(request.max_new_tokens)],
                                stats={"calls": self.calls})

    def info(self):
        return {"fake": True}


class FakeEnvSystem(FakeSystem):
    """Declares an environment variable its process needs; reports what it saw."""

    process_env = {"FIDDLER_FAKE_ENV": "set-before-start"}

    def generate(self, request, on_first_token):
        result = super().generate(request, on_first_token)
        result.stats["env"] = os.environ.get("FIDDLER_FAKE_ENV")
        return result
