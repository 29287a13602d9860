"""llama.cpp baseline (through llama-cpp-python), fed the same weights and token ids as Fiddler.

Importing this package is cheap: ``llama_cpp`` is only imported inside the functions that need it.
"""
