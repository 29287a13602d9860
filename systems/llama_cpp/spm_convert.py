"""Runs llama.cpp's convert_hf_to_gguf.py with the vocabulary taken from a SentencePiece tokenizer.model.

llama.cpp's converter writes the Qwen2/3-MoE, OLMoE and DeepSeek-V2/V3 vocabularies with its GPT-2 (BPE)
path, which only accepts tokenizers whose pre-tokenizer it recognises by hash ("BPE pre-tokenizer was not
recognized"). The project's generated checkpoints carry a SentencePiece tokenizer (tokenizer.model, as
Mixtral's), so for them this wrapper points the model class's `set_vocab` at the converter's own
SentencePiece path (`_set_vocab_sentencepiece`, what it uses for Llama/Mixtral) in this process only; the
converter files on disk are not touched. llama.cpp then tokenizes with its SPM tokenizer ("llama"
vocab) whatever the architecture.

Usage: python spm_convert.py CONVERTER_DIR [convert_hf_to_gguf.py arguments...]
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    converter = Path(sys.argv[1]).resolve()
    sys.argv = [str(converter / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    sys.path.insert(0, str(converter))
    sys.path.insert(1, str(converter / "gguf-py"))
    import conversion  # the converter's package (it imports its vendored gguf-py)

    original = conversion.get_model_class

    def get_model_class(name, *args, **kwargs):
        cls = original(name, *args, **kwargs)
        if not kwargs.get("mmproj") and not (args and args[0]):
            cls.set_vocab = lambda self: self._set_vocab_sentencepiece()
        return cls

    conversion.get_model_class = get_model_class  # convert_hf_to_gguf.py imports it from the package
    runpy.run_path(str(converter / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
