"""small_mixtral in bf16 gives the tokens recorded in tests/data/small_mixtral_bf16_tokens.json (greedy,
beam widths 4 and 16, 8 fixed prompts), on the kernel class they were recorded for: a structural change
to the engine must not change what it computes. How to re-record, and when it is allowed: tests/token_fixture.py."""
from __future__ import annotations

import pytest

from tests import token_fixture as tf


@pytest.mark.slow
def test_bf16_tokens_are_the_recorded_ones():
    want = tf.recorded().get(tf.kernel_class())
    if want is None:
        pytest.skip(f"no tokens recorded for kernel class {tf.kernel_class()} (python -m tests.token_fixture --record)")
    got = tf.outputs(tf.load_engine())
    diffs = [f"{case} prompt {i} ({tf.PROMPT_LENS[i]} tokens): first differs at step {tf.first_difference(w, g)}"
             for case in got for i, (w, g) in enumerate(zip(want[case], got[case])) if w != g]
    assert not diffs, "\n".join(diffs)


def test_first_difference():
    assert tf.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert tf.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert tf.first_difference([1, 2, 3], [1, 2]) == 2
